from rich.progress import Progress

import k3sys.kda
from k3sys.demo import PARTS
from k3sys.kda.demo import demo


def test_public_names():
    assert sorted(k3sys.kda.__all__) == sorted([
        "KDAState", "KimiDeltaAttention", "kda_chunk", "kda_chunk_cp", "kda_gate", "kda_naive", "kda_state_bytes",
        "kda_step", "kv_cache_bytes",
    ])
    for name in k3sys.kda.__all__:
        assert getattr(k3sys.kda, name).__module__.startswith("k3sys.kda.")


def test_state_and_kv_cache_bytes():
    # S: 4 heads x 128 x 128 fp32 = 256 KiB; conv tail: 3 steps x 3 * 4 * 128 channels x 2 bytes
    assert k3sys.kda.kda_state_bytes(4, 128) == 4 * 128 * 128 * 4 + 3 * 3 * 4 * 128 * 2
    assert k3sys.kda.kv_cache_bytes(4, 128, tokens=1000, batch=2) == 2 * 2 * 1000 * 4 * 128 * 2


def test_demo_part_runs_and_reports():
    assert ("KDA", "k3sys.kda.demo") in PARTS
    with Progress(disable=True) as progress:
        rows = demo(progress)
    figures = dict(rows)
    assert float(figures["chunked vs naive, relative RMS difference"]) < 1e-5
    assert any("1M tokens" in name for name in figures)
