"""Routing generator hits its imbalance target with valid routings; metrics against hand values."""

from __future__ import annotations

import pytest
import torch

from k3sys.ep import balancedness, make_routing, maxvio, tokens_per_expert

SIZES = [
    (8, 512, 64, 4, 0.5), (8, 512, 64, 4, 2.0), (4, 1024, 128, 8, 5.0), (16, 256, 256, 16, 10.0), (2, 512, 32, 2, 12.0)
]


@pytest.mark.parametrize("dist", ["lognormal", "zipf"])
@pytest.mark.parametrize(
    "R, s, E, K, target", SIZES, ids=[f"R{R}-s{s}-E{E}-K{K}-mv{t}" for R, s, E, K, t in SIZES]
)
def test_realised_maxvio_within_5_percent(R, s, E, K, target, dist):
    topk = make_routing(R, s, E, K, target, seed=3, dist=dist)
    assert topk.shape == (R, s, K) and topk.dtype == torch.long
    assert int(topk.min()) >= 0 and int(topk.max()) < E
    picks = topk.sort(dim=-1).values
    assert bool((picks[..., 1:] != picks[..., :-1]).all()), "K distinct experts per token"
    got = maxvio(tokens_per_expert(topk, E).sum(0))
    assert abs(got - target) <= 0.05 * target, f"realised maxvio {got:.4f} vs target {target}"


def test_zero_target_is_uniform_and_seeds_are_reproducible():
    a = make_routing(4, 256, 32, 4, 0.0, seed=1)
    assert torch.equal(a, make_routing(4, 256, 32, 4, 0.0, seed=1))
    assert not torch.equal(a, make_routing(4, 256, 32, 4, 0.0, seed=1, step=1))
    assert maxvio(tokens_per_expert(a, 32).sum(0)) < 0.3  # sampling noise only (mean 128 per expert)


def test_hot_shift_moves_hot_experts_keeps_skew():
    base = tokens_per_expert(make_routing(8, 512, 64, 4, 4.0, seed=5), 64).sum(0)
    moved = tokens_per_expert(make_routing(8, 512, 64, 4, 4.0, seed=5, hot_shift=1.0), 64).sum(0)
    kept = tokens_per_expert(make_routing(8, 512, 64, 4, 4.0, seed=5, step=1), 64).sum(0)
    assert abs(maxvio(moved) - 4.0) <= 0.2
    assert int(base.argmax()) == int(kept.argmax()) != int(moved.argmax())


def test_tokens_per_expert_counts_pairs():
    topk = torch.tensor([[[0, 1], [1, 2]], [[3, 0], [0, 2]]])
    assert tokens_per_expert(topk, 4).tolist() == [[1, 2, 1, 0], [2, 0, 1, 1]]


def test_metrics():
    assert maxvio(torch.tensor([1, 1, 4, 2])) == pytest.approx(4 / 2 - 1)
    assert maxvio(torch.zeros(3)) == 0.0
    assert balancedness(torch.tensor([2, 4, 6])) == pytest.approx(4 / 6)
    assert balancedness(torch.zeros(2)) == 1.0


@pytest.mark.parametrize(
    "args, match",
    [
        ((4, 8, 8, 9, 0.0), r"top_k \(9\) must be <= num_experts \(8\)"),
        ((4, 8, 8, 2, 3.0), r"maxvio must be in \[0, E/K - 1\) = \[0, 3\), got 3.0"),
        ((4, 8, 8, 2, -0.1), r"got -0.1"),
        ((0, 8, 8, 2, 0.0), r"R, E, K >= 1"),
    ],
    ids=["K-gt-E", "maxvio-unreachable", "maxvio-negative", "R-0"],
)
def test_bad_routing_input_rejected(args, match):
    with pytest.raises(ValueError, match=match):
        make_routing(*args)


def test_bad_routing_options_rejected():
    with pytest.raises(ValueError, match=r"hot_shift must be in \[0, 1\], got 1.5"):
        make_routing(2, 8, 8, 2, 1.0, hot_shift=1.5)
    with pytest.raises(ValueError, match=r"dist must be 'lognormal' or 'zipf', got 'pareto'"):
        make_routing(2, 8, 8, 2, 1.0, dist="pareto")
    with pytest.raises(ValueError, match=r"topk ids must lie in \[0, 4\), got \[0, 4\]"):
        tokens_per_expert(torch.tensor([[[0, 4]]]), 4)
    with pytest.raises(ValueError, match=r"3-D"):
        tokens_per_expert(torch.tensor([[0, 1]]), 4)
    with pytest.raises(ValueError, match=r"integer expert ids, got torch.float32"):
        tokens_per_expert(torch.tensor([[[0.5, 1.0]]]), 4)


def test_public_names():
    import k3sys.ep

    for name in ("Plan", "plan", "make_routing", "tokens_per_expert", "maxvio", "balancedness"):
        assert name in k3sys.ep.__all__ and hasattr(k3sys.ep, name)
