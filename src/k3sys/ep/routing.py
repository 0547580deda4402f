"""Synthetic expert routings with a target imbalance, and the load metrics the planner is judged by.

Each expert e has a preference weight w_e (log-normal `exp(a * z_e)` or Zipf `(rank_e + 1)^-a`); the
skew `a` is searched so that the realised maxvio lands on the target. A token picks K distinct experts
with inclusion probabilities q_e = min(1, c * w_e), sum_e q_e = K, by systematic sampling: lay the
q_e end to end (in a random expert order per chunk of tokens) and take the K points u, u+1, ..., u+K-1.
Every interval is at most 1 long, so the K picks are distinct, and P(e picked) = q_e exactly. That
makes the expected loads a closed form of `a` (the search needs no sampling) and costs O(K log E) per
token instead of the O(E) of a Gumbel top-k, which matters at K3 scale (10^6 tokens x 896 experts).
"""

from __future__ import annotations

import torch

__all__ = ["balancedness", "make_routing", "maxvio", "tokens_per_expert"]

# Inclusion probabilities in fixed point, so interval ends are exact and picks provably distinct.
_UNIT = 1 << 40
_CHUNK = 256  # tokens sharing one random expert order (orders only correlate picks, never bias them)
_MAXVIO_RTOL = 0.05


def maxvio(loads_per_expert: torch.Tensor) -> float:
    """max_e(T_e / mean_e T_e) - 1 of `[E]` expert loads (0 = perfectly even, 0 for no tokens)."""
    return _maxvio(loads_per_expert)


def _maxvio(loads: torch.Tensor) -> float:
    # Named apart from `maxvio` because make_routing's argument of that name shadows it.
    t = loads.double()
    mean = t.mean()
    return 0.0 if mean == 0 else float(t.max() / mean - 1)


def balancedness(loads_per_rank: torch.Tensor) -> float:
    """mean_r L_r / max_r L_r of `[R]` rank loads (1 = perfectly even, 1 for no tokens)."""
    t = loads_per_rank.double()
    top = t.max()
    return 1.0 if top == 0 else float(t.mean() / top)


def tokens_per_expert(topk: torch.Tensor, num_experts: int) -> torch.Tensor:
    """tpe[r, e] = token-k pairs rank r routes to expert e, from `topk` `[R, s, K]`; returns `[R, E]` int64."""
    if topk.dim() != 3:
        raise ValueError(f"topk must be 3-D [R, s, K], got shape {list(topk.shape)}")
    if topk.dtype.is_floating_point or topk.dtype.is_complex or topk.dtype == torch.bool:
        raise ValueError(f"topk must hold integer expert ids, got {topk.dtype}")
    if topk.numel() and (int(topk.min()) < 0 or int(topk.max()) >= num_experts):
        raise ValueError(f"topk ids must lie in [0, {num_experts}), got [{int(topk.min())}, {int(topk.max())}]")
    R = topk.shape[0]
    flat = (topk.long() + num_experts * torch.arange(R, device=topk.device).view(R, 1, 1)).reshape(-1)
    return torch.bincount(flat, minlength=R * num_experts).view(R, num_experts)


def _inclusion(w: torch.Tensor, top_k: int) -> torch.Tensor:
    """q_e = min(1, c * w_e) with sum_e q_e = K (water-filling: the c that caps the fewest experts)."""
    ws = w.sort(descending=True).values
    suffix = ws.flip(0).cumsum(0).flip(0)
    m = torch.arange(top_k, dtype=w.dtype)
    c = (top_k - m) / suffix[:top_k]
    first_fit = int(torch.nonzero(c * ws[:top_k] <= 1 + 1e-12)[0])
    return (c[first_fit] * w).clamp(max=1.0)


def _weights(z: torch.Tensor, skew: float, dist: str) -> torch.Tensor:
    # z holds N(0, 1) scores (log-normal) or 0-based popularity ranks (Zipf); skew 0 is uniform.
    # Scaled to a maximum of 1 and floored, so large skews neither overflow nor leave all-zero tails.
    w = torch.exp(skew * (z - z.max())) if dist == "lognormal" else (z + 1) ** -skew
    return w.clamp(min=1e-300)


def _solve_skew(z: torch.Tensor, top_k: int, target: float, dist: str) -> float:
    """Skew whose expected maxvio E * max_e q_e / K - 1 equals `target` (bisection; monotone in skew)."""
    E = z.numel()
    expected = lambda a: E * float(_inclusion(_weights(z, a, dist), top_k).max()) / top_k - 1
    lo, hi = 0.0, 1.0
    while expected(hi) < target and hi < 1e6:
        lo, hi = hi, 2 * hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected(mid) < target else (lo, mid)
    return (lo + hi) / 2


def make_routing(
    num_ranks: int,
    tokens_per_rank: int,
    num_experts: int,
    top_k: int,
    maxvio: float,
    seed: int = 0,
    hot_shift: float = 0.0,
    *,
    step: int = 0,
    dist: str = "lognormal",
) -> torch.Tensor:
    """Routing `[R, s, K]` int64 (K distinct experts per token) whose realised maxvio is near `maxvio`.

    Args:
        num_ranks, tokens_per_rank, num_experts, top_k: R, s, E, K.
        maxvio: target max_e(T_e / mean T_e) - 1, in [0, E/K - 1). The realised value is within 5% of
            it, except below the sampling-noise floor (the maxvio of a uniform routing of this size,
            about 0.05 at R=64, s=4096, E=896, K=16), where the routing is uniform.
        seed: fixes the expert preferences.
        hot_shift: fraction in [0, 1] of experts whose preferences are rotated among themselves: the
            same seed with a different shift models a distribution that drifted between steps.
        step: fixes the token draw; steps of one seed share preferences but not tokens.
        dist: "lognormal" or "zipf" preferences.
    """
    R, s, E, K = num_ranks, tokens_per_rank, num_experts, top_k
    if min(R, E, K) < 1 or s < 0:
        raise ValueError(f"need R, E, K >= 1 and s >= 0, got R={R}, s={s}, E={E}, K={K}")
    if K > E:
        raise ValueError(f"top_k ({K}) must be <= num_experts ({E})")
    if not 0 <= maxvio < E / K - 1 and not (maxvio == 0 and K == E):
        raise ValueError(f"maxvio must be in [0, E/K - 1) = [0, {E / K - 1:.4g}), got {maxvio}")
    if not 0.0 <= hot_shift <= 1.0:
        raise ValueError(f"hot_shift must be in [0, 1], got {hot_shift}")
    if dist not in ("lognormal", "zipf"):
        raise ValueError(f"dist must be 'lognormal' or 'zipf', got {dist!r}")

    g = torch.Generator().manual_seed(seed)
    if dist == "lognormal":
        z = torch.randn(E, generator=g, dtype=torch.float64)
    else:
        z = torch.randperm(E, generator=g).double()
    moved = torch.randperm(E, generator=g)[: round(hot_shift * E)]
    z[moved] = z[moved.roll(1)]

    # The token draw is fixed across the skew search, so the realised maxvio moves smoothly with skew.
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    n = R * s
    chunks = -(-n // _CHUNK)
    order = torch.rand(chunks, E, generator=g).argsort(dim=1)
    points = torch.randint(0, _UNIT, (chunks * _CHUNK, 1), generator=g) + _UNIT * torch.arange(K)
    points = points.view(chunks, _CHUNK * K)

    def draw(skew: float) -> torch.Tensor:
        q = _inclusion(_weights(z, skew, dist), K)
        fixed = (q * _UNIT).long()
        gap = K * _UNIT - int(fixed.sum())  # float rounding: a few units, parked on one roomy expert
        fixed[int(fixed.argmin() if gap >= 0 else fixed.argmax())] += gap
        picks = torch.searchsorted(fixed[order].cumsum(1), points, right=True)
        return order.gather(1, picks).view(-1, K)[:n].view(R, s, K)

    def realised(topk: torch.Tensor) -> float:
        return _maxvio(torch.bincount(topk.reshape(-1), minlength=E))

    if maxvio == 0 or n == 0:
        return draw(0.0)
    aim, best, best_err = maxvio, None, float("inf")
    for _ in range(8):
        topk = draw(_solve_skew(z, K, aim, dist) if aim > 0 else 0.0)
        got = realised(topk)
        if abs(got - maxvio) < best_err:
            best, best_err = topk, abs(got - maxvio)
        if best_err <= _MAXVIO_RTOL * maxvio or aim == 0:
            break
        # The sample's noise is nearly fixed across skews: aim past it (within the reachable range).
        aim = min(max(0.0, aim + maxvio - got), 0.999 * (E / K - 1))
    return best
