"""`k3sys sandbox template ...`: templates from OCI images and Dockerfiles, in the system directory
(`K3SYS_SYSTEM_DIR`, default /opt/k3sys), for every runtime and service of this host.

    k3sys sandbox template import ./layout -t app           # an OCI image layout (oci:DIR[:TAG])
    k3sys sandbox template import image.tar -t app          # `docker save` / OCI archive
    k3sys sandbox template import docker://python:3.12-slim -t py   # a registry, when reachable (skopeo)
    k3sys sandbox template build -f Dockerfile -t web .     # --build-arg K=V, --network
    k3sys sandbox template list
    k3sys sandbox template rm web                          # then its layers no template uses
    k3sys sandbox template prune                           # layers (the build cache) no template uses

docs/templates.md says what each does and what is refused.
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

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Templates from OCI images and Dockerfiles: import, build, list, rm, prune.")
err = Console(stderr=True, soft_wrap=True)
Name = Annotated[str, typer.Option("-t", "--tag", help="The new template's name.")]


def _fail(e: SandboxError) -> typer.Exit:
    err.print(f"[red]error ({e.code}):[/] {escape(str(e))}", highlight=False)
    return typer.Exit(e.exit_code)


def _log(line: str) -> None:
    err.print(escape(line), highlight=False)


@app.command("import")
def import_(source: Annotated[str, typer.Argument(help="oci:DIR[:TAG], oci-archive:FILE[:TAG], "
                                                     "docker-archive:FILE, docker://REF, or a DIR / FILE.")],
            name: Name) -> None:
    """Make template NAME from an OCI image: its layers unpacked once (shared with other templates),
    its config (Env, WorkingDir, User, Entrypoint, Cmd) its sandboxes' defaults."""
    from k3sys.sandbox.runtime.oci.catalog import import_image

    try:
        rootfs = import_image(source, name, log=_log)
    except SandboxError as e:
        raise _fail(e) from None
    print(f"{name}\t{rootfs}")


@app.command()
def build(name: Name,
          context: Annotated[Path | None, typer.Argument(help="The build context (COPY / ADD read from it).")] = None,
          file: Annotated[Path, typer.Option("-f", "--file", help="The Dockerfile [CONTEXT/Dockerfile].")] = None,
          build_arg: Annotated[list[str] | None, typer.Option("--build-arg", help="ARG value, K=V (repeat).")]
          = None,
          network: Annotated[bool, typer.Option(help="RUN steps reach the network (docs/sandbox-network.md).")]
          = False,
          memory_mb: Annotated[int, typer.Option(help="Memory of the build sandbox, MiB.")] = 1024,
          timeout: Annotated[float, typer.Option(help="Seconds one RUN may take.")] = 1800) -> None:
    """Build template NAME from a Dockerfile; each step is cached by the hash of its input."""
    from k3sys.sandbox.errors import DockerfileError
    from k3sys.sandbox.runtime.oci.builder import Builder
    from k3sys.sandbox.runtime.oci.dockerfile import read_dockerfile

    path = file or (context or Path(".")) / "Dockerfile"
    try:
        args = dict(a.split("=", 1) if "=" in a else (a, "") for a in build_arg or [])
        try:
            text = path.read_text()
        except OSError as e:
            raise DockerfileError(f"Dockerfile {path}: {e.strerror or e}") from None
        result = Builder(network=network, memory_mb=memory_mb, run_timeout=timeout, log=_log).build(
            read_dockerfile(text, args), name, context)
    except SandboxError as e:
        raise _fail(e) from None
    ran = sum(s == "ran" for s in result.steps)
    cached = sum(s == "cached" for s in result.steps)
    err.print(f"built {name}: {len(result.layers)} layers, {ran} step(s) ran, {cached} cached, "
              f"{result.seconds:.1f} s", highlight=False)
    print(name)


@app.command("list")
def list_() -> None:
    """Templates with their layers and bytes (a layer shared by several is counted in each)."""
    from k3sys.sandbox.runtime.oci.catalog import list_templates

    table = Table(box=box.SIMPLE)
    for col in ("name", "layers", "MiB", "built", "source"):
        table.add_column(col)
    for t in list_templates():
        built = f"{datetime.fromtimestamp(t.built):%Y-%m-%d %H:%M}" if t.built else "-"
        table.add_row(escape(t.name), str(t.layers or "-"), f"{t.bytes / 2**20:.1f}" if t.layers else "-", built,
                      escape(t.source))
    Console().print(table)


@app.command()
def rm(names: Annotated[list[str], typer.Argument(help="Templates to remove.")]) -> None:
    """Remove templates (none that a live sandbox or a kept checkpoint stands on: they need it), then
    every layer no template uses."""
    from k3sys.sandbox.runtime.oci.catalog import remove

    try:
        for name in names:
            gone = remove(name)
            err.print(f"removed {name} ({len(gone)} layer(s) no other template used)", highlight=False)
    except SandboxError as e:
        raise _fail(e) from None


@app.command()
def prune() -> None:
    """Remove the layers no template uses (the build cache among them)."""
    from k3sys.sandbox.runtime.oci.catalog import collect
    from k3sys.sandbox.runtime.templates import templates_lock

    with templates_lock():
        gone = collect()
    err.print(f"removed {len(gone)} layer(s)", highlight=False)
