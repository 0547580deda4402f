"""The agent of a sandbox (agent.py) as the runtime's parts call it: through the driver, as the
sandbox's template defaults (user, env, cwd), and made again when a checkpoint cut the call."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from k3sys.sandbox.errors import AgentError, AgentInterruptedError
from k3sys.sandbox.runtime.agent import Agent
from k3sys.sandbox.runtime.drivers.base import Driver
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.runtime.templates import template_defaults

T = TypeVar("T")


class Agents:
    """The agents of the sandboxes in `table`, reached through `driver`."""

    def __init__(self, table: SandboxTable, driver: Driver) -> None:
        self.table = table
        self.driver = driver

    def get(self, sid: str) -> Agent:
        """The sandbox's agent; AgentError once it is killed."""
        rec = self.table.get(sid)
        if rec is None:  # killed: its agent went with it
            raise AgentError(f"sandbox agent: sandbox {sid} is gone")
        agent = self.driver.agent(sid, self.table.dirs(sid))
        d = template_defaults(rec.spec.template)  # calls naming no user / cwd take the template's, and its env
        agent.user, agent.env, agent.cwd = d.user, d.env, d.cwd
        return agent

    def cwd(self, sid: str) -> str | None:
        """Where a command of the sandbox that names no directory starts (its template's `cwd`)."""
        rec = self.table.get(sid)
        return template_defaults(rec.spec.template).cwd if rec is not None else None

    def retrying(self, sid: str, call: Callable[[Agent], T], deadline: float | None = None) -> T:
        """`call(agent)` on the sandbox's agent, made again when a checkpoint cut it (the agent's gate
        holds the retry until the sandbox runs again); `deadline` in monotonic seconds."""
        while True:
            try:
                return call(self.get(sid))
            except AgentInterruptedError:
                if deadline is not None and time.monotonic() > deadline:
                    raise
