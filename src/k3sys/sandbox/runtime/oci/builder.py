"""The template builder: build steps (steps.py) run one after the other, each cached by its key,
the result sealed as a template (catalog.py). The one engine behind `k3sys sandbox template build`
(a Dockerfile: dockerfile.py) and E2B's template definitions (e2b_template.py; served over HTTP
by service/templates_api.py).

A build's state is its layers (bottom first), its config (env, cwd, user, cmd, entrypoint) and the
key of its last step. A step that makes files (RUN, COPY / ADD, a WORKDIR that is missing) makes one
layer, `step-<key>` in the layer store; the key hashes the parent's key, the step and what it reads
(a COPY's files), so a layer that exists *is* the cache hit: a rebuild after the last step changed
runs that step only. The cache is the layer store: layers no template lists go at `template rm` /
`template prune` (catalog.collect).

RUN runs in a sandbox like any other, with the hardening of a normal one (user namespace, seccomp,
cgroup limits, no network unless the build asks for it): the build's state is sealed as a stage
template (`_stage-<pid>-<key>`: its env, cwd and user are the step's defaults, as for any template), the
command runs as the sandbox's default user, a checkpoint seals what it wrote (overlay's diff, owners
canonical: layers.seal), and that diff is the layer. What the runtime itself put in the root (runc's
/dev entries, the agent's /.k3sys) and sockets are left out of it, and /dev, /proc and /sys, which a
sandbox gets fresh, too. A RUN that exits non-zero raises BuildError with its output; no template is
sealed, and the stage and sandbox are removed either way.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from k3sys.sandbox.errors import BuildError, CommandTimeoutError, InvalidStateError
from k3sys.sandbox.runtime.layers import link_tree
from k3sys.sandbox.runtime.oci import catalog
from k3sys.sandbox.runtime.oci.context import Context
from k3sys.sandbox.runtime.oci.image import ImageConfig, decompressed
from k3sys.sandbox.runtime.oci.steps import Step
from k3sys.sandbox.runtime.oci.unpack import IMPLIED, unpack_layer
from k3sys.sandbox.runtime.system import system_paths
from k3sys.sandbox.runtime.templates import BUILDERS, template_rootfs, templates_lock
from k3sys.sandbox.spec import CommandResult, OutputPieces, SandboxSpec

_NOT_OF_A_RUN = ("dev", "proc", "sys", ".k3sys")  # top-level entries a RUN layer never keeps
_TAR = re.compile(r"\.(tar|tar\.gz|tgz|tar\.zst)$")
OUTPUT_TAIL = 4000  # characters of a failed RUN's output in its BuildError
RUN_POLL_S = 0.2  # seconds between looks at a running RUN's output


@dataclass
class BuildResult:
    """What a build made: the template's `name`, its `layers`, and per step (in order) "cached",
    "ran" or "config" (a step that makes no layer; FROM "ran" when it unpacked a layer the store
    lacked), with the build's seconds."""

    name: str
    layers: list[str]
    steps: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _State:
    layers: list[str]
    config: ImageConfig
    key: str
    source: str


class Builder:
    """Runs builds (see the module docstring). `runtime`: the sandbox runtime RUN steps use (None:
    a private one under the layer store, opened at the first RUN and closed after the build);
    `network`, `memory_mb`, `disk_mb`: the build sandbox's; `run_timeout`: seconds per RUN;
    `log`: where progress and RUN output lines go."""

    def __init__(self, runtime=None, *, network: bool = False, memory_mb: int = 1024, disk_mb: int = 8192,
                 run_timeout: float = 1800, log: Callable[[str], None] = print) -> None:
        self.runtime = runtime
        self.spec = dict(network=network, memory_mb=memory_mb, disk_mb=disk_mb)
        self.run_timeout = run_timeout
        self.log = log
        self.store = catalog.layer_store()  # set again by each build (K3SYS_SYSTEM_DIR is read then)
        self._own_runtime = None

    def build(self, steps: list[Step], name: str, context: Path | None = None, meta: dict | None = None) -> BuildResult:
        """Run `steps` (the first a `from`) with files from `context`; seal template `name`, with
        `meta` added to its template.json (E2B's start and ready commands: runtime/warm.py)."""
        catalog.check_name(name)
        if (system_paths().templates / name).exists():
            raise InvalidStateError(f"template {name!r} exists: remove it first (k3sys sandbox template rm {name})")
        if not steps or steps[0].op != "from" or any(s.op == "from" for s in steps[1:]):
            raise BuildError("a build is one FROM followed by its steps")
        t0 = time.monotonic()
        self.store = catalog.layer_store()
        result = BuildResult(name, [])
        ctx = Context(context)
        try:
            held = set(self.store.ids())
            state = self._from(steps[0])
            result.steps.append("ran" if set(state.layers) - held else "cached")
            self.log(f"[1/{len(steps)}] {steps[0].where()}: {len(state.layers)} layer(s)")
            for i, step in enumerate(steps[1:], 2):
                t1 = time.monotonic()
                state, how = self._step(state, step, ctx)
                result.steps.append(how)
                self.log(f"[{i}/{len(steps)}] {step.where()}: {how} ({time.monotonic() - t1:.2f} s)")
            catalog.seal(name, state.layers, state.config, state.source, self.store, meta)
        finally:
            self._close_runtime()
        result.layers, result.seconds = state.layers, time.monotonic() - t0
        return result

    def _from(self, step: Step) -> _State:
        source = step.args["source"]
        if source in BUILDERS or (system_paths().templates / source / "rootfs").is_dir():
            template_rootfs(source)  # a built-in recipe is built on first use
            layers = catalog.template_layers(source)
            if layers is None:  # a built-in template's plain rootfs: one layer of hard links to it
                meta = (system_paths().templates / source / "template.json").read_bytes()
                lid = "rootfs-" + Step("from", {"source": source}).key(meta.decode(errors="replace"))
                self.store.add(lid, lambda tree: _link_rootfs(source, tree), f"template {source}")
                layers = [lid]
            config = catalog.template_config(source)
        else:
            layers, config = catalog.import_layers(source, self.store, self.log)
        return _State(list(layers), config, step.key("", ",".join(layers)), f"dockerfile FROM {source}")

    def _step(self, st: _State, step: Step, ctx: Context) -> tuple[_State, str]:
        op, a = step.op, step.args
        nonce = uuid.uuid4().hex if a.get("force") else ""  # E2B's force: this step's cache is skipped
        if op == "env":
            return replace(st, config=replace(st.config, env={**st.config.env, **a["env"]}), key=step.key(st.key)), \
                "config"
        if op == "user":
            return replace(st, config=replace(st.config, user=a["user"]), key=step.key(st.key)), "config"
        if op in ("cmd", "entrypoint"):
            return replace(st, config=replace(st.config, **{op: a[op]}), key=step.key(st.key)), "config"
        if op == "workdir":
            st = replace(st, config=replace(st.config, cwd=a["path"]), key=step.key(st.key))
            found = self.store.lookup(st.layers, a["path"])
            if found is not None and stat.S_ISDIR(found.st_mode):
                return st, "config"
            return self._layer(st, step.key(st.key, nonce), lambda tree: _mkdirs(tree, a["path"]))
        if op == "copy":
            dest_is_dir = a["dest"].endswith("/")
            if not dest_is_dir:
                found = self.store.lookup(st.layers, a["dest"])
                dest_is_dir = found is not None and stat.S_ISDIR(found.st_mode)
            sources, digest = ctx.plan(a["srcs"], dest_is_dir, step.where())
            owner = self._owner(st.layers, a["chown"], step)
            chmod = int(a["chmod"], 8) if a["chmod"] else None
            key = step.key(st.key, digest + nonce)
            if a["extract"] and len(sources) == 1 and sources[0].kind == "file" and _TAR.search(sources[0].rel):
                def fill(tree: Path) -> None:
                    dest = _mkdirs(tree, a["dest"], implied=True)
                    with ctx.open(sources[0].rel) as f, decompressed(f) as tar:
                        unpack_layer(tar, dest, f"ADD {sources[0].rel}")
            else:
                def fill(tree: Path) -> None:
                    ctx.fill(tree, a["dest"], sources, owner, chmod)
            return self._layer(st, key, fill)
        if op == "run":
            key = step.key(st.key, nonce)
            return self._layer(st, key, lambda tree: self._run(st, step, key, tree))
        raise BuildError(f"{step.where()}: unknown step {op!r}")

    def _layer(self, st: _State, key: str, fill: Callable[[Path], None]) -> tuple[_State, str]:
        lid = f"step-{key}"
        made = self.store.add(lid, fill, "build step")
        return replace(st, layers=[*st.layers, lid], key=key), "ran" if made else "cached"

    def _owner(self, layers: list[str], chown: str | None, step: Step) -> tuple[int, int]:
        """--chown's user[:group] as numbers, names looked up in the build's /etc/passwd and /etc/group."""
        if not chown:
            return 0, 0
        user, _, group = chown.partition(":")
        uid = self._id(layers, "etc/passwd", user, step)
        gid = self._id(layers, "etc/group", group, step) if group else None
        if gid is None:
            gid = uid if user.isdigit() else self._field(layers, "etc/passwd", user, 3, step)
        return uid, gid

    def _id(self, layers: list[str], table: str, name: str, step: Step) -> int:
        return int(name) if name.isdigit() else self._field(layers, table, name, 2, step)

    def _field(self, layers: list[str], table: str, name: str, col: int, step: Step) -> int:
        for lid in reversed(layers):
            path = self.store.tree(lid) / table
            if path.is_file() and not path.is_symlink():
                for line in path.read_text(errors="replace").splitlines()[:100_000]:
                    f = line.split(":")
                    if len(f) > col and f[0] == name and f[col].isdigit():
                        return int(f[col])
                break
        raise BuildError(f"{step.where()}: no {name!r} in the image's /{table}")

    def _run(self, st: _State, step: Step, key: str, tree: Path) -> None:
        """RUN `step` over the build's state (see the module docstring); its diff into `tree`."""
        stage = f"{catalog.STAGE_PREFIX}stage-{os.getpid()}-{key[:32]}"
        with self._stage(stage, st) as rt:
            info = rt.create(SandboxSpec(template=stage, **self.spec))
            ck = None
            try:
                cmd = step.args["cmd"]
                # As the step's user (E2B's run_cmd(user=)) or the template's default, from its cwd
                # (a Dockerfile without WORKDIR runs at /, as docker does).
                cid = rt.start_process(info.id, cmd if isinstance(cmd, str) else shlex.join(cmd),
                                       st.config.cwd or "/", step.args.get("env") or None, step.args.get("user"))
                try:
                    r = self._follow(rt, cid)
                except CommandTimeoutError as e:
                    raise BuildError(f"{step.where()}: ran past {self.run_timeout} s and was killed\n"
                                     f"{_tail(e.stdout + e.stderr)}") from None
                finally:
                    rt.forget_command(cid)
                if r.exit_code != 0:
                    raise BuildError(f"{step.where()}: exited {r.exit_code}\n{_tail(r.stdout + r.stderr)}")
                ck = rt.checkpoint(info.id)
                tree.rmdir()
                rt.store.checkout(ck.id, {"fs": tree})
            finally:
                with contextlib.suppress(Exception):
                    rt.kill(info.id)
                if ck is not None:
                    with contextlib.suppress(Exception):
                        rt.delete_checkpoint(ck.id)
        for name in _NOT_OF_A_RUN:
            path = tree / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
        for p in list(tree.rglob("*")):
            if stat.S_ISSOCK(p.lstat().st_mode):
                p.unlink()

    def _follow(self, rt, cid: str) -> CommandResult:
        """Wait for RUN command `cid` (at most `run_timeout` s), logging its output lines as they come
        (a build's log is read while it runs: E2B's build status), a line at most OUTPUT_TAIL characters."""
        deadline = time.monotonic() + self.run_timeout
        pieces, partial = OutputPieces(), {"stdout": "", "stderr": ""}
        done = False
        while not done and time.monotonic() < deadline:
            out, err, done = rt.read_command_output(cid, pieces.offsets)
            for name, text in pieces.feed(out, err, final=done):
                *lines, partial[name] = (partial[name] + text).split("\n")
                if len(partial[name]) > OUTPUT_TAIL:
                    lines, partial[name] = [*lines, partial[name]], ""
                for line in lines:
                    self.log(f"    {line}")
            if not done:
                time.sleep(RUN_POLL_S)
        for line in partial.values():
            if line:
                self.log(f"    {line}")
        return rt.wait_command(cid, max(deadline - time.monotonic(), 0.001))

    @contextlib.contextmanager
    def _stage(self, stage: str, st: _State) -> Iterator:
        """The runtime, with the build's state sealed as template `stage` for the time of a RUN."""
        catalog.seal(stage, st.layers, st.config, st.source, self.store)
        try:
            yield self._runtime()
        finally:
            with templates_lock() as root:
                shutil.rmtree(root / stage, ignore_errors=True)

    def _runtime(self):
        if self.runtime is not None:
            return self.runtime
        if self._own_runtime is None:
            from k3sys.sandbox.runtime.runtime import Runtime

            sweep(self.store.root)
            self._own_runtime = Runtime(self.store.root / f".runtime-{os.getpid()}")
        return self._own_runtime

    def _close_runtime(self) -> None:
        if self._own_runtime is not None:
            root = self._own_runtime.root
            self._own_runtime.kill_all()
            self._own_runtime.close()
            shutil.rmtree(root, ignore_errors=True)
            self._own_runtime = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(layers: Path) -> list[str]:
    """Remove what builds of processes no longer alive left: their private runtimes under `layers`
    (opened first, so recovery kills their sandboxes and unmounts what they held) and their stage
    templates; returns what went."""
    from k3sys.sandbox.runtime.runtime import Runtime

    gone = []
    for d in layers.glob(".runtime-*") if layers.is_dir() else []:
        pid = d.name.removeprefix(".runtime-")
        if pid.isdigit() and not _alive(int(pid)):
            with Runtime(d) as rt:
                rt.kill_all()
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d.name)
    with templates_lock() as root:
        for t in root.glob(f"{catalog.STAGE_PREFIX}stage-*"):
            pid = t.name.split("-")[1]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(t, ignore_errors=True)
                gone.append(t.name)
    return gone


def _link_rootfs(template: str, tree: Path) -> None:
    """Layer `tree` := hard links to built-in template `template`'s rootfs (its files are never
    written: templates are read-only lowers)."""
    tree.rmdir()
    link_tree(str(template_rootfs(template)), str(tree))


def _mkdirs(tree: Path, path: str, implied: bool = False) -> Path:
    """Directory `path` (absolute) in layer `tree`, 0755 root; the parents implied (lower metadata
    stays), the last one too if `implied`."""
    out = tree
    parts = [p for p in path.split("/") if p]
    for i, p in enumerate(parts):
        out = out / p
        if not out.is_dir():
            out.mkdir(0o755)
            if implied or i < len(parts) - 1:
                os.setxattr(out, IMPLIED, b"1")
    return out


def _tail(text: str) -> str:
    return text if len(text) <= OUTPUT_TAIL else f"... ({len(text) - OUTPUT_TAIL} characters before)\n" \
        + text[-OUTPUT_TAIL:]
