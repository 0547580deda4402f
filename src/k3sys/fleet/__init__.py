"""Sandboxes over many machines on Ray: node actors that own each machine's runtime and store, and
`Fleet`, the runtime-shaped backend the gateway serves (`k3sys fleet gateway`). Needs `k3sys[fleet]`
(ray). See docs/fleet.md.

The exports load on first access, so `k3sys fleet --help` (fleet/cli.py) starts where ray is missing."""

from typing import TYPE_CHECKING

from k3sys._lazy import lazy_exports

if TYPE_CHECKING:
    from k3sys.fleet.config import FleetConfig
    from k3sys.fleet.fleet import Fleet
    from k3sys.fleet.moves import Transfer
    from k3sys.fleet.node import NodeStats, SandboxNode, node_names, start_node, stop_node
    from k3sys.fleet.placement import POLICIES, choose

_EXPORTS = {"FleetConfig": "config", "Fleet": "fleet", "Transfer": "moves", "NodeStats": "node",
            "SandboxNode": "node", "node_names": "node", "start_node": "node", "stop_node": "node",
            "POLICIES": "placement", "choose": "placement"}
__all__ = ["POLICIES", "Fleet", "FleetConfig", "NodeStats", "SandboxNode", "Transfer", "choose", "node_names",
           "start_node", "stop_node"]
__getattr__ = lazy_exports(__name__, _EXPORTS)
