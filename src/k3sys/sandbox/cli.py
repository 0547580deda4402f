"""`k3sys sandbox ...`: sandboxes from the shell, embedded (the runtime directory `--data-dir`, default
`K3SYS_HOME` or ~/.local/share/k3sys) or against a service (`--api-url`, `K3SYS_API_URL`; key from
`--api-key` or `K3SYS_API_KEY`).

    k3sys sandbox serve --host 127.0.0.1 --port 3000 --data-dir DIR
    SID=$(k3sys sandbox create --memory-mb 256)
    k3sys sandbox exec $SID 'echo hi > /tmp/f'; k3sys sandbox cp $SID:/tmp/f ./f
    CK=$(k3sys sandbox checkpoint $SID); k3sys sandbox fork $SID -n 2; k3sys sandbox restore $CK
    k3sys sandbox ls; k3sys sandbox kill $SID
    k3sys sandbox keys add --tenant alice     # a tenant's API key for the service (cli_keys.py)
    k3sys sandbox template build -f Dockerfile -t web .   # templates from images, Dockerfiles (cli_templates.py)

Results meant for scripts (ids, file contents, command output) go to stdout, everything else to
stderr. Exit codes:

    0  success                         4  wrong state for the operation (e.g. exec in a paused sandbox)
    1  any other sandbox error         5  API key refused
    2  bad arguments (host files too)  6  the service is at a limit (sandboxes, memory): retry later
    3  no such sandbox/checkpoint/file 7  the service (or runtime directory) is unavailable or busy
    exec: the command's own exit code; 124 if it ran past --timeout; 125 if k3sys failed to run it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from k3sys.sandbox.cli_keys import app as keys_app
from k3sys.sandbox.cli_templates import app as templates_app
from k3sys.sandbox.egress import EgressPolicy
from k3sys.sandbox.errors import (
    CommandExitError,
    CommandTimeoutError,
    RuntimeLockedError,
    SandboxError,
    error_classes,
)
from k3sys.sandbox.sdk.api import Backend, Checkpoint, Sandbox

# The classes with an exit code of their own (each error class carries it: `SandboxError.exit_code`).
EXIT_CODES: dict[type[SandboxError], int] = {c: c.exit_code for c in error_classes() if c.exit_code != 1}
EXEC_TIMEOUT, EXEC_FAILED = 124, 125

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Agent sandboxes: create, exec, cp, pause, resume, hibernate, checkpoint, fork, restore, "
                       "kill; `serve` runs the HTTP service.")
err = Console(stderr=True, soft_wrap=True)  # messages stay one line in logs
app.add_typer(keys_app, name="keys")
app.add_typer(templates_app, name="template")

ApiUrl = Annotated[str | None, typer.Option("--api-url", envvar="K3SYS_API_URL",
                                            help="A sandbox service; default: the embedded runtime.")]
ApiKey = Annotated[str | None, typer.Option("--api-key", envvar="K3SYS_API_KEY", show_envvar=True,
                                            help="The service's API key.")]
DataDir = Annotated[Path | None, typer.Option("--data-dir", envvar="K3SYS_HOME",
                                              help="Runtime directory (embedded use, and `serve`).")]


def exit_code(e: SandboxError) -> int:
    """The documented exit code of an error (see the module docstring)."""
    return e.exit_code


@contextlib.contextmanager
def _backend(api_url: str | None, api_key: str | None, data_dir: Path | None,
             failure_code: int | None = None) -> Iterator[Backend]:
    """The backend for one command; errors become a message on stderr and the documented exit code."""
    try:
        if api_url:
            from k3sys.sandbox.sdk.client import HTTPBackend

            with HTTPBackend(api_url, api_key) as backend:
                yield backend
        else:
            from k3sys.sandbox.runtime.runtime import Runtime

            # Sandboxes outlive this process; the next runtime (or `serve`) on the directory adopts them.
            with Runtime(data_dir) as runtime:
                yield runtime
    except RuntimeLockedError as e:
        err.print(f"[red]error:[/] {e} (is `k3sys sandbox serve` using it? then pass --api-url)")
        raise typer.Exit(failure_code or exit_code(e)) from None
    except SandboxError as e:
        err.print(f"[red]error ({e.code}):[/] {e}", markup=True, highlight=False)
        raise typer.Exit(failure_code or exit_code(e)) from None


def _busy(what: str) -> Any:
    """A spinner on stderr for an operation that may take a while."""
    return err.status(what, spinner="dots")


@app.command()
def create(template: Annotated[str, typer.Option(help="Template name.")] = "busybox",
           cpu: Annotated[float, typer.Option(help="CPU cores.")] = 1.0,
           memory_mb: Annotated[int, typer.Option(help="Memory limit, MiB.")] = 512,
           pids: Annotated[int, typer.Option(help="Most tasks at once.")] = 256,
           network: Annotated[bool, typer.Option(help="Own network with NAT out (default: loopback only).")] = False,
           allow_out: Annotated[list[str] | None, typer.Option(help="With --network: reachable CIDR / host.")] = None,
           deny_out: Annotated[list[str] | None, typer.Option(help="With --network: unreachable CIDR / host.")] = None,
           timeout_s: Annotated[float | None, typer.Option(help="Lifetime in seconds.")] = None,
           on_timeout: Annotated[str | None, typer.Option(help="hibernate or kill.")] = None,
           id: Annotated[str | None, typer.Option("--id", help="Choose the id.")] = None,
           api_url: ApiUrl = None, api_key: ApiKey = None, data_dir: DataDir = None) -> None:
    """Start a sandbox; prints its id."""
    with _backend(api_url, api_key, data_dir) as rt, _busy("creating"):
        egress = EgressPolicy(tuple(allow_out or ()), tuple(deny_out or ())) if allow_out or deny_out else None
        s = Sandbox.create(template, cpu=cpu, memory_mb=memory_mb, pids=pids, network=network, timeout_s=timeout_s,
                           on_timeout=on_timeout, id=id, egress=egress, runtime=rt)
    print(s.id)


def _when(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


@app.command("ls")
def list_(checkpoints: Annotated[bool, typer.Option("--checkpoints", help="List checkpoints instead.")] = False,
          as_json: Annotated[bool, typer.Option("--json", help="JSON on stdout instead of a table.")] = False,
          api_url: ApiUrl = None, api_key: ApiKey = None, data_dir: DataDir = None) -> None:
    """List sandboxes (or checkpoints) with their states."""
    with _backend(api_url, api_key, data_dir) as rt:
        infos = rt.checkpoints() if checkpoints else rt.list()
    if as_json:
        print(json.dumps([asdict(i) for i in infos], indent=1))
        return
    table = Table(box=box.SIMPLE_HEAD)
    if checkpoints:
        for name in ("checkpoint", "parent", "sandbox", "template", "created", "MiB total", "MiB new"):
            table.add_column(name, no_wrap=True)
        for c in infos:
            table.add_row(c.id, c.parent or "-", c.sandbox_id, c.template, _when(c.created),
                          f"{c.bytes_total / 2**20:.1f}", f"{c.bytes_new / 2**20:.1f}")
    else:
        for name in ("sandbox", "state", "template", "cpu", "MiB", "created", "checkpoint", "note"):
            table.add_column(name, no_wrap=name != "note")
        for s in infos:
            table.add_row(s.id, s.state, s.spec.template, f"{s.spec.cpu:g}", str(s.spec.memory_mb), _when(s.created),
                          s.head or "-", s.reason)
    # Piped output keeps whole ids (a terminal's width would fold them).
    Console(width=None if sys.stdout.isatty() else 250).print(table)


def _split_env(env: list[str] | None) -> dict[str, str]:
    out = {}
    for item in env or []:
        k, sep, v = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--env")
        out[k] = v
    return out


@app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_(sid: Annotated[str, typer.Argument(help="Sandbox id.")],
          cmd: Annotated[list[str], typer.Argument(help="Command; words are joined with spaces for `sh -c`, "
                                                        "as ssh does.")],
          timeout: Annotated[float, typer.Option(help="Seconds before the command is killed.")] = 60.0,
          cwd: Annotated[str | None, typer.Option(help="Working directory in the sandbox.")] = None,
          env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE (repeatable).")] = None,
          stream: Annotated[bool, typer.Option(help="Print output as it comes instead of at the end.")] = False,
          api_url: ApiUrl = None, api_key: ApiKey = None, data_dir: DataDir = None) -> None:
    """Run a shell command in a sandbox; exits with its exit code. Options go before SID."""
    if cmd[0].startswith("-"):  # an option after SID would become the command (as in `docker exec`)
        err.print(f"[red]error:[/] {escape(repr(cmd[0]))} comes after SID: options go before it "
                  "(k3sys sandbox exec [OPTIONS] SID COMMAND...)", highlight=False)
        raise typer.Exit(2)
    variables = _split_env(env)
    with _backend(api_url, api_key, data_dir, failure_code=EXEC_FAILED) as rt:
        s = Sandbox(rt, sid)
        try:
            result = _run_streaming(s, " ".join(cmd), timeout, cwd, variables) if stream else \
                s.commands.run(" ".join(cmd), timeout=timeout, cwd=cwd, env=variables)
        except CommandExitError as e:  # a non-zero exit: the CLI exits with it
            result = e
        except CommandTimeoutError as e:
            sys.stdout.write(e.stdout)
            sys.stderr.write(e.stderr)
            err.print(f"[red]error:[/] {e}")
            raise typer.Exit(EXEC_TIMEOUT) from None
    if not stream:
        sys.stdout.write(result.stdout)
        sys.stderr.write(result.stderr)
    code = result.exit_code
    raise typer.Exit(code if code >= 0 else 128 - code)


def _run_streaming(s: Sandbox, cmd: str, timeout: float, cwd: str | None, env: dict[str, str]) -> Any:
    h = s.commands.run(cmd, cwd=cwd, env=env, background=True)
    timed_out = threading.Event()

    def expire() -> None:
        timed_out.set()
        with contextlib.suppress(SandboxError):
            h.kill()

    timer = threading.Timer(timeout, expire)
    timer.start()
    try:
        for name, text in h.stream():
            (sys.stdout if name == "stdout" else sys.stderr).write(text)
            (sys.stdout if name == "stdout" else sys.stderr).flush()
        result = h.wait(timeout=timeout)
    except CommandExitError as e:
        result = e
    finally:
        timer.cancel()
    if timed_out.is_set():
        raise CommandTimeoutError(f"command ran past {timeout:g} s and was killed")
    return result


def _sandbox_path(arg: str) -> tuple[str, str] | None:
    """`SID:/path` -> (SID, /path); a host path -> None."""
    sid, sep, path = arg.partition(":")
    return (sid, path) if sep and path.startswith("/") and "/" not in sid else None


@app.command()
def cp(src: Annotated[str, typer.Argument(help="SID:/path or a host path ('-': stdin).")],
       dst: Annotated[str, typer.Argument(help="SID:/path or a host path ('-': stdout).")],
       api_url: ApiUrl = None, api_key: ApiKey = None, data_dir: DataDir = None) -> None:
    """Copy a file into or out of a sandbox."""
    s_src, s_dst = _sandbox_path(src), _sandbox_path(dst)
    if (s_src is None) == (s_dst is None):
        raise typer.BadParameter("exactly one of SRC and DST must be SID:/path")
    with _host_errors(), _backend(api_url, api_key, data_dir) as rt:
        if s_dst is not None:
            with contextlib.nullcontext(sys.stdin.buffer) if src == "-" else open(src, "rb") as f:
                n = rt.write_file(s_dst[0], s_dst[1], f)
            err.print(f"{n} bytes -> {dst}")
        else:
            data = Sandbox(rt, s_src[0]).files.read(s_src[1], format="bytes")
            if dst == "-":
                sys.stdout.buffer.write(data)
            else:
                Path(dst).write_bytes(data)
                err.print(f"{len(data)} bytes -> {dst}")


@contextlib.contextmanager
def _host_errors() -> Iterator[None]:
    """A host file that cannot be opened is a bad argument (exit 2): one line naming it, no traceback."""
    try:
        yield
    except OSError as e:
        err.print(f"[red]error:[/] {escape(f'{e.strerror or e}: {e.filename}')}", highlight=False)
        raise typer.Exit(2) from None


def _each(verb: str, sids: list[str], api_url: str | None, api_key: str | None, data_dir: Path | None) -> None:
    with _backend(api_url, api_key, data_dir) as rt, _busy(f"{verb} {' '.join(sids)}"):
        for sid in sids:  # the backend's call, which raises for an unknown id (the SDK's kill answers False)
            getattr(rt, verb)(sid)


Sids = Annotated[list[str], typer.Argument(help="Sandbox ids.")]
Sid = Annotated[str, typer.Argument(help="Sandbox id.")]


@app.command()
def pause(sids: Sids, api_url: ApiUrl = None, api_key: ApiKey = None, data_dir: DataDir = None) -> None:
    """Freeze sandboxes (no CPU; memory kept)."""
    _each("pause", sids, api_url, api_key, data_dir)


@app.command()
def resume(sids: Sids, api_url: ApiUrl = None, api_key: ApiKey = None, data_dir: DataDir = None) -> None:
    """Thaw paused sandboxes or bring hibernated ones back."""
    _each("resume", sids, api_url, api_key, data_dir)


@app.command()
def kill(sids: Sids, api_url: ApiUrl = None, api_key: ApiKey = None, data_dir: DataDir = None) -> None:
    """Kill sandboxes (their checkpoints stay)."""
    _each("kill", sids, api_url, api_key, data_dir)


def _report(ck: Checkpoint) -> None:
    print(ck.id)
    err.print(f"{ck.id}: {ck.bytes_total / 2**20:.1f} MiB, {ck.bytes_new / 2**20:.1f} MiB new"
              + (f", {ck.timings['total'] * 1e3:.0f} ms" if "total" in ck.timings else ""))


@app.command()
def hibernate(sid: Sid, api_url: ApiUrl = None, api_key: ApiKey = None, data_dir: DataDir = None) -> None:
    """Checkpoint and stop a sandbox (memory released); prints the checkpoint id."""
    with _backend(api_url, api_key, data_dir) as rt, _busy(f"hibernating {sid}"):
        ck = Sandbox(rt, sid).hibernate()
    _report(ck)


@app.command()
def checkpoint(sid: Sid, api_url: ApiUrl = None, api_key: ApiKey = None, data_dir: DataDir = None) -> None:
    """Checkpoint a sandbox (it keeps running); prints the checkpoint id."""
    with _backend(api_url, api_key, data_dir) as rt, _busy(f"checkpointing {sid}"):
        ck = Sandbox(rt, sid).checkpoint()
    _report(ck)


@app.command()
def fork(sid: Sid, n: Annotated[int, typer.Option("-n", "--count", help="How many copies.")] = 1,
         api_url: ApiUrl = None, api_key: ApiKey = None, data_dir: DataDir = None) -> None:
    """Copy a running sandbox n times; prints the new ids."""
    with _backend(api_url, api_key, data_dir) as rt, _busy(f"forking {sid} x{n}"):
        kids = Sandbox(rt, sid).fork(n)
    for k in kids:
        print(k.id)


@app.command()
def restore(ck: Annotated[str, typer.Argument(help="Checkpoint id.")],
            id: Annotated[str | None, typer.Option("--id", help="Choose the new sandbox's id.")] = None,
            api_url: ApiUrl = None, api_key: ApiKey = None, data_dir: DataDir = None) -> None:
    """Start a new sandbox from a checkpoint; prints its id."""
    with _backend(api_url, api_key, data_dir) as rt, _busy(f"restoring {ck}"):
        s = Sandbox.restore(ck, id=id, runtime=rt)
    print(s.id)


@app.command()
def serve(host: Annotated[str, typer.Option(help="Address to listen on (beyond loopback only with a key).")]
          = "127.0.0.1",
          port: Annotated[int, typer.Option(help="TCP port (E2B's API port).")] = 3000,
          data_dir: DataDir = None,
          max_sandboxes: Annotated[int, typer.Option(help="Most sandboxes holding memory.")] = 64,
          max_memory_mb: Annotated[int | None, typer.Option(help="Most memory (sum of limits), MiB; "
                                                                 "default: the host's RAM.")] = None,
          max_body_mb: Annotated[float, typer.Option(help="Largest request body, MiB.")] = 256.0,
          max_command_timeout: Annotated[float, typer.Option(help="Longest command timeout, s.")] = 3600.0,
          on_timeout: Annotated[str, typer.Option(help="Default for sandboxes past timeout_s: hibernate or kill.")]
          = "hibernate",
          on_shutdown: Annotated[str, typer.Option(help="On stop, sandboxes holding memory are: "
                                                        "hibernate, keep or kill.")] = "hibernate",
          pause_delay: Annotated[float, typer.Option(help="Seconds from E2B's pause (a freeze, answered at once) "
                                                         "to its background hibernation.")] = 1.0,
          shutdown_timeout: Annotated[float, typer.Option(help="Most seconds a stop spends on --on-shutdown "
                                                              "(the rest is adopted at the next start).")] = 120.0,
          max_connections: Annotated[int, typer.Option(help="Most open connections (past it, the one waiting "
                                                            "longest for a request header goes).")] = 4096,
          max_connections_per_client: Annotated[int, typer.Option(help="Most open connections from one "
                                                                       "client address.")] = 1024,
          header_timeout: Annotated[float, typer.Option(help="Seconds a request header may take.")] = 10.0,
          no_auth: Annotated[bool, typer.Option("--no-auth", help="No API key (loopback only; refused while "
                                                                  "tenant keys exist).")] = False,
          log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "warning") -> None:
    """Serve the sandbox HTTP API until SIGINT/SIGTERM."""
    from k3sys.sandbox.runtime.runtime import default_root
    from k3sys.sandbox.service.auth import KEY_FILE, check_bind, check_open, load_or_create_key
    from k3sys.sandbox.service.guard import ConnectionLimits
    from k3sys.sandbox.service.server import ServiceConfig
    from k3sys.sandbox.service.server import serve as run_server

    root = data_dir or default_root()
    try:
        key = None if no_auth else load_or_create_key(root)
        extra = {"max_memory_mb": max_memory_mb} if max_memory_mb else {}
        config = ServiceConfig(root, key, max_sandboxes=max_sandboxes, max_body_bytes=int(max_body_mb * 2**20),
                               max_command_timeout_s=max_command_timeout, on_timeout=on_timeout,
                               on_shutdown=on_shutdown, pause_delay_s=pause_delay, shutdown_s=shutdown_timeout,
                               **extra,
                               connections=ConnectionLimits(max_connections, header_timeout,
                                                            max_connections_per_client))
        check_bind(host, key)
        check_open(root, key)
        where = "none" if no_auth else "$K3SYS_API_KEY" if os.environ.get("K3SYS_API_KEY") else str(root / KEY_FILE)
        err.print(f"k3sys sandbox service on http://{host}:{port} (data {root}, API key: {where})", highlight=False)
        run_server(config, host, port, log_level)
    except SandboxError as e:
        err.print(f"[red]error ({e.code}):[/] {e}", highlight=False)
        raise typer.Exit(exit_code(e)) from None


if __name__ == "__main__":  # `python -m k3sys.sandbox.cli`: no other design's imports (tests start servers so)
    app()
