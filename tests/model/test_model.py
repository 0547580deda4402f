import pytest
import torch

from k3sys.model import HybridCache, HybridModel, ModelConfig, count_params, generate, load_model, save_model

PRESET_NAMES = ["tiny", "kimi-linear-48b", "k3"]


def build(cfg: ModelConfig, dtype=torch.float32, seed=0) -> HybridModel:
    torch.manual_seed(seed)
    return HybridModel(cfg).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_runs_at_miniature_size(miniature, name, dtype):
    cfg = miniature(name)
    model = build(cfg, dtype)
    ids = torch.randint(0, cfg.vocab_size, (2, 19))
    logits = model(ids)
    assert logits.shape == (2, 19, cfg.vocab_size) and logits.dtype == dtype
    assert torch.isfinite(logits).all()
    out = generate(model, ids[:, :5], max_new_tokens=3)
    assert out.shape == (2, 8) and out.dtype == torch.int64 and torch.equal(out[:, :5], ids[:, :5])


def decode_logits(model, ids, prompt_len, cache):
    """Prefill ids[:, :prompt_len], then feed the rest one token at a time; logits of every position."""
    steps = [model(ids[:, :prompt_len], cache)]
    steps += [model(ids[:, t:t + 1], cache) for t in range(prompt_len, ids.shape[1])]
    return torch.cat(steps, dim=1)


CASES = {
    "tiny": {},  # KDA + gated MLA (NoPE, q low-rank) + dense layer + latent MoE with shared experts
    "tiny-rope-qfull": {"mla_use_rope": True, "q_lora_rank": None, "moe_latent_size": None},
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("max_len", [None, 40], ids=["growing", "prealloc"])
def test_decode_on_the_cache_equals_the_full_forward(case, max_len):
    """Logits of prefill + token-by-token decode equal the full forward at every position (fp32)."""
    cfg = ModelConfig.from_preset("tiny", **CASES[case])
    assert {"kda", "mla"} <= set(cfg.layers) and cfg.num_experts > 0 and cfg.first_dense_layers > 0
    model = build(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 36))
    with torch.no_grad():
        full = model(ids)
        cache = HybridCache(cfg, batch=2, max_len=max_len, block_size=8)
        stepped = decode_logits(model, ids, prompt_len=21, cache=cache)
    torch.testing.assert_close(stepped, full, rtol=1e-4, atol=1e-4)
    assert cache.seq_len == 36


def test_greedy_generate_equals_argmax_of_full_forwards(tiny):
    model = build(tiny)
    prompt = torch.randint(0, tiny.vocab_size, (3, 17))
    out = generate(model, prompt, max_new_tokens=8)
    ids = prompt
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat((ids, model(ids)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, ids)


def test_logits_to_keep_gives_the_last_rows_of_the_full_logits(tiny):
    model = build(tiny)
    ids = torch.randint(0, tiny.vocab_size, (2, 9))
    with torch.no_grad():
        full = model(ids)
        last = model(ids, logits_to_keep=3)
    assert last.shape == (2, 3, tiny.vocab_size)
    torch.testing.assert_close(last, full[:, -3:])
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="logits_to_keep"):
            model(ids, logits_to_keep=bad)


def test_sampling_is_reproducible_with_a_generator(tiny):
    model = build(tiny)
    prompt = torch.randint(0, tiny.vocab_size, (2, 4))
    a = generate(model, prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(1))
    b = generate(model, prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)


def test_generate_fills_a_given_cache(tiny):
    model = build(tiny)
    cache = HybridCache(tiny, batch=1)
    generate(model, torch.zeros(1, 10, dtype=torch.int64), max_new_tokens=5, cache=cache)
    assert cache.seq_len == 14  # the last sampled token is returned, not fed back
    with pytest.raises(ValueError, match="empty"):
        generate(model, torch.zeros(1, 2, dtype=torch.int64), 1, cache=cache)


@pytest.mark.parametrize("bad", [
    dict(prompt_ids=torch.zeros(3, dtype=torch.int64), max_new_tokens=1),
    dict(prompt_ids=torch.zeros(1, 3, dtype=torch.int64), max_new_tokens=-1),
    dict(prompt_ids=torch.zeros(1, 3, dtype=torch.int64), max_new_tokens=1, temperature=-0.5),
    dict(prompt_ids=torch.zeros(1, 3, dtype=torch.int64), max_new_tokens=4094),
], ids=["1d-prompt", "negative-new-tokens", "negative-temperature", "past-max-context"])
def test_generate_rejects_bad_arguments(tiny, bad):
    with pytest.raises(ValueError, match="prompt_ids|max_new_tokens|temperature"):
        generate(build(tiny), **bad)


def test_forward_rejects_float_ids_and_overlong_input(tiny):
    model = build(tiny)
    with pytest.raises(ValueError, match="ids"):
        model(torch.zeros(1, 3))
    cache = HybridCache(tiny, batch=1, max_len=4)
    with pytest.raises(ValueError, match="exceed"):
        model(torch.zeros(1, 5, dtype=torch.int64), cache)
    with pytest.raises(ValueError, match="batch"):
        model(torch.zeros(2, 1, dtype=torch.int64), cache)


def test_safetensors_round_trip(tiny, tmp_path):
    model = build(tiny, seed=3)
    path = tmp_path / "tiny.safetensors"
    save_model(model, path)
    loaded = load_model(path)
    assert loaded.cfg == tiny
    for (name, a), (name_b, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert name == name_b and torch.equal(a, b), name
    ids = torch.randint(0, tiny.vocab_size, (1, 12))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded.eval()(ids))
    assert not torch.equal(build(tiny, seed=4).state_dict()["embed.weight"], loaded.state_dict()["embed.weight"])


def test_load_refuses_a_file_without_config(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "bare.safetensors"
    save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="metadata"):
        load_model(path)


def tiny_hand_count(cfg: ModelConfig) -> tuple[int, int]:
    """Parameters of the tiny preset written out by hand from the layer definitions."""
    D, V = cfg.hidden_size, cfg.vocab_size
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    kda = (D * 3 * H * K + 3 * H * K * cfg.kda_conv_size  # fused qkv projection, depthwise conv
           + D * K + K * H * K + D * H + H + H * K  # low-rank decay gate, beta, A_log, dt_bias
           + D * K + K * H * K + H * K + K + H * K * D)  # low-rank output gate (+bias), o_norm, o_proj
    h, r, dn, dr, dv, rq = (cfg.mla_num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                            cfg.v_head_dim, cfg.q_lora_rank)
    mla = (D * rq + rq + rq * h * (dn + dr)  # q low-rank + its norm
           + D * (r + dr) + r + r * h * (dn + dv)  # kv latent + norm, up-projection
           + D * h * dv + h * dv * D)  # output gate, output projection
    dense = 3 * D * cfg.dense_ffn_size
    E, F, L = cfg.num_experts, cfg.expert_ffn_size, cfg.moe_latent_size
    routed = E * 3 * L * F
    moe = 2 * D * L + E * L + routed + 3 * D * cfg.num_shared_experts * F
    norms = 2 * D
    assert cfg.layers == ("kda", "kda", "kda", "mla") and cfg.first_dense_layers == 1
    total = 2 * V * D + D + 3 * (kda + norms) + mla + norms + dense + 3 * moe
    return total, total - 3 * routed * (E - cfg.top_k) // E


def test_param_count_matches_hand_count_and_the_modules(tiny):
    total, active = tiny_hand_count(tiny)
    assert count_params(tiny) == {"total": total, "active": active}
    assert sum(p.numel() for p in HybridModel(tiny).parameters()) == total


def test_k3_param_count_lands_within_10_percent_of_the_report():
    c = count_params(ModelConfig.from_preset("k3"))
    assert abs(c["total"] / 2.8e12 - 1) < 0.10, c
    assert abs(c["active"] / 104e9 - 1) < 0.10, c


def test_a_bf16_cache_serves_an_fp32_model(tiny):
    """The cache may be stored narrower than the model: decode reads it back in the model's dtype."""
    model = build(tiny)
    ids = torch.randint(0, tiny.vocab_size, (1, 24))
    cache = HybridCache(tiny, batch=1, dtype=torch.bfloat16)
    with torch.no_grad():
        stepped = decode_logits(model, ids, prompt_len=16, cache=cache)
        full = model(ids)
    assert stepped.dtype == torch.float32 and cache.layers[-1].buf.dtype == torch.bfloat16
    torch.testing.assert_close(stepped, full, rtol=0.05, atol=0.05)
