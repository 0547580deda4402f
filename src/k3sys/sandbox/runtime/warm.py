"""Warm templates: a template with a start command is a checkpoint taken once its ready command
passed, and every create from it is a restore of that checkpoint, so its server is already up.

A template's `template.json` may name `start_cmd` (a shell command left running, E2B's
`set_start_cmd(start, ready)`) and `ready_cmd` (run until it exits 0; absent: `sleep 1`, E2B's
shortest `wait_for_timeout`). `WarmTemplates.create` stands in for `Lifecycle.create`: a template
without a start command is created cold, as before; one with it is restored from its warm
checkpoint, built on the first create that needs it:

- **Build**: a build sandbox of the template (the create's spec, without its timeout, metadata or
  envs) runs the start command in the background as the template's default user in its home, the
  ready command every `READY_POLL_S` until it exits 0 (within `READY_TIMEOUT_S`, each try within
  `PROBE_TIMEOUT_S`), and is checkpointed there and killed. A start command that exits, or a ready
  command that never passes, is a `TemplateStartError` carrying both commands' output.
- **Where it lives**: in the runtime's store, as a checkpoint marked `internal` (never listed, never
  a sandbox's head) with the template's name and its key in the manifest (`WARM_TEMPLATE`,
  `WARM_KEY`): its memory and sealed files are chunks like any checkpoint's, shared with the
  checkpoints of the sandboxes made from it, and it survives a restart (the index is rebuilt from
  the manifests) and moves between fleet nodes as a checkpoint does. Its sealed layer stays checked
  out while the runtime knows it (this part holds a reference), so a create checks nothing out.
- **Invalidation**: the key hashes what the checkpoint depends on: template.json (its build time,
  recipe stamp and commands change with every rebuild), the rootfs directory's identity, the agent's
  and CRIU's binaries (a restore maps the agent the checkpoint was taken with) and the spec's shape
  a restore cannot change (`network`: a socket the server bound to the sandbox's address needs
  that address in the restored namespace; `memory_mb`, which sizes the agent's rings). A create
  whose key has no checkpoint builds one and deletes the template's older ones of the same shape;
  sandboxes restored from those keep their layers until they go.
- **Identity**: every sandbox has the hostname `sandbox` and learns its id from the host, never
  from inside, so a restore has nothing of the build sandbox's to shed; clocks are the host's
  (CLOCK_REALTIME and CLOCK_MONOTONIC go on from the build; timers fire when due). Each create gets
  its own upper layer, memory, cgroup and network, over the read-only shared layer: two creates
  share nothing writable. What a create gives (`envs`, `metadata`, `timeout_s`, cpu, pids, disk)
  applies as to a cold create: `envs` go to the commands the SDK starts, so the start command,
  started at build, never sees them (as with E2B's, which runs at build time too). Memory the
  server's process held at the checkpoint (a random seed, say) is the same in every create.
- **Eager**: a warm create restores all of the server's memory before it returns. The caller uses
  the server at once, and a lazy restore (pages streamed in behind the running processes) only
  moves the page faults into the first request: code-interpreter-v1 created then answering
  `run_code("1")` took 205-216 ms eagerly against 357-488 ms lazily (the create alone 187 vs 108 ms).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from k3sys.sandbox.errors import CheckpointNotFoundError, CommandTimeoutError, SandboxError, TemplateStartError
from k3sys.sandbox.runtime.catalog import INTERNAL, Catalog
from k3sys.sandbox.runtime.checkpoints import CheckpointService
from k3sys.sandbox.runtime.commands import CommandService
from k3sys.sandbox.runtime.layerset import LayerSet
from k3sys.sandbox.runtime.lifecycle import Lifecycle
from k3sys.sandbox.runtime.store import Store
from k3sys.sandbox.runtime.store.manifest import Manifest
from k3sys.sandbox.runtime.system import system_paths
from k3sys.sandbox.runtime.templates import template_rootfs
from k3sys.sandbox.spec import CommandResult, SandboxSpec
from k3sys.sandbox.types import SandboxInfo

_log = logging.getLogger(__name__)
WARM_TEMPLATE = "warm_template"  # manifest meta: the template a warm checkpoint is of
WARM_KEY = "warm_key"  # manifest meta: `WarmTemplates.key` it was built under
WARM_SHAPE = "warm_shape"  # manifest meta: the spec's shape part of that key
READY_TIMEOUT_S = 120.0  # the start command's time to get ready, at build
PROBE_TIMEOUT_S = 10.0  # one run of the ready command
READY_POLL_S = 0.05  # between runs of the ready command
DEFAULT_READY = "sleep 1"


@dataclasses.dataclass(frozen=True)
class StartCommands:
    """A template's `start_cmd` and `ready_cmd` (template.json)."""

    start: str
    ready: str


def start_commands(name: str) -> StartCommands | None:
    """Template `name`'s start and ready commands (None: it has no start command, or is not built)."""
    try:
        meta = json.loads((system_paths().templates / name / "template.json").read_text())
    except (OSError, ValueError):
        return None
    start = meta.get("start_cmd") if isinstance(meta, dict) else None
    if not isinstance(start, str) or not start:
        return None
    ready = meta.get("ready_cmd")
    return StartCommands(start, ready if isinstance(ready, str) and ready else DEFAULT_READY)


def _shape(spec: SandboxSpec) -> str:
    """What of a spec a restore from a checkpoint cannot change (see the module docstring)."""
    return f"network={int(spec.network)},memory_mb={spec.memory_mb}"


def _identity(path: Path) -> str:
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


class WarmTemplates:
    """Creates from templates: warm ones restored from their checkpoint (see the module docstring),
    the others handed to `lifecycle`."""

    def __init__(self, lifecycle: Lifecycle, checkpoints: CheckpointService, commands: CommandService,
                 catalog: Catalog, store: Store, layer_set: LayerSet) -> None:
        self.lifecycle = lifecycle
        self.checkpoints = checkpoints
        self.commands = commands
        self.catalog = catalog
        self.store = store
        self.layers = layer_set
        self._mu = threading.Lock()  # guards `_index`, `_held` and `_builds`
        self._index: dict[str, str] | None = None  # key -> checkpoint id; read from the store on first use
        self._held: set[str] = set()  # checkpoints whose layer this part holds
        self._builds: dict[str, threading.Lock] = {}  # key -> the lock its one build holds

    def create(self, spec: SandboxSpec, id: str | None = None) -> SandboxInfo:
        """`Lifecycle.create`, restoring a warm template's checkpoint instead of booting it."""
        cmds = start_commands(spec.template) if isinstance(spec, SandboxSpec) else None
        if cmds is None:
            return self.lifecycle.create(spec, id)
        try:
            return self._spawn(spec, self.checkpoint_for(spec, cmds), id)
        except CheckpointNotFoundError:
            # Superseded (the template changed) between the lookup and the restore: a second lookup
            # from the store finds, or builds, the new one.
            with self._mu:
                self._index = None
            return self._spawn(spec, self.checkpoint_for(spec, cmds), id)

    def _spawn(self, spec: SandboxSpec, ck: str, id: str | None) -> SandboxInfo:
        return self.checkpoints.spawn(spec, ck, None, self.catalog.fs_bytes(ck), id, eager=True)

    def key(self, spec: SandboxSpec) -> str:
        """What a warm checkpoint of `spec.template` in `spec`'s shape must have been built under."""
        rootfs = template_rootfs(spec.template)
        paths = system_paths()
        parts = [spec.template, (rootfs.parent / "template.json").read_text(), _identity(rootfs),
                 _identity(paths.agent), _identity(paths.criu), _shape(spec)]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]

    def checkpoint_for(self, spec: SandboxSpec, cmds: StartCommands) -> str:
        """The warm checkpoint of `spec.template` in `spec`'s shape, built first if there is none."""
        key = self.key(spec)
        with self._mu:
            ck = self._known().get(key)
            build = self._builds.setdefault(key, threading.Lock())
        if ck is not None:
            return self._hold(ck)
        with build:  # one build per key; the others wait for it
            with self._mu:
                ck = self._known().get(key)
            if ck is None:
                ck = self._build(spec, cmds, key)
                with self._mu:
                    self._known()[key] = ck
                self._drop_older(spec, key)
        return self._hold(ck)

    def _known(self) -> dict[str, str]:
        """The warm checkpoints in the store, by key (`_mu` held)."""
        if self._index is None:
            self._index = {m.meta[WARM_KEY]: m.id for m in self.store.list() if m.meta.get(WARM_KEY)}
        return self._index

    def _hold(self, ck: str) -> str:
        """Keep `ck`'s sealed layer checked out while this runtime knows it (one reference)."""
        with self._mu:
            if ck in self._held:
                return ck
            self._held.add(ck)
        self.layers.acquire(ck)
        return ck

    def _drop_older(self, spec: SandboxSpec, key: str) -> None:
        """Delete the template's warm checkpoints of this shape built under another key."""
        shape = _shape(spec)
        self._drop(spec.template, lambda m: m.meta.get(WARM_SHAPE) == shape and m.meta.get(WARM_KEY) not in (None, key),
                   "superseded (the template or its shape changed)")

    def forget(self, template: str) -> int:
        """Delete every warm checkpoint of `template` (removed: nothing creates from them again);
        sandboxes restored from one keep its layer until they go. Returns how many went."""
        return self._drop(template, lambda m: m.meta.get(WARM_KEY) is not None, "deleted with its template")

    def _drop(self, template: str, which: Callable[[Manifest], bool], why: str) -> int:
        gone = 0
        for m in self.store.list():
            if m.meta.get(WARM_TEMPLATE) != template or not which(m):
                continue
            with self._mu:
                self._known().pop(m.meta[WARM_KEY], None)
                held = m.id in self._held
                self._held.discard(m.id)
            if held:
                self.layers.release(m.id)  # sandboxes on it keep it until they go
            _log.info("warm template %s: checkpoint %s %s", template, m.id, why)
            with contextlib.suppress(SandboxError):
                self.catalog.delete(m.id)
                gone += 1
        return gone

    def _build(self, spec: SandboxSpec, cmds: StartCommands, key: str) -> str:
        """Run the start command in a build sandbox until the ready command passes; checkpoint it."""
        t0 = time.monotonic()
        build = dataclasses.replace(spec, timeout_s=READY_TIMEOUT_S * 2, on_timeout="kill", metadata={}, envs={})
        sid = self.lifecycle.create(build).id
        try:
            cid = self.commands.start_process(sid, cmds.start)
            self._wait_ready(sid, cid, cmds, spec.template)
            meta = {INTERNAL: True, WARM_TEMPLATE: spec.template, WARM_KEY: key, WARM_SHAPE: _shape(spec)}
            ck = self.checkpoints.checkpoint(sid, meta=meta).id
            self.commands.forget_command(cid)
        finally:
            with contextlib.suppress(SandboxError):
                self.lifecycle.kill(sid)
        _log.info("warm template %s: checkpoint %s built in %.1f s", spec.template, ck, time.monotonic() - t0)
        return ck

    def _wait_ready(self, sid: str, cid: str, cmds: StartCommands, template: str) -> None:
        """Run the ready command until it exits 0; TemplateStartError if the start command ends first,
        or at `READY_TIMEOUT_S`."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                probe = self.commands.run(sid, cmds.ready, timeout=PROBE_TIMEOUT_S)
            except CommandTimeoutError as e:  # not ready yet: a probe that hangs counts as a failed one
                probe = CommandResult(e.stdout, e.stderr, 124)
            if probe.exit_code == 0:
                return
            ended = not self.commands.command_running(cid)
            if ended or time.monotonic() > deadline:
                out, err = self.commands.command_output(cid)
                why = "exited" if ended else f"was not ready within {READY_TIMEOUT_S:g} s"
                raise TemplateStartError(
                    f"template {template!r}: start command {cmds.start!r} {why}; last ready command "
                    f"{cmds.ready!r} exited {probe.exit_code}: {(probe.stdout + probe.stderr)[-500:]!r}; "
                    f"start command output: {(out + err)[-1000:]!r}")
            time.sleep(READY_POLL_S)
