"""The embedded sandbox runtime: ids, the state machine, persistence, checkpoints, recovery.

One `Runtime` owns one runtime directory (default `~/.local/share/k3sys`, or `K3SYS_HOME`):

    runtime.lock              flock held while a runtime has the directory open
    sandboxes/<id>/record.json  the sandbox's `Record` (state.py); bundle/, upper/, work/, logs/
    layers/<checkpoint id>/   sealed file systems in use as lower layers (hard-linked, read-only)
    store/                    the content-addressed checkpoint store (`k3sys.sandbox.runtime.store`)
    runc/                     the driver's state (runc --root)
    tmp/                      staging on the same file system as layers/ (renames, hard links)

CRIU images are staged on tmpfs (`K3SYS_SCRATCH`, default /dev/shm) under `k3sys-<hash of the dir>`.

Thread safety: every life-cycle operation holds its sandbox's lock for its whole length, so two
operations on one sandbox never interleave and a caller sees each transition as atomic; a failed
one leaves the sandbox in its previous state. Operations on different sandboxes run concurrently.
Commands run without the lock (a long command does not block `pause` or `kill`).

Recovery: a runtime opening a directory another runtime left (crashed) adopts its sandboxes:
orphan runc/CRIU helpers are killed, a sandbox caught mid-checkpoint is thawed and rolled back,
one whose processes died is reported `lost` (never dropped), and staging directories are wiped.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from k3sys.sandbox.errors import (
    CheckpointNotFoundError,
    CommandTimeoutError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    RuntimeLockedError,
    SandboxError,
)
from k3sys.sandbox.runtime.drivers.base import Driver, SandboxDirs
from k3sys.sandbox.runtime.sandboxfs import SandboxFS
from k3sys.sandbox.runtime.state import LIVE, Record, State
from k3sys.sandbox.runtime.store import Follower, Manifest, Store
from k3sys.sandbox.runtime.templates import template_rootfs
from k3sys.sandbox.spec import MAX_FORK, ON_TIMEOUT, CommandResult, OutputPieces, SandboxSpec, check_id, check_number
from k3sys.sandbox.types import CheckpointInfo, EntryInfo, SandboxInfo

_log = logging.getLogger(__name__)

def default_root() -> Path:
    """`K3SYS_HOME`, else `~/.local/share/k3sys`."""
    env = os.environ.get("K3SYS_HOME")
    return Path(env) if env else Path.home() / ".local" / "share" / "k3sys"


@dataclass(frozen=True)
class _Snapshot:
    """A sandbox's state captured in staging: checkpoint id, image and sealed-fs directories, timings
    (seconds per phase), and the store follower already packing the images."""

    ck: str
    images: Path
    fs: Path
    t: dict[str, float]
    follower: Follower


@dataclass(frozen=True)
class _Staged:
    """Images of checkpoint `ck` checked out to `path` by `prefetch`, kept until `expires` (monotonic s)."""

    ck: str
    path: Path
    expires: float


@dataclass
class _Command:
    sandbox_id: str
    proc: subprocess.Popen
    pid: int
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    readers: list[threading.Thread] = field(default_factory=list)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(6)}"


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _decode(b: bytes) -> str:
    return b.decode("utf-8", errors="replace")


class Runtime:
    """Sandboxes of one runtime directory; see the module docstring. Use one per directory."""

    def __init__(self, root: Path | str | None = None, driver: Driver | None = None, on_timeout: str = "kill") -> None:
        """`on_timeout`: what happens to a sandbox past its `timeout_s` unless its spec says ("kill",
        "hibernate")."""
        if on_timeout not in ON_TIMEOUT:
            raise InvalidArgumentError(f"on_timeout: expected one of {ON_TIMEOUT}, got {on_timeout!r}")
        self.on_timeout = on_timeout
        self.root = (Path(root) if root is not None else default_root()).resolve()
        for d in ("sandboxes", "layers", "tmp"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.root / "runtime.lock", "a+")  # noqa: SIM115 (held for our lifetime)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise RuntimeLockedError(f"runtime directory {self.root} is in use by another live process") from None
        if driver is None:
            from k3sys.sandbox.runtime.drivers.runc import RuncDriver

            driver = RuncDriver(self.root)
        self.driver = driver
        self.store = Store(self.root / "store")
        tag = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:12]
        self.scratch = Path(os.environ.get("K3SYS_SCRATCH", "/dev/shm")) / f"k3sys-{tag}"
        self._mu = threading.Lock()  # guards the dictionaries below
        self._records: dict[str, Record] = {}
        self._locks: dict[str, threading.RLock] = {}
        self._commands: dict[str, _Command] = {}
        self._timings: dict[str, dict[str, float]] = {}  # sandbox id -> phases of its latest operation
        self._staged: dict[str, _Staged] = {}  # sandbox id -> images prefetched for its resume
        # Image directories are deleted off the caller's path (freeing 64 MiB of tmpfs takes ~5 ms).
        self._cleaner = ThreadPoolExecutor(1, thread_name_prefix="k3sys-sandbox-cleanup")
        self._closed = threading.Event()
        self._recover()
        self._reaper = threading.Thread(target=self._reap_expired, name="k3sys-sandbox-reaper", daemon=True)
        self._reaper.start()

    # --- bookkeeping --------------------------------------------------------------------------

    def _dirs(self, sid: str) -> SandboxDirs:
        return SandboxDirs(self.root / "sandboxes" / sid)

    def _save(self, rec: Record) -> None:
        rec.save(self._dirs(rec.id).root / "record.json")

    def _set(self, rec: Record, state: State, **changes: Any) -> None:
        rec.state = state
        for k, v in changes.items():
            setattr(rec, k, v)
        self._save(rec)

    @contextlib.contextmanager
    def _locked(self, sid: str) -> Iterator[Record]:
        """The sandbox's record, with its lock held (NotFoundError for an unknown or killed id)."""
        with self._mu:
            lock = self._locks.get(sid)
        if lock is None:
            raise NotFoundError(f"no sandbox {sid!r}")
        with lock:
            with self._mu:
                rec = self._records.get(sid)
                # Killed while we waited (and perhaps its id reused, under a new lock).
                if rec is None or self._locks.get(sid) is not lock:
                    raise NotFoundError(f"no sandbox {sid!r}")
            yield rec

    @staticmethod
    def _require(rec: Record, op: str, *allowed: State) -> None:
        if rec.state not in allowed:
            want = " or ".join(s.value for s in allowed)
            raise InvalidStateError(f"cannot {op} sandbox {rec.id}: it is {rec.state.value} (needs {want})")

    def _layer_dir(self, ck: str | None) -> Path | None:
        return self.root / "layers" / ck if ck else None

    def _lowers(self, rec: Record) -> list[Path]:
        template = template_rootfs(rec.spec.template)
        layer = self._layer_dir(rec.layer)
        return [layer, template] if layer else [template]

    def _register(self, rec: Record) -> None:
        with self._mu:
            self._records[rec.id] = rec
            self._locks.setdefault(rec.id, threading.RLock())

    def _staging(self, name: str) -> tuple[Path, Path]:
        """(tmpfs directory for process images, disk directory for a sealed tree), both not yet created.

        Unique per call: staging is deleted off the caller's path, so a retried operation must not meet
        (or have deleted under it) the directory of an earlier attempt."""
        self.scratch.mkdir(mode=0o700, exist_ok=True)
        name = f"{name}-{secrets.token_hex(4)}"
        return self.scratch / name, self.root / "tmp" / name

    # --- create / list / kill -----------------------------------------------------------------

    def create(self, spec: SandboxSpec, id: str | None = None) -> SandboxInfo:
        """Start a new sandbox from `spec.template`; `id` chosen by the caller or generated."""
        if not isinstance(spec, SandboxSpec):
            raise InvalidArgumentError(f"spec: expected a SandboxSpec, got {type(spec).__name__}")
        template_rootfs(spec.template)  # unknown template -> UnknownTemplateError before any work
        sid = self._claim_id(id)
        now = time.time()
        rec = Record(sid, spec, State.CREATING, now, deadline=now + spec.timeout_s if spec.timeout_s else None)
        self._register(rec)
        with self._locked(sid):
            self._save(rec)
            try:
                self.driver.create(sid, self._dirs(sid), spec, self._lowers(rec))
            except BaseException:
                self._discard(rec)
                raise
            self._set(rec, State.RUNNING)
            return self._info(rec)

    def _claim_id(self, id: str | None) -> str:
        sid = check_id("id", id) if id is not None else _new_id("sbx")
        with self._mu:
            if sid in self._records or self._dirs(sid).root.exists():
                raise InvalidArgumentError(f"id: sandbox {sid!r} already exists")
            self._dirs(sid).root.mkdir(parents=True)
        return sid

    def _discard(self, rec: Record) -> None:
        """Release everything of `rec` and forget it (its checkpoints stay in the store)."""
        dirs = self._dirs(rec.id)
        self._kill_commands(rec.id)
        try:
            self.driver.destroy(rec.id, dirs)
        except BaseException as e:
            # Something is still held (a mount, a cgroup): keep the record so it stays visible.
            self._set(rec, State.LOST, reason=f"kill failed: {e}")
            raise
        _rmtree(dirs.root)
        self._unstage(rec.id)
        with self._mu:
            self._records.pop(rec.id, None)
            self._locks.pop(rec.id, None)
            self._timings.pop(rec.id, None)
        rec.state = State.KILLED
        self._gc_layers()

    def kill(self, sid: str) -> None:
        """Stop the sandbox and release its processes, memory, mounts, cgroups and files."""
        with self._locked(sid) as rec:
            self._discard(rec)

    def info(self, sid: str) -> SandboxInfo:
        with self._mu:
            rec = self._records.get(sid)
        if rec is None:
            raise NotFoundError(f"no sandbox {sid!r}")
        return self._info(rec)

    def list(self) -> list[SandboxInfo]:
        """Every sandbox this runtime knows (killed ones are gone), oldest first."""
        with self._mu:
            recs = sorted(self._records.values(), key=lambda r: (r.created, r.id))
        return [self._info(r) for r in recs]

    @staticmethod
    def _info(rec: Record) -> SandboxInfo:
        return SandboxInfo(rec.id, rec.state.value, rec.spec, rec.created, rec.head, rec.reason)

    def timings(self, sid: str) -> dict[str, float]:
        """Seconds per phase of the sandbox's latest create / checkpoint / hibernate / resume / restore /
        fork (`runc+criu`: the runc call, `criu`: CRIU's own part of it, `store`: the checkpoint store)."""
        return dict(self._timings.get(sid, {}))

    def memory_bytes(self, sid: str) -> int:
        """Memory the sandbox's processes hold now, in bytes (0 unless running or paused)."""
        return self.driver.memory_bytes(sid)

    def cpu_seconds(self, sid: str) -> float:
        """CPU seconds the sandbox's cgroup has charged (0 unless running or paused; the count restarts
        from 0 when a hibernated sandbox resumes, since it comes back in a new cgroup)."""
        return self.driver.cpu_seconds(sid)

    # --- commands -----------------------------------------------------------------------------

    def start_command(self, sid: str, cmd: str, cwd: str | None = None, env: dict[str, str] | None = None,
                      stdin: bytes | None = None) -> str:
        """Start `sh -c cmd` in the sandbox; returns a command id for `wait_command` / `kill_command`."""
        if not isinstance(cmd, str) or not cmd:
            raise InvalidArgumentError(f"cmd: expected a non-empty string, got {cmd!r}")
        if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
            raise InvalidArgumentError(f"cwd: expected an absolute path in the sandbox, got {cwd!r}")
        env = dict(env or {})
        for k, v in env.items():
            if not isinstance(k, str) or not k or "=" in k or "\0" in k or not isinstance(v, str) or "\0" in v:
                raise InvalidArgumentError(f"env: bad variable {k!r}={v!r}")
        with self._locked(sid) as rec:
            self._require(rec, "run a command in", State.RUNNING)
            proc, pid = self.driver.exec(sid, ["/bin/sh", "-c", cmd], cwd or "/", env, stdin is not None)
        c = _Command(sid, proc, pid)
        for stream, buf in ((proc.stdout, c.out), (proc.stderr, c.err)):
            t = threading.Thread(target=_pump, args=(stream, buf), daemon=True)
            t.start()
            c.readers.append(t)
        if stdin is not None:
            # On a thread: a command that does not read its stdin would block a write past the pipe's
            # buffer, and with it this call and the timeout the caller's wait is about to start.
            threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
        cid = _new_id("cmd")
        with self._mu:
            self._commands[cid] = c
        return cid

    def _command(self, cid: str) -> _Command:
        with self._mu:
            c = self._commands.get(cid)
        if c is None:
            raise NotFoundError(f"no command {cid!r}")
        return c

    def wait_command(self, cid: str, timeout: float | None = None) -> CommandResult:
        """Wait for the command to end; on `timeout` (seconds) kill it and raise CommandTimeoutError."""
        c = self._command(cid)
        try:
            code = c.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_command(cid)
            for t in c.readers:  # what was still in the pipes belongs to the partial output
                t.join(1)
            out, err = bytes(c.out), bytes(c.err)
            raise CommandTimeoutError(f"command {cid} in sandbox {c.sandbox_id} ran past {timeout} s and was killed",
                                      _decode(out), _decode(err)) from None
        for t in c.readers:
            t.join()
        with self._mu:
            self._commands.pop(cid, None)
        return CommandResult(_decode(bytes(c.out)), _decode(bytes(c.err)), code)

    def command_output(self, cid: str) -> tuple[str, str]:
        """What the command has written so far (stdout, stderr)."""
        c = self._command(cid)
        return _decode(bytes(c.out)), _decode(bytes(c.err))

    def read_command_output(self, cid: str, since: tuple[int, int] = (0, 0)) -> tuple[bytes, bytes, bool]:
        """Raw (stdout, stderr) bytes after the offsets `since`, and whether the command has ended with
        all its output read. Never blocks."""
        c = self._command(cid)
        # Checked before reading, so whatever the command wrote before ending is in this answer.
        done = c.proc.poll() is not None and not any(t.is_alive() for t in c.readers)
        return bytes(c.out[since[0]:]), bytes(c.err[since[1]:]), done

    def stream_command(self, cid: str, poll: float = 0.02) -> Iterator[tuple[str, str]]:
        """Yield `("stdout" | "stderr", text)` as the command writes it (from its start), until it ends;
        `poll` seconds between looks. `wait_command` still gives the exit code afterwards."""
        pieces = OutputPieces()
        while True:
            out, err, done = self.read_command_output(cid, pieces.offsets)
            yield from pieces.feed(out, err, final=done)
            if done:
                return
            time.sleep(poll)

    def command_running(self, cid: str) -> bool:
        return self._command(cid).proc.poll() is None

    def kill_command(self, cid: str) -> None:
        """SIGKILL the command and everything it started (still its descendants)."""
        c = self._command(cid)
        self._kill_tree(c)
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(10)

    def _kill_tree(self, c: _Command) -> None:
        if c.proc.poll() is None:
            if c.pid:
                self.driver.kill_tree(c.pid)
            with contextlib.suppress(ProcessLookupError):
                c.proc.kill()  # runc exec itself, once the command is gone

    def run(self, sid: str, cmd: str, timeout: float | None = 60, cwd: str | None = None,
            env: dict[str, str] | None = None, stdin: bytes | None = None) -> CommandResult:
        """Run `sh -c cmd` to completion (see `start_command`, `wait_command`)."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
            raise InvalidArgumentError(f"timeout: expected None or a positive number of seconds, got {timeout!r}")
        cid = self.start_command(sid, cmd, cwd, env, stdin)
        try:
            return self.wait_command(cid, timeout)
        finally:
            with self._mu:
                self._commands.pop(cid, None)

    def _kill_commands(self, sid: str) -> None:
        with self._mu:
            mine = [(k, c) for k, c in self._commands.items() if c.sandbox_id == sid]
        for _, c in mine:
            self._kill_tree(c)
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(5)
        # Handles stay valid (wait() reports the kill) until their owner drops them.

    # --- files --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _fs(self, sid: str, op: str) -> Iterator[SandboxFS]:
        with self._locked(sid) as rec:
            self._require(rec, op, State.RUNNING)
            yield SandboxFS(self._dirs(sid).rootfs)

    def read_file(self, sid: str, path: str) -> bytes:
        with self._fs(sid, "read files of") as fs:
            return fs.read(path)

    def open_file(self, sid: str, path: str) -> BinaryIO:
        """The file at `path` open for reading, for streaming it out; the caller closes it. The open
        file stays readable whatever happens to the sandbox afterwards."""
        with self._fs(sid, "read files of") as fs:
            return fs.open(path)

    def write_file(self, sid: str, path: str, data: bytes | str | BinaryIO) -> int:
        with self._fs(sid, "write files of") as fs:
            return fs.write(path, data)

    def list_dir(self, sid: str, path: str = "/") -> list[EntryInfo]:
        with self._fs(sid, "list files of") as fs:
            return fs.list(path)

    def remove(self, sid: str, path: str) -> None:
        with self._fs(sid, "remove files of") as fs:
            fs.remove(path)

    def make_dir(self, sid: str, path: str) -> None:
        with self._fs(sid, "create directories in") as fs:
            fs.makedirs(path)

    def exists(self, sid: str, path: str) -> bool:
        with self._fs(sid, "look up files of") as fs:
            return fs.exists(path)

    # --- pause / resume -----------------------------------------------------------------------

    def pause(self, sid: str) -> None:
        """Freeze the sandbox: no CPU, memory kept; commands and files are refused until `resume`."""
        with self._locked(sid) as rec:
            self._require(rec, "pause", State.RUNNING)
            self.driver.pause(sid)
            self._set(rec, State.PAUSED)

    def resume(self, sid: str) -> None:
        """Thaw a paused sandbox, or restore a hibernated one (same id, same processes)."""
        with self._locked(sid) as rec:
            self._require(rec, "resume", State.PAUSED, State.HIBERNATED)
            if rec.state is State.PAUSED:
                self.driver.resume(sid)
                self._set(rec, State.RUNNING)
                return
            self._set(rec, State.RESUMING, prev=State.HIBERNATED)
            try:
                self._restore_into(rec, rec.head)
            except BaseException:
                with contextlib.suppress(SandboxError):
                    self.driver.destroy(sid, self._dirs(sid))
                self._wipe_upper(rec)
                self._set(rec, State.HIBERNATED, prev=None)
                raise
            # A sandbox hibernated by its timeout gets a fresh `timeout_s` from now.
            deadline = rec.deadline if rec.deadline or not rec.spec.timeout_s else time.time() + rec.spec.timeout_s
            self._set(rec, State.RUNNING, layer=rec.head, prev=None, deadline=deadline, reason="")
            self._gc_layers()

    def prefetch(self, sid: str, ttl_s: float = 60.0) -> bool:
        """Stage a hibernated sandbox's images on tmpfs ahead of a likely `resume` (e.g. while the
        policy model thinks), so that the resume restores without reading the store. A hint: it
        returns whether images are staged (False, doing nothing, unless the sandbox is hibernated).
        The staged copy holds as much memory as the sandbox's memory image until `resume` uses it,
        the sandbox is killed, or `ttl_s` seconds pass (a later call renews it)."""
        check_number("ttl_s", ttl_s, 0.1, 3600, "s")
        with self._locked(sid) as rec:
            if rec.state is not State.HIBERNATED:
                return False
            expires = time.monotonic() + ttl_s
            with self._mu:
                staged = self._staged.get(sid)
                if staged is not None and staged.ck == rec.head:
                    self._staged[sid] = _Staged(staged.ck, staged.path, expires)
                    return True
            self._unstage(sid)
            self._ensure_layer(rec.head)
            path, _ = self._staging(f"{rec.head}-{sid}-prefetched")
            self.store.checkout(rec.head, {"images": path})
            with self._mu:
                self._staged[sid] = _Staged(rec.head, path, expires)
            return True

    def _unstage(self, sid: str, keep: bool = False) -> _Staged | None:
        """Forget the images `prefetch` staged for `sid`; delete them unless `keep` (then the caller owns them)."""
        with self._mu:
            staged = self._staged.pop(sid, None)
        if staged is not None and not keep:
            self._cleaner.submit(_rmtree, staged.path)
        return staged

    # --- checkpoints --------------------------------------------------------------------------

    def _snapshot(self, rec: Record, transitional: State, *, thaw: bool) -> _Snapshot:
        """Freeze-consistent images + sealed fs of a live sandbox into staging; marks the record
        `transitional` with `prev` and `pending` set. The store packs the memory images while CRIU
        writes them (`Store.follow`); `_commit` finishes that, and a caller that does not commit
        must `abort` the follower."""
        ck = _new_id("ck")
        images, fs = self._staging(ck)
        self._set(rec, transitional, prev=rec.state, pending=ck)
        follower = self.store.follow(images)
        try:
            t = self.driver.snapshot(rec.id, self._dirs(rec.id), images, fs, self._layer_dir(rec.layer),
                                     thaw=thaw, network=rec.spec.network)
        except BaseException:
            follower.abort()
            _rmtree(images)
            _rmtree(fs)
            self._set(rec, rec.prev, prev=None, pending=None)
            raise
        return _Snapshot(ck, images, fs, t, follower)

    def _commit(self, rec: Record, snap: _Snapshot, fs: Path | None = None) -> Manifest:
        """Commit `snap` (its sealed fs from `fs` if it moved) as the sandbox's next checkpoint."""
        meta = {"sandbox": rec.id, "spec": rec.spec.to_json()}
        return self.store.commit({"images": snap.images, "fs": fs or snap.fs}, parent=rec.head, meta=meta,
                                 id=snap.ck, follower=snap.follower)

    def checkpoint(self, sid: str) -> CheckpointInfo:
        """Snapshot a running or paused sandbox into the store; the sandbox carries on as it was."""
        with self._locked(sid) as rec:
            self._require(rec, "checkpoint", *LIVE)
            info, images, fs = self._checkpoint_locked(rec)
            self._cleaner.submit(_rmtree, images)
            _rmtree(fs)
            return info

    def _checkpoint_locked(self, rec: Record) -> tuple[CheckpointInfo, Path, Path]:
        t0 = time.perf_counter()
        snap = self._snapshot(rec, State.CHECKPOINTING, thaw=True)
        t = snap.t
        try:
            # The sandbox runs again already; a failed commit only loses this checkpoint.
            self._set(rec, rec.prev, prev=None)
            t1 = time.perf_counter()
            m = self._commit(rec, snap)
            t["store"] = time.perf_counter() - t1
        except BaseException:
            snap.follower.abort()
            _rmtree(snap.images)
            _rmtree(snap.fs)
            self._set(rec, rec.state, pending=None)
            raise
        self._set(rec, rec.state, head=snap.ck, pending=None)
        t["total"] = time.perf_counter() - t0
        self._timings[rec.id] = t
        return CheckpointInfo.from_manifest(m, t), snap.images, snap.fs

    def hibernate(self, sid: str) -> CheckpointInfo:
        """Checkpoint, then stop every process: memory and CPU are released; `resume` brings it back."""
        with self._locked(sid) as rec:
            self._require(rec, "hibernate", *LIVE)
            t0 = time.perf_counter()
            # Frozen, not killed, until the checkpoint is durable: a failure can still roll back.
            snap = self._snapshot(rec, State.HIBERNATING, thaw=False)
            ck, images, fs, t = snap.ck, snap.images, snap.fs, snap.t
            try:
                t1 = time.perf_counter()
                m = self._commit(rec, snap)
                t["store"] = time.perf_counter() - t1
            except BaseException:
                _rmtree(images)
                _rmtree(fs)
                if rec.prev is State.RUNNING:
                    self.driver.resume(sid)
                self._set(rec, rec.prev, prev=None, pending=None)
                raise
            self._cleaner.submit(_rmtree, images)
            t1 = time.perf_counter()
            self.driver.destroy(sid, self._dirs(sid))
            self._wipe_upper(rec)
            # The sealed fs is exactly what `resume` will stack the new upper on: keep it as a layer.
            os.rename(fs, self._layer_dir(ck))
            t["stop"] = time.perf_counter() - t1
            self._set(rec, State.HIBERNATED, head=ck, layer=None, prev=None, pending=None)
            self._gc_layers()
            t["total"] = time.perf_counter() - t0
            self._timings[sid] = t
            return CheckpointInfo.from_manifest(m, t)

    def _wipe_upper(self, rec: Record) -> None:
        dirs = self._dirs(rec.id)
        for d in (dirs.upper, dirs.work, dirs.bundle, dirs.logs):
            _rmtree(d)

    def _ensure_layer(self, ck: str) -> Path:
        """The sealed fs of checkpoint `ck` as a layer directory, checked out of the store if needed."""
        layer = self._layer_dir(ck)
        if not layer.exists():
            tmp = self.root / "tmp" / f"{ck}-fs-{secrets.token_hex(4)}"
            self.store.checkout(ck, {"fs": tmp})
            try:
                os.rename(tmp, layer)
            except OSError:  # another thread checked it out first
                _rmtree(tmp)
        return layer

    def _restore_into(self, rec: Record, ck: str, images: Path | None = None) -> dict[str, float]:
        """Start `rec`'s processes from checkpoint `ck` (images from `prefetch` or the store unless given)."""
        t: dict[str, float] = {}
        t0 = time.perf_counter()
        self._ensure_layer(ck)
        own = images is None
        if own:
            staged = self._unstage(rec.id, keep=True)
            if staged is not None and staged.ck == ck:
                images = staged.path
            else:
                if staged is not None:
                    _rmtree(staged.path)
                images, _ = self._staging(f"{ck}-{rec.id}")
                self.store.checkout(ck, {"images": images})
        t["store"] = time.perf_counter() - t0
        try:
            lowers = [self._layer_dir(ck), template_rootfs(rec.spec.template)]
            t.update(self.driver.restore(rec.id, self._dirs(rec.id), rec.spec, lowers, images))
        finally:
            if own:
                self._cleaner.submit(_rmtree, images)
        t["total"] = time.perf_counter() - t0
        self._timings[rec.id] = t
        return t

    def restore(self, ck: str, id: str | None = None, timeout_s: float | None = None) -> SandboxInfo:
        """A new running sandbox from checkpoint `ck` (its processes, memory and files)."""
        m = self.store.get(ck)
        spec = SandboxSpec.from_json(m.meta.get("spec", {}))
        if timeout_s is not None:
            spec = SandboxSpec(**{**spec.to_json(), "timeout_s": timeout_s})
        return self._spawn(spec, ck, id)

    def _spawn(self, spec: SandboxSpec, ck: str, id: str | None = None, images: Path | None = None) -> SandboxInfo:
        sid = self._claim_id(id)
        now = time.time()
        rec = Record(sid, spec, State.CREATING, now, deadline=now + spec.timeout_s if spec.timeout_s else None,
                     head=ck, layer=ck)
        self._register(rec)
        with self._locked(sid):
            self._save(rec)
            try:
                self._restore_into(rec, ck, images)
            except BaseException:
                self._discard(rec)
                raise
            self._set(rec, State.RUNNING)
            return self._info(rec)

    def fork(self, sid: str, n: int = 1) -> tuple[CheckpointInfo, list[SandboxInfo]]:
        """`n` new running sandboxes, each a copy of this one now (processes, memory, files).

        One checkpoint serves all of them: its images stay on tmpfs and its sealed fs becomes their
        shared lower layer, so the store is written once (in parallel with the restores) and never read.
        """
        check_number("n", n, 1, MAX_FORK, "children", integer=True)
        with self._locked(sid) as rec:
            self._require(rec, "fork", *LIVE)
            t0 = time.perf_counter()
            snap = self._snapshot(rec, State.CHECKPOINTING, thaw=True)
            ck, images, fs, t = snap.ck, snap.images, snap.fs, snap.t
            kids: list[SandboxInfo] = []
            m: Manifest | None = None
            try:
                # `pending` stays set until the end: it keeps the new layer from being collected.
                self._set(rec, rec.prev, prev=None)
                os.rename(fs, self._layer_dir(ck))
                private = [self._private_images(images, i) for i in range(n)]  # before any child starts
                t1 = time.perf_counter()
                with ThreadPoolExecutor(max_workers=min(n, 8) + 1) as pool:
                    commit = pool.submit(self._commit, rec, snap, self._layer_dir(ck))
                    spawns = [pool.submit(self._spawn, rec.spec, ck, None, d) for d in private]
                    failures = []
                    for f in spawns:
                        try:
                            kids.append(f.result())
                        except Exception as e:
                            failures.append(e)
                    t["restore+store"] = time.perf_counter() - t1  # children restored while the store commits
                    m = commit.result()
                if failures:
                    raise failures[0]
            except BaseException:
                snap.follower.abort()  # in case the commit never ran
                for kid in kids:
                    with contextlib.suppress(SandboxError):
                        self.kill(kid.id)
                if m is not None:  # a fork that failed leaves no checkpoint behind
                    with contextlib.suppress(SandboxError):
                        self.store.delete(ck)
                self._set(rec, rec.state, pending=None)
                self._gc_layers()
                raise
            finally:
                for d in images.parent.glob(f"{images.name}*"):
                    self._cleaner.submit(_rmtree, d)
                _rmtree(fs)  # only there if the rename did not happen
            self._set(rec, rec.state, head=ck, pending=None)
            t["total"] = time.perf_counter() - t0
            self._timings[sid] = t
            return CheckpointInfo.from_manifest(m, t), kids

    @staticmethod
    def _private_images(images: Path, i: int) -> Path:
        """A hard-linked copy of the image directory: each concurrent CRIU restore writes its own
        stats file into the directory it restores from."""
        out = images.with_name(f"{images.name}.{i}")
        out.mkdir()
        for f in images.iterdir():
            os.link(f, out / f.name)
        return out

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint in the store, oldest first."""
        return [CheckpointInfo.from_manifest(m) for m in self.store.list()]

    def get_checkpoint(self, ck: str) -> CheckpointInfo:
        return CheckpointInfo.from_manifest(self.store.get(ck))

    def delete_checkpoint(self, ck: str) -> None:
        """Remove a checkpoint from the store; refused while a hibernated (or resuming) sandbox needs it."""
        with self._mu:
            users = [r for r in self._records.values()
                     if r.head == ck and r.state in (State.HIBERNATED, State.RESUMING)]
        if users:
            raise InvalidStateError(f"checkpoint {ck} holds {users[0].state} sandbox {users[0].id}; "
                                    "kill or resume it first")
        self.store.delete(ck)
        self._gc_layers()

    # --- garbage, expiry, recovery ------------------------------------------------------------

    def _gc_layers(self) -> None:
        """Remove sealed layers no sandbox stands on (or will resume onto)."""
        with self._mu:
            used = {r.layer for r in self._records.values()} | {
                r.head for r in self._records.values() if r.state in (State.HIBERNATED, State.RESUMING)}
            used |= {r.pending for r in self._records.values()}
        for d in (self.root / "layers").iterdir():
            if d.name not in used:
                _rmtree(d)

    def _reap_expired(self) -> None:
        while not self._closed.wait(0.5):
            now, mono = time.time(), time.monotonic()
            with self._mu:
                stale = [sid for sid, st in self._staged.items() if st.expires <= mono]
            for sid in stale:
                self._unstage(sid)
            with self._mu:
                expired = [r.id for r in self._records.values() if r.deadline is not None and r.deadline <= now]
            for sid in expired:
                try:
                    self._expire(sid)
                except Exception as e:  # noqa: BLE001 - the reaper must outlive any one sandbox's failure
                    _log.warning("timeout of sandbox %s not applied: %s: %s", sid, type(e).__name__, e)

    def _expire(self, sid: str) -> None:
        """Apply the sandbox's `on_timeout` (its spec's, else the runtime's) if it is still past its deadline."""
        with self._locked(sid) as rec:
            if rec.deadline is None or rec.deadline > time.time():
                return  # renewed or handled while we waited for the lock
            if (rec.spec.on_timeout or self.on_timeout) == "kill":
                self._discard(rec)
                return
            if rec.state not in LIVE:  # hibernated or lost already: nothing runs to stop
                self._set(rec, rec.state, deadline=None)
                return
            try:
                self.hibernate(sid)
            except Exception:  # noqa: BLE001 - e.g. a full disk under the store
                self._discard(rec)  # its time is up either way: never hold resources past it
                return
            why = f"hibernated when its timeout_s={rec.spec.timeout_s:g} ran out"
            self._set(rec, rec.state, deadline=None, reason=why)

    def _recover(self) -> None:
        self.driver.cleanup_stale()
        self.store.gc()  # temp files and unreferenced packs of commits a crash interrupted
        for d in (self.root / "tmp").iterdir():
            _rmtree(d)
        _rmtree(self.scratch)
        for path in sorted((self.root / "sandboxes").glob("*/record.json")):
            rec = Record.load(path)
            self._register(rec)
            self._settle(rec)
        for d in (self.root / "sandboxes").iterdir():  # created but never recorded
            if not (d / "record.json").exists():
                with contextlib.suppress(SandboxError):
                    self.driver.destroy(d.name, self._dirs(d.name))
                _rmtree(d)
        self._gc_layers()

    def _settle(self, rec: Record) -> None:
        """Bring one adopted record in line with what is really there (see the module docstring)."""
        status = self.driver.status(rec.id)
        alive = status in ("running", "paused")
        committed = rec.pending if rec.pending and self._has_checkpoint(rec.pending) else None
        s = rec.state
        if s is State.HIBERNATING and committed:
            # The checkpoint is durable: finish the hibernation.
            with contextlib.suppress(SandboxError):
                self.driver.destroy(rec.id, self._dirs(rec.id))
            self._wipe_upper(rec)
            self._set(rec, State.HIBERNATED, head=committed, layer=None, prev=None, pending=None)
        elif s in (State.CHECKPOINTING, State.HIBERNATING, *LIVE) and alive:
            target = rec.prev if s in (State.CHECKPOINTING, State.HIBERNATING) else s
            if target is State.RUNNING and status == "paused":
                self.driver.resume(rec.id)
            elif target is State.PAUSED and status == "running":
                self.driver.pause(rec.id)
            self._set(rec, target, head=committed or rec.head, prev=None, pending=None)
        elif s is State.RESUMING and alive:
            self._set(rec, State.RUNNING, layer=rec.head, prev=None)
        elif s is State.RESUMING:
            with contextlib.suppress(SandboxError):
                self.driver.destroy(rec.id, self._dirs(rec.id))
            self._wipe_upper(rec)
            self._set(rec, State.HIBERNATED, prev=None)
        elif s in (State.HIBERNATED, State.LOST):
            pass
        else:  # creating, or its processes are gone
            with contextlib.suppress(SandboxError):
                self.driver.destroy(rec.id, self._dirs(rec.id))
            why = ("the runtime died while creating it" if s is State.CREATING
                   else f"its processes were gone when the runtime restarted (it was {s.value})")
            self._set(rec, State.LOST, reason=why, prev=None, pending=None)

    def _has_checkpoint(self, ck: str) -> bool:
        try:
            self.store.get(ck)
            return True
        except CheckpointNotFoundError:
            return False

    def close(self) -> None:
        """Let go of the directory; sandboxes keep running and the next runtime adopts them."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._reaper.join()
        for sid in list(self._staged):
            self._unstage(sid)
        self._cleaner.shutdown(wait=True)
        with contextlib.suppress(OSError):
            self.scratch.rmdir()
        self._lock_file.close()

    def kill_all(self) -> None:
        """Kill every sandbox of this runtime."""
        for info in self.list():
            with contextlib.suppress(NotFoundError):
                self.kill(info.id)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pump(stream: Any, buf: bytearray) -> None:
    for chunk in iter(lambda: stream.read1(65536), b""):
        buf += chunk
    stream.close()


def _feed(stream: Any, data: bytes) -> None:
    """Write a command's whole stdin and close it (a command that exits early just gets less)."""
    with contextlib.suppress(BrokenPipeError, OSError):
        stream.write(data)
    with contextlib.suppress(BrokenPipeError, OSError):
        stream.close()
