"""Baselines against hand counts and a naive EPLB loop; the cost model against hand arithmetic."""

from __future__ import annotations

import pytest
import torch

from k3sys.ep import baselines, make_routing, plan, tokens_per_expert
from k3sys.ep.sim import Hardware, MoEShape, Schedule, break_even_tolerance, compare, step_cost

TPE = torch.tensor([[6, 0, 1, 1], [4, 2, 0, 2]])  # R=2, E=4, K=2, s=4


def test_static_is_home_placement():
    p = baselines.static(TPE)
    assert p.traffic.tolist() == [[6, 2], [6, 2]]
    assert p.loads.tolist() == [12, 4] and p.dropped == 0 and int(p.fetched.sum()) == 0


def test_capacity_drops_above_the_local_limit():
    p = baselines.capacity(TPE, factor=1.0)  # limit ceil(1.0 * 8 / 4) = 2 per (rank, expert)
    assert p.traffic.tolist() == [[2, 2], [4, 2]]
    assert p.dropped == (6 - 2) + (4 - 2)
    assert baselines.capacity(TPE, factor=4.0).dropped == 0


def naive_eplb_counts(load: list[float], slots: int, R: int) -> list[int]:
    count = [1] * len(load)
    for _ in range(slots - len(load)):
        e = max((e for e in range(len(load)) if count[e] < R), key=lambda e: load[e] / count[e])
        count[e] += 1
    return count


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eplb_replica_counts_match_the_sequential_greedy(seed):
    load = torch.randint(0, 1000, (32,), generator=torch.Generator().manual_seed(seed))
    got = baselines.eplb_replicas(load, 64, 8)
    assert got.tolist() == naive_eplb_counts(load.tolist(), 64, 8)


def test_eplb_refuses_more_slots_than_one_replica_per_rank_allows():
    assert baselines.eplb_replicas(torch.tensor([5, 3]), 4, 2).tolist() == [2, 2]
    for slots in (1, 5):
        with pytest.raises(ValueError, match=rf"num_slots \({slots}\) must be in \[num_experts, .*\[2, 4\]"):
            baselines.eplb_replicas(torch.tensor([5, 3]), slots, 2)


def test_eplb_conserves_pairs_and_balances_a_known_skew():
    tpe = tokens_per_expert(make_routing(8, 512, 32, 4, 3.0, seed=1), 32)
    p = baselines.eplb(tpe, tpe.sum(0), slots_per_rank=8)
    assert torch.equal(p.traffic.sum(1), tpe.sum(1)) and int(p.loads.sum()) == int(tpe.sum())
    assert float(p.loads.max()) < 1.05 * float(p.loads.float().mean()) < float(baselines.static(tpe).loads.max())
    with pytest.raises(ValueError, match=r"slots_per_rank \(3\) \* R \(8\) must be >= E \(32\)"):
        baselines.eplb(tpe, tpe.sum(0), slots_per_rank=3)


def test_from_plan_fetches_each_replica_from_its_home():
    tpe = tokens_per_expert(make_routing(4, 256, 32, 4, 4.0, seed=2), 32)
    p = plan(tpe, 4)
    pl = baselines.from_plan(p)
    assert torch.equal(pl.loads, p.loads) and torch.equal(pl.traffic, p.traffic())
    assert int(pl.fetched.sum()) == p.num_copies > 0
    for r in range(4):
        for home in range(4):
            held = [e for e in p.replicas[r].tolist() if e >= 0 and e // 8 == home]
            assert int(pl.fetched[home, r]) == len(held)


HW = Hardware(peak_flops=1e12, gemm_efficiency=0.5, nvlink_bytes_per_s=4e9, network_bytes_per_s=1e9, ranks_per_node=2)
SHAPE = MoEShape(hidden=8, ffn=4, bytes_per_elem=2)  # a row is 16 bytes, an expert 3 * 8 * 4 * 2 = 192


def test_step_cost_matches_hand_arithmetic():
    traffic = torch.tensor([[0, 10, 30, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    fetched = torch.zeros(4, 4, dtype=torch.long)
    fetched[0, 1] = 1  # over NVLink: rank 0's NVLink is idle next to its network-bound dispatch
    p = baselines.Placement(torch.tensor([100, 10, 30, 0]), traffic, fetched)
    cost = step_cost(p, SHAPE, HW)
    assert cost.compute.tolist() == pytest.approx([n * 6 * 8 * 4 / 0.5e12 for n in (100, 10, 30, 0)])
    # Rank 0 sends 10 rows over NVLink (to rank 1) and 30 over the network (to rank 2), in parallel.
    assert float(cost.dispatch[0]) == float(cost.combine[0]) == pytest.approx(max(10 * 16 / 4e9, 30 * 16 / 1e9))
    assert float(cost.all_to_all[2]) == pytest.approx(2 * 30 * 16 / 1e9)
    # Overlapped, the weights ride rank 0's NVLink send link, idle next to its network-bound dispatch,
    # and rank 1's NVLink receive link, where they queue behind its 10 token rows.
    assert float(cost.prefetch[0]) == pytest.approx(0, abs=1e-18)
    assert float(cost.prefetch[1]) == pytest.approx((10 * 16 + 192) / 4e9 - 10 * 16 / 4e9)
    serial = step_cost(p, SHAPE, HW, Schedule(prefetch_overlap=0.0))
    assert float(serial.prefetch[0]) == float(serial.prefetch[1]) == pytest.approx(192 / 4e9)
    assert cost.step <= serial.step


def test_prefetch_shares_the_links_of_the_dispatch():
    traffic = torch.zeros(4, 4, dtype=torch.long)
    traffic[0, 2] = 30  # 480 bytes on rank 0's network send link
    fetched = torch.zeros(4, 4, dtype=torch.long)
    fetched[0, 3] = 1  # 192 more bytes on the same link
    p = baselines.Placement(torch.tensor([1, 1, 1, 1]), traffic, fetched)
    for overlap in (1.0, 0.5, 0.0):  # on a shared link, overlapping saves nothing
        assert float(step_cost(p, SHAPE, HW, Schedule(prefetch_overlap=overlap)).prefetch[0]) == pytest.approx(192e-9)
    moves = torch.zeros(4, 4, dtype=torch.long)
    moves[0, 3] = 2
    rebalanced = baselines.Placement(p.loads, traffic, torch.zeros(4, 4, dtype=torch.long), rebalance=moves)
    cost = step_cost(rebalanced, SHAPE, HW, Schedule(eplb_interval=4))
    assert cost.rebalance.tolist() == pytest.approx([2 * 192 / 1e9 / 4, 0, 0, 2 * 192 / 1e9 / 4])
    assert float(cost.prefetch.abs().max()) == 0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"prefetch_overlap": 1.5}, r"prefetch_overlap must be in \[0, 1\], got 1.5"),
    ({"eplb_interval": 0}, "eplb_interval must be >= 1, got 0"),
], ids=["overlap", "interval"])
def test_schedule_rejects_bad_values(kwargs: dict, match: str):
    with pytest.raises(ValueError, match=match):
        Schedule(**kwargs)


def test_break_even_tolerance_matches_hand_arithmetic():
    # One fetch: 192 B / 4 GB/s = 48 ns; one pair: 192 FLOP / 0.5 TFLOP/s = 0.384 ns: 125 pairs, of a cap of 50.
    assert break_even_tolerance(10, 5, SHAPE, HW) == pytest.approx(125 / 50)
    assert break_even_tolerance(4096, 16) == pytest.approx(989e12 * 0.6 * 2 / (2 * 450e9) / 65536)  # 2.0%


def test_eplb_moves_fetch_changed_slots_from_the_least_busy_holder():
    old = torch.tensor([[0, 0], [0, 1], [1, 1], [1, 2]])  # (expert, rank)
    new = torch.tensor([[0, 2], [0, 3], [1, 1], [1, 2]])
    moves = baselines.eplb_moves(old, new, 4)
    assert moves.tolist() == [[0, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert int(baselines.eplb_moves(new, new, 4).sum()) == 0


def test_compare_small_scale():
    # Small experts: weight fetches are cheap next to the skewed pairs, so balancing must pay off.
    c = compare(4.0, 8, num_experts=64, top_k=4, tokens_per_rank=256, hot_shift=0.5, shape=MoEShape(64, 16),
                tolerance=0.05)
    assert abs(c.maxvio - 4.0) <= 0.2 and c.tpe.shape == (8, 64)
    m = c.methods
    assert set(m) == {"static", "eplb", "capacity", "greedy", "ours", "ours_node", "ours_tol"}
    for name in ("greedy", "ours", "ours_node"):
        assert m[name]["balancedness"] == 1.0 and m[name]["peak_rows"] == 1.0 and m[name]["dropped_pct"] == 0
    assert m["ours_tol"]["peak_rows"] <= 1.05 and m["ours_tol"]["copies"] <= m["ours"]["copies"]
    assert m["ours"]["moved_tokens"] == m["ours"]["lower_bound"] <= m["greedy"]["moved_tokens"]
    assert m["static"]["peak_rows"] > 1.5 and m["capacity"]["dropped_pct"] > 0
    assert m["static"]["relative"] > 1.3 * m["ours"]["relative"]
    assert all(f["relative"] <= f["relative_serial"] + 1e-12 for f in m.values())  # overlap never hurts
    assert m["eplb"]["moved_copies"] > 0 and m["eplb"]["rebalance_ms"] > 0 and m["ours"]["rebalance_ms"] == 0


def test_compare_defaults_to_the_break_even_tolerance():
    # At this size one replica costs more than a whole rank's pairs: the default plan makes none.
    c = compare(4.0, 8, num_experts=64, top_k=4, tokens_per_rank=256)
    assert break_even_tolerance(256, 4) > 1 and c.methods["ours_tol"]["copies"] == 0
