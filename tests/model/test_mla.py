import pytest
import torch

from k3sys.model.cache import LatentKV
from k3sys.model.mla import GatedMLA, rotate

CASES = {  # id -> (q_lora_rank, use_rope)
    "qlora-nope": (16, False),
    "qfull-rope": (None, True),
}


def make_mla(q_lora_rank, use_rope, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    mla = GatedMLA(hidden_size=32, num_heads=4, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=6,
                   v_head_dim=10, q_lora_rank=q_lora_rank, use_rope=use_rope)
    return mla.to(dtype)


def reference(mla: GatedMLA, x: torch.Tensor) -> torch.Tensor:
    """Plain causal attention over explicitly expanded per-head keys and values, fp64, written apart
    from the module's own paths: full K = [W_uk c | k_rope], V = W_uv c, softmax with a -inf mask."""
    B, T, _ = x.shape
    H, dn, dr, dv, r = mla.num_heads, mla.dn, mla.dr, mla.dv, mla.kv_lora_rank
    pos = torch.arange(T)
    q = mla.q_proj(x).view(B, T, H, dn + dr)
    ckv = mla.kv_a_proj(x)
    c, k_rope = mla.kv_a_norm(ckv[..., :r]), ckv[..., r:]
    if mla.use_rope:
        q = torch.cat((q[..., :dn], rotate(q[..., dn:], pos, mla.rope_theta)), -1)
        k_rope = rotate(k_rope, pos, mla.rope_theta)
    kvb = (c @ mla.kv_b_proj.weight.T).view(B, T, H, dn + dv)
    k = torch.cat((kvb[..., :dn], k_rope[:, :, None].expand(B, T, H, dr)), -1)
    v = kvb[..., dn:]
    s = torch.einsum("bthd,bshd->bhts", q, k) / (dn + dr) ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshv->bthv", s.softmax(-1), v).reshape(B, T, H * dv)
    return mla.o_proj(o * torch.sigmoid(mla.g_proj(x)))


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_full_forward_matches_reference(case):
    mla = make_mla(*CASES[case])
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    torch.testing.assert_close(mla(x), reference(mla, x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("split", [(5, 1, 1, 1, 1, 1, 1), (3, 4, 1, 3)], ids=["P5-decode6", "P3-extend4-1-3"])
def test_prefill_then_absorbed_decode_matches_reference(case, split):
    """Prefill the first tokens, then feed the rest (one at a time or in chunks) on the latent cache."""
    mla = make_mla(*CASES[case])
    x = torch.randn(2, sum(split), 32, dtype=torch.float64)
    cache = LatentKV(batch=2, width=12 + 6, dtype=torch.float64, block_size=4)
    outs, t = [], 0
    for n in split:
        outs.append(mla(x[:, t:t + n], cache))
        t += n
    torch.testing.assert_close(torch.cat(outs, 1), reference(mla, x), rtol=1e-10, atol=1e-10)
    assert cache.length == sum(split) and cache.buf.shape[2] == 12 + 6


def test_absorbed_decode_never_expands_the_cache():
    """Decode multiplies kv_b_proj's weight into q and the output; it never runs kv_b_proj as a layer."""
    mla = make_mla(16, False)
    cache = LatentKV(batch=1, width=18, dtype=torch.float64)
    calls = []
    mla.kv_b_proj.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    mla(torch.randn(1, 7, 32, dtype=torch.float64), cache)
    assert calls == [torch.Size([1, 7, 12])]  # prefill expands its own 7 tokens once
    mla(torch.randn(1, 1, 32, dtype=torch.float64), cache)
    assert len(calls) == 1


def test_gate_forced_to_zero_gives_zero_output():
    mla = make_mla(None, True)
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    assert mla(x).abs().max() > 0
    mla.g_proj.register_forward_hook(lambda m, i, o: torch.full_like(o, float("-inf")))
    assert torch.equal(mla(x), torch.zeros_like(x))


def test_gate_is_per_head():
    """Closing head 1's gate removes exactly head 1's contribution: the same as zeroing its o_proj columns."""
    mla = make_mla(None, False)
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    y_open = mla(x)
    head1 = slice(10, 20)  # v_head_dim = 10
    hook = mla.g_proj.register_forward_hook(lambda m, i, o: torch.cat(
        (o[..., :head1.start], torch.full_like(o[..., head1], float("-inf")), o[..., head1.stop:]), -1))
    y_closed = mla(x)
    hook.remove()
    with torch.no_grad():
        mla.o_proj.weight[:, head1] = 0
    torch.testing.assert_close(y_closed, mla(x), rtol=1e-12, atol=1e-12)
    assert (y_closed - y_open).abs().max() > 1e-3
