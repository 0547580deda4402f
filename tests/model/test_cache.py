import pytest
import torch

from k3sys.model import HybridCache, HybridModel, LatentKV, ModelConfig, cache_bytes, layer_cache_bytes


def storage_bytes(entry) -> int:
    """Bytes of the storage behind one layer's cache tensors (whole storages, so views can't hide any)."""
    tensors = (entry.buf,) if isinstance(entry, LatentKV) else (entry.conv, entry.recurrent)
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("max_len", [None, 50], ids=["growing", "prealloc"])
def test_breakdown_equals_tensor_storage_after_prefill_and_decode(tiny, dtype, max_len):
    torch.manual_seed(0)
    model = HybridModel(tiny).to(dtype).eval()
    cache = HybridCache(tiny, batch=2, max_len=max_len, dtype=dtype, block_size=16)
    assert [storage_bytes(e) for e in cache.layers] == [b for _, _, b in cache.breakdown()["layers"]]
    ids = torch.randint(0, tiny.vocab_size, (2, 40))
    with torch.no_grad():
        model(ids[:, :33], cache)
        for t in range(33, 40):
            model(ids[:, t:t + 1], cache)
    b = cache.breakdown()
    assert [bytes_ for _, _, bytes_ in b["layers"]] == [storage_bytes(e) for e in cache.layers]
    assert b["kda"] + b["mla"] == b["total"] == cache.nbytes()
    # growing: 33 prefill tokens take 3 blocks of 16; 7 decoded tokens still fit
    assert cache.capacity == (48 if max_len is None else 50)
    assert cache_bytes(tiny, cache.capacity, batch=2, dtype=dtype) == {k: b[k] for k in ("kda", "mla", "total")}


def test_kda_part_is_constant_and_mla_part_linear_in_context():
    cfg = ModelConfig.from_preset("k3")
    at = {n: cache_bytes(cfg, n) for n in (4096, 131072, 1 << 20)}
    assert at[4096]["kda"] == at[1 << 20]["kda"] > 0
    assert at[1 << 20]["mla"] == 8 * at[131072]["mla"] == 256 * at[4096]["mla"]
    # K3 at 1M tokens in bf16: 24 MLA layers x (512 + 64) values x 2 bytes per token
    assert at[1 << 20]["mla"] == 24 * 576 * 2 * (1 << 20)
    # 69 KDA layers x (fp32 S of 96 heads x 128 x 128 + bf16 conv tails of 3 x 96 x 128 channels x 3 steps)
    assert at[4096]["kda"] == 69 * (96 * 128 * 128 * 4 + 3 * 96 * 128 * 3 * 2)


def test_hybrid_mla_slope_is_a_quarter_of_all_mla(tiny):
    cfg = tiny.replace(layers="kda,kda,kda,mla," * 4)
    n = 1000
    hybrid = cache_bytes(cfg, 2 * n)["mla"] - cache_bytes(cfg, n)["mla"]
    all_mla = cache_bytes(cfg, 2 * n, layers=("mla",) * 16)["mla"] - cache_bytes(cfg, n, layers=("mla",) * 16)["mla"]
    assert 4 * hybrid == all_mla
    assert cache_bytes(cfg, n, layers=("mha",) * 16)["total"] == 16 * layer_cache_bytes(cfg, "mha", n)


def test_latent_cache_grows_geometrically_and_keeps_its_contents():
    cache = LatentKV(batch=2, width=3, dtype=torch.float32, block_size=4)
    chunks, reallocations, storage = [], 0, None
    for t in range(1000):
        chunk = torch.full((2, 1, 3), float(t))
        view = cache.append(chunk)
        chunks.append(chunk)
        reallocations += cache.buf.untyped_storage().data_ptr() != storage
        storage = cache.buf.untyped_storage().data_ptr()
    assert torch.equal(view, torch.cat(chunks, dim=1))
    assert reallocations <= 10  # 4, 8, 16, ..., 1024: amortised O(1) copies per token
    assert cache.capacity == 1024 and cache.capacity % 4 == 0


def test_bad_cache_arguments_are_rejected(tiny):
    with pytest.raises(ValueError, match="batch"):
        HybridCache(tiny, batch=0)
    with pytest.raises(ValueError, match="max_len"):
        HybridCache(tiny, batch=1, max_len=tiny.max_context + 1)
    full = LatentKV(batch=1, width=2, dtype=torch.float32, max_len=3)
    full.append(torch.zeros(1, 3, 2))
    with pytest.raises(ValueError, match="max_len=3"):
        full.append(torch.zeros(1, 1, 2))
    with pytest.raises(ValueError, match="kind"):
        layer_cache_bytes(tiny, "rnn", 10)
