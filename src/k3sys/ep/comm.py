"""`EPBuffer`: the whole expert-parallel communication API, on torch.distributed (gloo or NCCL).

    buf = EPBuffer(group, capacity=S, hidden=H, top_k=K, num_experts=E)
    recv_x, recv_w, cu_seqlens, handle = buf.dispatch(x, topk_ids, topk_weights)
    home, replicas = buf.prefetch(handle, {"w_gate": w_gate, ...})  # [homes, ...], [used slots, ...]
    out = buf.combine(handle, expert_out)                             # [buffer_rows, H] -> [s, H]
    home_grads = buf.reduce_grads(handle, replica_grads)              # what prefetch's backward runs

Legend (tensor-name suffixes): s tokens on this rank (<= S = capacity), k top-k slot, h hidden,
e expert, r rank, n pairs or buffer rows, g expert groups on a rank (2 * epn: the epn home slots,
then the epn replica slots). R ranks, E experts (any E >= R: `k3sys.ep.homes.Homes` places them,
epn = ceil(E / R) home experts at most per rank; a rank holds `homes.count(rank)` of them).

Over 400 lines: the buffer is the whole communication API of a step (DeepEP's shape, see STYLE.md):
dispatch, prefetch, combine, reduce_grads and their autograd functions share the handle, the static
buffers and the transfer helpers; the cross-rank failure agreement lives apart (`k3sys.ep.agreement`).

One step:
1. Plan. Each rank checks its input (layout on the host; id range, repeats and finiteness of x and
   the weights on the device), counts the pairs it routes to each expert (-1 ids: "no expert",
   counted nowhere), and all-gathers the counts `tpe [R, E]` together with a verdict code. Every rank
   runs the planner (`k3sys.ep.planner.plan`) on the same `tpe`: it is integer-only with stable
   sorts, so all ranks hold the identical plan without a broadcast. Then the step's one host sync
   reads, in one copy, every rank's verdict, the all_to_all split sizes, this rank's group ends and
   the replica table: before any token moves, a rank whose input is bad raises ValueError and the
   others raise `RemoteInputError` naming it, so nobody is left waiting in a later collective and the
   group stays usable (`k3sys.ep.agreement`). Nothing else in a step reads a device value on the host.
2. Dispatch. The plan gives every pair its destination rank and row (`Plan.slots`). A small
   all_to_all sends each pair's row and routing weight; then one all_to_all_single moves the token
   rows into a static staging buffer and one scatter puts them in their final expert-grouped row.
   A symmetric-memory backend (NVSHMEM, torch symmetric memory) would let senders write straight
   into the remote rows and remove the row exchange, the staging buffer and the scatter.
   With `async_op=True` dispatch returns while the token rows travel (`PendingDispatch.wait()`
   lands them), so the caller can overlap other work, e.g. the shared expert, with the transfer.
3. Prefetch. Each replica slot receives its expert's weights from the home rank by point-to-point
   sends straight from the home parameters into the static replica slots (no packing copies).
4. Combine. The inverse transfer returns each pair's expert output to its source rank, where the
   topk_weights live: the weighted sum runs there, so the weights and their gradient never travel.
5. Backward. dispatch and combine are each other's adjoint and run each other's transfer on the
   gradients; prefetch's backward sends the replica weight gradients home and adds them to the home
   experts' gradients (`reduce_grads`), so an optimizer step on home weights equals the local one.

A rank whose own code fails between dispatch and combine calls `abandon` (the other ranks' combine
then completes) and tells the others at the next agreement point: the next step's dispatch
(`abort`) or `check_in`. `apply_ep` does both for its layers.

Memory: every receive-side buffer (token rows, staging, replica slots, gradient staging) is sized by
S and the expert shapes, never by the routing: the same storage serves every step. Use one buffer per
MoE layer in training: its receive buffer doubles as the layer's saved activation, so a second dispatch
before the first one's backward would overwrite it (autograd's version check then raises).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from k3sys.ep.agreement import CALLER, FAILED, PROBLEMS, VALUES, RemoteInputError, RemoteStepError, raise_on_verdicts
from k3sys.ep.experts import weighted_sum
from k3sys.ep.homes import Homes
from k3sys.ep.planner import Plan, plan

__all__ = ["EPBuffer", "EPHandle", "PendingDispatch", "RemoteInputError", "RemoteStepError"]

_buffer_ids = itertools.count()


@dataclass(frozen=True, eq=False)
class EPHandle:
    """One dispatch's layout, reused by combine, prefetch, reduce_grads and the backward passes.

    owner: id of the EPBuffer that made it. rank: this rank. num_tokens: s. plan: the step's plan.
    send_splits / recv_splits: pairs sent to / received from each rank `[R]`.
    send_pair_n: `[n_send]` pair index `t * K + k` of each sent row, grouped by destination rank.
    send_token_n: `[n_send]` its token `t`. recv_row_n: `[n_recv]` buffer row of each received pair.
    ends: this rank's group ends `[2 * epn]` (host ints; `cu_seqlens` as a tuple).
    copies: (destination rank, slot, expert, home rank) of every replica of the step, sorted by
    (home, destination, slot): the point-to-point schedule of prefetch and reduce_grads (host ints).
    used: replica slots in use on this rank (the planner fills them from 0).
    topk_weights_sk: the routing weights combine applies (0 where the id is -1).
    Pairs with id -1 are in no send list.
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
    copies: tuple[tuple[int, int, int, int], ...]
    used: int
    topk_weights_sk: torch.Tensor


class EPBuffer:
    """Static-shape dispatch / combine / replica prefetch / gradient reduce for one MoE layer.

    Args:
        group: process group of R ranks (gloo on CPU, NCCL on GPU); expert e lives on rank
            `homes.rank_of(e)` (`k3sys.ep.homes.Homes`: contiguous, floor(E / R) or ceil(E / R) each).
        capacity: S, the most tokens a rank dispatches per step; sizes every buffer.
        hidden: H. top_k: K. num_experts: E >= R (any E: K3 puts 896 experts on 256 ranks).
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
        if num_experts < R:
            raise ValueError(f"num_experts ({num_experts}) must be >= the group size R ({R})")
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

    @property
    def home_experts(self) -> range:
        """Global ids of this rank's home experts."""
        return self.homes.experts_of(self.rank)

    # ------------------------------------------------------------------ dispatch
    def dispatch(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *, async_op: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, EPHandle] | PendingDispatch:
        """Send every token-k pair to the row the planner gave it.

        Args:
            x: `[s, H]` finite tokens of this rank, s <= capacity (s may differ across ranks).
            topk_ids: `[s, K]` int experts per token, distinct within a row; -1 means "no expert"
                (DeepEP's convention): the pair is not sent and contributes nothing, its weight ignored.
            topk_weights: `[s, K]` float routing weights, finite where the id is not -1 (combine
                applies them).
            async_op: return a `PendingDispatch` as soon as the token rows are on their way; its
                `wait()` lands them and returns what the synchronous call returns. The planning steps
                (a counts all-gather, a small row exchange) still run before it returns.

        Returns:
            recv_x: `[buffer_rows, H]` the static receive buffer, rows grouped by `cu_seqlens`;
                padding rows hold stale finite data. Differentiable; valid until the next dispatch.
            recv_w: `[buffer_rows]` fp32 routing weight of each received row (0 on padding), not
                differentiable; combine applies the weights itself, on the source rank.
            cu_seqlens: `[2 * epn]` int64 end row of each group (home experts, then replica slots).
            handle: the `EPHandle` for combine / prefetch / reduce_grads.

        Raises:
            ValueError on a rank whose input is bad, `RemoteInputError` naming it and its message on
            every other rank (`RemoteStepError` if a rank reported a failure with `abort(...,
            failed=True)`), all before any token moves (`k3sys.ep.agreement`): the group stays usable.
        """
        handle = self._route(x, topk_ids, topk_weights)
        pending = PendingDispatch(self, x, handle, self._start_rows(handle, x.detach(), handle.send_token_n))
        return pending if async_op else pending.wait()

    def abort(self, message: str, *, failed: bool = False) -> NoReturn:
        """Stop this rank's step in place of its dispatch, so that no other rank waits: joins the counts
        all-gather with a verdict, every other rank's dispatch raises (`RemoteInputError`, or
        `RemoteStepError` when `failed`) naming this rank and `message`; raises ValueError(message) here.

        For a check made before dispatch (a layer's own input check), or, with `failed=True`, to report
        that this rank's code raised since its last agreement point (see `abandon`)."""
        problem = (FAILED if failed else CALLER, message)
        _, verdict_r = self._gather_counts(None, None, None, problem)
        raise_on_verdicts(self.group, verdict_r.tolist(), message, "EPBuffer.dispatch")
        raise AssertionError("unreachable: raise_on_verdicts raises for a problem")

    def check_in(self, failure: str | None = None) -> None:
        """An agreement point outside dispatch: every rank of the group calls it at the same point of
        the program (`apply_ep`: at the end of every model forward). One all-gather of an int64 per
        rank and one host read.

        Args:
            failure: None if this rank's step went well since its last agreement point, else what
                failed (after `abandon`, or a failure with no dispatch after it).

        Raises:
            `RemoteStepError` naming the failed ranks and their messages on every rank that passed
            None; ValueError(failure) on a failed rank.
        """
        verdict = torch.full((1,), FAILED if failure is not None else 0, dtype=torch.long, device=self.device)
        verdict_r = torch.empty(self.world, dtype=torch.long, device=self.device)
        dist.all_gather_single(verdict_r, verdict, group=self.group)
        raise_on_verdicts(self.group, verdict_r.tolist(), failure, "EPBuffer.check_in")

    def abandon(self, step: EPHandle | PendingDispatch, home_weights: Mapping[str, torch.Tensor] | None) -> None:
        """Finish this rank's part of a step it cannot complete (its code raised between dispatch and
        combine), so that the other ranks' prefetch and combine do not wait for it.

        Lands the token rows (pass the `PendingDispatch` of an async dispatch), sends the replica
        weights when `home_weights` is given (when prefetch has not run on this rank but runs on the
        others; None when it ran or runs nowhere), and returns zero expert outputs in combine's
        transfer: the others' combine completes, with zeros for this rank's rows. No autograd. Then
        report the failure at the next agreement point (`abort(..., failed=True)` in place of the next
        dispatch on the group, or `check_in`), where every rank raises.
        """
        handle = step.handle if isinstance(step, PendingDispatch) else step
        self._check_handle(handle, "abandon")
        with torch.no_grad():
            if isinstance(step, PendingDispatch):
                step.wait()
            if home_weights is not None:
                self._fill_replicas(handle, [w.detach() for w in home_weights.values()], list(home_weights))
            self._rows_to_pairs(handle, torch.zeros_like(self._recv_x_nh))

    def _route(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> EPHandle:
        """Plan the step, give every pair its row and exchange the rows and weights; no token moves yet."""
        problem = self._check_layout(x, topk_ids, topk_weights)
        tpe_re, verdict_r = self._gather_counts(x, topk_ids, topk_weights, problem)
        p = self._plan(tpe_re)
        if p.buffer_rows != self.buffer_rows:
            raise AssertionError(f"planner gave {p.buffer_rows} buffer rows, expected {self.buffer_rows}")
        send_r, recv_r = p.traffic_of(self.rank)
        R, epn = self.world, self.experts_per_rank
        # The step's one host sync: all_to_all_single takes its split sizes as host ints. The
        # verdicts, the group ends (the grouped GEMM's slicing) and the replica table (the
        # point-to-point schedule) ride the same copy; nothing else reads the device on the host.
        host = torch.cat([verdict_r, send_r, recv_r, p.cu_seqlens[self.rank], p.replicas.reshape(-1)]).tolist()
        verdicts, send_splits, recv_splits = host[:R], host[R:2 * R], host[2 * R:3 * R]
        message = None
        if verdicts[self.rank]:
            message = problem[1] if problem is not None else self._describe(verdicts[self.rank], x, topk_ids,
                                                                            topk_weights)
        raise_on_verdicts(self.group, verdicts, message, "EPBuffer.dispatch")
        ends, replicas = tuple(host[3 * R:3 * R + 2 * epn]), host[3 * R + 2 * epn:]
        dst_rank_n, dst_row_n = self._slots(p, topk_ids.reshape(-1))
        # Pairs sorted by destination; "no expert" pairs (destination R) sort last and are not sent.
        send_pair_n = dst_rank_n.argsort(stable=True)[: sum(send_splits)].to(self.device)
        # Rows and weights travel ahead of the data, so the data lands in place with one scatter.
        topk_weights = topk_weights.masked_fill(topk_ids < 0, 0)
        send_meta = self._src_meta_n2[: send_pair_n.numel()]
        send_meta[:, 0] = dst_row_n.to(self.device)[send_pair_n]
        send_meta[:, 1] = topk_weights.detach().float().reshape(-1)[send_pair_n].view(torch.int32)
        recv_meta = self._dst_meta_n2[: sum(recv_splits)]
        dist.all_to_all_single(recv_meta, send_meta, recv_splits, send_splits, group=self.group)
        handle = EPHandle(
            owner=self._id, rank=self.rank, num_tokens=x.shape[0], plan=p,
            send_splits=tuple(send_splits), recv_splits=tuple(recv_splits),
            send_pair_n=send_pair_n, send_token_n=send_pair_n // self.top_k, recv_row_n=recv_meta[:, 0].long(),
            ends=ends, copies=self._copy_table(replicas),
            used=sum(e >= 0 for e in replicas[self.rank * epn:(self.rank + 1) * epn]), topk_weights_sk=topk_weights,
        )
        self._recv_w_n.zero_()
        self._recv_w_n.index_copy_(0, handle.recv_row_n, recv_meta[:, 1].view(torch.float32))
        return handle

    def _slots(self, p: Plan, ids_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(destination rank, row) `[s*K]` of each pair; rank R for a "no expert" (-1) pair.

        Unchecked (`check=False`): the verdict has checked every id and tpe is counted from them, so
        the plan's host re-validation would only add syncs. `Plan.slots(rank, ids)` (check=True) is
        the debugging check, and the reference (`k3sys.ep.comm_reference`) runs it in the tests.
        """
        dst_rank, dst_row = p.slots(self.rank, ids_n.view(-1, 1), check=False)
        return torch.where(dst_rank >= 0, dst_rank, self.world).view(-1), dst_row.view(-1)

    def _copy_table(self, replicas: list[int]) -> tuple[tuple[int, int, int, int], ...]:
        """(destination rank, slot, expert, home rank) of each replica in `replicas` (the plan's
        `[R, epn]` table as host ints, -1 for an unused slot), sorted by (home, destination, slot)."""
        epn = self.experts_per_rank
        copies = [(dest, slot, e, self.homes.rank_of(e))
                  for i, e in enumerate(replicas) if e >= 0 for dest, slot in [divmod(i, epn)]]
        return tuple(sorted(copies, key=lambda c: (c[3], c[0], c[1])))

    def _check_layout(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> tuple[int, str] | None:
        """Shape, dtype and device checks of dispatch's input (no values read, no host sync):
        None, or (problem code, message)."""
        S, H, K = self.capacity, self.hidden, self.top_k
        if x.dim() != 2 or x.shape[1] != H or x.dtype != self.dtype or x.device != self.device:
            return 1, f"x must be [s, {H}] {self.dtype} on {self.device}, got {list(x.shape)} {x.dtype} on {x.device}"
        s = x.shape[0]
        if s > S:
            return 2, f"x has s={s} tokens, more than the buffer capacity S={S}"
        if (topk_ids.shape != (s, K) or topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool
                or topk_ids.device != self.device):
            return 3, (f"topk_ids must be an integer [s={s}, K={K}] tensor on {self.device}, "
                       f"got {list(topk_ids.shape)} {topk_ids.dtype} on {topk_ids.device}")
        if (topk_weights.shape != (s, K) or not topk_weights.dtype.is_floating_point
                or topk_weights.device != self.device):
            return 4, (f"topk_weights must be a float [s={s}, K={K}] tensor on {self.device}, "
                       f"got {list(topk_weights.shape)} {topk_weights.dtype} on {topk_weights.device}")
        return None

    def _value_problem(self, x: torch.Tensor, ids_sk: torch.Tensor, weights_sk: torch.Tensor,
                       known_n: torch.Tensor) -> torch.Tensor:
        """Device scalar: the first value problem's code (5-8), 0 when the values are good."""
        ids_sorted = ids_sk.sort(-1).values
        repeated = ((ids_sorted.diff(dim=-1) == 0) & (ids_sorted[:, 1:] >= 0)).any()
        problems = torch.stack([~known_n.all(), repeated, ~x.isfinite().all(),
                                ~weights_sk.masked_fill(ids_sk < 0, 0).isfinite().all()])
        codes = torch.arange(VALUES, VALUES + 4, device=problems.device)
        return torch.where(problems, codes, len(PROBLEMS)).min() % len(PROBLEMS)

    def _describe(self, code: int, x: torch.Tensor, ids_sk: torch.Tensor, weights_sk: torch.Tensor) -> str:
        """The bad rank's message for a value problem (reads the values: only on the error path)."""
        if code == VALUES:
            return (f"topk_ids must lie in [-1, {self.num_experts}) (-1: no expert), "
                    f"got [{int(ids_sk.min())}, {int(ids_sk.max())}]")
        if code == VALUES + 1:
            return "topk_ids repeats an expert within a token's row"
        if code == VALUES + 2:
            return f"x holds {int((~x.isfinite()).sum())} non-finite values (NaN or inf)"
        bad = int((~weights_sk.masked_fill(ids_sk < 0, 0).isfinite()).sum())
        return f"topk_weights holds {bad} non-finite values (NaN or inf) on routed pairs"

    def _gather_counts(
        self, x: torch.Tensor | None, ids_sk: torch.Tensor | None, weights_sk: torch.Tensor | None,
        problem: tuple[int, str] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather `tpe [R, E]` plus a verdict column: (tpe `[R, E]`, verdicts `[R]`), both on the
        buffer's device (the caller reads the verdicts with the split sizes, `_route`).

        The verdict is the code of this rank's first problem: a layout one (`problem`, known on the
        host) or a value one (ids out of range or repeated, non-finite x or weights), computed on
        the device and carried by the same all-gather, so checking the values costs no host sync of
        its own. -1 ids are counted nowhere; a rank with a problem counts nothing, so every rank can
        still plan from the gathered tpe before it reads the verdicts.
        """
        E = self.num_experts
        row = torch.zeros(E + 1, dtype=torch.long, device=self.device)
        if problem is None:
            ids_n = ids_sk.reshape(-1).long()
            known_n = (ids_n >= -1) & (ids_n < E)
            # Pairs without a (valid) expert land in the verdict slot, overwritten right after.
            row.index_add_(0, torch.where(known_n & (ids_n >= 0), ids_n, E), torch.ones_like(ids_n))
            row[E] = self._value_problem(x, ids_sk, weights_sk, known_n)
        else:
            row[E] = problem[0]
        out_re = torch.empty(self.world * (E + 1), dtype=torch.long, device=self.device)
        dist.all_gather_single(out_re, row, group=self.group)
        out_re = out_re.view(self.world, E + 1)
        return out_re[:, :E], out_re[:, E]  # the counts stay on the device: the planner runs there

    def _plan(self, tpe_re: torch.Tensor) -> Plan:
        # The planner balances token-k pairs. With "no expert" (-1) ids a rank's pairs are not s*K,
        # so every pair is planned as a token of a top-1 routing: caps, replicas and rows are the same.
        # The verdict has checked every id, so the device planner runs unvalidated: no host sync.
        return plan(tpe_re, 1, tokens_per_rank=self.capacity * self.top_k, token_padding=self.token_padding,
                    tolerance=self.tolerance, validate=False)

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
        self._land_rows(h, self._start_rows(h, src_nh, index_n), out_nh)

    def _start_rows(self, h: EPHandle, src_nh: torch.Tensor, index_n: torch.Tensor) -> dist.Work:
        """First half of `_pairs_to_rows`: pack and start the all_to_all into the staging buffer."""
        send = self._src_nh[: index_n.numel()]
        torch.index_select(src_nh, 0, index_n, out=send)
        recv = self._dst_nh[: h.recv_row_n.numel()]
        return dist.all_to_all_single(recv, send, list(h.recv_splits), list(h.send_splits), group=self.group,
                                      async_op=True)

    def _land_rows(self, h: EPHandle, work: dist.Work, out_nh: torch.Tensor) -> None:
        """Second half: wait for the all_to_all and scatter the staged rows into their planned rows."""
        work.wait()
        out_nh.index_copy_(0, h.recv_row_n, self._dst_nh[: h.recv_row_n.numel()])

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
            home_weights: name -> `[homes, ...]` this rank's home expert weights (`homes.count(rank)`
                rows: epn, or epn - 1 with uneven homes; same names, shapes and dtypes every step).

        Returns:
            (home, replicas): the weights of the groups, home experts then replica slots, as two
            tensors rather than one `[2 * epn, ...]` concatenation (which would copy every home weight
            each step). `home` (`[homes, ...]` per name) is `home_weights` passed through: use it in the
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
        # Home weights hold this rank's home experts (epn or epn - 1 of them with uneven homes);
        # replica slots and their gradients always epn.
        rows = self.homes.count(self.rank) if what == "home_weights" else self.experts_per_rank
        for name, w in weights.items():
            if w.dim() < 1 or w.shape[0] != rows:
                raise ValueError(f"{what}[{name!r}] must be [{rows}, ...] (this rank's "
                                 f"{'home experts' if what == 'home_weights' else 'replica slots'}), "
                                 f"got {list(w.shape)}")
        if not self._replicas:
            if what != "home_weights":
                raise ValueError(f"EPBuffer: {what} given before any prefetch")
            for name, w in weights.items():
                self._replicas[name] = w.new_zeros(self.experts_per_rank, *w.shape[1:])
                self._grad_stage[name] = w.new_zeros(self.experts_per_rank, *w.shape[1:])
        layout = {n: (tuple(t.shape[1:]), t.dtype) for n, t in self._replicas.items()}
        given = {n: (tuple(t.shape[1:]), t.dtype) for n, t in weights.items()}
        if given != layout:
            raise ValueError(f"{what} must match the first prefetch's weights {layout}, got {given}")

    def _fill_replicas(self, h: EPHandle, home: list[torch.Tensor], names: list[str]) -> None:
        ops = []
        for dest, slot, expert, src in h.copies:
            if self.rank not in (dest, src):  # only the copies this rank is in
                continue
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
            name -> `[homes, ...]` (this rank's home experts, epn or epn - 1 with uneven homes) the
            sum, over every replica of each home expert on any rank, of its
            gradient (zeros for experts without replicas); add it to the home weights' gradients.
            (Prefetch's backward hands the sums to autograd as sparse rows instead, see `_Prefetch`.)
        """
        self._check_handle(handle, "reduce_grads")
        self._check_weights(grads, "grads")
        homes = self.homes.count(self.rank)
        out = {n: g.new_zeros(homes, *g.shape[1:]) for n, g in grads.items()}
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
        # Position of each copy among its home rank's copies (copies are sorted by home); host ints
        # from the handle's table, so the schedule reads nothing off the device.
        position, seen = [], {}
        for *_, home in h.copies:
            position.append(seen.get(home, 0))
            seen[home] = position[-1] + 1
        mine = [(local, pos) for (_, _, e, home), pos in zip(h.copies, position, strict=True) if home == self.rank
                for local in [self.homes.local(e)]]
        experts = sorted({local for local, _ in mine})  # this rank's experts that have copies
        row_of = {local: i for i, local in enumerate(experts)}
        sums = {name: g.new_zeros(len(experts), *g.shape[1:]) for name, g in grads.items()} if mine else None
        rounds = max(position) // epn + 1 if position else 0
        for rnd in range(rounds):
            ops = []
            for (dest, slot, _, src), pos in zip(h.copies, position, strict=True):
                if pos // epn != rnd or self.rank not in (dest, src):  # rounds count every copy; ops only this rank's
                    continue
                stage = pos % epn
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
            landing = [row_of[local] for local, pos in mine if pos // epn == rnd]
            if landing:
                rows = torch.tensor(landing, device=self.device)
                for name, total in sums.items():
                    total.index_add_(0, rows, self._grad_stage[name][: len(rows)].to(total.dtype))
        return None if sums is None else (torch.tensor(experts, device=self.device), sums)


def _run_p2p(ops: list[dist.P2POp]) -> None:
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


class PendingDispatch:
    """A dispatch whose token rows are in flight (`EPBuffer.dispatch(..., async_op=True)`).

    Work placed between the dispatch and `wait()` (a shared expert, another micro-batch's attention)
    overlaps the transfer. Until `wait()`, the buffer's staging is in use: no other call on the same
    EPBuffer, and `x` must not change in place.
    """

    def __init__(self, buf: EPBuffer, x: torch.Tensor, handle: EPHandle, work: dist.Work) -> None:
        self._buf, self._x, self._work = buf, x, work
        self.handle = handle
        self._result: tuple[torch.Tensor, torch.Tensor, torch.Tensor, EPHandle] | None = None

    def wait(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, EPHandle]:
        """Complete the dispatch: (recv_x, recv_w, cu_seqlens, handle) as `EPBuffer.dispatch` returns them."""
        if self._result is None:
            buf, h = self._buf, self.handle
            recv_x = _Dispatch.apply(self._x, buf, h, self._work)
            self._result = (recv_x, buf._recv_w_n, h.plan.cu_seqlens[h.rank], h)
        return self._result


class _Dispatch(torch.autograd.Function):
    """x `[s, H]` -> the static receive buffer `[buffer_rows, H]`; backward: the inverse transfer, summed over k.

    The forward transfer was started by `dispatch` (`work`); the forward lands it.
    """

    @staticmethod
    def forward(ctx, x_sh: torch.Tensor, buf: EPBuffer, handle: EPHandle, work: dist.Work) -> torch.Tensor:
        ctx.buf, ctx.handle = buf, handle
        buf._land_rows(handle, work, buf._recv_x_nh)
        return buf._recv_x_nh.view_as(buf._recv_x_nh)

    @staticmethod
    def backward(ctx, grad_nh: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        buf, h = ctx.buf, ctx.handle
        back_nh = buf._rows_to_pairs(h, grad_nh.contiguous())
        grad_sh = torch.zeros(h.num_tokens, buf.hidden, dtype=grad_nh.dtype, device=grad_nh.device)
        return grad_sh.index_add_(0, h.send_token_n, back_nh), None, None, None


class _Combine(torch.autograd.Function):
    """expert_out `[buffer_rows, H]` -> per-pair outputs `[s, K, H]`; backward: the forward transfer."""

    @staticmethod
    def forward(ctx, expert_out_nh: torch.Tensor, buf: EPBuffer, handle: EPHandle) -> torch.Tensor:
        ctx.buf, ctx.handle = buf, handle
        back_nh = buf._rows_to_pairs(handle, expert_out_nh.contiguous())
        pairs = handle.num_tokens * buf.top_k
        # "No expert" pairs get no row back: zeros, which their zeroed weights multiply.
        make = torch.empty if back_nh.shape[0] == pairs else torch.zeros
        y_nh = make(pairs, buf.hidden, dtype=back_nh.dtype, device=back_nh.device)
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
            grad_nh[:end].masked_fill_(padding.unsqueeze(1), 0)  # not `[padding] = 0`: a boolean index syncs
        return grad_nh, None, None


class _Prefetch(torch.autograd.Function):
    """home weights `[homes, ...]` per name -> (the same home weights, replica slots `[used, ...]`);
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
        return (*(w.view_as(w) for w in home), *(buf._replicas[n][:handle.used] for n in names))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        buf, h, names = ctx.buf, ctx.handle, ctx.names
        n = len(names)
        home_grads = grads[:n]
        replica_grads = {name: g if g is not None else torch.zeros_like(buf._replicas[name][:h.used])
                         for name, g in zip(names, grads[n:], strict=True)}
        received = buf._send_grads_home(h, replica_grads)
        if received is None:
            return None, None, None, *(None for _ in names), *home_grads
        experts, sums = received
        source_grads = []
        for name, g in zip(names, home_grads, strict=True):
            shape = (buf.homes.count(h.rank), *buf._replicas[name].shape[1:])  # the home weights'
            if g is None:  # nothing to add to: a sparse gradient alone would make the weight's .grad sparse
                source_grads.append(sums[name].new_zeros(shape).index_copy_(0, experts, sums[name]))
            else:
                source_grads.append(torch.sparse_coo_tensor(experts.view(1, -1), sums[name], shape,
                                                            is_coalesced=True, check_invariants=False))
        return None, None, None, *source_grads, *home_grads
