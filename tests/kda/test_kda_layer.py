import pytest
import torch

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
