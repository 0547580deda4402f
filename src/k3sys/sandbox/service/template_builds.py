"""The service's template builds (E2B's template API: templates_api.py): each build's state and
logs, the files its `copy()` steps uploaded, and the worker that runs it with the one builder every
front end shares (runtime/oci/builder.py), off the request path.

A build is made by `POST /v3/templates` ("waiting": the SDK uploads its files next), started by
`POST /v2/templates/{id}/builds/{build}` ("building", queued behind the builds before it), and ends
"ready" (the template sealed) or "error" (`reason`: the builder's message, a failed RUN's output
in it; no template left). Builds run one at a time (`workers`): two builds of the same steps at once
would seal the same stage template (`_stage-<pid>-<key>`), and a build is sandboxes like any others.

Memory per build is bounded: its log keeps the last `LOG_ENTRIES` lines of at most `LOG_LINE`
characters (older ones are counted, so a reader's offsets stay absolute), and the service keeps the
last `KEPT_BUILDS` builds. Builds are the process's: after a restart their ids are unknown (404);
the templates they made are in the system directory like any other.

Uploads: `<data dir>/e2b/template-files/<template>/<hash>.tar`, written by the link
`upload_url` gives (signed with a secret of this process, valid for `UPLOAD_TTL_S`: the SDK PUTs to
it without its key, as to E2B's storage), unpacked per build by the layer unpacker's rules
(runtime/oci/unpack.py: nothing lands outside the build's context, no devices) and removed when the
build ends; the directory is emptied at each start.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from k3sys.sandbox.errors import InvalidArgumentError, InvalidStateError, NotFoundError, SandboxError, TooLargeError
from k3sys.sandbox.runtime.oci.catalog import STAGE_PREFIX
from k3sys.sandbox.runtime.oci.image import decompressed
from k3sys.sandbox.runtime.oci.steps import Step
from k3sys.sandbox.runtime.oci.unpack import unpack_layer
from k3sys.sandbox.runtime.runtime import Runtime
from k3sys.sandbox.runtime.system import system_paths

_log = logging.getLogger(__name__)
LOG_ENTRIES = 5000  # lines of a build's log kept
LOG_LINE = 2000  # characters of one log line kept
KEPT_BUILDS = 256  # builds remembered (the oldest finished ones go first)
UPLOAD_TTL_S = 3600  # seconds an upload link is valid, and a build may wait for its files
MAX_WAITING = 8  # builds one tenant (or the admin) may have waiting for files at once
MAX_UPLOADS = 256  # uploads (copy() steps' files) of one build
_HASH = re.compile(r"^[0-9a-f]{64}$")  # the SDK's files hash: SHA-256, hex
_STEP = re.compile(r"^\[(\d+)/\d+\] ")  # the builder's line after each step


@dataclass
class Build:
    """One build: `template_id` as its caller names it, `stored` the template's name in the system
    directory, `owner` the tenant (None: the admin). Its log: `entries` (timestamp, level, message),
    `dropped` lines before the first kept."""

    id: str
    template_id: str
    stored: str
    owner: str | None
    memory_mb: int
    created: float = field(default_factory=time.time)
    status: str = "waiting"
    reason: dict | None = None
    steps_done: int = 0
    entries: deque = field(default_factory=lambda: deque(maxlen=LOG_ENTRIES))
    dropped: int = 0

    def log(self, message: str, level: str = "info") -> None:
        if len(self.entries) == LOG_ENTRIES:
            self.dropped += 1
        if (m := _STEP.match(message)) is not None:
            self.steps_done = int(m.group(1))
        self.entries.append((datetime.now(UTC).isoformat(), level, message[:LOG_LINE]))

    def log_page(self, offset: int, limit: int) -> list[dict]:
        """At most `limit` log entries from absolute line `offset` on (the first kept, if it is gone)."""
        start = max(offset - self.dropped, 0)
        return [{"timestamp": ts, "level": lv, "message": msg}
                for ts, lv, msg in list(self.entries)[start:start + limit]]

    def fail(self, e: Exception) -> None:
        # The SDK maps `step` to the stack trace of the instruction: "base" the FROM, N the Nth step.
        step = "base" if self.steps_done == 0 else str(self.steps_done)
        message = str(e) if isinstance(e, SandboxError) else f"internal error: {type(e).__name__}: {e}"
        self.log(message, "error")
        self.reason = {"message": message, "step": step}
        self.status = "error"


class TemplateBuilds:
    """The builds of one service (see the module docstring); `files` the uploads' directory."""

    def __init__(self, files: Path, workers: int = 1) -> None:
        self.files = files
        shutil.rmtree(files, ignore_errors=True)  # uploads of a previous process's builds
        files.mkdir(parents=True, exist_ok=True)
        self._secret = secrets.token_bytes(32)
        self._builds: OrderedDict[str, Build] = OrderedDict()
        self._mu = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="k3sys-template-build")

    def close(self, rt: Runtime | None = None) -> None:
        """Drop the queued builds, and kill the sandboxes of a running one in `rt` (the build fails,
        its stage template goes): a build sandbox is never hibernated at shutdown for the next start
        to adopt, since the build it served is gone with this process."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        stage = f"{STAGE_PREFIX}stage-{os.getpid()}-"  # the builder's stage templates (builder.py)
        for info in rt.list() if rt is not None else []:
            if info.spec.template.startswith(stage):
                with contextlib.suppress(SandboxError):
                    rt.kill(info.id)

    def new(self, template_id: str, stored: str, owner: str | None, memory_mb: int) -> Build:
        """A waiting build of `stored`. InvalidStateError (409) if that template exists or a build of it
        has not ended: a name is never replaced under the sandboxes standing on it."""
        with self._mu:
            now = time.time()
            for b in [b for b in self._builds.values() if b.status == "waiting" and b.created < now - UPLOAD_TTL_S]:
                b.fail(InvalidStateError(f"never started: {UPLOAD_TTL_S} s passed without its definition"))
                shutil.rmtree(self.files / b.stored, ignore_errors=True)
            if sum(b.owner == owner and b.status == "waiting" for b in self._builds.values()) >= MAX_WAITING:
                raise InvalidStateError(f"{MAX_WAITING} builds of yours are waiting for their files and definition: "
                                        f"start or abandon them first (they expire after {UPLOAD_TTL_S} s)")
            if (system_paths().templates / stored).exists():
                raise InvalidStateError(f"template {template_id!r} exists: delete it first (a template's "
                                        f"sandboxes and snapshots stand on it, so it is never rebuilt in place)")
            for b in [b for b in self._builds.values() if b.stored == stored and b.status != "error"]:
                if b.status == "building":
                    raise InvalidStateError(f"template {template_id!r}: build {b.id} of it has not ended")
                b.fail(InvalidStateError("superseded by a newer build before it started"))  # waiting
            build = Build(uuid.uuid4().hex, template_id, stored, owner, memory_mb)
            self._builds[build.id] = build
            for old in [b for b in self._builds.values() if b.status in ("ready", "error")]:
                if len(self._builds) <= KEPT_BUILDS:
                    break
                del self._builds[old.id]
        return build

    def get(self, build_id: str, stored: str) -> Build:
        build = self._builds.get(build_id)
        if build is None or build.stored != stored:
            raise NotFoundError(f"no build {build_id!r} of this template")
        return build

    def waiting(self, stored: str) -> Build | None:
        """The waiting build of `stored` (the one its uploads are for), if any."""
        return next((b for b in self._builds.values() if b.stored == stored and b.status == "waiting"), None)

    def of(self, stored: str) -> list[Build]:
        return [b for b in self._builds.values() if b.stored == stored]

    # --- uploads ---------------------------------------------------------------------------------------

    def upload_path(self, stored: str, files_hash: str) -> Path:
        if not _HASH.match(files_hash):
            raise InvalidArgumentError(f"files hash: expected 64 lowercase hex digits, got {files_hash[:80]!r}")
        return self.files / stored / f"{files_hash}.tar"

    def upload_room(self, stored: str) -> None:
        """TooLargeError once a build holds MAX_UPLOADS uploads (each is at most the body limit)."""
        held = self.files / stored
        if held.is_dir() and sum(1 for _ in held.glob("*.tar")) >= MAX_UPLOADS:
            raise TooLargeError(f"a build takes at most {MAX_UPLOADS} uploads (copy() steps' files)")

    def upload_token(self, stored: str, files_hash: str, expires: int) -> str:
        return hmac.new(self._secret, f"{stored}\0{files_hash}\0{expires}".encode(), hashlib.sha256).hexdigest()

    def check_upload(self, stored: str, files_hash: str, expires: int, token: str) -> Path:
        """Where an upload goes, if `token` is one `upload_token` gave and not past `expires`."""
        if expires < time.time() or not hmac.compare_digest(token, self.upload_token(stored, files_hash, expires)):
            raise NotFoundError("no such upload link (or it expired: ask the template API for another)")
        path = self.upload_path(stored, files_hash)
        path.parent.mkdir(exist_ok=True)
        return path

    # --- running -------------------------------------------------------------------------------------

    def start(self, build: Build, doc: dict, steps: list[Step], meta: dict,
              run: Callable[[Build, list[Step], Path, dict], None]) -> None:
        """Queue `build` of E2B definition `doc` (read into `steps` and template.json `meta`): its
        uploads checked now, then `run(build, steps, context, meta)` in the worker."""
        if build.status != "waiting":
            raise InvalidStateError(f"build {build.id}: already {build.status}")
        hashes = []
        for i, s in enumerate(doc.get("steps") or [], 1):
            if s.get("type") == "COPY":
                h = str(s.get("filesHash") or "")
                if not self.upload_path(build.stored, h).is_file():
                    raise InvalidArgumentError(f"E2B template step {i}: the files of hash {h[:64]!r} were not "
                                               f"uploaded (GET /templates/{{id}}/files/{{hash}} gives the link)")
                hashes.append(h)
        # Each COPY reads from its upload's own directory of the context: `<hash>/<src>`.
        steps = [_from_upload(s, hashes.pop(0)) if s.op == "copy" else s for s in steps]
        build.status = "building"
        build.log(f"build {build.id} queued")
        self._pool.submit(self._run, build, steps, meta, run)

    def _run(self, build: Build, steps: list[Step], meta: dict,
             run: Callable[[Build, list[Step], Path, dict], None]) -> None:
        t0 = time.monotonic()
        try:
            with self._context(build) as context:
                run(build, steps, context, meta)
            build.log(f"built {build.template_id} in {time.monotonic() - t0:.1f} s")
            build.status = "ready"
        except Exception as e:  # noqa: BLE001 - every failure ends the build, the SDK reads it there
            if not isinstance(e, SandboxError):
                _log.exception("template build %s of %s", build.id, build.stored)
            build.fail(e)
        finally:
            shutil.rmtree(self.files / build.stored, ignore_errors=True)

    @contextlib.contextmanager
    def _context(self, build: Build) -> Iterator[Path]:
        """The build's context: each upload of it unpacked into `<hash>/`, removed after."""
        with tempfile.TemporaryDirectory(dir=self.files, prefix=".context-") as tmp:
            for tar in sorted((self.files / build.stored).glob("*.tar")):
                dest = Path(tmp) / tar.stem
                dest.mkdir()
                with open(tar, "rb") as f, decompressed(f) as stream:
                    unpack_layer(stream, dest, f"upload {tar.stem}")
            yield Path(tmp)


def _from_upload(step: Step, files_hash: str) -> Step:
    return Step(step.op, {**step.args, "srcs": [f"{files_hash}/{s}" for s in step.args["srcs"]]}, step.line,
                step.text)
