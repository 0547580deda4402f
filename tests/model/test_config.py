import pytest

from k3sys.model.config import PRESETS, ModelConfig, hybrid_layers


def test_k3_preset_has_the_reported_shape():
    cfg = ModelConfig.from_preset("k3")
    assert (cfg.num_layers, cfg.count("kda"), cfg.count("mla")) == (93, 69, 24)
    assert (cfg.num_experts, cfg.top_k, cfg.max_context) == (896, 16, 1 << 20)
    assert cfg.layers[-1] == "mla" and cfg.layers[:4] == ("kda", "kda", "kda", "mla")


def test_kimi_linear_preset_places_mla_where_its_config_does():
    cfg = ModelConfig.from_preset("kimi-linear-48b")
    assert [i + 1 for i, k in enumerate(cfg.layers) if k == "mla"] == [4, 8, 12, 16, 20, 24, 27]


def test_layers_accept_a_string_or_a_list():
    kw = dict(vocab_size=8, hidden_size=8, kda_num_heads=2, dense_ffn_size=8)
    a = ModelConfig(layers="kda, kda mla", **kw)
    b = ModelConfig(layers=["KDA", "kda", "mla"], **kw)
    assert a.layers == b.layers == ("kda", "kda", "mla")
    assert hybrid_layers(6, 2) == ("kda", "kda", "mla", "kda", "kda", "mla")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dict_round_trip(name):
    cfg = PRESETS[name]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


BAD = {
    "heads-not-dividing-hidden": (dict(kda_num_heads=3, kda_head_dim=None), "kda_num_heads"),
    "mla-heads-not-dividing-hidden": (dict(mla_num_heads=5, v_head_dim=None), "mla_num_heads"),
    "unknown-layer-kind": (dict(layers="kda,mamba,mla"), "layers"),
    "empty-layers": (dict(layers=""), "layers"),
    "top-k-over-experts": (dict(top_k=9), "top_k"),
    "zero-top-k": (dict(top_k=0), "top_k"),
    "negative-hidden": (dict(hidden_size=-64), "hidden_size"),
    "gate-bound": (dict(kda_lower_bound=-6.0), "kda_lower_bound"),
    "odd-rotated-rope": (dict(mla_use_rope=True, qk_rope_head_dim=7), "qk_rope_head_dim"),
    "router": (dict(router="relu"), "router"),
    "dense-layers": (dict(first_dense_layers=5), "first_dense_layers"),
    "fractional-top-k": (dict(top_k=2.5), "top_k"),
    "missing-experts": (dict(num_experts=None), "num_experts"),
    "negative-shared-experts": (dict(num_shared_experts=-1), "num_shared_experts"),
    "missing-dense-layers": (dict(first_dense_layers=None), "first_dense_layers"),
    "missing-rope-dim": (dict(qk_rope_head_dim=None), "qk_rope_head_dim"),
    "string-gate-bound": (dict(kda_lower_bound="-5"), "kda_lower_bound"),
    "routed-scale": (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    "non-bool-gate": (dict(mla_output_gate=1), "mla_output_gate"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_config_names_the_field(case):
    changes, field = BAD[case]
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_preset("tiny", **changes)


def test_unknown_preset_and_field_are_rejected():
    with pytest.raises(ValueError, match="k4"):
        ModelConfig.from_preset("k4")
    with pytest.raises(ValueError, match="hiden_size"):
        ModelConfig.from_dict({**PRESETS["tiny"].to_dict(), "hiden_size": 3})
