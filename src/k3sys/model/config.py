"""`ModelConfig`: the shape of a hybrid KDA + gated-MLA + MoE decoder, and its presets.

Sources of the preset numbers, cited beside each value:
- [seed] the Kimi K3 technical report as summarised in this project's brief: 93 attention layers =
  69 KDA + 24 gated MLA, 896 routed experts, top-16, 2.8T total / 104B active parameters, 1M context.
- [KL] moonshotai/Kimi-Linear-48B-A3B-Instruct `config.json` (the published Kimi Linear release).
- [K3-cfg] third-party inference-engine configs and tests that quote moonshotai/Kimi-K3's
  `config.json` (e.g. TokenSpeed's Kimi-K3 config test: "checkpoint-derived reference values",
  KDA 96 heads x 128; an open K3 re-implementation listing hidden 7168, MLA q_lora 1536, latent
  MoE 3584 -> 3072, 2 shared experts). Not an official source: every such value is an assumption.
Where neither K3 source says anything the Kimi Linear value is used and marked "assumption (KL)".
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

LAYER_KINDS = ("kda", "mla")


def hybrid_layers(num_layers: int, kda_per_mla: int = 3, final_mla: bool = False) -> tuple[str, ...]:
    """Layer kinds repeating `kda_per_mla` KDA layers then one MLA layer, over `num_layers` layers.

    `final_mla` replaces the last layer by MLA so the model ends on global attention (K3 does).
    """
    period = kda_per_mla + 1
    kinds = ["mla" if (i + 1) % period == 0 else "kda" for i in range(num_layers)]
    if final_mla and kinds:
        kinds[-1] = "mla"
    return tuple(kinds)


def _parse_layers(layers: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    if isinstance(layers, str):
        layers = [s for s in re.split(r"[,\s]+", layers) if s]
    kinds = tuple(str(k).lower() for k in layers)
    if not kinds:
        raise ValueError("layers must name at least one layer, got an empty pattern")
    bad = sorted({k for k in kinds if k not in LAYER_KINDS})
    if bad:
        raise ValueError(f"layers may only contain {list(LAYER_KINDS)}, got unknown kind(s) {bad}")
    return kinds


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of `HybridModel`. Dimensions are counts of values, sizes in elements.

    `layers` accepts a tuple/list of "kda"/"mla" or a string such as "kda,kda,kda,mla"; it is stored
    as a tuple. Head dims left as None are derived as `hidden_size // heads` (which must divide).
    Layers `< first_dense_layers` use a dense SwiGLU FFN of `dense_ffn_size`; the rest are MoE when
    `num_experts > 0`. `moe_latent_size` (optional) projects tokens down before the routed experts
    and back up after them (a latent MoE); shared experts always act on the full hidden state.
    """

    vocab_size: int
    hidden_size: int
    layers: tuple[str, ...]
    # KDA (Kimi Delta Attention)
    kda_num_heads: int
    kda_head_dim: int | None = None
    kda_conv_size: int = 4
    kda_lower_bound: float | None = -5.0  # None: the plain softplus gate (fla's default, Kimi Linear's)
    kda_output_gate_bias: bool = True  # bias of the KDA output gate's up-projection (Kimi Linear: none)
    # Gated MLA
    mla_num_heads: int = 1
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int | None = None
    mla_use_rope: bool = False  # False = NoPE: the rope slice exists but is not rotated (Kimi Linear)
    rope_theta: float = 10000.0
    mla_output_gate: bool = True  # sigmoid output gate (K3's gated MLA); Kimi Linear's MLA has none
    # FFN / MoE
    first_dense_layers: int = 1
    dense_ffn_size: int = 0
    num_experts: int = 0
    top_k: int = 0
    num_shared_experts: int = 0
    expert_ffn_size: int = 0
    moe_latent_size: int | None = None
    router: str = "sigmoid"
    router_score_bias: bool = False  # a per-expert bias added to the scores for selection only (DeepSeek-V3's)
    routed_scaling_factor: float = 1.0  # the routed experts' weights (summing to 1) are scaled by this
    # misc
    norm_eps: float = 1e-5
    max_context: int = 1 << 20
    name: str = "custom"

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("layers", _parse_layers(self.layers))
        for field in ("vocab_size", "hidden_size", "kda_num_heads", "mla_num_heads", "kv_lora_rank",
                      "qk_nope_head_dim", "kda_conv_size", "max_context"):
            _positive(field, getattr(self, field))
        for field, heads in (("kda_head_dim", "kda_num_heads"), ("v_head_dim", "mla_num_heads")):
            if getattr(self, field) is None:
                n = getattr(self, heads)
                if self.hidden_size % n:
                    raise ValueError(f"{heads} ({n}) must divide hidden_size ({self.hidden_size}) "
                                     f"when {field} is not given")
                set_(field, self.hidden_size // n)
            _positive(field, getattr(self, field))
        for field in ("qk_rope_head_dim", "first_dense_layers", "num_experts", "top_k", "num_shared_experts"):
            _count(field, getattr(self, field))
        if self.mla_use_rope and self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even when rotated, got {self.qk_rope_head_dim}")
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        lb = self.kda_lower_bound
        if lb is not None and (isinstance(lb, bool) or not isinstance(lb, int | float) or not -5.0 <= lb < 0.0):
            raise ValueError(f"kda_lower_bound must be None or in [-5, 0), got {self.kda_lower_bound}")
        for field in ("kda_output_gate_bias", "mla_output_gate", "router_score_bias"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be a bool, got {getattr(self, field)!r}")
        rs = self.routed_scaling_factor
        if isinstance(rs, bool) or not isinstance(rs, int | float) or not rs > 0:
            raise ValueError(f"routed_scaling_factor must be a number > 0, got {rs!r}")
        if self.first_dense_layers > self.num_layers:
            raise ValueError(f"first_dense_layers must be in [0, {self.num_layers}], got {self.first_dense_layers}")
        if any(not self.is_moe_layer(i) for i in range(self.num_layers)):
            _positive("dense_ffn_size", self.dense_ffn_size)
        if self.num_experts:
            _positive("expert_ffn_size", self.expert_ffn_size)
            if not 1 <= self.top_k <= self.num_experts:
                raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
            if self.moe_latent_size is not None:
                _positive("moe_latent_size", self.moe_latent_size)
            if self.router not in ("softmax", "sigmoid"):
                raise ValueError(f"router must be 'softmax' or 'sigmoid', got {self.router!r}")

    # ---- derived shapes -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def qk_head_dim(self) -> int:
        """MLA query/key head dim: the NoPE part plus the decoupled rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_dense_layers

    def count(self, kind: str) -> int:
        return sum(k == kind for k in self.layers)

    # ---- construction ---------------------------------------------------------------------
    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig field(s) {unknown}")
        return cls(**d)

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """One of `PRESETS` ("tiny", "kimi-linear-48b", "k3"), with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[name].replace(**overrides)


def _positive(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field} must be a positive integer, got {value!r}")


def _count(field: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field} must be an integer >= 0, got {value!r}")


PRESETS: dict[str, ModelConfig] = {
    # Runs in seconds on a CPU; mirrors K3's structure (3:1 hybrid ending on MLA, first layer dense,
    # latent MoE with shared experts, q low-rank, NoPE) at toy sizes.
    "tiny": ModelConfig(
        name="tiny", vocab_size=512, hidden_size=64, layers=hybrid_layers(4, 3, final_mla=True),
        kda_num_heads=2, kda_head_dim=32,
        mla_num_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        first_dense_layers=1, dense_ffn_size=128,
        num_experts=8, top_k=2, num_shared_experts=1, expert_ffn_size=32, moe_latent_size=32,
        max_context=4096,
    ),
    "kimi-linear-48b": ModelConfig(
        name="kimi-linear-48b",
        vocab_size=163840,  # [KL] vocab_size
        hidden_size=2304,  # [KL] hidden_size
        # [KL] full_attn_layers [4, 8, ..., 24, 27] (1-based): 3:1 over 27 layers, last layer MLA; 20 KDA + 7 MLA
        layers=hybrid_layers(27, 3, final_mla=True),
        kda_num_heads=32,  # [KL] linear_attn_config.num_heads
        kda_head_dim=128,  # [KL] linear_attn_config.head_dim
        kda_conv_size=4,  # [KL] short_conv_kernel_size
        kda_lower_bound=None,  # [KL] no gate_lower_bound: the plain softplus gate
        kda_output_gate_bias=False,  # [KL] g_b_proj has no bias (HF modeling_kimi.py, vLLM kimi_linear)
        mla_num_heads=32,  # [KL] num_attention_heads
        q_lora_rank=None,  # [KL] q_lora_rank: null
        kv_lora_rank=512,  # [KL] kv_lora_rank
        qk_nope_head_dim=128,  # [KL] qk_nope_head_dim
        qk_rope_head_dim=64,  # [KL] qk_rope_head_dim
        v_head_dim=128,  # [KL] v_head_dim (DeepSeek-V3 convention, = qk_nope_head_dim)
        mla_use_rope=False,  # [KL] mla_use_nope: true
        mla_output_gate=False,  # [KL] KimiMLAAttention has no output gate
        first_dense_layers=1,  # [KL] first_k_dense_replace
        dense_ffn_size=9216,  # [KL] intermediate_size
        num_experts=256,  # [KL] num_experts
        top_k=8,  # [KL] num_experts_per_token
        num_shared_experts=1,  # [KL] num_shared_experts
        expert_ffn_size=1024,  # [KL] moe_intermediate_size
        moe_latent_size=None,  # [KL] experts act on the full hidden state
        router="sigmoid",  # [KL] moe_router_activation_func
        router_score_bias=True,  # [KL] block_sparse_moe.gate.e_score_correction_bias
        routed_scaling_factor=2.446,  # [KL] routed_scaling_factor
        norm_eps=1e-5,  # [KL] rms_norm_eps
        max_context=1 << 20,  # [KL] model_max_length 1048576
    ),
    "k3": ModelConfig(
        name="k3",
        vocab_size=163840,  # [K3-cfg] 163840, same tokenizer as [KL]
        hidden_size=7168,  # [K3-cfg] hidden_size (assumption)
        # [seed] 93 layers = 69 KDA + 24 gated MLA: 23 x (3 KDA + 1 MLA) + a final MLA layer
        layers=hybrid_layers(93, 3, final_mla=True),
        kda_num_heads=96,  # [K3-cfg] 96 (assumption; one engine test uses 64)
        kda_head_dim=128,  # [K3-cfg] 128, same as [KL]
        kda_conv_size=4,  # [K3-cfg] 4, same as [KL]
        kda_lower_bound=-5.0,  # [K3-cfg] gate_lower_bound -5.0
        mla_num_heads=96,  # [K3-cfg] (assumption)
        q_lora_rank=1536,  # [K3-cfg] (assumption; [KL] has none)
        kv_lora_rank=512,  # assumption (KL); [K3-cfg] agrees
        qk_nope_head_dim=128,  # assumption (KL)
        qk_rope_head_dim=64,  # assumption (KL)
        v_head_dim=128,  # assumption (KL)
        mla_use_rope=False,  # assumption (KL): NoPE
        first_dense_layers=1,  # [K3-cfg] first_k_dense_replace 1, same as [KL]
        dense_ffn_size=33792,  # [K3-cfg] dense FFN width (assumption)
        num_experts=896,  # [seed]
        top_k=16,  # [seed]
        num_shared_experts=2,  # [K3-cfg] (assumption; [KL] has 1)
        expert_ffn_size=3072,  # [K3-cfg] moe_intermediate_size (assumption)
        moe_latent_size=3584,  # [K3-cfg] routed experts see a 3584-wide latent (assumption)
        router="sigmoid",  # assumption (KL)
        norm_eps=1e-5,  # assumption (KL)
        max_context=1 << 20,  # [seed] 1M context
    ),
}
