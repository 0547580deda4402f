"""KimiDeltaAttention: the KDA token mixer as an nn.Module, with a fixed-size decode state.

x -> fused q/k/v projection -> depthwise causal short conv + SiLU -> L2-normalised q, k
  -> low-rank gate projection -> kda_gate (g) ; sigmoid(b_proj x) (beta)
  -> kda_chunk (prefill, T > 1) or kda_step's update (decode, T = 1)
  -> per-head RMSNorm * sigmoid(low-rank output gate) -> output projection
(the structure of fla's `KimiDeltaAttention`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from k3sys.kda.chunk import MAX_HEAD_DIM, kda_chunk
from k3sys.kda.cp import from_previous_rank, kda_chunk_cp
from k3sys.kda.gate import check_lower_bound, kda_gate
from k3sys.kda.state import KDAState
from k3sys.kda.step import step_unchecked


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention layer.

    Args:
        hidden_size: model width D.
        num_heads: H.
        head_dim: K = V per head (<= 256).
        conv_size: short convolution width (>= 1; the state keeps `conv_size - 1` steps).
        lower_bound: safe-gate bound in [-5, 0), or None for the plain, unbounded gate.
        norm_eps: epsilon of the per-head output RMSNorm.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        conv_size: int = 4,
        lower_bound: float | None = -5.0,
        norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        for name, val in (("hidden_size", hidden_size), ("num_heads", num_heads), ("head_dim", head_dim),
                          ("conv_size", conv_size)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM}, got {head_dim}")
        check_lower_bound(lower_bound)
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.conv_size, self.lower_bound, self.norm_eps = conv_size, lower_bound, norm_eps
        H, D = num_heads, head_dim
        self.channels = 3 * H * D
        # q, k and v in one GEMM; the depthwise conv over their concatenation equals three separate ones
        self.qkv_proj = nn.Linear(hidden_size, self.channels, bias=False)
        # only its weight `[channels, 1, conv_size]` (and nn.Conv1d's init) is used, by `_short_conv`
        self.conv = nn.Conv1d(self.channels, self.channels, conv_size, groups=self.channels, bias=False)
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, D, bias=False), nn.Linear(D, H * D, bias=False))
        self.b_proj = nn.Linear(hidden_size, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H).uniform_(1, 16).log())
        self.dt_bias = nn.Parameter(torch.zeros(H, D))
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, D, bias=False), nn.Linear(D, H * D, bias=True))
        self.o_norm_weight = nn.Parameter(torch.ones(D))
        self.o_proj = nn.Linear(H * D, hidden_size, bias=False)

    def init_state(self, batch_size: int, device: torch.device | None = None) -> KDAState:
        """A zero state for `batch_size` sequences (what `forward` assumes when given None)."""
        p = self.qkv_proj.weight
        return KDAState.zeros(batch_size, self.num_heads, self.head_dim, self.conv_size, conv_dtype=p.dtype,
                              recurrent_dtype=torch.promote_types(p.dtype, torch.float32),
                              device=p.device if device is None else device)

    def _check(self, x: torch.Tensor, state: KDAState | None) -> None:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size or x.shape[1] == 0:
            raise ValueError(f"x must be [B, T, {self.hidden_size}] with T >= 1, got {list(x.shape)}")
        if state is None:
            return
        B, H, D = x.shape[0], self.num_heads, self.head_dim
        for name, t, want in (("state.conv", state.conv, (B, self.conv_size - 1, self.channels)),
                              ("state.recurrent", state.recurrent, (B, H, D, D))):
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape {list(want)}, got {list(t.shape)}")

    def _short_conv(self, window: torch.Tensor, T: int) -> torch.Tensor:
        """Depthwise causal conv of `window` `[B, W - 1 + T, channels]` -> `[B, T, channels]`.

        As W shifted multiply-adds in the token-major layout: F.conv1d wants channels-major copies both
        ways and takes a slow path for fp64 and single-token decode.
        """
        w = self.conv.weight[:, 0]  # [channels, W]
        out = window[:, :T] * w[:, 0]
        for i in range(1, self.conv_size):
            out = out.addcmul_(window[:, i:i + T], w[:, i])
        return out

    def forward(self, x: torch.Tensor, state: KDAState | None = None,
                cp_group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, KDAState]:
        """x `[B, T, D]` -> (y `[B, T, D]`, the state after the last token).

        `state` None means a fresh sequence. T > 1 runs the chunked op, T = 1 the decode step; one call
        over a sequence and token-by-token calls threading the state give the same y.
        With `cp_group`, x is this rank's slice (T >= conv_size - 1) of a sequence split over the group in
        rank order (`kda.cp`); `state` is the sequence's start (read on rank 0), the state returned its
        state after this slice.
        """
        self._check(x, state)
        B, T, _ = x.shape
        H, D, W = self.num_heads, self.head_dim, self.conv_size
        state = self.init_state(B, x.device) if state is None else state
        proj, conv = self.qkv_proj(x), state.conv.to(x.dtype)
        if cp_group is not None and W > 1:  # the conv's halo: the previous rank's last W - 1 projections
            if T < W - 1:
                raise ValueError(f"under context parallelism each rank needs T >= conv_size - 1 = {W - 1}, got {T}")
            conv = from_previous_rank(proj[:, T - (W - 1):], cp_group, first=conv)
        window = torch.cat([conv, proj], dim=1)  # [B, W - 1 + T, channels]
        qkv = F.silu(self._short_conv(window, T))
        q, k, v = qkv.view(B, T, 3, H, D).unbind(2)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        g = kda_gate(self.f_proj(x).view(B, T, H, D), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x))
        if cp_group is not None:
            o, S = kda_chunk_cp(q, k, v, g, beta, cp_group, initial_state=state.recurrent, output_final_state=True)
        elif T == 1:
            # Shapes are the layer's own and kda_gate keeps g in range: no per-token validation sync.
            o, S = step_unchecked(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.recurrent)
            o = o[:, None]
        else:
            o, S = kda_chunk(q, k, v, g, beta, initial_state=state.recurrent, output_final_state=True)
        gate = self.g_proj(x).view(B, T, H, D)
        o = o.to(S.dtype)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.o_norm_weight
        o = o * torch.sigmoid(gate.to(S.dtype))
        y = self.o_proj(o.to(x.dtype).reshape(B, T, H * D))
        # A copy, not a view: a view would keep the whole prefill window's projections alive.
        return y, KDAState(conv=window[:, window.shape[1] - (W - 1):].clone(), recurrent=S)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"conv_size={self.conv_size}, lower_bound={self.lower_bound}")

