"""KimiDeltaAttention: the KDA token mixer as an nn.Module, with a fixed-size decode state.

x -> fused q/k/v projection -> depthwise causal short conv + SiLU -> q, k, v
  -> the op with its in-kernel activations (L2-normalised q, k; the gate from the low-rank gate
     projection, A_log and dt_bias; sigmoid(b_proj x) as beta): kda_chunk (prefill, T > 1), kda_step's
     update (decode, T = 1) or kda_chunk_cp (a slice of a sequence split over a context-parallel group)
  -> per-head RMSNorm * sigmoid(low-rank output gate) -> output projection
(the structure of fla's `KimiDeltaAttention`, whose weights load losslessly: `load_fla_state_dict`).

Shapes: B batch, T tokens, N sequences (B, or len(cu_seqlens) - 1), H q/k heads, HV v heads (GVA when
HV > H), K key dim, V value dim, W conv width, C = 2 H K + HV V fused q/k/v channels.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from k3sys.kda.chunk import kda_chunk
from k3sys.kda.cp import from_previous_rank, kda_chunk_cp
from k3sys.kda.gate import check_lower_bound
from k3sys.kda.state import STATE_LAYOUTS, KDAState
from k3sys.kda.step import step_unchecked
from k3sys.kda.validate import MAX_HEAD_DIM, NaNError, check_cu_seqlens

# fla's layer names that map one to one onto ours (same shape); the rest are split, fused or reshaped.
_SAME_NAMES = ("f_proj.0.weight", "f_proj.1.weight", "b_proj.weight", "A_log", "g_proj.0.weight",
               "g_proj.1.weight", "g_proj.1.bias", "o_proj.weight")


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention layer.

    Args:
        hidden_size: model width D.
        num_heads: H, the q/k heads.
        head_dim: K per head (<= 512, the op's MAX_HEAD_DIM); also V unless `head_v_dim` is given.
        conv_size: short convolution width W (>= 1; the state keeps `W - 1` steps).
        lower_bound: safe-gate bound in [-5, 0) (ours, default -5), or None for fla's default
            `-exp(A_log) * softplus(f + dt_bias)`, unbounded below (what Kimi Linear uses).
        norm_eps: epsilon of the per-head output RMSNorm.
        num_v_heads: HV, value heads (grouped value attention: a multiple of H; g, beta, A_log and
            dt_bias are per value head, as in fla). Default H.
        head_v_dim: V per head. Default `head_dim`.
        use_short_conv: False drops the convolution (q, k, v = SiLU of the projections; no conv state).
        conv_bias: a bias in the short convolution.
        allow_neg_eigval: beta = 2 sigmoid(b) in (0, 2), so I - beta k k^T can have negative eigenvalues.
        output_gate_bias: bias of the output gate's second projection (fla: True; Kimi Linear: False).
        l2norm_eps: epsilon of the q/k L2 normalisation (fla's 1e-6).
        init: "k3sys" (dt_bias 0, A_log = log U(1, 16)) or "fla" (dt_bias the inverse softplus of a
            log-uniform dt in [1e-3, 0.1]; A_log 0 under a safe gate, as fla's `safe_gate`).
        state_layout: "kv" (S `[K, V]` per head, ours) or "vk" (`[V, K]`, fla's cache) for the states
            `forward` takes and returns.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        conv_size: int = 4,
        lower_bound: float | None = -5.0,
        norm_eps: float = 1e-5,
        *,
        num_v_heads: int | None = None,
        head_v_dim: int | None = None,
        use_short_conv: bool = True,
        conv_bias: bool = False,
        allow_neg_eigval: bool = False,
        output_gate_bias: bool = True,
        l2norm_eps: float = 1e-6,
        init: Literal["k3sys", "fla"] = "k3sys",
        state_layout: Literal["kv", "vk"] = "kv",
    ) -> None:
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        head_v_dim = head_dim if head_v_dim is None else head_v_dim
        for name, val in (("hidden_size", hidden_size), ("num_heads", num_heads), ("head_dim", head_dim),
                          ("conv_size", conv_size), ("num_v_heads", num_v_heads), ("head_v_dim", head_v_dim)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if max(head_dim, head_v_dim) > MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM}, got {max(head_dim, head_v_dim)}")
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_heads ({num_heads})")
        if init not in ("k3sys", "fla"):
            raise ValueError(f"init must be 'k3sys' or 'fla', got {init!r}")
        if state_layout not in STATE_LAYOUTS:
            raise ValueError(f"state_layout must be one of {list(STATE_LAYOUTS)}, got {state_layout!r}")
        check_lower_bound(lower_bound)
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.num_v_heads, self.head_v_dim = num_v_heads, head_v_dim
        self.conv_size = conv_size if use_short_conv else 1  # a 1-wide window: no conv state
        self.use_short_conv, self.lower_bound, self.norm_eps = use_short_conv, lower_bound, norm_eps
        self.allow_neg_eigval, self.l2norm_eps, self.state_layout = allow_neg_eigval, l2norm_eps, state_layout
        H, K, HV, V = num_heads, head_dim, num_v_heads, head_v_dim
        self.splits = (H * K, H * K, HV * V)
        self.channels = sum(self.splits)
        # q, k and v in one GEMM; the depthwise conv over their concatenation equals three separate ones
        self.qkv_proj = nn.Linear(hidden_size, self.channels, bias=False)
        # only its weight `[C, 1, W]` (and bias), with nn.Conv1d's init, is used, by `_short_conv`
        self.conv = (nn.Conv1d(self.channels, self.channels, conv_size, groups=self.channels, bias=conv_bias)
                     if use_short_conv else None)
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, V, bias=False), nn.Linear(V, HV * K, bias=False))
        self.b_proj = nn.Linear(hidden_size, HV, bias=False)
        self.A_log = nn.Parameter(torch.empty(HV).uniform_(1, 16).log())
        self.dt_bias = nn.Parameter(torch.zeros(HV, K))
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, V, bias=False),
                                    nn.Linear(V, HV * V, bias=output_gate_bias))
        self.o_norm_weight = nn.Parameter(torch.ones(V))
        self.o_proj = nn.Linear(HV * V, hidden_size, bias=False)
        if init == "fla":
            self._fla_init()

    @torch.no_grad()
    def _fla_init(self) -> None:
        """fla's init of the gate: dt log-uniform in [1e-3, 0.1], dt_bias = softplus^-1(dt) (Mamba's)."""
        dt = torch.exp(torch.rand_like(self.dt_bias) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        dt = dt.clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        if self.lower_bound is not None:
            self.A_log.zero_()

    def init_state(self, batch_size: int, device: torch.device | None = None) -> KDAState:
        """A zero state for `batch_size` sequences (what `forward` assumes when given None)."""
        p = self.qkv_proj.weight
        return KDAState.zeros(batch_size, self.num_heads, self.head_dim, self.conv_size, conv_dtype=p.dtype,
                              recurrent_dtype=torch.promote_types(p.dtype, torch.float32),
                              device=p.device if device is None else device, num_v_heads=self.num_v_heads,
                              head_v_dim=self.head_v_dim, layout=self.state_layout)

    def _check(self, x: torch.Tensor, state: KDAState | None, cu_seqlens: torch.Tensor | None) -> int:
        """Validate x, cu_seqlens (a host copy: its values are read) and state; return the number of sequences N."""
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [B, T, {self.hidden_size}], got {list(x.shape)}")
        N = x.shape[0]
        if cu_seqlens is None:
            if x.shape[1] == 0:
                raise ValueError(f"x must be [B, T, {self.hidden_size}] with T >= 1, got {list(x.shape)}")
        else:
            if x.shape[0] != 1 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
                raise ValueError(f"cu_seqlens must be 1-D int [N + 1] with x [1, T, D], got cu_seqlens "
                                 f"{list(cu_seqlens.shape)} {cu_seqlens.dtype} and x {list(x.shape)}")
            N = check_cu_seqlens(cu_seqlens, x.shape[1])
        if state is None:
            return N
        want_S = self.init_state(N, device=torch.device("meta")).recurrent.shape
        for name, t, want in (("state.conv", state.conv, (N, self.conv_size - 1, self.channels)),
                              ("state.recurrent", state.recurrent, tuple(want_S))):
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape {list(want)}, got {list(t.shape)}")
        return N

    def _short_conv(self, window: torch.Tensor, T: int) -> torch.Tensor:
        """Depthwise causal conv (+ bias) of `window` `[B, W - 1 + T, C]` -> `[B, T, C]`.

        As W shifted multiply-adds in the token-major layout: F.conv1d wants channels-major copies both
        ways and takes a slow path for fp64 and single-token decode.
        """
        if self.conv is None:
            return window
        w = self.conv.weight[:, 0]  # [C, W]
        out = window[:, :T] * w[:, 0]
        for i in range(1, self.conv_size):
            out = out.addcmul_(window[:, i:i + T], w[:, i])
        return out if self.conv.bias is None else out + self.conv.bias

    def _packed_conv(self, proj: torch.Tensor, conv: torch.Tensor, cu_seqlens: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The short conv over packed sequences: proj `[T, C]`, conv `[N, W - 1, C]` -> (`[T, C]`, new conv).

        Each sequence's conv tail is laid in front of its tokens, `[tail_0, seq_0, tail_1, seq_1, ...]`,
        so one conv over the whole row is every sequence's conv; the new tails are the W - 1 rows that
        end each sequence (for a sequence shorter than W - 1, or empty, partly its old tail).
        """
        W1, N, T, dev = self.conv_size - 1, conv.shape[0], proj.shape[0], proj.device
        cu = cu_seqlens.to(device=dev, dtype=torch.long)
        seq = torch.repeat_interleave(torch.arange(N, device=dev), cu[1:] - cu[:-1], output_size=T)
        token_rows = torch.arange(T, device=dev) + (seq + 1) * W1
        shift, taps = torch.arange(N, device=dev)[:, None] * W1, torch.arange(W1, device=dev)
        ext = proj.new_zeros(T + N * W1, proj.shape[1])
        ext[(cu[:-1, None] + shift + taps).flatten()] = conv.to(proj.dtype).flatten(0, 1)
        ext[token_rows] = proj
        out = self._short_conv(ext[None], ext.shape[0] - W1)[0][token_rows - W1]
        new_tail = ext[cu[1:, None] + shift + taps]  # [N, W - 1, C], a copy (advanced indexing)
        return out, new_tail

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                S0: torch.Tensor, cu_seqlens: torch.Tensor | None, cu_host: torch.Tensor | None,
                cp_group: dist.ProcessGroup | None = None, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The KDA op on pre-activation inputs, the one place the layer calls it.

        q, k `[B, T, H, K]` and v `[B, T, HV, V]` after conv + SiLU; f `[B, T, HV, K]` the gate projection;
        b `[B, T, HV]` beta logits; S0 `[N, HV, ...]` in `state_layout`. Returns (o `[B, T, HV, V]`, S in
        `state_layout`). The op applies the activations in fp32 (q/k L2 norm, the gate from A_log and
        dt_bias, sigmoid beta, x2 for negative eigenvalues), reads q/k head j // (HV / H) for value head j,
        keeps empty sequences' states and works in the state layout asked for.
        """
        options = dict(use_qk_l2norm_in_kernel=True, l2norm_eps=self.l2norm_eps, use_gate_in_kernel=True,
                       A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound,
                       use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval,
                       state_v_first=self.state_layout == "vk")
        if cp_group is not None:
            return kda_chunk_cp(q, k, v, f, b, cp_group, initial_state=S0, output_final_state=True, **options)
        if cu_seqlens is None and q.shape[1] == 1:
            # Shapes are the layer's own and its gate is in range by construction: no per-token check (sync).
            # inplace: the step updates the cache's buffer itself (no state-sized allocation or copy).
            o, S = step_unchecked(q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], S0, inplace=inplace, **options)
            return o[:, None], S
        return kda_chunk(q, k, v, f, b, initial_state=S0, output_final_state=True, cu_seqlens=cu_seqlens,
                         cu_seqlens_cpu=cu_host, **options)

    def forward(self, x: torch.Tensor, state: KDAState | None = None, attention_mask: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None, cp_group: dist.ProcessGroup | None = None, *,
                inplace: bool = False) -> tuple[torch.Tensor, KDAState]:
        """x `[B, T, D]` -> (y `[B, T, D]`, the state after the last token of each sequence).

        `state` None means fresh sequences. T > 1 runs the chunked op, T = 1 the decode step; one call
        over a sequence and token-by-token calls threading the state give the same y.
        `attention_mask` `[B, T]` (or `[B, >= T]`, of which the last T columns are this call's, as
        Hugging Face passes it): 1 = token, 0 = padding, anywhere in the row; padding yields y = 0 and
        leaves the state untouched. `cu_seqlens` `[N + 1]` int: x `[1, T, D]` packs N sequences (empty
        ones allowed), and the state holds N. Not both.
        With `cp_group`, x is this rank's slice (T >= conv_size - 1) of B sequences split over the group in
        rank order (`kda.cp`; no mask, no cu_seqlens); `state` is the sequences' start (read on rank 0), the
        state returned their state after this slice.
        `inplace`: write the new state into `state`'s tensors (a decode cache's buffers, which must then be
        contiguous, S in the compute dtype) and return that `state`; the decode step updates S in place.
        """
        if inplace and state is None:
            raise ValueError("inplace=True writes into the given state: pass one (e.g. layer.init_state(B))")
        if cp_group is not None and (attention_mask is not None or cu_seqlens is not None):
            raise ValueError("a context-parallel forward takes whole rows: no attention_mask or cu_seqlens")
        if attention_mask is not None:
            if cu_seqlens is not None:
                raise ValueError("pass attention_mask or cu_seqlens, not both")
            return self._forward_masked(x, state, attention_mask, inplace)
        # the one read of the offsets (a sync on a GPU, which the op would make anyway: it gets this copy)
        cu_host = None if cu_seqlens is None else cu_seqlens.cpu()
        N = self._check(x, state, cu_host)
        B, T, _ = x.shape
        H, K, HV, V, W = self.num_heads, self.head_dim, self.num_v_heads, self.head_v_dim, self.conv_size
        state = self.init_state(N, x.device) if state is None else state
        proj = self.qkv_proj(x)
        if cu_seqlens is None:
            conv = state.conv.to(x.dtype)
            if cp_group is not None and W > 1:  # the conv's halo: the previous rank's last W - 1 projections
                if T < W - 1:
                    raise ValueError(f"under context parallelism each rank needs T >= conv_size - 1 = {W - 1}, "
                                     f"got {T}")
                conv = from_previous_rank(proj[:, T - (W - 1):], cp_group, first=conv)
            window = torch.cat([conv, proj], dim=1)  # [B, W - 1 + T, C]
            qkv = self._short_conv(window, T)
            # A copy, not a view: a view would keep the whole prefill window's projections alive.
            conv = window[:, window.shape[1] - (W - 1):].clone()
        else:
            qkv, conv = self._packed_conv(proj[0], state.conv, cu_seqlens)
            qkv = qkv[None]
        q, k, v = F.silu(qkv).split(self.splits, dim=-1)
        try:
            o, S = self._attend(q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, V),
                                self.f_proj(x).view(B, T, HV, K), self.b_proj(x), state.recurrent, cu_seqlens, cu_host,
                                cp_group, inplace)
        except NaNError as e:  # the op sees only its gate: name where the NaN came from
            raise NaNError(self._nan_source(x)) from e
        gate = self.g_proj(x).view(B, T, HV, V)
        o = o.to(S.dtype)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.o_norm_weight
        o = o * torch.sigmoid(gate.to(S.dtype))
        y = self.o_proj(o.to(x.dtype).reshape(B, T, HV * V))
        new = KDAState(conv=conv, recurrent=S)
        return y, state.copy_(new) if inplace else new

    def _nan_source(self, x: torch.Tensor) -> str:
        """Why the gate is NaN: the input, a parameter (by name), or neither (an overflow inside)."""
        if torch.isnan(x).any():
            return f"x (the layer's input) contains NaN at {int(torch.isnan(x).sum())} of {x.numel()} elements"
        for name, p in self.named_parameters():
            if torch.isnan(p).any():
                return f"parameter {name} contains NaN at {int(torch.isnan(p).sum())} of {p.numel()} elements"
        return "the gate is NaN although x and every parameter are NaN-free (an overflow to inf in f_proj?)"

    def _forward_masked(self, x: torch.Tensor, state: KDAState | None, attention_mask: torch.Tensor,
                        inplace: bool) -> tuple[torch.Tensor, KDAState]:
        """Padding removed (packed as B sequences), the packed forward, y scattered back (0 at padding)."""
        B, T, D = x.shape
        if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
            raise ValueError(f"attention_mask must be [B, >= T] = [{B}, >= {T}], got {list(attention_mask.shape)}")
        keep = attention_mask[:, attention_mask.shape[1] - T:].bool()
        rows = keep.flatten().nonzero().squeeze(1)
        cu_seqlens = F.pad(keep.sum(1).cumsum(0), (1, 0))
        y_packed, state = self.forward(x.reshape(B * T, D)[rows][None], state, cu_seqlens=cu_seqlens, inplace=inplace)
        y = x.new_zeros(B * T, D).index_copy(0, rows, y_packed[0])
        return y.view(B, T, D), state

    # ---- fla interop ----------------------------------------------------------------------
    @classmethod
    def from_fla_config(
        cls, hidden_size: int = 2048, expand_v: float = 1, head_dim: int = 128, num_heads: int = 16,
        num_v_heads: int | None = None, mode: str = "chunk", use_short_conv: bool = True,
        allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: float | None = None,
        conv_size: int = 4, conv_bias: bool = False, layer_idx: int | None = None, norm_eps: float = 1e-5,
        **kwargs: object,
    ) -> KimiDeltaAttention:
        """The layer fla's `KimiDeltaAttention(**same arguments)` builds, with fla's defaults and init
        (softplus gate unless `lower_bound` is set) and fla's `[V, K]` state layout.

        `mode` and `layer_idx` are fla's kernel choice and cache slot: accepted and unused (we pick the
        op by T; the caller holds the state). `safe_gate` is fla's kernel hint; it also zeroes A_log's
        init, as in fla.
        """
        del mode, layer_idx, kwargs
        if safe_gate and lower_bound is None:
            raise ValueError("safe_gate=True needs lower_bound (fla's rule)")
        head_v_dim = int(head_dim * expand_v)
        if not math.isclose(head_dim * expand_v, head_v_dim, rel_tol=1e-5):
            raise ValueError(f"head_dim * expand_v must be an integer, got {head_dim} * {expand_v}")
        return cls(hidden_size, num_heads, head_dim, conv_size=conv_size, lower_bound=lower_bound,
                   norm_eps=norm_eps, num_v_heads=num_v_heads, head_v_dim=head_v_dim, use_short_conv=use_short_conv,
                   conv_bias=conv_bias, allow_neg_eigval=allow_neg_eigval, init="fla", state_layout="vk")

    def _fla_split(self) -> list[tuple[str, str, int, int]]:
        """(fla name, our name, row start, row end) of the rows of our fused tensors each fla tensor is."""
        names, start = [], 0
        for p, n in zip("qkv", self.splits, strict=True):
            names.append((f"{p}_proj.weight", "qkv_proj.weight", start, start + n))
            if self.conv is not None:
                names.append((f"{p}_conv1d.weight", "conv.weight", start, start + n))
                if self.conv.bias is not None:
                    names.append((f"{p}_conv1d.bias", "conv.bias", start, start + n))
            start += n
        return names

    def state_dict_from_fla(self, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """fla's `KimiDeltaAttention.state_dict()` names and shapes -> ours (for `load_state_dict`).

        Lossless: q/k/v projections and convs are concatenated into our fused ones, `dt_bias` `[HV * K]`
        becomes `[HV, K]`, `o_norm.weight` is `o_norm_weight`. Raises ValueError listing missing or
        unexpected names and naming any tensor of the wrong shape.
        """
        ours = dict(self.state_dict())
        split = self._fla_split()
        same = [n for n in _SAME_NAMES if n in ours]
        expected = {n for n, *_ in split} | set(same) | {"dt_bias", "o_norm.weight"}
        missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
        if missing or unexpected:
            raise ValueError(f"fla state dict does not match this layer: missing {missing}, unexpected {unexpected}")
        out = {n: sd[n] for n in same}
        dt_bias = sd["dt_bias"]  # [HV * K] -> [HV, K]; a wrong size falls through to the shape check
        out["dt_bias"] = dt_bias.reshape(self.dt_bias.shape) if dt_bias.numel() == self.dt_bias.numel() else dt_bias
        out["o_norm_weight"] = sd["o_norm.weight"]
        for ours_name in {o for _, o, *_ in split}:
            out[ours_name] = torch.cat([sd[f] for f, o, *_ in split if o == ours_name])
        for name, t in out.items():
            if t.shape != ours[name].shape:
                fla_name = {"o_norm_weight": "o_norm.weight"}.get(name, name)
                raise ValueError(f"{fla_name} has shape {list(t.shape)}, this layer needs {list(ours[name].shape)} "
                                 f"(as our {name})")
        return out

    def load_fla_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load the weights of an fla `KimiDeltaAttention` (its `state_dict()`), strictly."""
        self.load_state_dict(self.state_dict_from_fla(sd), strict=True)

    def fla_state_dict(self) -> dict[str, torch.Tensor]:
        """Our weights under fla's names and shapes (the inverse of `state_dict_from_fla`)."""
        ours = {n: t.detach() for n, t in self.state_dict().items()}
        out = {n: ours[n] for n in _SAME_NAMES if n in ours}
        out["dt_bias"] = ours["dt_bias"].flatten()
        out["o_norm.weight"] = ours["o_norm_weight"]
        out.update({f: ours[o][a:b] for f, o, a, b in self._fla_split()})
        return out

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"num_v_heads={self.num_v_heads}, head_v_dim={self.head_v_dim}, conv_size={self.conv_size}, "
                f"lower_bound={self.lower_bound}, state_layout={self.state_layout!r}")
