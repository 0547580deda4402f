"""The sandbox service's state: its configuration, the runtime, admission limits, metrics, and the
worker threads every runtime call of a request runs in (`Service.call`)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from k3sys.sandbox.errors import InvalidArgumentError, QuotaError, SandboxError, UnavailableError
from k3sys.sandbox.runtime.runtime import HIBERNATE_DELAY_S, Runtime
from k3sys.sandbox.runtime.state import State
from k3sys.sandbox.service import metrics as _metrics
from k3sys.sandbox.service.attrs import AttrsTable, SnapshotNames
from k3sys.sandbox.service.guard import ConnectionLimits
from k3sys.sandbox.service.limits import Admission
from k3sys.sandbox.service.scope import Principal, Scope
from k3sys.sandbox.service.template_builds import TemplateBuilds
from k3sys.sandbox.service.tenants import Tenants
from k3sys.sandbox.spec import ON_TIMEOUT, SandboxSpec, check_number
from k3sys.sandbox.types import CheckpointInfo, SandboxInfo

T = TypeVar("T")
_log = logging.getLogger(__name__)
ON_SHUTDOWN = ("hibernate", "keep", "kill")
_HOLDING = ("running", "paused")  # states whose sandboxes hold memory at shutdown


def _host_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)


@dataclass(frozen=True)
class ServiceConfig:
    """How a service runs. Sizes in MiB or bytes as named, times in seconds.

    `api_key` None serves without auth (loopback addresses only); `max_memory_mb` defaults to the
    host's RAM, so memory limits are never over-committed; `on_timeout` is what happens to a sandbox
    past its `timeout_s` unless its spec says; `on_shutdown` what stopping the service does to the
    sandboxes that hold memory ("hibernate": released now, resumed on demand; "keep": left running
    for the next start to adopt; "kill"). `pause_delay_s`: how long after E2B's pause (a freeze,
    answered at once) its background hibernation starts (`Runtime(hibernate_delay_s=)`). `shutdown_s`:
    the most a stop spends on `on_shutdown` and closing the runtime (a SIGTERM exits within it plus
    the 10 s given to open connections; `Service.stop`).
    `connections`: how many, and how long a request header may take (guard.py).
    """

    data_dir: Path
    api_key: str | None
    max_sandboxes: int = 64
    max_memory_mb: int = dataclasses.field(default_factory=_host_memory_mb)
    max_body_bytes: int = 256 << 20
    max_command_timeout_s: float = 3600.0
    on_timeout: str = "hibernate"
    on_shutdown: str = "hibernate"
    pause_delay_s: float = HIBERNATE_DELAY_S
    shutdown_s: float = 120.0
    op_threads: int = 32
    io_threads: int = 256
    connections: ConnectionLimits = dataclasses.field(default_factory=ConnectionLimits)

    def __post_init__(self) -> None:
        for name in ("max_sandboxes", "max_memory_mb", "max_body_bytes", "op_threads", "io_threads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name}: expected a positive integer, got {v!r}")
        if not self.max_command_timeout_s > 0:
            raise InvalidArgumentError(f"max_command_timeout_s: expected > 0 s, got {self.max_command_timeout_s!r}")
        if self.on_timeout not in ON_TIMEOUT:
            raise InvalidArgumentError(f"on_timeout: expected one of {ON_TIMEOUT}, got {self.on_timeout!r}")
        if self.on_shutdown not in ON_SHUTDOWN:
            raise InvalidArgumentError(f"on_shutdown: expected one of {ON_SHUTDOWN}, got {self.on_shutdown!r}")
        check_number("pause_delay_s", self.pause_delay_s, 0, 3600, "s")
        check_number("shutdown_s", self.shutdown_s, 0, 3600, "s")

    def open_runtime(self) -> Runtime:
        """The runtime of `data_dir`, as this configuration asks."""
        return Runtime(self.data_dir, on_timeout=self.on_timeout, hibernate_delay_s=self.pause_delay_s)


class Service:
    """The runtime, its limits and metrics; every runtime call of a request goes through `call`."""

    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.runtime: Runtime | None = None
        self.admission: Admission | None = None
        self.tenants: Tenants | None = None
        self.template_builds: TemplateBuilds | None = None
        self.attrs = AttrsTable(config.data_dir / "e2b" / "sandboxes")
        self.names = SnapshotNames(config.data_dir / "e2b" / "snapshot-names.json")
        self.draining = False
        self.ops = anyio.CapacityLimiter(config.op_threads)
        self.io = anyio.CapacityLimiter(config.io_threads)
        self.latency = _metrics.Histogram("k3sys_sandbox_operation_seconds", "Sandbox operations served, by op.")
        self.errors = _metrics.Counter("k3sys_sandbox_operation_errors_total", "Failed operations, by op and type.")
        self.requests = _metrics.Counter("k3sys_http_requests_total", "HTTP requests, by method, route, status.")

    @property
    def rt(self) -> Runtime:
        if self.runtime is None or self.draining:
            raise UnavailableError("the sandbox service is shutting down")
        return self.runtime

    def start(self) -> None:
        if self.runtime is None:
            self.runtime = self.config.open_runtime()
        self.admission = Admission(self.runtime, self.config.max_sandboxes, self.config.max_memory_mb)
        self.tenants = Tenants(self.config.data_dir)
        self.template_builds = TemplateBuilds(self.config.data_dir / "e2b" / "template-files")
        # Owners of sandboxes gone for good (not alive, no checkpoint of them left) are forgotten.
        rt = self.runtime
        self.tenants.prune({i.id for i in rt.list()} | {c.sandbox_id for c in rt.checkpoints()})

    def scope(self, who: Principal) -> Scope:
        """What `who` may see and reach (every route's filter)."""
        return Scope(self.rt, self.tenants, who)

    def stop(self) -> None:
        """Apply `on_shutdown` to the sandboxes holding memory, then let go of the runtime directory;
        within `config.shutdown_s`. What is not done by then is left as a crash leaves it (each step
        of a life cycle survives that): the sandboxes still running, or mid-hibernation, are the next
        start's to adopt; the runtime directory is released with the process."""
        self.draining = True
        rt = self.runtime
        if self.template_builds is not None:
            self.template_builds.close(rt)
        if rt is None:
            return
        act = {"hibernate": rt.hibernate, "kill": rt.kill, "keep": None}[self.config.on_shutdown]
        left = {i.id for i in rt.list() if i.state in _HOLDING} if act is not None else set()
        mu = threading.Lock()

        def work(todo: list[str]) -> None:
            while True:
                with mu:
                    if not todo:
                        return
                    sid = todo.pop()
                try:
                    act(sid)  # type: ignore[misc]
                except SandboxError as e:  # left running: adopted at the next start
                    _log.warning("shutdown: %s of sandbox %s failed: %s: %s", self.config.on_shutdown, sid,
                                 type(e).__name__, e)
                with mu:
                    left.discard(sid)

        def finish() -> None:
            if left:
                todo = sorted(left)
                # A few at a time (each hibernation is a CRIU dump plus a store commit); daemon threads,
                # so one stuck past the deadline never holds the process.
                workers = [threading.Thread(target=work, args=(todo,), daemon=True) for _ in range(min(4, len(todo)))]
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
            rt.close()

        stopper = threading.Thread(target=finish, name="k3sys-service-stop", daemon=True)
        stopper.start()
        stopper.join(self.config.shutdown_s)
        if stopper.is_alive():
            with mu:
                pending = sorted(left)
            _log.error("shutdown: on_shutdown=%s not done within shutdown_s=%g s; exiting without it (sandboxes "
                       "still at it: %s; the next start adopts them)", self.config.on_shutdown,
                       self.config.shutdown_s, ", ".join(pending) or "none, the runtime was closing")
        if self.tenants is not None:
            self.tenants.close()

    async def call(self, op: str, fn: Callable[..., T], *args: Any, io: bool = False) -> T:
        """Run `fn(*args)` in a worker thread, timed as `op` in the metrics."""
        t0 = time.perf_counter()
        try:
            result = await anyio.to_thread.run_sync(partial(fn, *args), limiter=self.io if io else self.ops)
        except Exception as e:
            self.errors.inc(op=op, type=getattr(e, "code", "internal"))
            raise
        self.latency.observe(time.perf_counter() - t0, op=op)
        return result

    def cap_timeout(self, timeout: float | None) -> float:
        """A command's timeout within the service's cap (None: the cap)."""
        cap = self.config.max_command_timeout_s
        if timeout is not None and timeout > cap:
            raise InvalidArgumentError(f"timeout: at most {cap:g} s on this service, got {timeout!r}")
        return cap if timeout is None else timeout

    # --- operations that admit new sandboxes (run in worker threads) -----------------------------

    def create(self, spec: SandboxSpec, id: str | None, scope: Scope) -> SandboxInfo:
        scope.check_new_id(id)
        with self.admission.admit(1, spec, scope):
            info = self.rt.create(spec, id)
        scope.claim([info])
        return info

    def restore(self, ck: str, id: str | None, timeout_s: float | None, scope: Scope,
                on_timeout: str | None = None, network: bool | None = None) -> SandboxInfo:
        """`network`: E2B's allow_internet_access, if sent: it must be the snapshot's own (a restored
        sandbox keeps the network namespace, or none, of the one the snapshot was taken of)."""
        scope.checkpoint(ck)
        scope.check_new_id(id)
        spec = SandboxSpec.from_json(self.rt.store.get(ck).meta.get("spec", {}))
        if network is not None and network != spec.network:
            raise InvalidArgumentError(
                f"allow_internet_access: {network} asked, but snapshot {ck!r} was taken of a sandbox "
                f"{'with' if spec.network else 'without'} internet access, which a sandbox made from it "
                f"keeps: send {spec.network}, or none")
        with self.admission.admit(1, spec, scope):
            if on_timeout is None:
                info = self.rt.restore(ck, id, timeout_s)
            else:
                info = self.rt.restore(ck, id, timeout_s, on_timeout=on_timeout)
        scope.claim([info])
        return info

    def fork(self, sid: str, n: int, scope: Scope) -> list[SandboxInfo]:
        with self.admission.admit(n, scope.sandbox(sid).spec, scope):
            kids = self.rt.fork(sid, n)
        scope.claim(kids)
        return kids

    def resume(self, sid: str, scope: Scope, memory: bool = True) -> SandboxInfo:
        """Resume (see `Runtime.resume`; `memory=False`: a hibernated sandbox boots cold). It adds no
        disk (a hibernated sandbox holds its own), but is refused while the tenant is over its disk
        quota, so that hibernations, which are never refused, cannot fill the store round after round."""
        info = scope.sandbox(sid)
        hibernated = info.state == "hibernated"
        room = self.admission.admit(1, info.spec, scope, disk=False) if hibernated else contextlib.nullcontext()
        with room:
            if memory:
                self.rt.resume(sid)
            else:
                self.rt.resume(sid, memory=False)
        return self.rt.info(sid)

    def snapshot(self, sid: str, scope: Scope) -> CheckpointInfo:
        """Checkpoint a sandbox the caller owns into the store, kept only within its tenant's disk
        quota (QuotaError naming it past that; the checkpoint is deleted again)."""
        ck = self.rt.checkpoint(sid)
        try:
            self.admission.keep(ck, scope)
        except QuotaError:
            self.rt.delete_checkpoint(ck.id)
            raise
        return ck

    def pause(self, sid: str) -> SandboxInfo:
        self.rt.pause(sid)
        return self.rt.info(sid)

    # --- metrics ---------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        rt = self.rt
        infos = rt.list()
        by_state = {s.value: 0 for s in State if s is not State.KILLED}
        for i in infos:
            by_state[i.state] = by_state.get(i.state, 0) + 1
        stats = rt.store.stats()
        _, mb = self.admission.usage()
        L, G = _metrics.labels, _metrics.Gauge
        gauges = [
            G("k3sys_sandboxes", "Sandboxes by state.", {L(state=s): n for s, n in by_state.items()}),
            G("k3sys_sandbox_memory_reserved_bytes", "Memory limits of sandboxes holding memory.", {(): mb << 20}),
            G("k3sys_limit_sandboxes", "Most sandboxes holding memory at once.", {(): self.config.max_sandboxes}),
            G("k3sys_limit_memory_bytes", "Most memory (sum of limits) of sandboxes at once.",
              {(): self.config.max_memory_mb << 20}),
            G("k3sys_checkpoints", "Checkpoints in the store.", {(): stats["manifests"]}),
            G("k3sys_store_bytes", "Checkpoint store size: on disk, logical (sum of checkpoints), unique chunk data.",
              {L(kind=k): stats[f"bytes_{k}"] for k in ("on_disk", "logical", "unique")}),
        ]
        return _metrics.render([*gauges, self.latency, self.errors, self.requests])
