"""The timing engine behind bench/ep_runtime.py and the demo: a tiny real run, and its inputs."""

from __future__ import annotations

import pytest
import torch

from k3sys.ep import make_routing
from k3sys.ep.measure import StepSetup, hot_on_rank0, measure_step


def test_hot_on_rank0_renames_hottest_first() -> None:
    ids = make_routing(2, 256, 16, 2, 3.0, seed=3)
    renamed = hot_on_rank0(ids, 16)
    load = torch.bincount(renamed.reshape(-1), minlength=16)
    assert (load.diff() <= 0).all()  # expert 0 hottest, then 1, ...
    assert torch.equal(load.sort(descending=True).values, torch.bincount(ids.reshape(-1), minlength=16).sort(
        descending=True).values)


@pytest.mark.timeout(120)
def test_measure_step_runs_both_methods() -> None:
    setup = StepSetup(experts=8, top_k=2, hidden=16, ffn=16, tokens=64, maxvio=2.0, placement="rank0",
                      steps=2, warmup=1)
    out = measure_step(setup)
    assert set(out) == {"ours", "baseline"}
    assert out["ours"]["max_over_mean_load"] == 1.0  # exact caps
    assert out["baseline"]["max_over_mean_load"] > 1.2 and out["baseline"]["copies"] == 0
    assert all(r["time_s"] > 0 and r["peak_rss_mib"] > 0 and r["page_faults"] >= 0 for r in out.values())


def test_measure_step_rejects_unknown_method_and_malloc() -> None:
    with pytest.raises(ValueError, match=r"methods must be a non-empty subset of \('ours', 'baseline'\)"):
        measure_step(StepSetup(), ["deepep"])
    with pytest.raises(ValueError, match=r"malloc must be one of \('cache', 'release', 'default'\), got 'jemalloc'"):
        measure_step(StepSetup(), malloc="jemalloc")
