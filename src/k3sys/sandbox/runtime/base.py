"""What the runtime's mixins (commands.py, files.py, checkpoints.py, sealed.py, recovery.py) share:
the parts they work with (`table`, `layers`, `driver`, `store`) and the helpers over them: a
sandbox's agent, its lower layers, staging directories. The attributes are set by `Runtime.__init__`.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from k3sys.sandbox.errors import AgentError, AgentInterruptedError, DriverError
from k3sys.sandbox.runtime.agent import Agent
from k3sys.sandbox.runtime.drivers.base import Driver
from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.state import Record
from k3sys.sandbox.runtime.store import Store
from k3sys.sandbox.runtime.table import SandboxTable
from k3sys.sandbox.runtime.templates import template_rootfs, template_user

T = TypeVar("T")


class Base:
    """The parts and helpers `Runtime`'s mixins share (see the module docstring)."""

    root: Path
    driver: Driver
    store: Store
    table: SandboxTable
    layers: LayerSet
    scratch: Path
    on_timeout: str
    _cleaner: ThreadPoolExecutor

    def _agent(self, sid: str) -> Agent:
        rec = self.table.get(sid)
        if rec is None:  # killed: its agent went with it
            raise AgentError(f"sandbox agent: sandbox {sid} is gone")
        agent = self.driver.agent(sid, self.table.dirs(sid))
        agent.user = template_user(rec.spec.template)  # calls naming no user run as the template's
        return agent

    def _retrying(self, sid: str, call: Callable[[Agent], T], deadline: float | None = None) -> T:
        """`call(agent)` on the sandbox's agent, made again when a checkpoint cut it (the agent's gate
        holds the retry until the sandbox runs again)."""
        while True:
            try:
                return call(self._agent(sid))
            except AgentInterruptedError:
                if deadline is not None and time.monotonic() > deadline:
                    raise

    def _layer_dir(self, ck: str | None) -> Path | None:
        return self.layers.path(ck) if ck else None

    def _lowers(self, rec: Record) -> list[Path]:
        template = template_rootfs(rec.spec.template)
        layer = self._layer_dir(rec.layer)
        return [layer, template] if layer else [template]

    def _staging(self, name: str) -> tuple[Path, Path]:
        """(tmpfs directory for process images, disk directory for a sealed tree), both not yet created.

        Unique per call: staging is deleted off the caller's path, so a retried operation must not meet
        (or have deleted under it) the directory of an earlier attempt."""
        self.scratch.mkdir(mode=0o700, exist_ok=True)
        # Its name is predictable and /dev/shm open to every host user, who could make it first and
        # then read or change tenants' process images (which CRIU, as root, restores): only ours.
        st = os.lstat(self.scratch)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise DriverError(f"{self.scratch}: not this runtime's private directory (owner {st.st_uid}, mode "
                              f"{stat.S_IMODE(st.st_mode):o}): another host user made it? Remove it")
        name = f"{name}-{secrets.token_hex(4)}"
        return self.scratch / name, self.root / "tmp" / name
