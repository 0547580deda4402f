"""A template's start command, run when a sandbox of it is created (the cold path).

A template whose template.json names `start_cmd` (E2B's set_start_cmd(start, ready)) gets it started
detached, as the template's default user in that user's home, right after `create`; `create` returns
once `ready_cmd` exits 0, or fails with TemplateStartError (the sandbox killed) when the start command
exits first or `READY_TIMEOUT_S` passes. The check is tried after POLL_S, then less and less often,
up to every POLL_MAX_S: each try is a process in the sandbox, competing for its CPU with the start
it waits on. No `ready_cmd`: create returns once the start command is started. Restores and forks
start nothing: the server is in their memory.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from k3sys.sandbox.errors import CommandTimeoutError, SandboxError, TemplateStartError
from k3sys.sandbox.runtime.commands import CommandService
from k3sys.sandbox.runtime.templates import template_start

READY_TIMEOUT_S = 120.0  # a cold start of a kernel under heavy load; a healthy one takes about a second
POLL_S = 0.01  # s before the second ready check; each next wait is 1.5 times longer ...
POLL_MAX_S = 0.1  # ... up to this


def start_template(commands: CommandService, kill: Callable[[str], None], sid: str, template: str,
                   timeout_s: float | None = None) -> None:
    """Start template `template`'s start command in sandbox `sid` and wait until it is ready, at most
    `timeout_s` (None: READY_TIMEOUT_S) seconds (see the module docstring); on failure kill `sid` and
    raise TemplateStartError."""
    plan = template_start(template)
    if plan is None:
        return
    start, ready = plan
    try:
        cid = commands.start_process(sid, start)
        if ready is not None:
            _wait_ready(commands, cid, sid, template, start, ready, time.monotonic() + (timeout_s or READY_TIMEOUT_S))
        commands.forget_command(cid)  # it runs on, a process of the sandbox like any other
    except BaseException:
        with contextlib.suppress(SandboxError):
            kill(sid)
        raise


def _wait_ready(commands: CommandService, cid: str, sid: str, template: str, start: str, ready: str,
                deadline: float) -> None:
    wait = POLL_S
    while True:
        with contextlib.suppress(CommandTimeoutError):
            if commands.run(sid, ready, timeout=max(1.0, deadline - time.monotonic())).exit_code == 0:
                return
        if not commands.command_running(cid):
            out, err = commands.command_output(cid)
            raise TemplateStartError(f"template {template!r}: its start command {start!r} exited before "
                                     f"{ready!r} passed; its output ends: {(out + err)[-1500:]!r}")
        if time.monotonic() > deadline:
            raise TemplateStartError(f"template {template!r}: {ready!r} did not pass within the start's bound "
                                     f"after {start!r} was started")
        time.sleep(wait)
        wait = min(wait * 1.5, POLL_MAX_S)
