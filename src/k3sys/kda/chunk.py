"""Two-phase chunked KDA: FlashKDA's structure in PyTorch.

Every sequence is cut into chunks of C tokens (the last one zero-padded: a padded token has k = v = 0,
g = 0, beta = 0, so it leaves the state untouched). Within a chunk, with G the inclusive cumsum of g
and S the state entering the chunk, the recurrence unrolls to

    (I + L) V' = Diag(beta) V - Diag(beta) (exp(G) * K) S     L[i,j] = beta_i sum_d k_id k_jd exp(G_id - G_jd), j < i
    O          = (scale * q * exp(G)) S + Aqk V'              Aqk[i,j] = scale sum_d q_id k_jd exp(G_id - G_jd), j <= i
    S_next     = Diag(exp(G_last)) S + (exp(G_last - G) * K)^T V'

so V' = U - W S with W = (I + L)^-1 Diag(beta) (exp(G) * K) and U = (I + L)^-1 Diag(beta) V, and the
output regroups to O = Qs S + Ou with Qs = scale * q * exp(G) - Aqk W and Ou = Aqk U, both free of S.

Phase 1, `intra_chunk`, computes everything that does not depend on S for all chunks of all sequences
and heads in one batched pass. Phase 2, `inter_chunk`, is the only loop: over chunk steps, carrying S
for all sequences and heads at once; per step it does V' = U - W S, O = Qs S + Ou and the state update,
so Aqk never enters the loop (the regrouping is the Triton backend's, which mirrors these tensors).
FlashKDA found that fusing the two phases lets the low-parallelism recurrence drag the token-parallel
work; the CPU version of that claim is measured in bench/kda.py.

Chunk slots. All chunks live in one "slot" axis M, ordered step-major: sequences are sorted by chunk
count, longest first, so at step c the sequences that still have a chunk are a prefix of that order
and their chunks occupy the contiguous slots [offset_c, offset_c + active_c). Phase 2 therefore reads
plain slices, and a finished sequence's state simply leaves the carried batch.

Workspace legend (M slots, H heads, C chunk size, K key dim, V value dim). Phase-1 intermediates:
    G      [M, H, C, K]  inclusive cumsum of g inside the chunk (<= 0, non-increasing)
    Aqk    [M, H, C, C]  scale * sum_d q_id k_jd exp(G_id - G_jd), zero above the diagonal
Phase 1's output, phase 2's input (`ChunkWorkspace`):
    W      [M, H, C, K]  (I + L)^-1 Diag(beta) (exp(G) * k)
    U      [M, H, C, V]  (I + L)^-1 Diag(beta) v
    Qs     [M, H, C, K]  scale * q * exp(G) - Aqk W: what the queries read from the entering state
    Ou     [M, H, C, V]  Aqk U: the output if the entering state were zero
    Kd     [M, H, C, K]  k * exp(G_last - G): keys decayed to the chunk end
    decay  [M, H, K]     exp(G_last): the whole chunk's decay
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from k3sys.kda.activations import Prepared, kda_options, prepare, state_out
from k3sys.kda.chunk_fused import fused_forward, kernel_activates, runs_fused

# Stands in for g = -inf (see `_two_phases`): every exponent that includes such a step is <= this, and
# exp(-1e4) is 0 in fp32 and fp64; the blocks holding it are wider than any factorisation, so they take
# the pairwise path, whose segment sums never subtract it.
RESET_LOG_DECAY = -1.0e4
BACKENDS = ("auto", "torch", "triton")
# Phase 1 runs on blocks of chunk steps of about this many (slot, head, position) rows, each block followed
# by its phase-2 steps: a block's workspace (~1 MB per tensor at K = 128) stays in cache and is recycled by
# the allocator, where whole-sequence temporaries (> 32 MB from T = 16K on, H = 4) were fresh mmap pages,
# faulted in on every call, and made the cost per token grow with T (bench/kda_scaling.py).
PHASE1_ROWS = 2048
# Block size for the intra-chunk decay products: FlashKDA's tile; inside it the factorised form is safe
# for the bounded gate (16 steps of at most -5 span exp(+-40)).
SUB_CHUNK = 16


@dataclass(frozen=True)
class ChunkLayout:
    """Where each token of each sequence lives on the step-major slot axis (see the module docstring).

    num_slots: M, the chunks of all sequences; chunk_size: C.
    gather_rows: `[M * H * C]` row of the token-major `[B * T * H, D]` view of an input that feeds each
        (slot, head, position) of the slot-major `[M * H * C, D]` view; padding positions point at row 0.
    pad_rows: `[P]` the padding positions among those `M * H * C` (they are zeroed after the gather).
    scatter_rows: `[B * T * H]` row of the slot-major view holding each (token, head)'s output.
    active: number of sequences that have a chunk at each step (non-increasing), one entry per step.
    order: `[N]` sequence ids sorted by chunk count, longest first (slot rank r is sequence order[r]).
    slot_of_chunk: `[M]` the slot of each chunk in sequence-major order (sequence 0's chunks first).
    """

    num_slots: int
    chunk_size: int
    gather_rows: torch.Tensor
    pad_rows: torch.Tensor
    scatter_rows: torch.Tensor
    active: list[int]
    order: torch.Tensor
    slot_of_chunk: torch.Tensor


def chunk_layout(lengths: torch.Tensor, starts: torch.Tensor, chunk_size: int, num_heads: int) -> ChunkLayout:
    """Lay out sequences of `lengths` `[N]`, starting at flat token `starts` `[N]`, in chunks of `chunk_size`."""
    C, H, device = chunk_size, num_heads, lengths.device
    total = int(lengths.sum())
    n_chunks = (lengths + C - 1) // C
    order = torch.argsort(n_chunks, descending=True, stable=True)
    nc, ln, st = n_chunks[order], lengths[order], starts[order]
    steps = int(nc[0])
    # active[c] = #{sequences with more than c chunks}
    active = lengths.numel() - torch.bincount(nc, minlength=steps + 1)[:steps].cumsum(0)
    offsets = active.cumsum(0) - active
    # enumerate chunks sequence by sequence (sorted rank, step), then place each at its slot
    rank = torch.repeat_interleave(torch.arange(len(nc), device=device), nc)
    step = torch.arange(len(rank), device=device) - torch.repeat_interleave(nc.cumsum(0) - nc, nc)
    slot = offsets[step] + rank
    first_chunk = n_chunks.cumsum(0) - n_chunks  # sequence-major index of each sequence's first chunk
    slot_of_chunk = torch.empty_like(slot)
    slot_of_chunk[first_chunk[order[rank]] + step] = slot
    local = step[:, None] * C + torch.arange(C, device=device)  # [M, C] position inside the sequence
    token = torch.empty(len(slot), C, dtype=torch.long, device=device)
    token[slot] = torch.where(local < ln[rank, None], st[rank, None] + local, -1)
    head = torch.arange(H, device=device)
    gather = (token[:, None, :] * H + head[:, None]).flatten()  # [M * H * C]
    pad = token[:, None, :].expand(-1, H, -1).flatten() < 0
    real = (token >= 0).flatten()
    # slot-major row of (token t, head h): ((m * H + h) * C + p) where t sits at slot m, position p
    pos = torch.arange(token.numel(), device=device)[real]
    scatter = torch.empty(total, H, dtype=torch.long, device=device)
    scatter[token.flatten()[real]] = ((pos // C)[:, None] * H + head) * C + (pos % C)[:, None]
    return ChunkLayout(len(slot), C, gather.clamp(min=0), pad.nonzero().flatten(), scatter.flatten(),
                       active.tolist(), order, slot_of_chunk)


def to_slots(x: torch.Tensor, layout: ChunkLayout, dtype: torch.dtype) -> torch.Tensor:
    """Gather token-major `[B, T, H, D]` into slot-major `[M, H, C, D]` (zeros at padding), cast to `dtype`."""
    rows = x.reshape(-1, x.shape[-1]).index_select(0, layout.gather_rows).to(dtype)
    if layout.pad_rows.numel():
        rows.index_fill_(0, layout.pad_rows, 0.0)  # in place: the gather's backward does not need its output
    return rows.view(layout.num_slots, -1, layout.chunk_size, x.shape[-1])


def from_slots(o: torch.Tensor, layout: ChunkLayout, B: int, T: int) -> torch.Tensor:
    """Scatter slot-major outputs `[M, H, C, V]` back to token-major `[B, T, H, V]`."""
    M, H, C, V = o.shape
    return o.reshape(M * H * C, V).index_select(0, layout.scatter_rows).view(B, T, H, V)


@dataclass(frozen=True)
class ChunkWorkspace:
    """Phase 1's output, phase 2's input; shapes in the module legend."""

    W: torch.Tensor
    U: torch.Tensor
    Qs: torch.Tensor
    Ou: torch.Tensor
    Kd: torch.Tensor
    decay: torch.Tensor

    def heads_flat(self) -> ChunkWorkspace:
        """The same tensors with (slot, head) flattened into the one batch axis phase 2's matmuls take."""
        return ChunkWorkspace(*(t.flatten(0, 1) for t in (self.W, self.U, self.Qs, self.Ou, self.Kd, self.decay)))


def _max_half_span(dtype: torch.dtype) -> float:
    """Largest |exponent| the factorised decay may use: exp(+-x) stays far inside the normal range."""
    return (2.0 / 3.0) * math.log(torch.finfo(dtype).max)  # fp32: 59, fp64: 473


def _segment_sums(x: torch.Tensor) -> torch.Tensor:
    """`[..., n, K]` -> `[..., n, n, K]` with `out[i, j] = x_{j+1} + ... + x_i` (zero for i <= j).

    A masked cumsum rather than a difference of two cumsums: when the prefix sums are large (a huge
    log-decay step earlier on), their difference would lose the small segment's digits.
    """
    n = x.shape[-2]
    after = torch.ones(n, n, dtype=torch.bool, device=x.device).tril(-1)  # [t, j]: t > j
    return (x[..., :, None, :] * after[:, :, None]).cumsum(-3)


def _suffix_sums(g: torch.Tensor) -> torch.Tensor:
    """`[..., n, K]` -> `[..., n, K]`: `out[i] = g_{i+1} + ... + g_{n-1}` (exclusive, zero at the end).

    One matmul with a constant mask: sums of same-signed steps, not `total - prefix` (which would
    cancel the digits of a small tail after a huge step).
    """
    n = g.shape[-2]
    return torch.ones(n, n, dtype=g.dtype, device=g.device).triu(1) @ g


def _decayed_products(
    q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, G_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`A_kk[i,j] = sum_d k_id k_jd exp(G_id - G_jd)` (j < i) and `A_qk` (same with q_i, j <= i), `[M, H, C, C]`.

    q, k, g `[M, H, C, K]`; G_b `[M, H, nb, b, K]` the cumsum of g inside each block of b = `SUB_CHUNK`
    tokens. exp(G_i - G_j) is never formed per pair:
    - a pair inside one block factorises through the midpoint c of that block's range, so both factors
      stay within exp(+-span/2); a block whose span is too wide for the dtype (only possible with an
      unbounded gate) is recomputed by `_pairwise_products`;
    - a pair in blocks J < I factorises at the end r of block I-1: exp(G_i - r) exp(r - G_j), both
      factors <= 1 (nothing can overflow), every exponent a sum of same-signed steps.
    """
    M, H, nb, b, K = G_b.shape
    q_b, k_b, g_b = (x.view(M, H, nb, b, K) for x in (q, k, g))
    lim = _max_half_span(g.dtype)
    # the products do not depend on c, so c needs no gradient
    c = (0.5 * (G_b[..., :1, :] + G_b[..., -1:, :])).detach()
    # the clamp only bites in blocks that the pairwise form overwrites; it keeps their unused values finite
    e = (G_b - c).clamp_(-lim, lim)
    up = e.exp()
    k_col = k_b * torch.exp(-e)  # not 1 / up: its backward, -1 / up^2, would overflow
    D_kk = (k_b * up) @ k_col.mT  # [M, H, nb, b, b]
    D_qk = (q_b * up) @ k_col.mT
    wide = (G_b[..., 0, :] - G_b[..., -1, :]).amax(-1) > 2 * lim  # [M, H, nb]
    if wide.any():
        idx = wide.nonzero(as_tuple=True)
        D_kk_w, D_qk_w = _pairwise_products(q_b[idx], k_b[idx], g_b[idx])
        D_kk, D_qk = D_kk.index_put(idx, D_kk_w), D_qk.index_put(idx, D_qk_w)
    # above the diagonal the factorised products may overflow (exp(G_i - G_j) > 1): select, never multiply, them away
    lower = torch.ones(b, b, dtype=torch.bool, device=g.device).tril()
    D_kk = torch.where(lower.tril(-1), D_kk, 0.0)
    D_qk = torch.where(lower, D_qk, 0.0)
    if nb == 1:
        return D_kk.view(M, H, b, b), D_qk.view(M, H, b, b)
    I, J = torch.tril_indices(nb, nb, -1, device=g.device)  # the P block pairs J < I
    # decay over the whole blocks strictly between J and I: block totals summed over (J, I - 1]
    between = _segment_sums(G_b[..., -1, :])[:, :, I - 1, J].exp()  # [M, H, P, K]
    rows = G_b.exp()  # exp(G_i - r): from the start of i's block
    cols = (k_b * _suffix_sums(g_b).exp())[:, :, J] * between[..., None, :]  # [M, H, P, b, K]
    off_kk = (k_b * rows)[:, :, I] @ cols.mT  # [M, H, P, b, b]
    off_qk = (q_b * rows)[:, :, I] @ cols.mT
    return _assemble_blocks(D_kk, off_kk, I, J), _assemble_blocks(D_qk, off_qk, I, J)


def _assemble_blocks(D: torch.Tensor, off: torch.Tensor, I: torch.Tensor, J: torch.Tensor) -> torch.Tensor:
    """Diagonal blocks D `[M, H, nb, b, b]` and blocks `off` `[M, H, P, b, b]` at (I, J) -> `[M, H, C, C]`."""
    M, H, nb, b, _ = D.shape
    A = D.new_zeros(M, H, nb, nb, b, b)
    diag = torch.arange(nb, device=D.device)
    A[:, :, diag, diag] = D
    A[:, :, I, J] = off
    return A.transpose(3, 4).reshape(M, H, nb * b, nb * b)


def _pairwise_products(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairwise form of `_decayed_products` for `[n, b, K]` blocks: `[n, b, b]` each, via `[n, b, b, K]`."""
    b = g.shape[-2]
    lower = torch.ones(b, b, dtype=torch.bool, device=g.device).tril()
    decay = torch.where(lower[:, :, None], _segment_sums(g), -torch.inf).exp()  # [n, i, j, K]
    A_kk = torch.einsum("nid,njd,nijd->nij", k, k, decay)
    A_qk = torch.einsum("nid,njd,nijd->nij", q, k, decay)
    return A_kk, A_qk


def intra_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float
) -> ChunkWorkspace:
    """Phase 1: everything that does not depend on the carried state, for all chunk slots at once.

    Args:
        q, k, g: `[M, H, C, K]` in the compute dtype; v `[M, H, C, V]`; beta `[M, H, C]`.
        scale: query scale.
    """
    M, H, C, K = g.shape
    b = min(C, SUB_CHUNK)
    G_b = g.view(M, H, C // b, b, K).cumsum(-2)
    G = G_b.view(M, H, C, K) if b == C else g.cumsum(-2)
    A_kk, A_qk = _decayed_products(q, k, g, G_b)
    A_qk = A_qk * scale  # scale applied to the small matrix, never to q
    eye = torch.eye(C, dtype=g.dtype, device=g.device)
    # (I + L)^-1 by a batched triangular solve: backward-stable, as fast here as FlashKDA's product form
    # (I - L)(I + L^2)(I + L^4)(I + L^8), which loses digits from C = 32 on when keys in a chunk correlate.
    inv = torch.linalg.solve_triangular(eye + beta[..., None] * A_kk, eye, upper=False, unitriangular=True)
    inv = inv * beta[..., None, :]  # (I + L)^-1 Diag(beta): beta folded into the small matrix
    decay_in = G.exp()
    W, U = inv @ (k * decay_in), inv @ v
    Qs = torch.baddbmm((q * decay_in).flatten(0, 1), A_qk.flatten(0, 1), W.flatten(0, 1), beta=scale, alpha=-1)
    return ChunkWorkspace(W=W, U=U, Qs=Qs.view(M, H, C, K), Ou=A_qk @ U, Kd=k * _suffix_sums(g).exp(),
                          decay=decay_in[..., -1, :])


def step_blocks(active: list[int], rows_per_step: int, max_rows: int = PHASE1_ROWS) -> list[tuple[int, int]]:
    """Split the chunk steps (slot counts `active`, `rows_per_step` rows per slot) into `[a, b)` ranges of
    at most `max_rows` rows each (a single step may exceed it)."""
    blocks, a, rows = [], 0, 0
    for c, n in enumerate(active):
        if rows and rows + n * rows_per_step > max_rows:
            blocks.append((a, c))
            a, rows = c, 0
        rows += n * rows_per_step
    return [*blocks, (a, len(active))]


def inter_chunk_step(S: torch.Tensor, ws: ChunkWorkspace) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk step, (sequence, head) pairs flattened: S `[A*H, K, V]`, ws `heads_flat()` over A slots.

    Returns O `[A*H, C, V]` and the next S. Each add is fused into its matmul (baddbmm): four calls per
    step in the only sequential loop.
    """
    Vn = torch.baddbmm(ws.U, ws.W, S, alpha=-1)
    O = torch.baddbmm(ws.Ou, ws.Qs, S)
    S = torch.baddbmm(S * ws.decay[..., None], ws.Kd.mT, Vn)
    return O, S


def inter_chunk(
    ws: ChunkWorkspace, active: list[int], S: torch.Tensor, keep_states: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Phase 2: the recurrence over chunk steps, all sequences and heads at once.

    Args:
        ws: phase 1's workspace over M slots.
        active: sequences with a chunk at each step (non-increasing); the slot ranks are sorted longest first.
        S: `[N, H, K, V]` initial states in slot-rank order.
        keep_states: also return the state entering each slot's chunk.

    Returns:
        O `[M, H, C, V]`, the final states `[N, H, K, V]` in slot-rank order, and the entering states
        `[M, H, K, V]` (slot order) or None.
    """
    M, H, C, _ = ws.W.shape
    N, _, K, V = S.shape
    rows = [a * H for a in active]
    flat = ws.heads_flat()
    steps = zip(*(t.split(rows) for t in (flat.W, flat.U, flat.Qs, flat.Ou, flat.Kd, flat.decay)), strict=True)
    S = S.flatten(0, 1)
    outs, finished, entering = [], [], []
    for r, step in zip(rows, steps, strict=True):
        if r < S.shape[0]:
            finished.append(S[r:])
            S = S[:r]
        if keep_states:
            entering.append(S)
        O, S = inter_chunk_step(S, ChunkWorkspace(*step))
        outs.append(O)
    # sequences leave from the highest rank down, so reversing restores rank order
    states = torch.cat(entering).view(M, H, K, V) if keep_states else None
    return torch.cat(outs).view(M, H, C, V), torch.cat([S, *finished[::-1]]).view(N, H, K, V), states


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    *,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    return_intermediate_states: bool = False,
    chunk_size: int = 16,
    backend: str = "auto",
    **options,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Chunked KDA (two phases), differentiable; fla's `chunk_kda` signature, same results as `kda_naive`.

    Args:
        q, k: `[B, T, H, K]`, used as given unless `use_qk_l2norm_in_kernel`; K <= 512.
        v: `[B, T, HV, V]`, V <= 512; HV a multiple of H (value head j reads q/k head j // (HV // H)).
        g: `[B, T, HV, K]` per-step natural-log decay, <= 0 (unbounded below; -inf resets the state);
            the raw gate input with `use_gate_in_kernel`.
        beta: `[B, T, HV]`, activated unless `use_beta_sigmoid_in_kernel`.
        scale: query scale, default `K ** -0.5`.
        initial_state: `[N, HV, K, V]` (`[N, HV, V, K]` with `state_v_first`), default zeros.
        output_final_state: return the final state, same layout (else None).
        cu_seqlens: `[N + 1]` int64 offsets of packed sequences (B must be 1); empty sequences allowed.
        cu_seqlens_cpu: a host copy of cu_seqlens; the checks read it instead (no device sync for them).
        return_intermediate_states: also return the state entering each chunk (fla's `h`, for inference).
        chunk_size: tokens per chunk C, default 16.
        backend: "torch" (this module), "triton" (`k3sys.kda.triton`: CUDA tensors, or CPU under
            TRITON_INTERPRET=1; chunk_size 16, bf16/fp16/fp32, K, V <= 256, the safe gate g >= -5), or
            "auto": Triton on CUDA tensors when it supports the call, torch otherwise.
        **options: `k3sys.kda.activations.KDAOptions`: fla's `use_qk_l2norm_in_kernel`, `use_gate_in_kernel`
            (with `A_log`, `dt_bias`, `lower_bound`, `safe_gate`), `use_beta_sigmoid_in_kernel`,
            `allow_neg_eigval`, `state_v_first`, and FlashKDA's `l2norm_eps`, `transpose_state_layout`.

    Returns:
        o `[B, T, HV, V]` in v's dtype, the final state in the compute dtype (fp32, or fp64 when any input
        is fp64; bf16/fp16 inputs accumulate in fp32) or None, and with `return_intermediate_states` the
        entering states `[B, NT, HV, K, V]` (`[1, total chunks, HV, K, V]` with cu_seqlens) in the
        compute dtype.
    """
    opts = kda_options(**options)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1 or (
            chunk_size > SUB_CHUNK and chunk_size % SUB_CHUNK):
        raise ValueError(f"chunk_size must be a positive int, a multiple of {SUB_CHUNK} above {SUB_CHUNK}, "
                         f"got {chunk_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        from k3sys.kda.triton import kda_triton, triton_unsupported  # triton is optional: import when chosen

        why = triton_unsupported(q, k, v, g, beta, chunk_size, initial_state, opts)
        if why is None:
            return kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens=cu_seqlens,
                              cu_seqlens_cpu=cu_seqlens_cpu, return_intermediate_states=return_intermediate_states,
                              **options)
        if backend == "triton":
            raise ValueError(f"backend='triton' cannot run this call: {why}")
    fused = runs_fused((q, k, v, g, beta, initial_state), opts, chunk_size, return_intermediate_states)
    raw = fused and kernel_activates(opts)  # the kernel applies the activations to the rows it reads
    p = prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu, opts, raw=raw)
    dims, dt, device = p.dims, p.v.dtype, q.device
    S0 = p.S0 if p.S0 is not None else torch.zeros(dims.N, dims.HV, dims.K, dims.V, dtype=dt, device=device)
    if dims.B * dims.T == 0:  # no tokens: every state passes through
        o, S, h = v.new_zeros(v.shape), S0, S0.new_zeros(dims.B, 0, dims.HV, dims.K, dims.V)
    elif fused:  # CPU fp32 without autograd: one C++ pass (chunk_fused.py)
        (o, S), h = fused_forward(p, S0, opts if raw else None), None
    else:
        o, S, h = _two_phases(p, S0, chunk_size, return_intermediate_states)
    result = (o.to(v.dtype), state_out(S, opts) if output_final_state else None)
    return (*result, state_out(h, opts)) if return_intermediate_states else result


def _two_phases(
    p: Prepared, S0: torch.Tensor, chunk_size: int, keep_states: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The torch path on prepared inputs: (o `[B, T, HV, V]`, final states `[N, HV, K, V]`, entering states)."""
    dims, device = p.dims, p.v.device
    if p.cu_seqlens is None:
        lengths = torch.full((dims.B,), dims.T, dtype=torch.long, device=device)
        starts = torch.arange(dims.B, device=device) * dims.T
    else:
        cu = p.cu_seqlens.to(device=device, dtype=torch.long)
        lengths, starts = cu[1:] - cu[:-1], cu[:-1]
    layout = chunk_layout(lengths, starts, chunk_size, dims.HV)
    # an exact reset (g = -inf) as a finite step whose exp is 0 in fp32 and fp64: -inf would make the
    # in-chunk differences G_i - G_j NaN; the clamp's gradient there is 0, as exp(-inf)'s is
    g = p.g.clamp(min=RESET_LOG_DECAY)
    xs = [to_slots(x, layout, p.v.dtype) for x in (p.q, p.k, p.v, g)]
    xs.append(to_slots(p.beta[..., None], layout, p.v.dtype)[..., 0])
    S, offsets = S0[layout.order], [0, *itertools.accumulate(layout.active)]
    outs, entering = [], []
    for a, b in step_blocks(layout.active, dims.HV * chunk_size):  # the slots of steps [a, b) are contiguous
        ws = intra_chunk(*(x[offsets[a]:offsets[b]] for x in xs), p.scale)
        O, S, states = inter_chunk(ws, layout.active[a:b], S, keep_states)
        outs.append(O)
        entering.append(states)
    o = from_slots(torch.cat(outs) if len(outs) > 1 else outs[0], layout, dims.B, dims.T)
    h = None
    if keep_states:
        h = torch.cat(entering).index_select(0, layout.slot_of_chunk)
        h = h.view(dims.B, -1, *h.shape[1:]) if p.cu_seqlens is None else h.unsqueeze(0)
    return o, S[torch.argsort(layout.order)], h
