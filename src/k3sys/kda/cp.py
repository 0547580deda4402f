"""Exact context parallelism for KDA: one sequence split over the ranks of a process group.

Per head the recurrence is affine in the state: a slice of tokens maps an incoming state S0 `[K, V]` to

    S_t = P_t S0 + S_t^loc,      o_t = scale S_t^T q_t = o_t^loc + S0^T qt_t,      qt_t = scale P_t^T q_t

where P_t (K x K) is the product of the per-token maps (I - beta k k^T) Diag(exp g) and the "loc" terms
are what the slice gives from a zero start. The columns of the state evolve independently, so one call
of `kda_chunk` with the value widened to `[v | 0_K]` from the initial state `[0 | I_K]` returns both at
once: outputs `[o^loc | qt]` and final state `[S^loc | M]` with M = P_T. Each rank then all-gathers its
carry element (M, S^loc) `[K, K + V]`, folds the elements of the ranks before it into its true incoming
state S0 (S0_r = M_{r-1} S0_{r-1} + S^loc_{r-1}), and corrects: o = o^loc + qt S0, S_end = S^loc + M S0.
No second pass, nothing approximate. docs/kda.md ("Context parallel") counts the extra flops.

Only `kda_chunk`'s public interface is used, so its backend choice (Triton on CUDA) carries over.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3sys.kda.activations import kda_options
from k3sys.kda.chunk import kda_chunk
from k3sys.kda.validate import MAX_HEAD_DIM, compute_dtype


class _AllGather(torch.autograd.Function):
    """`[...]` on every rank -> `[R, ...]` on every rank; backward sums the gradients over ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # every rank used the other ranks' elements: the gradient of my element is the sum of theirs
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


class _Tie(torch.autograd.Function):
    """Identity on `x` that makes `anchor` part of its graph (zero gradient), so every rank runs the
    all-gather's backward collective even when it used none of the gathered carries (rank 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.anchor_shape, ctx.anchor_dtype = anchor.shape, anchor.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_zeros(ctx.anchor_shape, dtype=ctx.anchor_dtype)


def cp_lengths(T: int, group: dist.ProcessGroup, device: torch.device) -> list[int]:
    """Every rank's slice length, in rank order (one small all-gather)."""
    lengths = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, torch.tensor([T], device=device), group=group)
    return torch.cat(lengths).tolist()


def gather_sequence(x: torch.Tensor, lengths: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's `[B, T_r, ...]` -> the whole sequence `[B, sum(lengths), ...]` on every rank, differentiable
    (slices of unequal `lengths` are padded to the longest for the all-gather)."""
    pad = max(lengths) - x.shape[1]
    if pad:
        x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
    parts = _AllGather.apply(x, group)
    return torch.cat([p[:, :n] for p, n in zip(parts, lengths, strict=True)], dim=1)


def from_previous_rank(x: torch.Tensor, group: dist.ProcessGroup, first: torch.Tensor) -> torch.Tensor:
    """The previous rank's `x` (rank 0 gets `first`); its gradient goes back to the sender.

    The short convolution's halo: a rank's first tokens read the previous rank's last ones.
    """
    parts, rank = _AllGather.apply(x, group), dist.get_rank(group)
    return _Tie.apply(first, parts) if rank == 0 else parts[rank - 1]


@dataclass(frozen=True)
class SliceLayout:
    """How this rank's tokens `[start, end)` cut the global sequences.

    head: tokens `[0, head)` continue a sequence begun on an earlier rank (0 when none does).
    local_cu: `[0, ..., T_r]` offsets of the local pieces (None without cu_seqlens: B rows, one piece each).
    first: global index of the sequence of the first piece that begins on this rank.
    carries_out: the last piece continues on the next rank.
    """

    head: int
    local_cu: list[int] | None
    first: int
    carries_out: bool


def slice_layout(cu_seqlens: list[int] | None, start: int, end: int, rank: int, world: int) -> SliceLayout:
    """The pieces of `rank` (of `world`) holding global tokens `[start, end)`; `cu_seqlens` global, or
    None (B rows that all run over every rank)."""
    if cu_seqlens is None:
        return SliceLayout(head=end - start if rank > 0 else 0, local_cu=None, first=0, carries_out=rank < world - 1)
    n0 = bisect.bisect_right(cu_seqlens, start) - 1  # the sequence holding token `start`
    cuts = [c - start for c in cu_seqlens if start < c < end]
    local_cu = [0, *cuts, end - start]
    continues = cu_seqlens[n0] < start
    return SliceLayout(head=local_cu[1] if continues else 0, local_cu=local_cu, first=n0 + continues,
                       carries_out=cu_seqlens[-1] > end and end not in cu_seqlens)


def _transition_call(q, k, v, g, beta, scale, chunk_size, backend, options) -> tuple[torch.Tensor, ...]:
    """The head's local outputs and state from zero, and its maps: (o_loc, qt, S_loc, M), in the compute dtype.

    Widened value `[v | 0_K]` from `[0 | I]`, one call; two calls when V + K exceeds the op's limit.
    `options` are the op's (states `[K, V]`: `state_v_first` is applied by the caller).
    """
    B, T, _, K = q.shape
    HV, V = v.shape[-2:]
    dt = compute_dtype(q, k, v, g, beta)
    eye = torch.eye(K, dtype=dt, device=q.device).expand(B, HV, K, K)
    zeros = v.new_zeros(B, T, HV, K, dtype=dt)
    run = dict(chunk_size=chunk_size, backend=backend, **options)
    if V + K <= MAX_HEAD_DIM:
        S0 = torch.cat([eye.new_zeros(B, HV, K, V), eye], dim=-1)
        o, S = kda_chunk(q, k, torch.cat([v.to(dt), zeros], dim=-1), g, beta, scale, S0, True, **run)
        (o_loc, qt), (S_loc, M) = o.split([V, K], dim=-1), S.split([V, K], dim=-1)
        return o_loc, qt, S_loc, M
    o_loc, S_loc = kda_chunk(q, k, v.to(dt), g, beta, scale, None, True, **run)
    qt, M = kda_chunk(q, k, zeros, g, beta, scale, eye, True, **run)
    return o_loc, qt, S_loc, M


def _incoming(chain: torch.Tensor, rank: int, V: int) -> torch.Tensor:
    """This rank's incoming state from the gathered carry elements `[R, Bc, H, K, K + V]` (`[S | M]`).

    A left fold over the ranks before this one, S0 <- M S0 + S: O(R K^2 V) work; a log-depth scan
    would compose the K x K maps too (O(R log R K^3)), and the one all-gather already is the only
    round of communication.
    """
    S0 = chain.new_zeros(chain.shape[1:-1] + (V,))
    for j in range(rank):
        S0 = torch.baddbmm(chain[j, ..., :V].flatten(0, 1), chain[j, ..., V:].flatten(0, 1),
                           S0.flatten(0, 1)).view_as(S0)
    return S0


def kda_chunk_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    group: dist.ProcessGroup,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 16,
    backend: str = "auto",
    **options,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kda_chunk` over a sequence split across the ranks of `group`, exact; differentiable.

    Rank r holds the contiguous token slice r (any lengths >= 1; rank order = token order). Every rank
    calls this (and, in training, backpropagates through its `o`: the backward runs one collective).

    Args:
        q, k: `[B, T_r, H, K]` this rank's slice; v `[B, T_r, HV, V]`, g `[B, T_r, HV, K]`, beta
            `[B, T_r, HV]` (HV a multiple of H, as in `kda_chunk`).
        group: the context-parallel process group (gloo or NCCL).
        scale, chunk_size, backend: as `kda_chunk`.
        initial_state: `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`), the same on every rank; a
            rank reads the rows of the sequences that begin in its slice (so each row's gradient lands on
            the rank that read it).
        output_final_state: return the state at the end of each local piece `[N_r, HV, K, V]` (N_r = B
            without cu_seqlens): the final state of a sequence is on the rank holding its last token.
        cu_seqlens: `[N + 1]` GLOBAL offsets, the same on every rank (B must be 1); sequences may cross
            rank boundaries.
        **options: `kda_chunk`'s (`k3sys.kda.activations.KDAOptions`): the activations are per token,
            so each call on this rank's tokens applies them; `state_v_first` is applied here.

    Returns:
        o `[B, T_r, HV, V]` in v's dtype, and the local pieces' end states (compute dtype) or None.
    """
    v_first = kda_options(**options).state_v_first  # also rejects unknown options, on every rank alike
    options = {n: x for n, x in options.items() if n not in ("state_v_first", "transpose_state_layout")}
    if v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)  # [N, HV, K, V] inside, the caller's layout outside
    R, rank = dist.get_world_size(group), dist.get_rank(group)
    B, T, _, K = q.shape
    H, V = v.shape[-2:]  # the value heads carry the state
    cu, start = None, 0
    if cu_seqlens is not None:
        offsets = [0, *itertools.accumulate(cp_lengths(T, group, q.device))]
        cu = cu_seqlens.tolist()
        if B != 1 or cu[0] != 0 or cu[-1] != offsets[-1] or any(b <= a for a, b in zip(cu, cu[1:], strict=False)):
            raise ValueError(f"cu_seqlens must increase from 0 to the total length {offsets[-1]} over the ranks, "
                             f"with B == 1; got {cu} with B={B}")
        start = offsets[rank]
    N = B if cu is None else len(cu) - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(f"initial_state must be the global [N, HV, K, V] = {[N, H, K, V]} ([N, HV, V, K] with "
                         f"state_v_first), got {list(initial_state.shape)}")
    lay = slice_layout(cu, start, start + T, rank, R)
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    h = lay.head
    outs, states = [], []
    carry_M = carry_S = None
    if h:
        o_loc, qt, S_loc, M = _transition_call(q[:, :h], k[:, :h], v[:, :h], g[:, :h], beta[:, :h], scale,
                                               chunk_size, backend, options)
    if h < T:  # the pieces that begin on this rank
        n_body = B if cu is None else len(lay.local_cu) - 1 - (h > 0)
        init = None if initial_state is None else initial_state[lay.first:lay.first + n_body]
        body_cu = None if cu is None else torch.tensor([c - h for c in lay.local_cu[(h > 0):]], device=q.device)
        o_body, S_body = kda_chunk(q[:, h:], k[:, h:], v[:, h:], g[:, h:], beta[:, h:], scale, init, True,
                                   cu_seqlens=body_cu, chunk_size=chunk_size, backend=backend, **options)
        carry_S = S_body[-1:] if cu is not None else S_body
    elif lay.carries_out:  # the whole slice lies inside one sequence that carries on
        carry_M, carry_S = M, S_loc
    Bc = B if cu is None else 1
    if carry_S is None or not lay.carries_out:
        carry_S = torch.zeros(Bc, H, K, V, dtype=dt, device=q.device)
    if carry_M is None:
        carry_M = carry_S.new_zeros(Bc, H, K, K)
    element = torch.cat([carry_S.to(dt), carry_M.to(dt)], dim=-1)
    needs_grad = any(x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state))
    if torch.is_grad_enabled() and needs_grad and not element.requires_grad:
        element.requires_grad_()  # a constant element (the last rank's) must still join the backward's collective
    chain = _AllGather.apply(element, group)
    if h:
        S0 = _incoming(chain, rank, V)  # [Bc, H, K, V]
        outs.append((o_loc + torch.einsum("bthk,bhkv->bthv", qt, S0)).to(v.dtype))
        states.append(S_loc + M @ S0)
    if h < T:
        outs.append(o_body)
        states.append(S_body)
    o = _Tie.apply(torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], chain)
    if not output_final_state:
        return o, None
    S = torch.cat(states)
    return o, (S.transpose(-1, -2) if v_first else S)
