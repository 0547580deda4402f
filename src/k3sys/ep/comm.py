"""`EPBuffer`: the whole expert-parallel communication API, on torch.distributed (gloo or NCCL).

    buf = EPBuffer(group, capacity=S, hidden=H, top_k=K, num_experts=E)
    recv_x, recv_w, cu_seqlens, handle = buf.dispatch(x, topk_ids, topk_weights)
    home, replicas = buf.prefetch(handle, {"w_gate": w_gate, ...})  # [epn, ...], [used slots, ...]
    out = buf.combine(handle, expert_out)                             # [buffer_rows, H] -> [s, H]
    home_grads = buf.reduce_grads(handle, replica_grads)              # what prefetch's backward runs

Legend (tensor-name suffixes): s tokens on this rank (<= S = capacity), k top-k slot, h hidden,
e expert, r rank, n pairs or buffer rows, g expert groups on a rank (2 * epn: the epn home experts,
then the epn replica slots). R ranks, E experts, epn = E / R.

One step:
1. Plan. Each rank checks its input, counts the pairs it routes to each expert, and all-gathers the
   counts `tpe [R, E]` together with a verdict; a rank whose input is bad raises ValueError and the
   others raise `RemoteInputError`, so nobody is left waiting in a later collective. Every rank then
   runs the planner (`k3sys.ep.planner.plan`) on the same `tpe`: it is integer-only with stable
   sorts, so all ranks hold the identical plan without a broadcast.
2. Dispatch. The plan gives every pair its destination rank and row (`Plan.slots`). A small
   all_to_all sends each pair's row and routing weight; then one all_to_all_single moves the token
   rows into a static staging buffer and one scatter puts them in their final expert-grouped row.
   A symmetric-memory backend (NVSHMEM, torch symmetric memory) would let senders write straight
   into the remote rows and remove the row exchange, the staging buffer and the scatter.
3. Prefetch. Each replica slot receives its expert's weights from the home rank by point-to-point
   sends straight from the home parameters into the static replica slots (no packing copies).
4. Combine. The inverse transfer returns each pair's expert output to its source rank, where the
   topk_weights live: the weighted sum runs there, so the weights and their gradient never travel.
5. Backward. dispatch and combine are each other's adjoint and run each other's transfer on the
   gradients; prefetch's backward sends the replica weight gradients home and adds them to the home
   experts' gradients (`reduce_grads`), so an optimizer step on home weights equals the local one.

Memory: every receive-side buffer (token rows, staging, replica slots, gradient staging) is sized by
S and the expert shapes, never by the routing: the same storage serves every step. Use one buffer per
MoE layer in training: its receive buffer doubles as the layer's saved activation, so a second dispatch
before the first one's backward would overwrite it (autograd's version check then raises).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3sys.ep.experts import weighted_sum
from k3sys.ep.homes import Homes
from k3sys.ep.planner import Plan, plan

__all__ = ["EPBuffer", "EPHandle", "RemoteInputError"]

_buffer_ids = itertools.count()

# Verdict codes carried by the planning all-gather, so other ranks can say what went wrong where.
_INPUT_PROBLEMS = ("", "x", "capacity", "topk_ids", "topk_weights")


class RemoteInputError(RuntimeError):
    """Another rank rejected its input to a collective step; this rank stops with it instead of hanging."""


@dataclass(frozen=True, eq=False)
class EPHandle:
    """One dispatch's layout, reused by combine, prefetch, reduce_grads and the backward passes.

    owner: id of the EPBuffer that made it. rank: this rank. num_tokens: s. plan: the step's plan.
    send_splits / recv_splits: pairs sent to / received from each rank `[R]`.
    send_pair_n: `[n_send]` pair index `t * K + k` of each sent row, grouped by destination rank.
    send_token_n: `[n_send]` its token `t`. recv_row_n: `[n_recv]` buffer row of each received pair.
    ends: this rank's group ends `[2 * epn]` (host ints; `cu_seqlens` as a tuple).
    topk_weights_sk: the routing weights combine applies.
    """

    owner: int
    rank: int
    num_tokens: int
    plan: Plan
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    send_pair_n: torch.Tensor
    send_token_n: torch.Tensor
    recv_row_n: torch.Tensor
    ends: tuple[int, ...]
    topk_weights_sk: torch.Tensor


class EPBuffer:
    """Static-shape dispatch / combine / replica prefetch / gradient reduce for one MoE layer.

    Args:
        group: process group of R ranks (gloo on CPU, NCCL on GPU); expert e lives on rank e // epn.
        capacity: S, the most tokens a rank dispatches per step; sizes every buffer.
        hidden: H. top_k: K. num_experts: E, a multiple of R.
        token_padding: expert groups are padded to a multiple of this many rows. Default 1.
        dtype: dtype of the token rows. Default float32.
        device: where the buffers live. Default: the current CUDA device for NCCL, else CPU.
        tolerance: the planner's bounded-imbalance knob: 0 (default) gives every rank exactly its
            cap; R - 1 disables balancing (every pair on its expert's home rank: plain expert
            parallelism, the buffer then holds R * S * K rows as any static no-drop EP must).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        capacity: int,
        hidden: int,
        top_k: int,
        num_experts: int,
        token_padding: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        tolerance: float = 0.0,
    ) -> None:
        R = dist.get_world_size(group)
        if num_experts % R:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the group size R ({R})")
        for name, value in (("capacity", capacity), ("hidden", hidden), ("top_k", top_k),
                            ("token_padding", token_padding)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be <= num_experts ({num_experts})")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        self.group, self.rank, self.world = group, dist.get_rank(group), R
        self.capacity, self.hidden, self.top_k, self.num_experts = capacity, hidden, top_k, num_experts
        self.homes = Homes(num_experts, R)
        self.experts_per_rank = self.homes.epn
        self.token_padding, self.tolerance = token_padding, tolerance
        self.dtype, self.device = dtype, torch.device(device)
        self._id = next(_buffer_ids)
        # The planner sizes the buffer from S alone; an empty step asks it without any routing.
        self.buffer_rows = self._plan(torch.zeros(R, num_experts, dtype=torch.long, device="cpu")).buffer_rows
        pairs = capacity * top_k
        rows = self.buffer_rows
        self._recv_x_nh = torch.zeros(rows, hidden, dtype=dtype, device=self.device)
        self._recv_w_n = torch.zeros(rows, dtype=torch.float32, device=self.device)
        # Staging for the all_to_alls: the source side holds at most S*K pairs, a destination at
        # most buffer_rows (which bounds its load).
        self._src_nh = torch.empty(pairs, hidden, dtype=dtype, device=self.device)
        self._dst_nh = torch.empty(rows, hidden, dtype=dtype, device=self.device)
        self._src_meta_n2 = torch.empty(pairs, 2, dtype=torch.int32, device=self.device)
        self._dst_meta_n2 = torch.empty(rows, 2, dtype=torch.int32, device=self.device)
        # Replica slots and the gradient staging of reduce_grads, allocated on the first prefetch
        # (when the expert shapes are known) and reused after.
        self._replicas: dict[str, torch.Tensor] = {}
        self._grad_stage: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ dispatch
    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, EPHandle]:
        """Send every token-k pair to the row the planner gave it.

        Args:
            x: `[s, H]` tokens of this rank, s <= capacity (s may differ across ranks).
            topk_ids: `[s, K]` int experts per token, distinct within a row.
            topk_weights: `[s, K]` float routing weights (combine applies them).

        Returns:
            recv_x: `[buffer_rows, H]` the static receive buffer, rows grouped by `cu_seqlens`;
                padding rows hold stale finite data. Differentiable; valid until the next dispatch.
            recv_w: `[buffer_rows]` fp32 routing weight of each received row (0 on padding), not
                differentiable; combine applies the weights itself, on the source rank.
            cu_seqlens: `[2 * epn]` int64 end row of each group (home experts, then replica slots).
            handle: the `EPHandle` for combine / prefetch / reduce_grads.
        """
        problem = self._check_dispatch(x, topk_ids, topk_weights)
        tpe_e = None if problem else torch.bincount(topk_ids.reshape(-1).long(), minlength=self.num_experts)
        tpe_re = self._gather_counts(tpe_e, problem)
        p = self._plan(tpe_re)
        if p.buffer_rows != self.buffer_rows:
            raise AssertionError(f"planner gave {p.buffer_rows} buffer rows, expected {self.buffer_rows}")
        dst_rank_sk, dst_row_sk = p.slots(self.rank, topk_ids.to(p.tpe.device))
        send_r, recv_r = p.traffic_of(self.rank)
        send_splits, recv_splits = send_r.tolist(), recv_r.tolist()
        send_pair_n = dst_rank_sk.reshape(-1).argsort(stable=True).to(self.device)
        # Rows and weights travel ahead of the data, so the data lands in place with one scatter.
        send_meta = self._src_meta_n2[: send_pair_n.numel()]
        send_meta[:, 0] = dst_row_sk.reshape(-1).to(self.device)[send_pair_n]
        send_meta[:, 1] = topk_weights.detach().float().reshape(-1)[send_pair_n].view(torch.int32)
        recv_meta = self._dst_meta_n2[: sum(recv_splits)]
        dist.all_to_all_single(recv_meta, send_meta, recv_splits, send_splits, group=self.group)
        handle = EPHandle(
            owner=self._id, rank=self.rank, num_tokens=x.shape[0], plan=p,
            send_splits=tuple(send_splits), recv_splits=tuple(recv_splits),
            send_pair_n=send_pair_n, send_token_n=send_pair_n // self.top_k, recv_row_n=recv_meta[:, 0].long(),
            ends=tuple(p.cu_seqlens[self.rank].tolist()), topk_weights_sk=topk_weights,
        )
        self._recv_w_n.zero_()
        self._recv_w_n.index_copy_(0, handle.recv_row_n, recv_meta[:, 1].view(torch.float32))
        recv_x = _Dispatch.apply(x, self, handle)
        return recv_x, self._recv_w_n, p.cu_seqlens[self.rank], handle

    def _check_dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[int, str] | None:
        """Local checks of dispatch's input: None, or (problem code, message)."""
        S, H, K, E = self.capacity, self.hidden, self.top_k, self.num_experts
        if x.dim() != 2 or x.shape[1] != H or x.dtype != self.dtype or x.device != self.device:
            return 1, f"x must be [s, {H}] {self.dtype} on {self.device}, got {list(x.shape)} {x.dtype} on {x.device}"
        s = x.shape[0]
        if s > S:
            return 2, f"x has s={s} tokens, more than the buffer capacity S={S}"
        if topk_ids.shape != (s, K) or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
            return 3, f"topk_ids must be an integer [s={s}, K={K}] tensor, got {list(topk_ids.shape)} {topk_ids.dtype}"
        if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= E):
            return 3, f"topk_ids must lie in [0, {E}), got [{int(topk_ids.min())}, {int(topk_ids.max())}]"
        if K > 1 and bool((topk_ids.sort(-1).values.diff(dim=-1) == 0).any()):
            return 3, "topk_ids repeats an expert within a token's row"
        if (topk_weights.shape != (s, K) or not topk_weights.dtype.is_floating_point
                or topk_weights.device != self.device):
            return 4, (f"topk_weights must be a float [s={s}, K={K}] tensor on {self.device}, "
                       f"got {list(topk_weights.shape)} {topk_weights.dtype} on {topk_weights.device}")
        return None

    def _gather_counts(self, tpe_e: torch.Tensor | None, problem: tuple[int, str] | None) -> torch.Tensor:
        """All-gather `tpe [R, E]` plus a verdict column; raise on every rank if any input was bad."""
        row = torch.zeros(self.num_experts + 1, dtype=torch.long, device=self.device)
        if problem is None:
            row[:-1] = tpe_e
        else:
            row[-1] = problem[0]
        out_re = torch.empty(self.world * (self.num_experts + 1), dtype=torch.long, device=self.device)
        dist.all_gather_single(out_re, row, group=self.group)
        out_re = out_re.view(self.world, -1)
        if problem is not None:
            raise ValueError(f"EPBuffer.dispatch on rank {self.rank}: {problem[1]}")
        verdict_r = out_re[:, -1].cpu()
        if bool(verdict_r.any()):
            bad = int(verdict_r.nonzero()[0])
            raise RemoteInputError(
                f"EPBuffer.dispatch: rank {bad} rejected its input ({_INPUT_PROBLEMS[int(verdict_r[bad])]}); "
                f"rank {self.rank} stops too"
            )
        return out_re[:, :-1]  # stays on the device: the planner runs there

    def _plan(self, tpe_re: torch.Tensor) -> Plan:
        return plan(tpe_re, self.top_k, tokens_per_rank=self.capacity,
                    total_tokens=int(tpe_re.sum()) // self.top_k, token_padding=self.token_padding,
                    tolerance=self.tolerance)

    # ------------------------------------------------------------------ combine
    def combine(self, handle: EPHandle, expert_out: torch.Tensor) -> torch.Tensor:
        """Return each pair's expert output to its token and sum them weighted by topk_weights.

        Args:
            handle: from this buffer's dispatch.
            expert_out: `[buffer_rows, H]` expert outputs in recv_x's rows (padding rows are ignored).

        Returns:
            `[s, H]`: `out[t] = sum_k topk_weights[t, k] * expert_out[row of (t, k)]`. Differentiable in
            expert_out and topk_weights.
        """
        self._check_handle(handle, "combine")
        if expert_out.shape != (self.buffer_rows, self.hidden) or expert_out.dtype != self.dtype:
            raise ValueError(f"expert_out must be [{self.buffer_rows}, {self.hidden}] {self.dtype}, "
                             f"got {list(expert_out.shape)} {expert_out.dtype}")
        return weighted_sum(handle.topk_weights_sk, _Combine.apply(expert_out, self, handle))

    def _check_handle(self, handle: EPHandle, where: str) -> None:
        if not isinstance(handle, EPHandle) or handle.owner != self._id:
            raise ValueError(f"EPBuffer.{where}: handle comes from another EPBuffer (owner "
                             f"{getattr(handle, 'owner', None)}, this buffer is {self._id})")

    # The two transfers; each is the other's adjoint.
    def _pairs_to_rows(self, h: EPHandle, src_nh: torch.Tensor, index_n: torch.Tensor, out_nh: torch.Tensor) -> None:
        """Rows `src[index]` (in send order) -> their planned rows of `out` on the destination ranks."""
        send = self._src_nh[: index_n.numel()]
        torch.index_select(src_nh, 0, index_n, out=send)
        recv = self._dst_nh[: h.recv_row_n.numel()]
        dist.all_to_all_single(recv, send, list(h.recv_splits), list(h.send_splits), group=self.group)
        out_nh.index_copy_(0, h.recv_row_n, recv)

    def _rows_to_pairs(self, h: EPHandle, rows_nh: torch.Tensor) -> torch.Tensor:
        """Planned rows of `rows` on the destination ranks -> `[n_send, H]` back on the source, in send order."""
        send = self._dst_nh[: h.recv_row_n.numel()]
        torch.index_select(rows_nh, 0, h.recv_row_n, out=send)
        recv = self._src_nh[: h.send_pair_n.numel()]
        dist.all_to_all_single(recv, send, list(h.send_splits), list(h.recv_splits), group=self.group)
        return recv

    # ------------------------------------------------------------------ replica weights
    def prefetch(
        self, handle: EPHandle, home_weights: Mapping[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Fill this rank's replica slots with their experts' weights, sent by the home ranks.

        Args:
            handle: from this buffer's dispatch (its plan names the replicas).
            home_weights: name -> `[epn, ...]` this rank's home expert weights (same names, shapes
                and dtypes every step).

        Returns:
            (home, replicas): the weights of the groups, home experts then replica slots, as two
            tensors rather than one `[2 * epn, ...]` concatenation (which would copy every home weight
            each step). `home` (`[epn, ...]` per name) is `home_weights` passed through: use it in the
            home GEMMs, so that every rank's backward joins the gradient exchange and the replicas'
            gradients are added into the home gradient in place (see `_Prefetch`).
            `replicas` (`[c, ...]` per name, c <= epn the slots in use this step; the planner fills
            slots from 0, so groups `epn + c ...` are empty) views the static slot storage: slot j
            holds expert `plan.replicas[rank, j]`. Differentiable.
        """
        self._check_handle(handle, "prefetch")
        self._check_weights(home_weights, "home_weights")
        names = list(home_weights)
        home = [home_weights[n] for n in names]
        out = _Prefetch.apply(self, handle, names, *home, *home)
        return dict(zip(names, out[: len(names)], strict=True)), dict(zip(names, out[len(names):], strict=True))

    def _check_weights(self, weights: Mapping[str, torch.Tensor], what: str) -> None:
        epn = self.experts_per_rank
        for name, w in weights.items():
            if w.dim() < 1 or w.shape[0] != epn:
                raise ValueError(f"{what}[{name!r}] must be [epn={epn}, ...], got {list(w.shape)}")
        if not self._replicas:
            if what != "home_weights":
                raise ValueError(f"EPBuffer: {what} given before any prefetch")
            for name, w in weights.items():
                self._replicas[name] = torch.zeros_like(w, memory_format=torch.contiguous_format)
                self._grad_stage[name] = torch.zeros_like(w, memory_format=torch.contiguous_format)
        layout = {n: (tuple(t.shape), t.dtype) for n, t in self._replicas.items()}
        given = {n: (tuple(t.shape), t.dtype) for n, t in weights.items()}
        if given != layout:
            raise ValueError(f"{what} must match the first prefetch's weights {layout}, got {given}")

    def _copies(self, p: Plan) -> torch.Tensor:
        """`[c, 4]` (destination rank, slot, expert, home rank) of every replica, sorted by (home, dest, slot)."""
        dest, slot = torch.nonzero(p.replicas >= 0, as_tuple=True)
        expert = p.replicas[dest, slot]
        home = self.homes.rank_of(expert)
        key = (home * self.world + dest) * self.experts_per_rank + slot
        return torch.stack([dest, slot, expert, home], 1)[key.argsort()].cpu()  # host tables: p2p schedule

    def _fill_replicas(self, h: EPHandle, home: list[torch.Tensor], names: list[str]) -> None:
        ops = []
        copies = self._copies(h.plan)
        copies = copies[(copies[:, 0] == self.rank) | (copies[:, 3] == self.rank)]  # the ones this rank is in
        for dest, slot, expert, src in copies.tolist():
            for i, name in enumerate(names):
                tag = slot * len(names) + i
                if src == self.rank:
                    w = home[i][self.homes.local(expert)]
                    ops.append(dist.P2POp(dist.isend, w.contiguous(), group=self.group, tag=tag, group_peer=dest))
                elif dest == self.rank:
                    ops.append(dist.P2POp(dist.irecv, self._replicas[name][slot], group=self.group, tag=tag,
                                          group_peer=src))
        _run_p2p(ops)

    def reduce_grads(self, handle: EPHandle, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Send replica-slot gradients home and sum them per home expert.

        Args:
            handle: the dispatch whose prefetch made the replicas.
            grads: name -> `[epn, ...]` gradients of this rank's replica slots.

        Returns:
            name -> `[epn, ...]` the sum, over every replica of each home expert on any rank, of its
            gradient (zeros for experts without replicas); add it to the home weights' gradients.
            (Prefetch's backward hands the sums to autograd as sparse rows instead, see `_Prefetch`.)
        """
        self._check_handle(handle, "reduce_grads")
        self._check_weights(grads, "grads")
        out = {n: torch.zeros_like(g, memory_format=torch.contiguous_format) for n, g in grads.items()}
        received = self._send_grads_home(handle, grads)
        if received is not None:
            experts, sums = received
            for name in grads:
                out[name].index_copy_(0, experts, sums[name])
        return out

    def _send_grads_home(
        self, h: EPHandle, grads: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
        """Send `grads` (replica slots) home; return what came home to this rank: (local ids `[u]`,
        ascending, of its experts that have copies; name -> `[u, ...]` the sum of their copies'
        gradients), or None when no copy of this rank's experts exists.

        A home rank may have more incoming copies than its `epn` gradient staging slots, so the
        transfers run in rounds of at most epn per home rank (one round when R = 2); the round
        schedule comes from the plan, identical on every rank.
        """
        epn = self.experts_per_rank
        copies = self._copies(h.plan)
        home_r = copies[:, 3].contiguous()
        # Position of each copy among its home rank's copies (copies are sorted by home).
        position = torch.arange(len(copies)) - torch.searchsorted(home_r, home_r, side="left")
        mine = home_r == self.rank
        experts, landing = torch.unique(self.homes.local(copies[mine, 2]), return_inverse=True)  # copy -> its sum's row
        sums = {name: g.new_zeros(len(experts), *g.shape[1:]) for name, g in grads.items()} if mine.any() else None
        rounds = int(position.max()) // epn + 1 if len(copies) else 0
        involved = mine | (copies[:, 0] == self.rank)  # rounds count every copy; ops only this rank's
        for rnd in range(rounds):
            in_round = ((position // epn) == rnd) & involved
            ops = []
            for (dest, slot, _, src), stage in zip(copies[in_round].tolist(), (position[in_round] % epn).tolist(),
                                                   strict=True):
                for i, name in enumerate(grads):
                    tag = slot * len(grads) + i
                    if dest == self.rank:
                        ops.append(dist.P2POp(dist.isend, grads[name][slot].contiguous(), group=self.group,
                                              tag=tag, group_peer=src))
                    elif src == self.rank:
                        ops.append(dist.P2POp(dist.irecv, self._grad_stage[name][stage], group=self.group,
                                              tag=tag, group_peer=dest))
            _run_p2p(ops)
            # This rank's copies in a round are consecutive positions, so they fill stage slots 0, 1, ...
            rows = landing[(position[mine] // epn) == rnd].to(self.device)
            if len(rows):
                for name, total in sums.items():
                    total.index_add_(0, rows, self._grad_stage[name][: len(rows)].to(total.dtype))
        return None if sums is None else (experts.to(self.device), sums)


def _run_p2p(ops: list[dist.P2POp]) -> None:
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


class _Dispatch(torch.autograd.Function):
    """x `[s, H]` -> the static receive buffer `[buffer_rows, H]`; backward: the inverse transfer, summed over k."""

    @staticmethod
    def forward(ctx, x_sh: torch.Tensor, buf: EPBuffer, handle: EPHandle) -> torch.Tensor:
        ctx.buf, ctx.handle = buf, handle
        buf._pairs_to_rows(handle, x_sh, handle.send_token_n, buf._recv_x_nh)
        return buf._recv_x_nh.view_as(buf._recv_x_nh)

    @staticmethod
    def backward(ctx, grad_nh: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        buf, h = ctx.buf, ctx.handle
        back_nh = buf._rows_to_pairs(h, grad_nh.contiguous())
        grad_sh = torch.zeros(h.num_tokens, buf.hidden, dtype=grad_nh.dtype, device=grad_nh.device)
        return grad_sh.index_add_(0, h.send_token_n, back_nh), None, None


class _Combine(torch.autograd.Function):
    """expert_out `[buffer_rows, H]` -> per-pair outputs `[s, K, H]`; backward: the forward transfer."""

    @staticmethod
    def forward(ctx, expert_out_nh: torch.Tensor, buf: EPBuffer, handle: EPHandle) -> torch.Tensor:
        ctx.buf, ctx.handle = buf, handle
        back_nh = buf._rows_to_pairs(handle, expert_out_nh.contiguous())
        y_nh = torch.empty(handle.num_tokens * buf.top_k, buf.hidden, dtype=back_nh.dtype, device=back_nh.device)
        return y_nh.index_copy_(0, handle.send_pair_n, back_nh).view(handle.num_tokens, buf.top_k, buf.hidden)

    @staticmethod
    def backward(ctx, grad_skh: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        buf, h = ctx.buf, ctx.handle
        grad_nh = torch.empty(buf.buffer_rows, buf.hidden, dtype=grad_skh.dtype, device=grad_skh.device)
        buf._pairs_to_rows(h, grad_skh.reshape(-1, buf.hidden), h.send_pair_n, grad_nh)
        # Rows no pair came to (group padding, the tail) get zero gradient; the rest were just written.
        end = h.ends[-1]
        grad_nh[end:].zero_()
        if buf.token_padding > 1:
            padding = torch.ones(end, dtype=torch.bool, device=grad_nh.device).index_fill_(0, h.recv_row_n, False)
            grad_nh[:end][padding] = 0
        return grad_nh, None, None


class _Prefetch(torch.autograd.Function):
    """home weights `[epn, ...]` per name -> (the same home weights, replica slots `[used, ...]`);
    backward: the replica gradients go home and join the home gradient.

    The home weights come in twice: first as the replicas' source, then to pass through. Backward
    returns the pass-through gradient unchanged and, for the source, the summed replica gradients as
    sparse rows (only the experts with copies). The autograd engine sums the two for the home
    weight in input order, and it adds a dense gradient onto an earlier sparse one in place when it
    holds the only reference to the dense one (torch/csrc/autograd/input_buffer.cpp): so the replica
    rows land straight in the gradient the home GEMMs produced, with no copy and no full-size zero
    tensor, and where that gradient is shared elsewhere in the graph the engine adds out of place.
    """

    @staticmethod
    def forward(
        ctx, buf: EPBuffer, handle: EPHandle, names: list[str], *home_twice: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.buf, ctx.handle, ctx.names = buf, handle, names
        ctx.set_materialize_grads(False)  # unused outputs give None: no full-size zero tensors
        home = home_twice[len(names):]
        buf._fill_replicas(handle, list(home), names)
        # Only the slots in use (the planner fills slots from 0): unused ones get no gradient to write.
        used = int((handle.plan.replicas[handle.rank] >= 0).sum())
        return (*(w.view_as(w) for w in home), *(buf._replicas[n][:used] for n in names))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        buf, h, names = ctx.buf, ctx.handle, ctx.names
        n = len(names)
        used = int((h.plan.replicas[h.rank] >= 0).sum())
        home_grads = grads[:n]
        replica_grads = {name: g if g is not None else torch.zeros_like(buf._replicas[name][:used])
                         for name, g in zip(names, grads[n:], strict=True)}
        received = buf._send_grads_home(h, replica_grads)
        if received is None:
            return None, None, None, *(None for _ in names), *home_grads
        experts, sums = received
        source_grads = []
        for name, g in zip(names, home_grads, strict=True):
            shape = buf._replicas[name].shape
            if g is None:  # nothing to add to: a sparse gradient alone would make the weight's .grad sparse
                source_grads.append(sums[name].new_zeros(shape).index_copy_(0, experts, sums[name]))
            else:
                source_grads.append(torch.sparse_coo_tensor(experts.view(1, -1), sums[name], shape,
                                                            is_coalesced=True, check_invariants=False))
        return None, None, None, *source_grads, *home_grads
