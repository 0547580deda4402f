"""fla's `KimiDeltaAttention`, written out from its formulas over fla-named weights: the oracle the
layer's fla interop is tested against (and the model's Kimi-Linear loader, whose KDA layers are fla's).

Nothing here uses the layer: separate q/k/v projections, `F.conv1d` with causal padding for the short
convolutions, fla's l2norm / gate / sigmoid formulas, and `kda_naive`'s token loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3sys.kda import kda_naive


def fla_shapes(D: int, H: int, K: int, HV: int | None = None, V: int | None = None, W: int = 4,
               use_short_conv: bool = True, conv_bias: bool = False, gate_bias: bool = True) -> dict[str, tuple]:
    """Names and shapes of fla's layer state dict (fla/layers/kda.py)."""
    HV, V = HV or H, V or K
    shapes = {"q_proj.weight": (H * K, D), "k_proj.weight": (H * K, D), "v_proj.weight": (HV * V, D),
              "f_proj.0.weight": (V, D), "f_proj.1.weight": (HV * K, V), "b_proj.weight": (HV, D),
              "A_log": (HV,), "dt_bias": (HV * K,), "g_proj.0.weight": (V, D), "g_proj.1.weight": (HV * V, V),
              "o_norm.weight": (V,), "o_proj.weight": (D, HV * V)}
    if gate_bias:
        shapes["g_proj.1.bias"] = (HV * V,)
    if use_short_conv:
        for p, n in (("q", H * K), ("k", H * K), ("v", HV * V)):
            shapes[f"{p}_conv1d.weight"] = (n, 1, W)
            if conv_bias:
                shapes[f"{p}_conv1d.bias"] = (n,)
    return shapes


def random_state_dict(shapes: dict[str, tuple], seed: int = 0, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """Random weights of sensible scale for every name in `shapes`."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=gen, dtype=dtype)
        if len(shape) == 2:  # projections and embeddings: fan-in scale
            t = t * shape[1] ** -0.5
        elif name.endswith("norm.weight"):
            t = 1 + 0.2 * t
        else:  # convs, biases, A_log, dt_bias
            t = 0.5 * t
        out[name] = t
    return out


def fla_layer_reference(sd: dict[str, torch.Tensor], x: torch.Tensor, H: int, K: int, *,
                        lower_bound: float | None = None, allow_neg_eigval: bool = False, norm_eps: float = 1e-5,
                        l2_eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """y `[B, T, D]` and the final state `[B, HV, V, K]` (fla's layout) of fla's layer, fresh state."""
    B, T, _ = x.shape
    HV = sd["b_proj.weight"].shape[0]
    V = sd["o_norm.weight"].shape[0]

    def conv_silu(p: str) -> torch.Tensor:
        h = x @ sd[f"{p}_proj.weight"].T
        if f"{p}_conv1d.weight" in sd:
            w = sd[f"{p}_conv1d.weight"]
            h = F.conv1d(h.transpose(1, 2), w, sd.get(f"{p}_conv1d.bias"), padding=w.shape[-1] - 1,
                         groups=w.shape[0])[..., :T].transpose(1, 2)
        return F.silu(h)

    def l2(t: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt((t * t).sum(-1, keepdim=True) + l2_eps)

    q, k = (l2(conv_silu(p).view(B, T, H, K)) for p in "qk")
    v = conv_silu("v").view(B, T, HV, V)
    f = (x @ sd["f_proj.0.weight"].T @ sd["f_proj.1.weight"].T).view(B, T, HV, K) + sd["dt_bias"].view(HV, K)
    A = sd["A_log"].exp()[:, None]
    g = -A * F.softplus(f) if lower_bound is None else lower_bound * torch.sigmoid(A * f)
    beta = torch.sigmoid(x @ sd["b_proj.weight"].T) * (2 if allow_neg_eigval else 1)
    q, k = (t.repeat_interleave(HV // H, dim=2) for t in (q, k))
    o, S = kda_naive(q, k, v, g, beta, output_final_state=True)
    gate = x @ sd["g_proj.0.weight"].T @ sd["g_proj.1.weight"].T
    if "g_proj.1.bias" in sd:
        gate = gate + sd["g_proj.1.bias"]
    o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + norm_eps) * sd["o_norm.weight"]
    o = o * torch.sigmoid(gate.view(B, T, HV, V))
    return o.reshape(B, T, HV * V) @ sd["o_proj.weight"].T, S.transpose(-1, -2)
