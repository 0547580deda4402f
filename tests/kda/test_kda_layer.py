import pytest
import torch
from fla_reference import fla_layer_reference, fla_shapes, random_state_dict

from k3sys.kda import KDAState, KimiDeltaAttention, kda_state_bytes


def make_layer(seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    kw = {"hidden_size": 32, "num_heads": 2, "head_dim": 8, **kw}
    layer = KimiDeltaAttention(**kw).to(dtype)
    with torch.no_grad():  # a non-trivial output gate bias and norm weight, so they are exercised
        layer.g_proj[1].bias.normal_()
        layer.o_norm_weight.normal_()
        layer.dt_bias.normal_()
    return layer


def token_by_token(layer, x, state=None):
    ys = []
    for t in range(x.shape[1]):
        y, state = layer(x[:, t:t + 1], state)
        ys.append(y)
    return torch.cat(ys, dim=1), state


@pytest.mark.parametrize("conv_size", [1, 4])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_one_call_equals_token_by_token(conv_size, lower_bound):
    layer = make_layer(conv_size=conv_size, lower_bound=lower_bound)
    x = torch.randn(2, 37, 32, dtype=torch.float64)
    y, state = layer(x)
    y_tok, state_tok = token_by_token(layer, x)
    assert torch.allclose(y_tok, y, rtol=0, atol=1e-12 * y.abs().max().item())
    assert torch.allclose(state_tok.recurrent, state.recurrent, rtol=0, atol=1e-12)
    assert torch.allclose(state_tok.conv, state.conv, rtol=0, atol=1e-12)


def test_prefill_decode_prefill_chain_equals_one_call():
    layer = make_layer()
    x = torch.randn(3, 50, 32, dtype=torch.float64)
    y, state = layer(x)
    y1, s = layer(x[:, :21])  # chunked prefill, not chunk-aligned
    y2, s = token_by_token(layer, x[:, 21:26], s)  # decode
    y3, s = layer(x[:, 26:], s)  # chunked prefill continuing from a state
    assert torch.allclose(torch.cat([y1, y2, y3], dim=1), y, rtol=0, atol=1e-12)
    assert torch.allclose(s.recurrent, state.recurrent, rtol=0, atol=1e-12)


def test_state_is_fixed_size_and_copies_into_preallocated_buffers():
    layer = make_layer(dtype=torch.float32, conv_size=4)
    cache = layer.init_state(2)
    assert cache.conv.shape == (2, 3, 3 * 2 * 8) and cache.recurrent.shape == (2, 2, 8, 8)
    assert cache.recurrent.dtype == torch.float32
    assert cache.nbytes() == kda_state_bytes(2, 8, conv_size=4, batch=2, conv_dtype=torch.float32)
    storage = (cache.conv.data_ptr(), cache.recurrent.data_ptr())
    x = torch.randn(2, 40, 32)
    _, short = layer(x[:, :5])
    _, long = layer(x)
    assert short.nbytes() == long.nbytes() == cache.nbytes()  # independent of the context length
    # ... and so is the memory the returned state keeps alive (no view into the prefill window)
    assert sum(t.untyped_storage().nbytes() for t in (long.conv, long.recurrent)) == long.nbytes()
    assert cache.copy_(long) is cache
    assert (cache.conv.data_ptr(), cache.recurrent.data_ptr()) == storage
    assert torch.equal(cache.recurrent, long.recurrent) and torch.equal(cache.conv, long.conv)
    y_cache, _ = layer(x[:, :1], cache)
    y_ref, _ = layer(x[:, :1], long)
    assert torch.equal(y_cache, y_ref)
    with pytest.raises(ValueError, match=r"state.recurrent shape mismatch"):
        cache.copy_(KDAState(conv=long.conv, recurrent=long.recurrent[:1]))


@pytest.mark.parametrize("state_layout", ["kv", "vk"])
def test_inplace_forward_writes_the_cache_buffers(state_layout):
    """A cache's decode path: prefill then decode with inplace=True gives the same y and state as without,
    in the cache's own storage (the decode step updates S in place)."""
    layer = make_layer(dtype=torch.float32, num_v_heads=4, head_v_dim=136, state_layout=state_layout)
    x = torch.randn(2, 12, 32)
    cache = layer.init_state(2)
    storage = (cache.conv.data_ptr(), cache.recurrent.data_ptr())
    state, ys, ys_ref = None, [], []
    with torch.no_grad():  # as a decode loop runs (with autograd the step takes the torch formula)
        for t0, t1 in ((0, 9), (9, 10), (10, 11), (11, 12)):  # a prefill, then three decoded tokens
            y, same = layer(x[:, t0:t1], cache, inplace=True)
            y_ref, state = layer(x[:, t0:t1], state)
            assert same is cache and (cache.conv.data_ptr(), cache.recurrent.data_ptr()) == storage
            ys.append(y)
            ys_ref.append(y_ref)
    assert torch.allclose(torch.cat(ys, 1), torch.cat(ys_ref, 1), rtol=0, atol=1e-6)
    assert torch.allclose(cache.recurrent, state.recurrent, rtol=0, atol=1e-6)
    assert torch.equal(cache.conv, state.conv)
    with pytest.raises(ValueError, match=r"inplace=True writes into the given state"):
        layer(x[:, :1], inplace=True)


def test_bf16_layer_keeps_an_fp32_recurrent_state():
    layer = make_layer(dtype=torch.bfloat16)
    x = torch.randn(2, 20, 32, dtype=torch.bfloat16)
    y, state = layer(x)
    assert y.dtype == torch.bfloat16 and state.conv.dtype == torch.bfloat16
    assert state.recurrent.dtype == torch.float32 and torch.isfinite(y).all()
    y32, _ = make_layer(dtype=torch.float32)(x.float())
    assert ((y.float() - y32).norm() / y32.norm()).item() < 5e-2


def test_training_step_reaches_every_parameter():
    layer = make_layer(dtype=torch.float32)
    x = torch.randn(2, 33, 32, requires_grad=True)
    y, _ = layer(x)
    (y * torch.randn_like(y)).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("kwargs, match", [
    ({"lower_bound": -6.0}, r"lower_bound must be None or in \[-5, 0\), got -6.0"),
    ({"lower_bound": 0.0}, r"lower_bound must be None or in \[-5, 0\), got 0.0"),
    ({"head_dim": 0}, r"head_dim must be a positive int, got 0"),
    ({"head_dim": 513}, r"head_dim must be <= 512, got 513"),
    ({"conv_size": 0}, r"conv_size must be a positive int, got 0"),
])
def test_layer_rejects_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KimiDeltaAttention(**{"hidden_size": 32, "num_heads": 2, "head_dim": 8, **kwargs})


def test_layer_rejects_bad_input_and_state():
    layer = make_layer(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"x must be \[B, T, 32\]"):
        layer(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match=r"x must be \[B, T, 32\]"):
        layer(torch.randn(2, 0, 32))
    state = layer.init_state(3)
    with pytest.raises(ValueError, match=r"state.conv must have shape \[2, 3, 48\], got \[3, 3, 48\]"):
        layer(torch.randn(2, 5, 32), state)
    with pytest.raises(ValueError, match=r"state.recurrent must have shape \[2, 2, 8, 8\]"):
        layer(torch.randn(2, 5, 32), KDAState(conv=torch.zeros(2, 3, 48), recurrent=torch.zeros(2, 2, 8, 7)))


# ---- fla interop: weights, options, padding, packed sequences, state layout ----------------------------
FLA_CASES = {  # fla constructor arguments (and the gate it implies)
    "fla-default": dict(),
    "gva": dict(num_v_heads=4),
    "no-conv": dict(use_short_conv=False),
    "safe-gate-conv-bias-neg-eig": dict(safe_gate=True, lower_bound=-5.0, conv_bias=True, allow_neg_eigval=True),
    "expand-v-gva-w2": dict(expand_v=2, num_v_heads=4, conv_size=2),
}


def fla_layer(case, **extra):
    kw = {"hidden_size": 32, "num_heads": 2, "head_dim": 8, **FLA_CASES[case], **extra}
    layer = KimiDeltaAttention.from_fla_config(**kw).double()
    H, K = kw["num_heads"], kw["head_dim"]
    HV, V = kw.get("num_v_heads") or H, int(K * kw.get("expand_v", 1))
    shapes = fla_shapes(32, H, K, HV, V, kw.get("conv_size", 4), kw.get("use_short_conv", True),
                        kw.get("conv_bias", False))
    return layer, shapes, kw


@pytest.mark.parametrize("case", FLA_CASES, ids=list(FLA_CASES))
def test_fla_state_dict_round_trip(case):
    layer, shapes, _ = fla_layer(case)
    sd = random_state_dict(shapes, seed=1)
    layer.load_fla_state_dict(sd)
    back = layer.fla_state_dict()
    assert set(back) == set(sd) and all(torch.equal(back[n], sd[n]) for n in sd)
    again, _, _ = fla_layer(case)
    again.load_fla_state_dict(back)  # and ours -> fla -> ours is the identity too
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), layer.state_dict().values(), strict=True))


@pytest.mark.parametrize("case", FLA_CASES, ids=list(FLA_CASES))
def test_layer_with_fla_weights_matches_fla_reference(case):
    layer, shapes, kw = fla_layer(case)
    sd = random_state_dict(shapes, seed=2)
    layer.load_fla_state_dict(sd)
    x = torch.randn(2, 37, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y, state = layer(x)
    y_ref, S_ref = fla_layer_reference(sd, x, kw["num_heads"], kw["head_dim"], lower_bound=kw.get("lower_bound"),
                                       allow_neg_eigval=kw.get("allow_neg_eigval", False))
    assert state.recurrent.shape == S_ref.shape  # fla's [N, HV, V, K]
    assert ((y - y_ref).norm() / y_ref.norm()).item() <= 5e-7
    assert ((state.recurrent - S_ref).norm() / S_ref.norm()).item() <= 5e-7
    y_tok, state_tok = token_by_token(layer, x)  # the decode path, in fla's layout, agrees as well
    assert ((y_tok - y_ref).norm() / y_ref.norm()).item() <= 5e-7
    assert ((state_tok.recurrent - S_ref).norm() / S_ref.norm()).item() <= 5e-7


def test_fla_init_and_defaults():
    layer = KimiDeltaAttention.from_fla_config(hidden_size=32, num_heads=2, head_dim=8)
    assert layer.lower_bound is None and layer.state_layout == "vk" and layer.g_proj[1].bias is not None
    dt = torch.nn.functional.softplus(layer.dt_bias.detach())
    assert dt.min() >= 1e-4 * 0.999 and dt.max() <= 0.1 * 1.001 and dt.std() > 0
    assert torch.all((layer.A_log.exp() >= 1) & (layer.A_log.exp() <= 16))
    safe = KimiDeltaAttention.from_fla_config(hidden_size=32, num_heads=2, head_dim=8, safe_gate=True, lower_bound=-5)
    assert torch.equal(safe.A_log.detach(), torch.zeros(2)) and safe.lower_bound == -5


@pytest.mark.parametrize("case", ["fla-default", "gva"])
def test_attention_mask_equals_each_sequence_alone(case):
    layer, shapes, kw = fla_layer(case)
    layer.load_fla_state_dict(random_state_dict(shapes, seed=4))
    T = 23
    x = torch.randn(4, T, 32, dtype=torch.float64)
    mask = torch.ones(4, T + 5, dtype=torch.long)  # HF passes [B, past + T]: only the last T columns count
    mask[0, 5:5 + 6] = 0  # left padding
    mask[1, -4:] = 0  # right padding
    mask[2, 5 + 10:5 + 12] = 0  # a hole
    mask[3] = 0  # nothing at all
    state0 = layer.init_state(4)
    state0.recurrent.normal_()
    state0.conv.normal_()
    y, state = layer(x, state0, attention_mask=mask)
    for b in range(4):
        keep = mask[b, 5:].bool()
        assert torch.equal(y[b, ~keep], torch.zeros_like(y[b, ~keep]))
        if keep.any():
            s_b = KDAState(conv=state0.conv[b:b + 1], recurrent=state0.recurrent[b:b + 1])
            y_b, st_b = layer(x[b:b + 1, keep], s_b)
            assert torch.allclose(y[b, keep], y_b[0], rtol=0, atol=1e-12)
            assert torch.allclose(state.recurrent[b], st_b.recurrent[0], rtol=0, atol=1e-12)
            assert torch.allclose(state.conv[b], st_b.conv[0], rtol=0, atol=1e-12)
        else:  # an all-padding row leaves its state as it was
            assert torch.equal(state.recurrent[3], state0.recurrent[3]) and torch.equal(state.conv[3], state0.conv[3])


def test_cu_seqlens_equals_separate_calls_with_states():
    layer = make_layer(conv_size=4, num_v_heads=4)
    lengths = [7, 0, 2, 19]  # an empty sequence, and one shorter than the conv window
    xs = [torch.randn(1, n, 32, dtype=torch.float64) for n in lengths]
    state0 = layer.init_state(4)
    state0.recurrent.normal_()
    state0.conv.normal_()
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    y, state = layer(torch.cat(xs, dim=1), state0, cu_seqlens=cu)
    for n, x_n in enumerate(xs):
        if lengths[n] == 0:
            assert torch.equal(state.recurrent[n], state0.recurrent[n]) and torch.equal(state.conv[n], state0.conv[n])
            continue
        y_n, s_n = layer(x_n, KDAState(conv=state0.conv[n:n + 1], recurrent=state0.recurrent[n:n + 1]))
        assert torch.allclose(y[:, cu[n]:cu[n + 1]], y_n, rtol=0, atol=1e-12)
        assert torch.allclose(state.recurrent[n], s_n.recurrent[0], rtol=0, atol=1e-12)
        assert torch.allclose(state.conv[n], s_n.conv[0], rtol=0, atol=1e-12)
    y0, same = layer(x_n[:, :0], state0, cu_seqlens=torch.zeros(5, dtype=torch.long))  # nothing at all: T = 0
    assert y0.shape == (1, 0, 32) and torch.equal(same.recurrent, state0.recurrent)
    assert torch.equal(same.conv, state0.conv)


def test_state_layouts_hold_the_same_state_transposed():
    kv = make_layer(num_v_heads=4)
    vk = make_layer(num_v_heads=4, state_layout="vk")
    vk.load_state_dict(kv.state_dict())
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    y_kv, s_kv = kv(x)
    y_vk, s_vk = vk(x)
    assert torch.equal(y_kv, y_vk) and torch.equal(s_kv.recurrent, s_vk.recurrent.transpose(-1, -2))
    assert vk.init_state(2).recurrent.shape == (2, 4, 8, 8) and s_vk.nbytes() == s_kv.nbytes()
    y1, _ = vk(x[:, :1], s_vk)  # decode continues from the vk state
    y2, _ = kv(x[:, :1], s_kv)
    assert torch.allclose(y1, y2, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kwargs, match", [
    ({"num_v_heads": 3}, r"num_v_heads \(3\) must be a multiple of num_heads \(2\)"),
    ({"state_layout": "kk"}, r"state_layout must be one of \['kv', 'vk'\], got 'kk'"),
    ({"init": "xavier"}, r"init must be 'k3sys' or 'fla', got 'xavier'"),
])
def test_layer_rejects_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KimiDeltaAttention(**{"hidden_size": 32, "num_heads": 2, "head_dim": 8, **kwargs})


def test_bad_fla_weights_masks_and_packing_are_named():
    layer, shapes, _ = fla_layer("fla-default")
    sd = random_state_dict(shapes)
    with pytest.raises(ValueError, match=r"missing \['q_conv1d.weight'\], unexpected \['q_conv.weight'\]"):
        layer.load_fla_state_dict({**{n: t for n, t in sd.items() if n != "q_conv1d.weight"},
                                   "q_conv.weight": sd["q_conv1d.weight"]})
    with pytest.raises(ValueError, match=r"dt_bias has shape \[15\], this layer needs \[2, 8\]"):
        layer.load_fla_state_dict({**sd, "dt_bias": sd["dt_bias"][:15]})
    with pytest.raises(ValueError, match=r"safe_gate=True needs lower_bound"):
        KimiDeltaAttention.from_fla_config(hidden_size=32, num_heads=2, head_dim=8, safe_gate=True)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, >= T\] = \[2, >= 5\], got \[2, 4\]"):
        layer(x, attention_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="not both"):
        layer(x[:1], attention_mask=torch.ones(1, 5), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"cu_seqlens must be 1-D int \[N \+ 1\] with x \[1, T, D\]"):
        layer(x, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"state.recurrent must have shape \[2, 2, 8, 8\]"):
        layer(x[:1], KDAState(conv=torch.zeros(2, 3, 48), recurrent=torch.zeros(2, 4, 8, 8)),
              cu_seqlens=torch.tensor([0, 2, 5]))
