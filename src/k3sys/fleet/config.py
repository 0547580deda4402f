"""`FleetConfig`: how a `Fleet` places sandboxes, watches its nodes and keeps hibernations safe."""

from __future__ import annotations

import dataclasses

from k3sys.fleet.placement import check_policy
from k3sys.sandbox.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    """`policy`: "spread" or "pack"; `heartbeat_s` between looks at the nodes; a node silent for
    `lost_after_s` is lost; `replicate_hibernated`: copy every hibernation's checkpoint to a second node;
    `info_ttl_s`: a sandbox's info seen (or changed by the fleet) this recently is answered without
    asking its node (the service asks for it on every envd request; 0: always ask). Changes made
    behind the fleet's back (a timeout on the node) show after at most this long."""

    policy: str = "spread"
    heartbeat_s: float = 1.0
    lost_after_s: float = 6.0
    replicate_hibernated: bool = True
    info_ttl_s: float = 0.5

    def __post_init__(self) -> None:
        check_policy(self.policy)
        if not 0 <= self.info_ttl_s <= 60:
            raise InvalidArgumentError(f"info_ttl_s: expected 0-60 s, got {self.info_ttl_s!r}")
        if not 0 < self.heartbeat_s < self.lost_after_s:
            raise InvalidArgumentError(f"expected 0 < heartbeat_s < lost_after_s, got {self.heartbeat_s!r}, "
                                       f"{self.lost_after_s!r}")
