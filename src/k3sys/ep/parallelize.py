"""`apply_ep`: make a model's MoE layers expert-parallel from outside (torchtitan's `parallelize.py` style).

    model = HybridModel(cfg)                       # or any module holding `MoELayer`s; same seed on every rank
    apply_ep(model, dist.group.WORLD, capacity=4096)
    opt = torch.optim.AdamW(model.parameters())     # after apply_ep: expert weights were replaced

Each `MoELayer` keeps its rank's home experts (the expert weights are sliced to `[epn, ...]`), gets
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

A rank whose forward fails outside an MoE layer (bad token ids in the embedding, say) would leave the
others waiting in their next layer's dispatch. When the model calls its MoE layers once each, in
module order (as `HybridModel` does), `apply_ep` guards the model's forward: on such a failure the
rank joins that next layer's verdict all-gather (`EPBuffer.abort`), so the others raise
`RemoteInputError` naming it, and re-raises its own error.
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
from k3sys.ep.layer import EXPERT_WEIGHTS, MoELayer, MoEStats, MoEWork
from k3sys.ep.routing import maxvio

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
        group: process group of R ranks (gloo on CPU, NCCL on GPU); E must be a multiple of R.
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
    guard = _ForwardGuard(layers)
    for layer in layers:
        layer.guard = guard
    model.register_forward_pre_hook(guard.begin)
    model.register_forward_hook(guard.end, always_call=True)
    return model


class _ForwardGuard:
    """Tracks which MoE layers a model forward has reached, to fail the other ranks fast when this
    rank's forward raises between layers (see the module doc)."""

    def __init__(self, layers: list[ExpertParallelMoE]) -> None:
        self.layers = layers
        self.begin()

    def begin(self, *_: object) -> None:
        """Forward pre-hook: a new forward starts at the first layer."""
        self.joined = self.finished = 0  # layers whose verdict all-gather this rank joined / finished
        self.in_order = True

    def join(self, layer: ExpertParallelMoE) -> None:
        """A layer is about to join its verdict all-gather (dispatch or abort)."""
        self.in_order &= self.joined < len(self.layers) and self.layers[self.joined] is layer
        self.joined += 1

    def end(self, module: nn.Module, args: object, output: object) -> None:
        """Forward hook, also run when the forward raised (`output` None, the error in sys.exc_info)."""
        error = sys.exc_info()[1] if output is None else None
        # Only between layers: inside one (joined > finished) the other ranks raised with this one,
        # or wait in a transfer no verdict can reach.
        if error is None or not self.in_order or self.joined != self.finished or self.joined == len(self.layers):
            return
        layer = self.layers[self.joined]
        self.join(layer)
        with contextlib.suppress(ValueError):  # abort raises here; the forward's own error propagates
            layer.buffer.abort(f"{type(module).__name__} forward raised before MoE layer {self.joined - 1}: "
                               f"{type(error).__name__}: {error}")


class ExpertParallelMoE(MoELayer):
    """A `MoELayer` after `apply_ep`: home experts only, routed tokens through its `EPBuffer`.

    Not constructed directly (`apply_ep` swaps a layer's class). Attributes: buffer (`EPBuffer`),
    async_dispatch (bool).
    """

    buffer: EPBuffer
    async_dispatch: bool
    guard: _ForwardGuard

    def _reject(self, message: str) -> NoReturn:
        # A bad input found before dispatch joins the verdict all-gather: every rank raises, none hangs.
        self.guard.join(self)
        self.buffer.abort(f"MoELayer: {message}")

    def start_routed(self, x_sh: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> MoEWork:
        work = super().start_routed(x_sh, topk_ids, topk_weights)
        self.guard.join(self)
        work.pending = self.buffer.dispatch(x_sh, topk_ids, topk_weights, async_op=True)
        if not self.async_dispatch:
            work.pending.wait()
        return work

    def finish(self, work: MoEWork) -> torch.Tensor:
        buf = self.buffer
        epn, homes = buf.experts_per_rank, buf.homes.count(buf.rank)
        recv_nh, _, _, handle = work.pending.wait()
        home, replicas = buf.prefetch(handle, {n: getattr(self, n) for n in EXPERT_WEIGHTS})
        # The home experts' weights, then the replica slots', as two tensors: a concatenation would
        # copy every home weight each step.
        used = replicas["w_gate"].shape[0]
        # A rank with epn - 1 homes (uneven homes) has an empty last home group: skipped, as it
        # has no weights.
        ends = handle.ends[:homes] + handle.ends[epn:epn + used]
        y_nh = grouped_swiglu(recv_nh, ends, *((home[n], replicas[n]) for n in EXPERT_WEIGHTS))
        p = handle.plan
        self.last_stats = MoEStats(tuple(p.loads.tolist()), p.num_copies, p.moved_tokens, maxvio(p.tpe.sum(0)))
        out = buf.combine(handle, y_nh).view(work.shape)
        self.guard.finished += 1
        return out

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
