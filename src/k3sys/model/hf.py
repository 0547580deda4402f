"""Kimi-Linear-style Hugging Face checkpoints -> `HybridModel` (`HybridModel.from_pretrained`).

A checkpoint directory holds `config.json` and the weights, sharded (`*.safetensors` plus
`model.safetensors.index.json`, whose `weight_map` names each tensor's file) or in one
`model.safetensors`. Names and shapes are those of moonshotai/Kimi-Linear-48B-A3B-Instruct (its
`modeling_kimi.py`, and vLLM's `kimi_linear.py` / `layers/kda.py`); `L` = `model.layers.{i}.`, ours
`blocks.{i}.`:

- `model.embed_tokens`, `model.norm`, `lm_head` -> `embed`, `norm`, `lm_head`;
  `L input_layernorm`, `L post_attention_layernorm` -> `attn_norm`, `ffn_norm`.
- KDA `L self_attn.`: `{q,k,v}_proj` `[HK, D]` and `{q,k,v}_conv1d` `[HK, 1, W]` -> row blocks of
  `attn.qkv_proj` and `attn.conv`; `f_a_proj`/`f_b_proj`, `g_a_proj`/`g_b_proj` (no bias) ->
  `attn.f_proj.0/1`, `attn.g_proj.0/1`; `A_log` `[1, 1, H, 1]` -> `[H]`; `dt_bias` `[HK]` -> `[H, K]`;
  `b_proj`, `o_norm`, `o_proj` -> the same names (`o_norm.weight` is `o_norm_weight`).
- MLA `L self_attn.`: `q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj` ->
  `attn.q_proj`, `attn.kv_a_proj`, `attn.kv_a_norm`, `attn.kv_b_proj`, `attn.o_proj`; no output gate.
- Dense `L mlp.{gate,up,down}_proj` `[F, D]`, `[F, D]`, `[D, F]` -> `ffn.w_gate/w_up/w_down`, transposed.
- MoE `L block_sparse_moe.`: `gate.weight` `[E, D]`, `gate.e_score_correction_bias` `[E]` ->
  `ffn.experts.router.weight`, `ffn.experts.score_bias`; `experts.{e}.w1/w3/w2` -> row e of
  `ffn.experts.w_gate/w_up/w_down`, transposed; `shared_experts.{gate,up,down}_proj` -> `ffn.shared.*`.

The KDA layers are fla's `KimiDeltaAttention` under other names, so they go through
`KimiDeltaAttention.state_dict_from_fla`. Multi-token-prediction layers (index >= num_hidden_layers)
and rotary caches are skipped; every other checkpoint tensor must be used, and every model tensor found.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from k3sys.kda import KimiDeltaAttention
from k3sys.model.config import ModelConfig

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def config_from_hf(hf: dict[str, Any], name: str = "custom") -> ModelConfig:
    """Our config for a Kimi-Linear `config.json` (a dict). Raises ValueError naming any setting that
    this model does not implement (grouped top-k over several groups, MoE every other layer, ...)."""
    lac = hf.get("linear_attn_config")
    if not lac:
        raise ValueError("config has no linear_attn_config: not a Kimi-Linear-style (KDA) checkpoint")
    L = hf["num_hidden_layers"]
    kda, full = set(lac["kda_layers"]), set(lac["full_attn_layers"])  # 1-based layer numbers
    if kda & full or kda | full != set(range(1, L + 1)):
        raise ValueError(f"kda_layers {sorted(kda)} and full_attn_layers {sorted(full)} must split layers 1..{L}")
    unsupported = {
        "hidden_act": hf.get("hidden_act", "silu") != "silu",
        "moe_layer_freq": hf.get("moe_layer_freq", 1) != 1,
        "num_expert_group": hf.get("use_grouped_topk", True) and hf.get("num_expert_group", 1) != 1,
        "topk_group": hf.get("use_grouped_topk", True) and hf.get("topk_group", 1) != 1,
        "moe_renormalize": not hf.get("moe_renormalize", True),
        # HF leaves a single expert's weight unnormalised; ours always renormalises
        "num_experts_per_token": hf.get("num_experts") is not None and hf.get("num_experts_per_token", 2) < 2,
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "mla_use_nope": not hf.get("mla_use_nope", False),  # HF's KimiMLAAttention asserts NoPE ...
        "q_lora_rank": hf.get("q_lora_rank") is not None,  # ... and a full-rank query
    }
    bad = {k: hf.get(k) for k, is_bad in unsupported.items() if is_bad}
    if bad:
        raise ValueError(f"unsupported Kimi-Linear setting(s) {bad}")
    moe = hf.get("num_experts") is not None
    return ModelConfig(
        name=name, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        layers=tuple("kda" if i + 1 in kda else "mla" for i in range(L)),
        kda_num_heads=lac["num_heads"], kda_head_dim=lac["head_dim"], kda_conv_size=lac["short_conv_kernel_size"],
        kda_lower_bound=lac.get("gate_lower_bound"),  # absent in Kimi Linear: the softplus gate
        kda_output_gate_bias=False,
        mla_num_heads=hf["num_attention_heads"], q_lora_rank=None,
        kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"], mla_use_rope=False,
        rope_theta=float(hf.get("rope_theta", 10000.0)), mla_output_gate=False,
        first_dense_layers=hf.get("first_k_dense_replace", 0) if moe else L,
        dense_ffn_size=hf.get("intermediate_size", 0),
        num_experts=hf["num_experts"] if moe else 0, top_k=hf["num_experts_per_token"] if moe else 0,
        num_shared_experts=hf.get("num_shared_experts") or 0, expert_ffn_size=hf.get("moe_intermediate_size") or 0,
        router=hf.get("moe_router_activation_func", "sigmoid"), router_score_bias=moe,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        norm_eps=hf.get("rms_norm_eps", 1e-6), max_context=hf.get("model_max_length") or 1 << 20,
    )


class _Shards:
    """The checkpoint's tensors by name, read on demand from their shard; records what was read."""

    def __init__(self, path: Path) -> None:
        if (path / INDEX).is_file():
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        elif (path / SINGLE).is_file():
            with safe_open(str(path / SINGLE), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE)
        else:
            raise ValueError(f"{path} has neither {INDEX} nor {SINGLE}")
        self.path, self.weight_map, self.used = path, weight_map, set()
        self._open: dict[str, Any] = {}

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ValueError(f"checkpoint has no tensor {name!r}")
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.path / file), framework="pt")
        self.used.add(name)
        return self._open[file].get_tensor(name)


def _kda(get: Callable[[str], torch.Tensor], p: str, attn: KimiDeltaAttention) -> dict[str, torch.Tensor]:
    """A KDA layer's tensors, renamed to fla's layer names, mapped onto ours."""
    fla = {n: get(p + n) for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight",
                                    "k_conv1d.weight", "v_conv1d.weight", "b_proj.weight", "dt_bias",
                                    "o_norm.weight", "o_proj.weight")}
    fla.update({"f_proj.0.weight": get(p + "f_a_proj.weight"), "f_proj.1.weight": get(p + "f_b_proj.weight"),
                "g_proj.0.weight": get(p + "g_a_proj.weight"), "g_proj.1.weight": get(p + "g_b_proj.weight"),
                "A_log": get(p + "A_log").flatten()})  # [1, 1, H, 1] -> [H]
    return attn.state_dict_from_fla(fla)


def _mla(get: Callable[[str], torch.Tensor], p: str) -> dict[str, torch.Tensor]:
    names = {"q_proj.weight": "q_proj.weight", "kv_a_proj.weight": "kv_a_proj_with_mqa.weight",
             "kv_a_norm.weight": "kv_a_layernorm.weight", "kv_b_proj.weight": "kv_b_proj.weight",
             "o_proj.weight": "o_proj.weight"}
    return {ours: get(p + theirs) for ours, theirs in names.items()}


def _swiglu(get: Callable[[str], torch.Tensor], p: str) -> dict[str, torch.Tensor]:
    """HF's `gate_proj/up_proj/down_proj` (`[out, in]`) -> our SwiGLU's `w_gate/w_up/w_down` (`[in, out]`)."""
    return {f"w_{n}": get(f"{p}{n}_proj.weight").T for n in ("gate", "up", "down")}


def _moe(get: Callable[[str], torch.Tensor], p: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    experts = range(cfg.num_experts)
    out = {"experts.router.weight": get(p + "gate.weight"),
           "experts.score_bias": get(p + "gate.e_score_correction_bias")}
    for ours, theirs in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
        out[f"experts.{ours}"] = torch.stack([get(f"{p}experts.{e}.{theirs}.weight").T for e in experts])
    if cfg.num_shared_experts:
        out.update({f"shared.{n}": t for n, t in _swiglu(get, p + "shared_experts.").items()})
    return out


def state_dict_from_hf(model: nn.Module, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict for `model`, each tensor read by `get(checkpoint name)`."""
    cfg = model.cfg
    sd = {"embed.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight"),
          "lm_head.weight": get("lm_head.weight")}
    for i, block in enumerate(model.blocks):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        sd[q + "attn_norm.weight"] = get(p + "input_layernorm.weight")
        sd[q + "ffn_norm.weight"] = get(p + "post_attention_layernorm.weight")
        attn = _kda(get, p + "self_attn.", block.attn) if block.kind == "kda" else _mla(get, p + "self_attn.")
        ffn = _moe(get, p + "block_sparse_moe.", cfg) if cfg.is_moe_layer(i) else _swiglu(get, p + "mlp.")
        sd.update({q + "attn." + n: t for n, t in attn.items()})
        sd.update({q + "ffn." + n: t for n, t in ffn.items()})
    return sd


def load_pretrained(build: Callable[[ModelConfig], nn.Module], path: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None) -> nn.Module:
    """Build the model a Kimi-Linear-style checkpoint directory describes (`build(cfg)`: `HybridModel`,
    passed in so this module does not import the model's) and load its weights.

    `dtype` None keeps each tensor as stored (Kimi Linear keeps A_log and dt_bias in fp32 beside bf16
    weights; our layer computes its gate in fp32 either way); a dtype casts every tensor to it. The
    model is built on the meta device and takes the loaded tensors as its parameters (no second copy).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json")
    hf = json.loads((path / "config.json").read_text())
    cfg = config_from_hf(hf, name=path.name)
    with torch.device("meta"):
        model = build(cfg)
    shards = _Shards(path)
    sd = state_dict_from_hf(model, shards)
    extra = sorted(n for n in set(shards.weight_map) - shards.used
                   if not _skipped(n, cfg.num_layers))
    if extra:
        raise ValueError(f"checkpoint tensors this model has no place for: {extra[:8]}"
                         f"{f' and {len(extra) - 8} more' if len(extra) > 8 else ''}")
    sd = {n: t.to(device=device, dtype=dtype).contiguous() for n, t in sd.items()}
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval()


def _skipped(name: str, num_layers: int) -> bool:
    """Checkpoint tensors deliberately left out: rotary caches and multi-token-prediction layers."""
    if "rotary_emb" in name:
        return True
    parts = name.split(".")
    return parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers
