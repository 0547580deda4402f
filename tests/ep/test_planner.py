"""Planner invariants on random and adversarial token counts, the slot map against a naive oracle,
and every rejected input."""

from __future__ import annotations

import pytest
import torch
from plan_checks import check_plan, check_slots, reference_slots, routing_hot_expert, routing_hot_rank, routing_uniform

from k3sys.ep import make_routing, plan, tokens_per_expert

# name -> (routing [R, s, K], E)
CASES = {
    "zipf-mv2-R4-E16-K4": lambda: (make_routing(4, 96, 16, 4, 2.0, seed=3, dist="zipf"), 16),
    "lognormal-mv1-R8-E32-K4": lambda: (make_routing(8, 64, 32, 4, 1.0, seed=5), 32),
    "lognormal-mv5-R4-E32-K3": lambda: (make_routing(4, 80, 32, 3, 5.0, seed=7), 32),
    "hot-expert-R4-E8-K2": lambda: (routing_hot_expert(4, 50, 8, 2), 8),
    "hot-expert-R4-E8-K1": lambda: (routing_hot_expert(4, 50, 8, 1), 8),
    "hot-rank-R4-E16-K3": lambda: (routing_hot_rank(4, 40, 16, 3), 16),
    "uniform-R4-E16-K4": lambda: (routing_uniform(4, 32, 16, 4), 16),
    "R1-E8-K2": lambda: (make_routing(1, 40, 8, 2, 1.0, seed=2), 8),
    "epn1-R8-E8-K2": lambda: (make_routing(8, 40, 8, 2, 2.0, seed=4), 8),
}


STRATEGIES = {"device": {}, "match": {"strategy": "match"}, "greedy": {"strategy": "greedy"},
              "match-node2": {"strategy": "match", "ranks_per_node": 2}, "device-node2": {"ranks_per_node": 2}}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("token_padding", [1, 8], ids=["pad1", "pad8"])
@pytest.mark.parametrize("case", list(CASES))
def test_invariants_and_slots(case, token_padding, strategy):
    topk, E = CASES[case]()
    R, s, K = topk.shape
    tpe = tokens_per_expert(topk, E)
    p = plan(tpe, K, token_padding=token_padding, **STRATEGIES[strategy])
    check_plan(p, tpe, K, s, token_padding)
    dst, row = check_slots(p, topk)
    ref_dst, ref_row = reference_slots(p, topk)
    assert torch.equal(dst, ref_dst) and torch.equal(row, ref_row)


@pytest.mark.parametrize("strategy", ["device", "match"])
def test_uniform_routing_moves_nothing(strategy):
    topk = routing_uniform(4, 32, 16, 4)
    p = plan(tokens_per_expert(topk, 16), 4, strategy=strategy)
    assert p.moved_tokens == 0 and p.num_copies == 0 and bool((p.replicas == -1).all())


def test_uneven_tokens_per_rank_with_total_tokens():
    full = make_routing(4, 64, 16, 3, 2.0, seed=11)
    s_r = [64, 10, 37, 2]
    E, K = 16, 3
    tpe = torch.stack([tokens_per_expert(full[r : r + 1, : s_r[r]], E)[0] for r in range(4)])
    capacity = 80
    p = plan(tpe, K, tokens_per_rank=capacity, total_tokens=sum(s_r), token_padding=4)
    check_plan(p, tpe, K, capacity, 4)
    assert p.cap.tolist() == [85, 85, 85, 84]  # 113 tokens * 3 = 339 = 4 * 84 + 3
    dst = [p.slots(r, full[r, : s_r[r]])[0] for r in range(4)]
    assert [sum(int((d == q).sum()) for d in dst) for q in range(4)] == [85, 85, 85, 84]


def test_capacity_sizes_buffer_rows_only():
    topk = make_routing(4, 32, 16, 4, 1.0, seed=1)
    tpe = tokens_per_expert(topk, 16)
    small, big = plan(tpe, 4, token_padding=8), plan(tpe, 4, tokens_per_rank=100, token_padding=8)
    assert torch.equal(small.alloc, big.alloc) and torch.equal(small.cu_seqlens, big.cu_seqlens)
    assert (small.buffer_rows, big.buffer_rows) == (32 * 4 + 7 * 8, 100 * 4 + 7 * 8)


@pytest.mark.parametrize("strategy", ["device", "match"])
@pytest.mark.parametrize("tolerance", [0.05, 0.25])
def test_tolerance_bounds_loads_and_saves_copies(tolerance, strategy):
    topk = make_routing(8, 256, 64, 4, 1.5, seed=9)
    tpe = tokens_per_expert(topk, 64)
    exact = plan(tpe, 4, strategy=strategy)
    loose = plan(tpe, 4, tolerance=tolerance, token_padding=2, strategy=strategy)
    check_plan(loose, tpe, 4, 256, 2, tolerance)
    check_slots(loose, topk)
    assert loose.strategy == strategy
    assert loose.moved_tokens < exact.moved_tokens and loose.num_copies < exact.num_copies


def test_a_tolerance_with_almost_no_slack_never_falls_back_to_the_greedy():
    # floor(cap * 0.005) is 0 here (caps 128), so the inexact match has no slack and can run out of
    # room; it must then plan exactly, not hand over to the greedy (which moves more).
    for seed in range(40):
        tpe = tokens_per_expert(make_routing(8, 64, 16, 2, 3.0, seed=seed), 16)
        exact, tiny = plan(tpe, 2, strategy="match"), plan(tpe, 2, tolerance=0.005, strategy="match")
        check_plan(tiny, tpe, 2, 64, 1, 0.005)
        assert tiny.strategy == "match", seed
        assert tiny.moved_tokens <= exact.moved_tokens and tiny.num_copies <= exact.num_copies, seed


def test_match_meets_the_moved_lower_bound_and_the_greedy_copies():
    for seed, mv in [(0, 0.5), (1, 2.0), (2, 8.0), (3, 0.0)]:
        topk = make_routing(16, 512, 128, 8, mv, seed=seed)
        tpe = tokens_per_expert(topk, 128)
        ours, greedy = plan(tpe, 8, strategy="match"), plan(tpe, 8, strategy="greedy")
        home = tpe.sum(0).view(16, 8).sum(1)
        lower_bound = int((home - ours.cap).clamp(min=0).sum())
        assert ours.strategy == "match" and ours.moved_tokens == lower_bound == plan(tpe, 8).moved_tokens
        assert greedy.moved_tokens >= lower_bound and ours.num_copies <= greedy.num_copies


def test_last_replica_slot_makes_a_group_overshoot():
    # One replica slot per rank: rank 2 (room 4) cannot take the two surpluses of 2, so group 0 fills it
    # completely and takes group 1's surplus in its own slot, as the greedy would.
    # The device planner's line match would give rank 2 two replicas; its chain does what the greedy does.
    tpe = torch.tensor([[3, 3, 0], [3, 3, 0], [2, 2, 2]])  # K=1, s=6: expert loads 8, 8, 2, caps 6
    for strategy in ("match", "device"):
        p = plan(tpe, 1, strategy=strategy)
        check_plan(p, tpe, 1, 6, 1)
        assert p.strategy == strategy and p.alloc.tolist() == [[4, 0, 4], [2, 6, 0], [0, 0, 2]]


def test_node_aware_keeps_replicas_inside_nodes():
    # K=1, caps 30. Groups: node 0 = ranks 0, 1 with surplus 10 and room 5; node 1 = ranks 2, 3 with
    # surplus 5 and room 10. Node-blind, the equal sizes pair up across nodes (twice); node-aware,
    # each node first balances inside itself and only 5 pairs cross (once).
    loads = [22, 18, 10, 15, 18, 17, 10, 10]
    tpe = torch.tensor([[n // 4 + (r < n % 4) for n in loads] for r in range(4)])

    def crossing(p):
        return sum(int(p.alloc[e, r] > 0) for e in range(8) for r in range(4) if e // 4 != r // 2)

    blind = plan(tpe, 1, total_tokens=120, strategy="match")
    aware = plan(tpe, 1, total_tokens=120, ranks_per_node=2, strategy="match")
    check_plan(aware, tpe, 1, int(tpe.sum(1).max()), 1)
    assert aware.moved_tokens == blind.moved_tokens == 15
    assert (crossing(blind), crossing(aware)) == (2, 1)


def test_plan_is_deterministic():
    topk = make_routing(8, 128, 64, 4, 3.0, seed=21)
    tpe = tokens_per_expert(topk, 64)
    a, b = plan(tpe, 4, token_padding=4), plan(tpe.clone(), 4, token_padding=4)
    for name in ("cap", "alloc", "replicas", "cu_seqlens"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert all(torch.equal(x, y) for x, y in zip(a.slots(3, topk[3]), b.slots(3, topk[3]), strict=True))


def test_plan_is_frozen():
    p = plan(tokens_per_expert(routing_uniform(2, 8, 4, 2), 4), 2)
    with pytest.raises(AttributeError):
        p.buffer_rows = 0


GOOD = torch.tensor([[2, 1, 1, 0], [0, 2, 1, 1]])  # R=2, E=4, K=2, s=2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tpe": torch.zeros(5, 4, dtype=torch.long)}, r"\[R, E\] with 1 <= R <= E, got R=5, E=4"),
        ({"tpe": torch.tensor([[2, 1, 1, 0]] * 2).T.contiguous()}, r"1 <= R <= E, got R=4, E=2"),
        ({"tpe": torch.tensor([[3, 1, 1, -1], [0, 2, 1, 1]])}, r"counts must be >= 0, got -1"),
        ({"tpe": torch.tensor([[2, 1, 1, 1], [0, 2, 1, 1]])}, r"row 0 sums to 5, not a multiple of top_k=2"),
        ({"tpe": torch.tensor([[2, 1, 1, 0], [2, 2, 1, 1]])}, r"must all sum to s\*K .* total_tokens"),
        ({"tpe": torch.tensor([[3, 1, 0, 0], [0, 2, 1, 1]])}, r"row 0 routes more than its s=2 tokens"),
        ({"tpe": GOOD.float()}, r"integer counts, got torch.float32"),
        ({"tpe": GOOD[0]}, r"2-D \[R, E\]"),
        ({"top_k": 5}, r"top_k must be in \[1, E=4\], got 5"),
        ({"top_k": 0}, r"top_k must be in \[1, E=4\], got 0"),
        ({"total_tokens": 5}, r"tpe sums to 8 pairs, but total_tokens\*K = 10"),
        ({"tokens_per_rank": 1}, r"tokens_per_rank \(capacity S=1\) is below this step's s=2"),
        ({"token_padding": 0}, r"token_padding must be >= 1, got 0"),
        ({"strategy": "eplb"}, r"strategy must be one of .* got 'eplb'"),
        ({"tolerance": -0.1}, r"tolerance must be a finite number >= 0, got -0.1"),
        ({"tolerance": float("inf")}, r"tolerance must be a finite number >= 0, got inf"),
        ({"ranks_per_node": 0}, r"ranks_per_node must be >= 1, got 0"),
    ],
    ids=["R-gt-E", "R-gt-E-transposed", "negative", "row-not-sK", "uneven-no-total", "over-s", "float", "1-D",
         "topk-gt-E", "topk-0", "total-mismatch", "capacity-below-s", "padding-0", "strategy", "tolerance",
         "tolerance-inf", "ranks-per-node"],
)
def test_bad_plan_input_rejected(kwargs, match):
    args = {"tpe": GOOD, "top_k": 2} | kwargs
    with pytest.raises(ValueError, match=match):
        plan(**args)


def test_bad_slots_input_rejected():
    p = plan(GOOD, 2)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        p.slots(2, torch.tensor([[0, 1], [0, 2]]))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got -1"):
        p.recv_rows(-1)
    with pytest.raises(ValueError, match=r"shape \[s, K=2\], got \[2, 3\]"):
        p.slots(0, torch.tensor([[0, 1, 2], [0, 2, 3]]))
    with pytest.raises(ValueError, match=r"must lie in \[-1, 4\), got \[0, 4\]"):
        p.slots(0, torch.tensor([[0, 1], [0, 4]]))
    with pytest.raises(ValueError, match=r"rank 1 route 2 pairs to expert 0, but the plan's tpe\[1, 0\] is 0"):
        p.slots(1, torch.tensor([[0, 1], [0, 2]]))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        p.traffic_of(2)
