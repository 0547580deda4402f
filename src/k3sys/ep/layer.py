"""`MoELayer`: router, SwiGLU routed experts, optional shared expert; local or expert-parallel.

With `group=None` every expert lives in this process and the layer is the plain reference: pairs
sorted by expert, one grouped GEMM, unsort, weighted sum. With a process group each rank holds its
`epn = E / R` home experts and runs the balanced path of `k3sys.ep.comm.EPBuffer`: dispatch into the
static buffer, prefetch of the replica weights the planner asks for, grouped GEMMs over the `2 * epn`
groups (home experts, then replicas), combine. Both paths compute every token's expert outputs with
the same code, so they agree to rounding.

Shape suffixes: s tokens, h hidden, f ffn hidden, k top-k, e experts, n rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from k3sys.ep.comm import EPBuffer
from k3sys.ep.experts import grouped_swiglu, weighted_sum
from k3sys.ep.routing import maxvio


@dataclass(frozen=True)
class MoEStats:
    """What the last forward did.

    slots_per_rank: token-expert pairs each rank's experts processed (one entry when local).
    copies: replica expert weights prefetched this step. moved_tokens: pairs processed on a replica
    instead of their expert's home rank. maxvio: `max_e T_e / mean_e T_e - 1` over all ranks' tokens.
    """

    slots_per_rank: tuple[int, ...]
    copies: int
    moved_tokens: int
    maxvio: float


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


class MoELayer(nn.Module):
    """Mixture-of-experts FFN: x `[..., hidden]` -> `[..., hidden]`.

    Args:
        hidden: model width h. ffn_hidden: each routed expert's SwiGLU width f.
        num_experts: E routed experts. top_k: K experts per token (distinct).
        num_shared_experts: shared experts, fused into one SwiGLU of width `num_shared_experts * f`
            that every token goes through. Default 0.
        group: `torch.distributed` process group of R ranks for expert parallelism; None (default)
            keeps all experts local (the reference path).
        capacity: most tokens a rank sends per step (S); required with a group, sizes the static buffers.
        router: "softmax" (default) or "sigmoid" scores; the top-K scores are renormalised to sum to 1.
        score_bias: a per-expert bias `score_bias [E]` added to the scores to choose the top-K but not to
            weigh them (DeepSeek-V3's `e_score_correction_bias`; zeros, not trained by backward).
        routed_scale: the renormalised top-K weights are multiplied by this (`routed_scaling_factor`).
        token_padding: rows of each expert group are padded to a multiple of this (GEMM tile). Default 1.
        tolerance: the planner's imbalance allowance (see `EPBuffer`); R - 1 turns balancing off.

    Parameters: `router.weight [E, h]`; `w_gate, w_up [E or epn, h, f]`, `w_down [E or epn, f, h]`
    (the home experts `rank * epn ...` with a group); `shared` (a `SwiGLU`) when shared experts exist.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        num_experts: int,
        top_k: int,
        num_shared_experts: int = 0,
        group: dist.ProcessGroup | None = None,
        capacity: int | None = None,
        router: Literal["softmax", "sigmoid"] = "softmax",
        token_padding: int = 1,
        *,
        tolerance: float = 0.0,
        score_bias: bool = False,
        routed_scale: float = 1.0,
    ) -> None:
        super().__init__()
        for name, value in (("hidden", hidden), ("ffn_hidden", ffn_hidden), ("num_experts", num_experts),
                            ("top_k", top_k), ("token_padding", token_padding)):
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
        self.group = group
        self.buffer: EPBuffer | None = None
        num_local = num_experts
        if group is not None:
            if capacity is None:
                raise ValueError("capacity (tokens per rank per step) is required when group is set")
            self._buffer_args = (group, capacity, hidden, top_k, num_experts, token_padding, tolerance)
            self.buffer = self._make_buffer(torch.get_default_dtype(), None)
            num_local = self.buffer.experts_per_rank
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.score_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False) if score_bias else None
        self.routed_scale = routed_scale
        self.w_gate = nn.Parameter(torch.empty(num_local, hidden, ffn_hidden))
        self.w_up = nn.Parameter(torch.empty(num_local, hidden, ffn_hidden))
        self.w_down = nn.Parameter(torch.empty(num_local, ffn_hidden, hidden))
        self.shared = SwiGLU(hidden, num_shared_experts * ffn_hidden) if num_shared_experts else None
        self.last_stats: MoEStats | None = None
        self.reset_parameters()

    def _make_buffer(self, dtype: torch.dtype, device: torch.device | None) -> EPBuffer:
        group, capacity, hidden, top_k, num_experts, token_padding, tolerance = self._buffer_args
        return EPBuffer(group, capacity, hidden, top_k, num_experts, token_padding, dtype=dtype, device=device,
                        tolerance=tolerance)

    def _apply(self, fn, recurse: bool = True):  # nn.Module's (untyped) signature
        # .to() / .bfloat16() / .to_empty() land here: the static buffers follow the parameters.
        super()._apply(fn, recurse)
        w = self.w_gate
        if self.buffer is not None and not w.is_meta and (w.dtype, w.device) != (self.buffer.dtype, self.buffer.device):
            self.buffer = self._make_buffer(w.dtype, w.device)
        return self

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.hidden:
            raise ValueError(f"x must be [..., {self.hidden}], got {list(x.shape)}")
        x_sh = x.reshape(-1, self.hidden)
        out_sh = self.routed_experts(x_sh, *self.route(x_sh))
        if self.shared is not None:
            out_sh = out_sh + self.shared(x_sh)
        return out_sh.view(x.shape)

    def routed_experts(self, x_sh: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The routed half of the layer for a given routing: `sum_k w[t, k] * expert_{ids[t, k]}(x[t])`.

        x_sh `[s, h]`, topk_ids `[s, K]`, topk_weights `[s, K]` -> `[s, h]`. `forward` calls it with the
        router's choice; benchmarks and custom routers call it directly. Sets `last_stats`.
        """
        experts = self._local_experts if self.buffer is None else self._parallel_experts
        return experts(x_sh, topk_ids, topk_weights)

    def _local_experts(self, x_sh: torch.Tensor, ids_sk: torch.Tensor, weights_sk: torch.Tensor) -> torch.Tensor:
        s, k = ids_sk.shape
        ids_n = ids_sk.flatten()
        order_n = ids_n.argsort(stable=True)  # pairs grouped by expert, token order inside a group
        tpe_e = torch.bincount(ids_n, minlength=self.num_experts)
        y_nh = grouped_swiglu(x_sh[order_n // k], tpe_e.cumsum(0).tolist(), self.w_gate, self.w_up, self.w_down)
        inverse_n = torch.empty_like(order_n)
        inverse_n[order_n] = torch.arange(order_n.numel(), device=order_n.device)
        y_skh = y_nh[inverse_n].view(s, k, self.hidden)
        self.last_stats = MoEStats((s * k,), 0, 0, maxvio(tpe_e))
        return weighted_sum(weights_sk, y_skh)

    def _parallel_experts(self, x_sh: torch.Tensor, ids_sk: torch.Tensor, weights_sk: torch.Tensor) -> torch.Tensor:
        buf = self.buffer
        epn = buf.experts_per_rank
        recv_nh, _, _, handle = buf.dispatch(x_sh, ids_sk, weights_sk)
        home, replicas = buf.prefetch(handle, {"w_gate": self.w_gate, "w_up": self.w_up, "w_down": self.w_down})
        # The home experts' weights, then the replica slots', as two tensors: a concatenation would
        # copy every home weight each step.
        used = replicas["w_gate"].shape[0]
        y_nh = grouped_swiglu(recv_nh, handle.ends[:epn + used],
                              *((home[n], replicas[n]) for n in ("w_gate", "w_up", "w_down")))
        p = handle.plan
        self.last_stats = MoEStats(tuple(p.loads.tolist()), p.num_copies, p.moved_tokens, maxvio(p.tpe.sum(0)))
        return buf.combine(handle, y_nh)

    def home_experts(self) -> range:
        """Global ids of the experts this layer holds (all of them when local)."""
        if self.buffer is None:
            return range(self.num_experts)
        epn = self.buffer.experts_per_rank
        return range(self.buffer.rank * epn, (self.buffer.rank + 1) * epn)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load a single-process (all-expert) state dict, keeping this rank's home experts."""
        home = self.home_experts()
        self.load_state_dict({k: v[home.start:home.stop] if k in ("w_gate", "w_up", "w_down") else v
                              for k, v in state.items()})
