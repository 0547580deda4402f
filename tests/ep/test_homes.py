"""The home layout: which experts live on which rank, even and uneven."""

from __future__ import annotations

import pytest
import torch

from k3sys.ep import baselines
from k3sys.ep.homes import Homes


def test_homes_spread_the_fuller_ranks():
    assert [Homes(7, 2).experts_of(r) for r in range(2)] == [range(0, 3), range(3, 7)]
    assert [Homes(6, 4).count(r) for r in range(4)] == [1, 2, 1, 2]
    assert Homes(896, 256).epn == 4 and sum(Homes(896, 256).count(r) == 4 for r in range(256)) == 128
    experts = torch.arange(896)
    rank = Homes(896, 256).rank_of(experts)
    assert torch.equal(rank, torch.repeat_interleave(torch.arange(256), torch.tensor([3, 4] * 128)))
    assert torch.equal(Homes(896, 256).local(experts), experts - torch.tensor([r * 896 // 256 for r in rank]))
    # static placement sums each rank's home experts, uneven homes included
    tpe = torch.arange(1, 15).view(2, 7)  # R=2 sources, E=7
    assert baselines.static(tpe).loads.tolist() == [9 + 11 + 13, 15 + 17 + 19 + 21]
    assert torch.equal(Homes(7, 2).group_sum(tpe), torch.tensor([[6, 22], [27, 50]]))
    with pytest.raises(ValueError, match=r"need 1 <= R <= E, got R=5, E=4"):
        Homes(4, 5)


@pytest.mark.parametrize("E, R", [(16, 3), (896, 256), (896, 64), (7, 7), (5, 1)])
def test_homes_tables_agree(E, R):
    homes = Homes(E, R)
    slots = homes.slots()
    assert slots.shape == (R, homes.epn)
    for r in range(R):
        ids = homes.experts_of(r)
        assert slots[r].tolist() == [*ids] + [E] * (homes.epn - len(ids))
        assert all(homes.rank_of(e) == r and homes.local(e) == i for i, e in enumerate(ids))
    assert sorted(homes.count(r) for r in range(R)) in ([E // R] * R, sorted([E // R, -(-E // R)] * R)[:0] or
                                                         sorted(homes.count(r) for r in range(R)))
    assert {homes.count(r) for r in range(R)} <= {E // R, -(-E // R)} and sum(map(homes.count, range(R))) == E
