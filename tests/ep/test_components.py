"""The exact components the device planner lays out first (ep/components.py): each one found really
closes on both sides, none shares an item, and on random routings the device plan then uses at most
the greedy's copies (issue 29, EP 2), moving the lower bound."""

from __future__ import annotations

import pytest
import torch

from k3sys.ep import plan
from k3sys.ep.components import components_first
from k3sys.ep.device_match import _equal_first
from k3sys.ep.routing import make_routing, tokens_per_expert

torch.set_num_threads(1)


def _blocks(surplus: torch.Tensor, room: torch.Tensor) -> tuple[int, list[tuple[list[int], list[int]]]]:
    """(the line's closing points, the components: where both lines' prefix sums meet)."""
    s_order, r_order = components_first(surplus, room, *_equal_first(surplus, room))
    u, t = surplus[s_order].cumsum(0).tolist(), room[r_order].cumsum(0).tolist()
    meets = sorted(set(u) & set(t) - {0})
    blocks, i, j = [], 0, 0
    for m in meets:
        i2, j2 = u.index(m) + 1, t.index(m) + 1
        blocks.append((s_order[i:i2].tolist(), r_order[j:j2].tolist()))
        i, j = i2, j2
    return len(meets), blocks


@pytest.mark.parametrize("surplus, room, expected", [
    # 7 = 4 + 3 and 11 = 5 + 6: two 1:2 components (without them the lines meet only at the end).
    ([7, 0, 0, 11, 0, 0], [0, 4, 3, 0, 5, 6], [({0}, {1, 2}), ({3}, {4, 5})]),
    # 2 + 3 = 5 (2:1) beside 4 = 4 (1:1, first as before).
    ([2, 3, 0, 4, 0, 0], [0, 0, 5, 0, 4, 0], [({3}, {4}), ({0, 1}, {2})]),
    # 9 = 6 + 2 + 1 (1:3), found at this small R.
    ([9, 0, 0, 0], [0, 6, 2, 1], [({0}, {1, 2, 3})]),
])
def test_components_close_exactly_and_share_nothing(surplus, room, expected):
    _, blocks = _blocks(torch.tensor(surplus), torch.tensor(room))
    assert [(set(s), set(r)) for s, r in blocks] == expected


@pytest.mark.parametrize("R, E", [(8, 64), (16, 128), (32, 256), (128, 896)])
def test_random_routings_use_at_most_the_greedys_copies(R, E):
    """Random routings (before the components the device plan used 3.7% more copies than the greedy in
    total, more at 54 of 80 points); docs/ep.md has the 240-point sweep."""
    ours = greedy = 0
    for maxvio in (0.5, 1.0, 2.0):
        tpe = tokens_per_expert(make_routing(R, 256, E, 16, maxvio, seed=1), E)
        p, g = plan(tpe, 16), plan(tpe, 16, strategy="greedy")
        assert p.moved_tokens == p.moved_lower_bound
        assert p.num_copies <= g.num_copies, (maxvio, p.num_copies, g.num_copies)
        ours, greedy = ours + p.num_copies, greedy + g.num_copies
    assert ours <= greedy and (R < 32 or ours < greedy)  # at R=8 both often reach n + m - 1
