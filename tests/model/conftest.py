import pytest

from k3sys.model import ModelConfig


def _miniature(name: str, **overrides) -> ModelConfig:
    """A preset shrunk to run in well under a second on a CPU, keeping its structural choices:
    layer pattern (first 8 layers, ending on its last kind), q low-rank or not, latent MoE or not,
    shared experts, NoPE, router."""
    cfg = ModelConfig.from_preset(name)
    layers = cfg.layers[:7] + cfg.layers[-1:]
    small = dict(
        vocab_size=128, hidden_size=32, layers=layers, kda_num_heads=2, kda_head_dim=16, mla_num_heads=2,
        q_lora_rank=None if cfg.q_lora_rank is None else 16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, dense_ffn_size=48, num_experts=min(cfg.num_experts, 8),
        top_k=min(cfg.top_k, 2), expert_ffn_size=16,
        moe_latent_size=None if cfg.moe_latent_size is None else 24, max_context=4096,
    )
    return cfg.replace(**{**small, **overrides})


@pytest.fixture
def tiny() -> ModelConfig:
    return ModelConfig.from_preset("tiny")


@pytest.fixture
def miniature():
    return _miniature
