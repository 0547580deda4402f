"""One real local Ray cluster for the fleet's tests: three nodes on this machine (`ray.cluster_utils`),
each with a custom resource that pins its node actor and its own runtime directory; a `Fleet` over
them and the gateway (the sandbox service over the fleet) on 127.0.0.1. Shared by every test of the
session: starting Ray costs ~15 s here. At the end every sandbox of every node is killed and nothing
may be left behind."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandbox"))  # sandbox_fixtures

from sandbox_fixtures import MISSING, leftovers  # noqa: E402
from waiting import wait_until

ray = pytest.importorskip("ray", reason="the fleet needs ray: pip install 'k3sys[fleet]'")

NODES = ("n0", "n1", "n2")
CAPACITY_MB = 8192  # per node: room for the tests' sandboxes, equal so that placement is predictable


@dataclass
class LocalCluster:
    """The test cluster: Ray's `Cluster`, each node's runtime directory, the Ray node of each."""

    cluster: object
    homes: dict[str, Path]
    raynodes: dict[str, object]

    def add(self, name: str, root: Path) -> object:
        """One more Ray node with a node actor `name` on it (runtime directory under `root`)."""
        from k3sys.fleet import start_node

        self.raynodes[name] = self.cluster.add_node(num_cpus=1, resources={f"k3sys_node_{name}": 1})
        self.cluster.wait_for_nodes()
        self.homes[name] = root / name
        return start_node(name, self.homes[name], resource=f"k3sys_node_{name}", capacity_mb=CAPACITY_MB)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    from ray.cluster_utils import Cluster

    from k3sys.fleet import start_node

    root = tmp_path_factory.mktemp("fleet")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"k3sys_node_n0": 1},
                                                      "include_dashboard": False})
    lc = LocalCluster(c, {"n0": root / "n0"}, {"n0": c.head_node})
    ray.init(address=c.address, namespace="k3sys", log_to_driver=False)
    start_node("n0", lc.homes["n0"], resource="k3sys_node_n0", capacity_mb=CAPACITY_MB)
    for name in NODES[1:]:
        lc.add(name, root)
    try:
        yield lc
    finally:
        from k3sys.fleet import stop_node
        from k3sys.sandbox import Runtime

        for name in list(lc.homes):
            with contextlib.suppress(Exception):  # a node the tests killed: its sandboxes are cleaned below
                stop_node(name, kill_sandboxes=True)
        ray.shutdown()
        c.shutdown()
        for home in lc.homes.values():  # sandboxes of killed nodes outlive them on this one machine
            if home.exists():
                with Runtime(home) as rt:
                    rt.kill_all()
        for name, home in lc.homes.items():
            assert [x for x in leftovers(home) if "sandbox dir" not in x] == [], name


@pytest.fixture(scope="session")
def fleet(cluster):
    from k3sys.fleet import Fleet, FleetConfig

    f = Fleet(config=FleetConfig(heartbeat_s=0.5, lost_after_s=4.0))
    yield f
    f.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gateway(fleet, tmp_path_factory) -> Iterator[str]:
    """The gateway's URL: the sandbox service over `fleet`, served by uvicorn in a thread of this
    process (the Ray driver)."""
    import uvicorn

    from k3sys.fleet.gateway import gateway_app, gateway_config, gateway_protocol

    port = _free_port()
    app = gateway_app(gateway_config(tmp_path_factory.mktemp("gw"), api_key=None), fleet)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                           http=gateway_protocol(app)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the gateway starting", step=0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)
