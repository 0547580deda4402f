"""`MoELayer`: router, SwiGLU routed experts, optional shared expert; single-device code.

Every expert lives in this process: pairs sorted by expert, one grouped GEMM, unsort, weighted sum.
Expert parallelism is applied from outside (`k3sys.ep.parallelize.apply_ep`), which keeps each rank's
home experts and replaces the two halves of the routed computation (`start`: route and send the
tokens; `finish`: experts and combine) with the `EPBuffer` path. The forward calls the halves with the
shared expert between them, so under EP the shared expert overlaps the token transfer.

Shape suffixes: s tokens, h hidden, f ffn hidden, k top-k, e experts, n rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NoReturn

import torch
from torch import nn

from k3sys.ep.experts import grouped_swiglu, weighted_sum

if TYPE_CHECKING:
    from k3sys.ep.comm import PendingDispatch


@dataclass(frozen=True)
class MoEStats:
    """What the last forward did (`MoELayer.stats()`).

    slots_per_rank: token-expert pairs each rank's experts processed (one entry when local).
    copies: replica expert weights prefetched this step. moved_tokens: pairs processed on a replica
    instead of their expert's home rank. maxvio: `max_e T_e / mean_e T_e - 1` over all ranks' tokens.
    """

    slots_per_rank: tuple[int, ...]
    copies: int
    moved_tokens: int
    maxvio: float


@dataclass
class MoEWork:
    """A routed computation between its halves (`MoELayer.start_routed` and `finish`).

    x_sh `[s, h]`, ids_sk / weights_sk `[s, K]` its routing, shape: what `finish` returns (`[..., h]`),
    pending: the tokens in flight under expert parallelism (None on one device).
    """

    x_sh: torch.Tensor
    ids_sk: torch.Tensor
    weights_sk: torch.Tensor
    shape: torch.Size
    pending: PendingDispatch | None = None


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP `(silu(x @ w_gate) * (x @ w_up)) @ w_down`, the shared expert."""

    def __init__(self, hidden: int, ffn_hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(hidden, ffn_hidden))
        self.w_up = nn.Parameter(torch.empty(hidden, ffn_hidden))
        self.w_down = nn.Parameter(torch.empty(ffn_hidden, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w_gate, self.w_up, self.w_down):
            _init_fan_in(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (nn.functional.silu(x @ self.w_gate) * (x @ self.w_up)) @ self.w_down


def _init_fan_in(w: torch.Tensor) -> None:
    # nn.Linear's default scale, for weights stored `[..., in, out]`.
    bound = 1 / math.sqrt(w.shape[-2])
    nn.init.uniform_(w, -bound, bound)


EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")


class MoELayer(nn.Module):
    """Mixture-of-experts FFN: x `[..., hidden]` -> `[..., hidden]`.

    Args:
        hidden: model width h. ffn_hidden: each routed expert's SwiGLU width f.
        num_experts: E routed experts. top_k: K experts per token (distinct).
        num_shared_experts: shared experts, fused into one SwiGLU of width `num_shared_experts * f`
            that every token goes through. Default 0.
        router: "softmax" (default) or "sigmoid" scores; the top-K scores are renormalised to sum to 1.
        score_bias: a per-expert bias `score_bias [E]` added to the scores to choose the top-K but not to
            weigh them (DeepSeek-V3's `e_score_correction_bias`; zeros, not trained by backward).
        routed_scale: the renormalised top-K weights are multiplied by this (`routed_scaling_factor`).

    Parameters: `router.weight [E, h]`; `w_gate, w_up [E, h, f]`, `w_down [E, f, h]` (the home experts
    only after `apply_ep`); `shared` (a `SwiGLU`) when shared experts exist.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        num_shared_experts: int = 0,
        router: Literal["softmax", "sigmoid"] = "softmax",
        *,
        score_bias: bool = False,
        routed_scale: float = 1.0,
    ) -> None:
        super().__init__()
        for name, value in (("hidden", hidden), ("ffn_hidden", ffn_hidden), ("num_experts", num_experts),
                            ("top_k", top_k)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts})")
        if num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be >= 0, got {num_shared_experts}")
        if router not in ("softmax", "sigmoid"):
            raise ValueError(f"router must be 'softmax' or 'sigmoid', got {router!r}")
        self.hidden, self.ffn_hidden, self.num_experts, self.top_k = hidden, ffn_hidden, num_experts, top_k
        self.router_kind = router
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.score_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) if score_bias else None
        self.routed_scale = routed_scale
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden, ffn_hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, ffn_hidden, hidden))
        self.shared = SwiGLU(hidden, num_shared_experts * ffn_hidden) if num_shared_experts else None
        # The last forward's statistics stay on the device until `stats()` reads them: reading them
        # every step would add host syncs to the expert-parallel step (issue 29).
        self._stats: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.router.reset_parameters()
        for w in (self.w_gate, self.w_up, self.w_down):
            _init_fan_in(w)
        if self.shared is not None:
            self.shared.reset_parameters()

    def route(self, x_sh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K routing: x `[s, h]` -> (topk_ids `[s, K]` int64, topk_weights `[s, K]` summing to `routed_scale`)."""
        # Scores in at least fp32: top-K and the normalisation are where bf16 ties and drift hurt.
        scores_se = self.router(x_sh).to(torch.promote_types(x_sh.dtype, torch.float32))
        scores_se = scores_se.softmax(-1) if self.router_kind == "softmax" else scores_se.sigmoid()
        if self.score_bias is None:
            weights_sk, ids_sk = scores_se.topk(self.top_k, dim=-1)
        else:  # the bias steers the choice only; the weights are the unbiased scores
            ids_sk = (scores_se + self.score_bias.to(scores_se.dtype)).topk(self.top_k, dim=-1).indices
            weights_sk = scores_se.gather(-1, ids_sk)
        weights_sk = weights_sk / weights_sk.sum(-1, keepdim=True) * self.routed_scale
        return ids_sk, weights_sk.to(x_sh.dtype)

    def stats(self) -> MoEStats | None:
        """What the last forward did (None before the first). Reads a few integers off the device (a
        host sync): call it when you log (every N steps), not inside the step."""
        if self._stats is None:
            return None
        values = self._stats.tolist()
        E = self.num_experts
        loads, (copies, moved), tpe_e = values[:-E - 2], values[-E - 2:-E], values[-E:]
        mean = sum(tpe_e) / E
        return MoEStats(tuple(loads), copies, moved, 0.0 if mean == 0 else max(tpe_e) / mean - 1)

    def _keep_stats(
        self, loads_r: torch.Tensor, copies: torch.Tensor, moved: torch.Tensor, tpe_e: torch.Tensor
    ) -> None:
        """Keep the step's statistics on the device, packed for `stats()`: loads `[R]`, replica copies and
        moved pairs (scalars), pairs per expert `[E]` (maxvio's input)."""
        self._stats = torch.cat([loads_r, copies.view(1), moved.view(1), tpe_e]).long()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = self.start(x)
        # Under expert parallelism the tokens are in flight here: the shared expert overlaps the transfer.
        shared_sh = self.shared(work.x_sh) if self.shared is not None else None
        out = self.finish(work)
        return out if shared_sh is None else out + shared_sh.view(out.shape)

    def start(self, x: torch.Tensor) -> MoEWork:
        """First half of the routed experts: check x `[..., h]`, route it, start the work.

        `finish(start(x))` is the routed part of `forward`; a caller may run other work between them
        (it overlaps the token transfer under expert parallelism).
        """
        w = self.router.weight
        if x.shape[-1] != self.hidden or x.dtype != w.dtype or x.device != w.device:
            self._reject(f"x must be [..., {self.hidden}] {w.dtype} on {w.device}, "
                         f"got {list(x.shape)} {x.dtype} on {x.device}")
        x_sh = x.reshape(-1, self.hidden)
        work = self.start_routed(x_sh, *self.route(x_sh))
        work.shape = x.shape
        return work

    def _reject(self, message: str) -> NoReturn:
        raise ValueError(message)

    def start_routed(self, x_sh: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> MoEWork:
        """`start` for a given routing: x_sh `[s, h]`, topk_ids `[s, K]` (-1: no expert), topk_weights `[s, K]`."""
        return MoEWork(x_sh, topk_ids, topk_weights, x_sh.shape)

    def finish(self, work: MoEWork) -> torch.Tensor:
        """Second half: `sum_k w[t, k] * expert_{ids[t, k]}(x[t])`, shaped as `work.shape`. Keeps `stats()`."""
        x_sh, ids_sk, weights_sk = work.x_sh, work.ids_sk, work.weights_sk
        s, k = ids_sk.shape
        E = self.num_experts
        # "No expert" (-1) pairs go to a bucket past the last expert: the tail rows, which the grouped
        # GEMM leaves zero, and their weights are zeroed.
        ids_n = ids_sk.flatten().long()
        expert_n = torch.where(ids_n >= 0, ids_n, E)
        order_n = expert_n.argsort(stable=True)  # pairs grouped by expert, token order inside a group
        tpe_e = torch.bincount(expert_n, minlength=E + 1)[:E]
        ends = tpe_e.cumsum(0).tolist()
        y_nh = grouped_swiglu(x_sh[order_n // k], ends, self.w_gate, self.w_up, self.w_down)
        inverse_n = torch.empty_like(order_n)
        inverse_n[order_n] = torch.arange(order_n.numel(), device=order_n.device)
        y_skh = y_nh[inverse_n].view(s, k, self.hidden)
        none = tpe_e.new_zeros(())
        self._keep_stats(tpe_e.sum().view(1), none, none, tpe_e)
        return weighted_sum(weights_sk.masked_fill(ids_sk < 0, 0), y_skh).view(work.shape)

    def routed_experts(self, x_sh: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The routed half of the layer for a given routing: `sum_k w[t, k] * expert_{ids[t, k]}(x[t])`.

        x_sh `[s, h]`, topk_ids `[s, K]` (-1: no expert), topk_weights `[s, K]` -> `[s, h]`. Benchmarks
        and custom routers call it directly. Keeps `stats()`.
        """
        return self.finish(self.start_routed(x_sh, topk_ids, topk_weights))

    def home_experts(self) -> range:
        """Global ids of the experts this layer holds (all of them on one device)."""
        return range(self.num_experts)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a single-process (all-expert) state dict, keeping the experts this layer holds."""
        home = self.home_experts()
        self.load_state_dict({k: v[home.start:home.stop] if k in EXPERT_WEIGHTS else v for k, v in state.items()})
