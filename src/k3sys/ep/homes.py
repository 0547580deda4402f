"""Which experts live at home on which rank: the one place that decides it.

E experts over R ranks (R <= E), contiguous and as even as possible: rank r holds experts
[floor(r * E / R), floor((r + 1) * E / R)), so every rank holds floor(E / R) or ceil(E / R) of them and
the larger ranks are spread evenly (K3's E = 896 on R = 256 ranks alternates 3 and 4; on R = 3, E = 16
gives 5, 5, 6). When R divides E this is the plain `e // (E / R)`. epn = ceil(E / R), the most homes
on any rank, sizes the per-rank tables: `[R, epn]` home slots (the short ranks' last slot empty) and
epn replica slots per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Homes"]


@dataclass(frozen=True)
class Homes:
    """The home layout of `num_experts` experts over `num_ranks` ranks."""

    num_experts: int
    num_ranks: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_ranks <= self.num_experts:
            raise ValueError(f"need 1 <= R <= E, got R={self.num_ranks}, E={self.num_experts}")

    @property
    def epn(self) -> int:
        """The most home experts on any rank (and the replica slots per rank)."""
        return -(-self.num_experts // self.num_ranks)

    @property
    def even(self) -> bool:
        return self.num_experts % self.num_ranks == 0

    def start(self, rank: int) -> int:
        """First home expert of `rank`."""
        return rank * self.num_experts // self.num_ranks

    def count(self, rank: int) -> int:
        """Home experts of `rank` (epn or epn - 1)."""
        return self.start(rank + 1) - self.start(rank)

    def experts_of(self, rank: int) -> range:
        """Global ids of `rank`'s home experts."""
        return range(self.start(rank), self.start(rank + 1))

    def rank_of(self, expert: torch.Tensor | int) -> torch.Tensor | int:
        """Home rank of each expert id: the largest r with floor(r * E / R) <= e."""
        return ((expert + 1) * self.num_ranks - 1) // self.num_experts

    def local(self, expert: torch.Tensor | int) -> torch.Tensor | int:
        """Index of each expert among its home rank's experts (its home group)."""
        return expert - (self.rank_of(expert) * self.num_experts) // self.num_ranks

    def slots(self, device: torch.device | str | None = None) -> torch.Tensor:
        """`[R, epn]` int64 expert id in each home slot; E (one past the last id) in an empty slot."""
        R, E, epn = self.num_ranks, self.num_experts, self.epn
        start = torch.arange(R, device=device) * E // R
        ids = start.view(R, 1) + torch.arange(epn, device=device)
        end = torch.arange(1, R + 1, device=device) * E // R
        return torch.where(ids < end.view(R, 1), ids, E)

    def group_sum(self, per_expert: torch.Tensor) -> torch.Tensor:
        """`[..., E]` -> `[..., R]`: the sum over each rank's home experts."""
        out = per_expert.new_zeros(*per_expert.shape[:-1], self.num_ranks)
        rank = self.rank_of(torch.arange(self.num_experts, device=per_expert.device))
        return out.index_add_(-1, rank, per_expert)
