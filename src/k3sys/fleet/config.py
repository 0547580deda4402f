"""`FleetConfig`: how a `Fleet` places sandboxes, watches its nodes and keeps hibernations safe."""

from __future__ import annotations

import dataclasses

from k3sys.fleet.placement import check_policy
from k3sys.sandbox.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    """`policy`: "spread" or "pack"; `heartbeat_s` between looks at the nodes; a node silent for
    `lost_after_s` is lost; `replicate_hibernated`: copy every hibernation's checkpoint to a second node."""

    policy: str = "spread"
    heartbeat_s: float = 1.0
    lost_after_s: float = 6.0
    replicate_hibernated: bool = True

    def __post_init__(self) -> None:
        check_policy(self.policy)
        if not 0 < self.heartbeat_s < self.lost_after_s:
            raise InvalidArgumentError(f"expected 0 < heartbeat_s < lost_after_s, got {self.heartbeat_s!r}, "
                                       f"{self.lost_after_s!r}")
