"""`k3sys sandbox keys ...`: the service's tenants and their API keys (service/tenants.py), in the
service's data directory (`--data-dir`, default `K3SYS_HOME`); a running service sees changes at once.

    KEY=$(k3sys sandbox keys add --tenant alice --sandboxes 4 --memory-mb 4096)   # printed once
    k3sys sandbox keys list
    k3sys sandbox keys remove 1f2e3d4c5b6a        # one key, by the id `list` shows
    k3sys sandbox keys remove --tenant alice      # the tenant and all its keys
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from k3sys.sandbox.errors import SandboxError
from k3sys.sandbox.service.tenants import Quota, Tenants

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Tenants' API keys for `k3sys sandbox serve` (stored hashed; a key is shown once).")
err = Console(stderr=True, soft_wrap=True)
_DEFAULT = Quota()

DataDir = Annotated[Path | None, typer.Option("--data-dir", envvar="K3SYS_HOME",
                                              help="The service's data directory.")]


def _open(data_dir: Path | None) -> Tenants:
    from k3sys.sandbox.runtime.runtime import default_root

    return Tenants(data_dir or default_root())


def _fail(e: SandboxError) -> typer.Exit:
    err.print(f"[red]error ({e.code}):[/] {escape(str(e))}", highlight=False)
    return typer.Exit(e.exit_code)


@app.command()
def add(tenant: Annotated[str, typer.Option(help="The tenant the key belongs to (made if new).")],
        sandboxes: Annotated[int | None, typer.Option(help=f"Most sandboxes holding memory [{_DEFAULT.sandboxes}].")]
        = None,
        memory_mb: Annotated[int | None, typer.Option(help=f"Most memory, sum of limits, MiB [{_DEFAULT.memory_mb}].")]
        = None,
        disk_mb: Annotated[int | None, typer.Option(help=f"Most disk, sum of disk_mb, MiB [{_DEFAULT.disk_mb}].")]
        = None,
        pids: Annotated[int | None, typer.Option(help=f"Most tasks one sandbox may ask for [{_DEFAULT.pids}].")]
        = None,
        data_dir: DataDir = None) -> None:
    """Make a key for TENANT and print it (only now: it is stored hashed). Quota options set the
    tenant's quota (the rest default); without any, an existing tenant keeps its quota."""
    given = {"sandboxes": sandboxes, "memory_mb": memory_mb, "disk_mb": disk_mb, "pids": pids}
    try:
        quota = Quota(**{k: v for k, v in given.items() if v is not None}) if any(
            v is not None for v in given.values()) else None
        with _open(data_dir) as t:
            key = t.add_key(tenant, quota)
    except SandboxError as e:
        raise _fail(e) from None
    err.print(f"key for tenant {tenant!r} (shown once; stored as its hash):", highlight=False)
    print(key)


@app.command("list")
def list_keys(data_dir: DataDir = None) -> None:
    """The tenants, their quotas and their keys' ids (never the keys)."""
    with _open(data_dir) as t:
        tenants, keys = t.tenants(), t.keys()
    table = Table(box=box.SIMPLE)
    for col in ("tenant", "sandboxes", "memory_mb", "disk_mb", "pids", "keys"):
        table.add_column(col)
    for tn in tenants:
        ids = [f"{k.id} ({datetime.fromtimestamp(k.created):%Y-%m-%d %H:%M})" for k in keys if k.tenant == tn.name]
        q = tn.quota
        table.add_row(tn.name, str(q.sandboxes), str(q.memory_mb), str(q.disk_mb), str(q.pids), "\n".join(ids) or "-")
    Console().print(table)


@app.command()
def remove(key_id: Annotated[str | None, typer.Argument(help="A key's id, as `list` shows it.")] = None,
           tenant: Annotated[str | None, typer.Option(help="Remove this tenant and all its keys instead.")] = None,
           data_dir: DataDir = None) -> None:
    """Remove one key, or a whole tenant (its sandboxes stay; the admin key still reaches them)."""
    if (key_id is None) == (tenant is None):
        err.print("[red]error:[/] give a key id or --tenant, not both or neither")
        raise typer.Exit(2)
    try:
        with _open(data_dir) as t:
            if tenant is not None:
                n = t.remove_tenant(tenant)
                err.print(f"removed tenant {tenant!r} and its {n} key(s)", highlight=False)
            else:
                k = t.remove_key(key_id)
                err.print(f"removed key {k.id} of tenant {k.tenant!r}", highlight=False)
    except SandboxError as e:
        raise _fail(e) from None
