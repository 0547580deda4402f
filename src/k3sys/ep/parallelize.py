"""`apply_ep`: make a model's MoE layers expert-parallel from outside (torchtitan's `parallelize.py` style).

    model = HybridModel(cfg)                       # or any module holding `MoELayer`s; same seed on every rank
    apply_ep(model, dist.group.WORLD, capacity=4096)
    opt = torch.optim.AdamW(model.parameters())     # after apply_ep: expert weights were replaced

Each `MoELayer` keeps its rank's home experts (the expert weights are sliced to `[homes, ...]`), gets
an `EPBuffer`, and becomes an `ExpertParallelMoE`: the class swap FSDP2's `fully_shard` does
(`module.__class__` set to a subclass). Why a class swap rather than a wrapper module or a patched
`forward` attribute: the module keeps its place, its parameter names (checkpoints and optimizers
see the same keys) and `isinstance(layer, MoELayer)`; the subclass overrides only the two halves
of the routed computation (`start_routed`: dispatch; `finish`: prefetch, grouped GEMMs, combine),
so `MoELayer.forward` and callers that put work between the halves (`MoEFFN`'s shared expert) run
unchanged and overlap the transfer; and `_apply` can rebuild the static buffer when `.to()` /
`.double()` / `.to_empty()` move the parameters (a patched forward could not).

Non-expert parameters (router, shared experts, everything else) stay replicated: all-reduce their
gradients as data parallelism does. Expert gradients come out complete on the home rank.

A rank whose forward fails would leave the others waiting in a collective: in their next layer's
dispatch (a failure outside an MoE layer: bad token ids in the embedding, say), or in the combine of
the layer it failed in (its expert function or the shared expert raised between dispatch and
combine), or in the backward (a failure after the last MoE layer). `apply_ep` guards the model's
forward (`_ForwardGuard`): the failed rank first finishes the transfers of a layer it left mid-flight
(`EPBuffer.abandon`: the others' combine completes), then tells the others at the next agreement point
(`k3sys.ep.agreement`): the next MoE layer's verdict all-gather (`EPBuffer.abort`) when the model calls
its MoE layers once each, in module order (as `HybridModel` does), else the check-in every forward
ends with (`EPBuffer.check_in`: one all-gather of an int64 per rank and one host read per forward,
the price of never leaving a rank in the backward). The others raise `RemoteStepError` naming the
rank and its error; it re-raises its own error, with a note saying the others were told.
"""

from __future__ import annotations

import contextlib
import sys
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from k3sys.ep.comm import EPBuffer
from k3sys.ep.experts import grouped_swiglu
from k3sys.ep.layer import EXPERT_WEIGHTS, MoELayer, MoEWork

__all__ = ["ExpertParallelMoE", "apply_ep"]


def apply_ep(
    model: nn.Module,
    group: dist.ProcessGroup,
    capacity: int,
    *,
    tolerance: float = 0.0,
    token_padding: int = 1,
    async_dispatch: bool = True,
) -> nn.Module:
    """Make every `MoELayer` in `model` expert-parallel over `group`, in place; returns `model`.

    Args:
        model: a module holding `MoELayer`s (or one itself), with the same weights on every rank.
        group: process group of R ranks (gloo on CPU, NCCL on GPU), R <= E (E need not be a multiple
            of R: `k3sys.ep.homes.Homes` gives each rank floor(E / R) or ceil(E / R) home experts).
        capacity: S, the most tokens one rank sends through a layer per step (`[B, T]` ids: B * T);
            sizes every static buffer.
        tolerance: the planner's imbalance allowance (see `EPBuffer`); R - 1 turns balancing off.
        token_padding: rows of each expert group are padded to a multiple of this (GEMM tile).
        async_dispatch: start the token transfer asynchronously, so the shared expert overlaps it
            (False: wait for the tokens before the shared expert; the same numbers).
    """
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not layers:
        raise ValueError(f"apply_ep: {type(model).__name__} holds no MoELayer")
    for layer in layers:
        if isinstance(layer, ExpertParallelMoE):
            raise ValueError("apply_ep: the model is already expert-parallel")
        w = layer.w_gate
        buffer = EPBuffer(group, capacity, layer.hidden, layer.top_k, layer.num_experts, token_padding,
                          dtype=w.dtype, device=w.device, tolerance=tolerance)
        home = buffer.home_experts
        for name in EXPERT_WEIGHTS:
            full = getattr(layer, name)
            setattr(layer, name, nn.Parameter(full.detach()[home.start:home.stop].clone(),
                                              requires_grad=full.requires_grad))
        layer.__class__ = ExpertParallelMoE
        layer.buffer, layer.async_dispatch = buffer, async_dispatch
        layer._work, layer._replicas_sent = None, False
    guard = _ForwardGuard(layers)
    for layer in layers:
        layer.guard = guard
    model.register_forward_pre_hook(guard.begin)
    model.register_forward_hook(guard.end, always_call=True)
    return model


class _ForwardGuard:
    """Tracks which MoE layers a model forward has reached, to fail the other ranks fast when this
    rank's forward raises (see the module doc)."""

    def __init__(self, layers: list[ExpertParallelMoE]) -> None:
        self.layers = layers
        self.begin()

    def begin(self, *_: object) -> None:
        """Forward pre-hook: a new forward starts at the first layer."""
        self.joined = self.finished = 0  # layers whose verdict all-gather this rank joined / finished
        self.in_order = True
        for layer in self.layers:  # a layer called on its own (no model hook) may have failed mid-flight
            layer._work = None

    def join(self, layer: ExpertParallelMoE) -> None:
        """A layer is about to join its verdict all-gather (dispatch or abort)."""
        self.in_order &= self.joined < len(self.layers) and self.layers[self.joined] is layer
        self.joined += 1

    def end(self, module: nn.Module, args: object, output: object) -> None:
        """Forward hook, also run when the forward raised (`output` None, the error in sys.exc_info)."""
        error = sys.exc_info()[1] if output is None else None
        in_flight = next((layer for layer in self.layers if layer._work is not None), None)
        if error is not None and self.joined > self.finished and in_flight is None:
            return  # it raised at a verdict all-gather: every rank raised there, nothing left to tell
        failure = None
        if error is not None:
            rank = self.layers[0].buffer.rank
            where = f"before MoE layer {self.joined}" if self.joined < len(self.layers) else "after its MoE layers"
            if in_flight is not None:
                in_flight._abandon()
                where = f"between the dispatch and the combine of MoE layer {self.layers.index(in_flight)}"
            failure = f"{type(module).__name__} forward raised {where}: {type(error).__name__}: {error}"
            error.add_note(f"k3sys.ep: rank {rank}'s {failure.split(': ')[0]}; the other ranks were told")
            if self.in_order and self.joined < len(self.layers):
                layer = self.layers[self.joined]
                self.join(layer)
                with contextlib.suppress(ValueError):  # abort raises here; the forward's own error propagates
                    layer.buffer.abort(failure, failed=True)
                return
        # The check-in every forward ends with: a failure after the last agreement point reaches the
        # other ranks here, before any of them starts the backward (whose transfers would wait for it).
        with contextlib.suppress(ValueError):  # raised on the failed rank only; its own error propagates
            self.layers[-1].buffer.check_in(failure)


class ExpertParallelMoE(MoELayer):
    """A `MoELayer` after `apply_ep`: home experts only, routed tokens through its `EPBuffer`.

    Not constructed directly (`apply_ep` swaps a layer's class). Attributes: buffer (`EPBuffer`),
    async_dispatch (bool).
    """

    buffer: EPBuffer
    async_dispatch: bool
    guard: _ForwardGuard
    _work: MoEWork | None  # the routed work between dispatch and the end of combine
    _replicas_sent: bool  # whether that work's prefetch ran

    def _reject(self, message: str) -> NoReturn:
        # A bad input found before dispatch joins the verdict all-gather: every rank raises, none hangs.
        self.guard.join(self)
        self.buffer.abort(f"MoELayer: {message}")

    def start_routed(self, x_sh: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> MoEWork:
        work = super().start_routed(x_sh, topk_ids, topk_weights)
        self.guard.join(self)
        work.pending = self.buffer.dispatch(x_sh, topk_ids, topk_weights, async_op=True)
        # In flight from here to the end of combine: a failure in between must finish the transfers
        # (`_abandon`), or the other ranks would wait in them.
        self._work, self._replicas_sent = work, False
        if not self.async_dispatch:
            work.pending.wait()
        return work

    def finish(self, work: MoEWork) -> torch.Tensor:
        buf = self.buffer
        epn, homes = buf.experts_per_rank, buf.homes.count(buf.rank)
        recv_nh, _, _, handle = work.pending.wait()
        home, replicas = buf.prefetch(handle, {n: getattr(self, n) for n in EXPERT_WEIGHTS})
        self._replicas_sent = True
        # The home experts' weights, then the replica slots', as two tensors: a concatenation would
        # copy every home weight each step.
        used = replicas["w_gate"].shape[0]
        # A rank with epn - 1 homes (uneven homes) has an empty last home group: skipped, as it
        # has no weights.
        ends = handle.ends[:homes] + handle.ends[epn:epn + used]
        y_nh = grouped_swiglu(recv_nh, ends, *((home[n], replicas[n]) for n in EXPERT_WEIGHTS))
        # Statistics stay on the device (`stats()` reads them): no host sync in the step.
        p = handle.plan
        experts = torch.arange(self.num_experts, device=p.alloc.device)
        moved = p.alloc.sum() - p.alloc[experts, buf.homes.rank_of(experts)].sum()
        self._keep_stats(p.alloc.sum(0), (p.replicas >= 0).sum(), moved, p.tpe.sum(0))
        out = buf.combine(handle, y_nh).view(work.shape)
        self._work = None
        self.guard.finished += 1
        return out

    def _abandon(self) -> None:
        """This rank's forward raised while the layer was in flight: finish its transfers (zeros for
        its expert outputs) so the other ranks complete the layer; the guard then tells them."""
        work, self._work = self._work, None
        weights = None if self._replicas_sent else {n: getattr(self, n) for n in EXPERT_WEIGHTS}
        self.buffer.abandon(work.pending, weights)
        self.guard.finished += 1

    def home_experts(self) -> range:
        return self.buffer.home_experts

    def _apply(self, fn, recurse: bool = True):  # nn.Module's (untyped) signature
        # .to() / .double() / .to_empty() land here: the static buffers follow the parameters.
        super()._apply(fn, recurse)
        w, buf = self.w_gate, self.buffer
        if not w.is_meta and (w.dtype, w.device) != (buf.dtype, buf.device):
            self.buffer = EPBuffer(buf.group, buf.capacity, buf.hidden, buf.top_k, buf.num_experts,
                                   buf.token_padding, dtype=w.dtype, device=w.device, tolerance=buf.tolerance)
        return self
