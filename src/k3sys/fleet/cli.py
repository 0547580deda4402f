"""`k3sys fleet`: join a machine to a fleet, list the nodes, serve the gateway (see docs/fleet.md).

    ray start --head                                    # one machine: the Ray head
    ray start --address HEAD:6379                       # every other machine
    k3sys fleet node --name n1 --home /var/lib/k3sys    # on each machine: its node actor
    k3sys fleet gateway --host 0.0.0.0                  # anywhere in the cluster: the E2B endpoint
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Sandboxes over many machines on Ray (needs k3sys\\[fleet]).")
err = Console(stderr=True)
Address = Annotated[str, typer.Option(help="Ray cluster address (HOST:PORT, or auto: the local `ray start`).")]


# How long a HOST:PORT may take to accept a TCP connection before we call the cluster unreachable:
# ray.init itself retries an unreachable address for minutes.
CONNECT_TIMEOUT_S = 5.0


def _fail(message: str) -> NoReturn:
    err.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def connect(address: str) -> None:
    """Join the Ray cluster at `address` (HOST:PORT, ray://HOST:PORT or auto) as a driver; without ray, or
    with no cluster answering there within CONNECT_TIMEOUT_S, print one line naming the problem and exit 1."""
    try:
        import ray
    except ImportError:
        _fail("the fleet needs ray, which is not installed: pip install 'k3sys[fleet]'")
    from k3sys.fleet.node import NAMESPACE

    if address != "auto":
        host, _, port = address.rpartition("://")[2].rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except (OSError, ValueError) as e:
            _fail(f"no Ray cluster at {address} (within {CONNECT_TIMEOUT_S:g} s: {e})")
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
    except ConnectionError as e:
        _fail(f"no Ray cluster at {address} ({str(e).splitlines()[0]}); start one with `ray start --head`")


@app.command()
def node(name: Annotated[str, typer.Option(help="The node's name in the fleet.")] = os.uname().nodename.lower(),
         home: Annotated[Path | None, typer.Option(envvar="K3SYS_HOME", help="Runtime directory of this node.")]
         = None,
         address: Address = "auto",
         capacity_mb: Annotated[int | None, typer.Option(help="Memory sandboxes may reserve here, MiB; "
                                                              "default: the host's RAM.")] = None) -> None:
    """Join this machine to the fleet: start its node actor (detached; it outlives this command)."""
    connect(address)
    from k3sys.fleet.node import start_node
    from k3sys.sandbox.errors import SandboxError
    from k3sys.sandbox.runtime.runtime import default_root

    try:
        handle = start_node(name, home or default_root(), capacity_mb=capacity_mb)
    except (SandboxError, ValueError) as e:
        err.print(f"[red]error:[/] {e}", highlight=False)
        raise typer.Exit(1) from None
    import ray

    s = ray.get(handle.stats.remote())
    err.print(f"node {s.name} on {s.host}: {s.cpus} cpus, {s.free_mb} MiB free, {s.disk_free_mb} MiB disk",
              highlight=False)


@app.command("nodes")
def nodes(address: Address = "auto") -> None:
    """The fleet's nodes and what each reports."""
    connect(address)
    from k3sys.fleet import Fleet

    fleet = Fleet()
    t = Table("node", "host", "cpus free", "MiB free", "disk MiB", "sandboxes")
    for name, s in sorted(fleet.nodes().items()):
        if isinstance(s, str):
            t.add_row(name, f"[red]lost: {s}[/red]", "", "", "", "")
        else:
            t.add_row(name, s.host, f"{s.free_cpus:g}/{s.cpus}", str(s.free_mb), str(s.disk_free_mb),
                      ", ".join(f"{k} {v}" for k, v in sorted(s.sandboxes.items())) or "-")
    fleet.close()
    Console().print(t)


@app.command()
def gateway(address: Address = "auto",
            host: Annotated[str, typer.Option(help="Address to listen on (beyond loopback only with a key).")]
            = "127.0.0.1",
            port: Annotated[int, typer.Option(help="TCP port (E2B's API port).")] = 3000,
            data_dir: Annotated[Path | None, typer.Option(help="The gateway's own directory (API key, "
                                                               "sandbox attributes).")] = None,
            policy: Annotated[str, typer.Option(help="Placement: spread or pack.")] = "spread",
            no_auth: Annotated[bool, typer.Option("--no-auth", help="No API key (loopback only).")] = False,
            log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning") -> None:
    """Serve the sandbox API (E2B's protocol) over every node of the fleet until SIGINT/SIGTERM."""
    connect(address)
    from k3sys.fleet.fleet import FleetConfig
    from k3sys.fleet.gateway import gateway_config, serve
    from k3sys.sandbox.errors import SandboxError
    from k3sys.sandbox.runtime.runtime import default_root
    from k3sys.sandbox.service.auth import load_or_create_key

    root = data_dir or default_root() / "gateway"
    try:
        root.mkdir(parents=True, exist_ok=True)
        key = None if no_auth else load_or_create_key(root)
        err.print(f"k3sys fleet gateway on http://{host}:{port} (Ray {address}, {policy})", highlight=False)
        serve(gateway_config(root, key), address, FleetConfig(policy=policy), host, port, log_level)
    except SandboxError as e:
        err.print(f"[red]error ({e.code}):[/] {e}", highlight=False)
        raise typer.Exit(1) from None
