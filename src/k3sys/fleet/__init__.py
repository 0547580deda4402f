"""Sandboxes over many machines on Ray: node actors that own each machine's runtime and store, and
`Fleet`, the runtime-shaped backend the gateway serves (`k3sys fleet gateway`). Needs `k3sys[fleet]`
(ray). See docs/fleet.md."""

from k3sys.fleet.config import FleetConfig
from k3sys.fleet.fleet import Fleet
from k3sys.fleet.moves import Transfer
from k3sys.fleet.node import NodeStats, SandboxNode, node_names, start_node, stop_node
from k3sys.fleet.placement import POLICIES, choose

__all__ = ["POLICIES", "Fleet", "FleetConfig", "NodeStats", "SandboxNode", "Transfer", "choose", "node_names",
           "start_node", "stop_node"]
