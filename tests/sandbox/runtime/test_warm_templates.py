"""Warm templates (runtime/warm.py): a template whose template.json names a start command is
checkpointed once its ready command passes, and every create from it is a restore, so its HTTP
server answers the first request; two creates share nothing writable; a create's envs and metadata
apply; a changed template builds a new checkpoint and deletes the old one; the checkpoint outlives a
runtime restart; a start command that exits is a TemplateStartError that leaves nothing behind."""

from __future__ import annotations

import json
import shutil
import time
import uuid

import pytest

from k3sys.sandbox import Runtime, Sandbox
from k3sys.sandbox.errors import TemplateStartError
from k3sys.sandbox.runtime.system import system_paths
from k3sys.sandbox.runtime.templates import template_rootfs
from k3sys.sandbox.runtime.warm import WARM_KEY, WARM_TEMPLATE

pytestmark = pytest.mark.timeout(600)  # debian: minutes the first time

SERVER = ("mkdir -p /srv/www && cd /srv/www && echo served > index.html && "
          "exec python3 -m http.server {port} --bind 127.0.0.1")
PROBE = ("python3 -c \"import urllib.request as u; "
         "print(u.urlopen('http://127.0.0.1:{port}/{path}', timeout=5).read().decode())\"")


def _write_template(name: str, rootfs, start: str, ready: str | None, **extra: str) -> None:
    d = system_paths().templates / name
    d.mkdir(exist_ok=True)
    if not (d / "rootfs").exists():
        (d / "rootfs").symlink_to(rootfs)  # a built template's files, under a name of the test's
    meta = {"name": name, "built": time.time(), "start_cmd": start, **extra}
    if ready is not None:
        meta["ready_cmd"] = ready
    (d / "template.json").write_text(json.dumps(meta))


@pytest.fixture
def warm_name(debian):
    name = f"k3sys-test-warm-{uuid.uuid4().hex[:8]}"
    _write_template(name, debian, SERVER.format(port=8000), PROBE.format(port=8000, path=""))
    yield name
    shutil.rmtree(system_paths().templates / name)


def _warm_checkpoints(rt, name: str) -> list[str]:
    return [m.id for m in rt.store.list() if m.meta.get(WARM_TEMPLATE) == name]


@pytest.mark.embedded
def test_server_answers_first_request_and_creates_are_independent(rt, warm_name):
    with Sandbox.create(warm_name, runtime=rt, memory_mb=256) as a, \
            Sandbox.create(warm_name, runtime=rt, memory_mb=256) as b:
        # The first request after create, no retry: the server was up in the checkpoint.
        assert a.commands.run(PROBE.format(port=8000, path="")).stdout == "served\n\n"
        assert b.commands.run(PROBE.format(port=8000, path="")).stdout == "served\n\n"
        assert len(_warm_checkpoints(rt, warm_name)) == 1  # one build served both
        assert not set(_warm_checkpoints(rt, warm_name)) & {c.id for c in rt.checkpoints()}  # internal: not listed
        # Nothing writable is shared: a's file, a's server process are a's alone.
        a.files.write("/srv/www/only-a.txt", "a")
        assert a.commands.run(PROBE.format(port=8000, path="only-a.txt")).stdout == "a\n"
        assert not b.files.exists("/srv/www/only-a.txt")
        server = [p for p in a.commands.list() if "http.server" in p.cmd]
        assert len(server) == 1 and server[0].running, a.commands.list()
        a.commands.kill(server[0].pid)
        assert b.commands.run(PROBE.format(port=8000, path="")).stdout == "served\n\n"
        assert a.get_info().sandbox_id != b.get_info().sandbox_id


def test_create_envs_and_metadata_apply(rt, warm_name):
    """Embedded and through the service (its E2B envVars, applied by its envd)."""
    with Sandbox.create(warm_name, runtime=rt, memory_mb=256, envs={"GREETING": "hello"},
                        metadata={"run": "7"}, timeout_s=300) as s:
        assert s.commands.run("echo $GREETING").stdout == "hello\n"
        assert s.get_info().metadata == {"run": "7"}
        assert s.commands.run(PROBE.format(port=8000, path="")).stdout == "served\n\n"


@pytest.mark.embedded
def test_template_change_invalidates_the_checkpoint(rt, warm_name, debian):
    with Sandbox.create(warm_name, runtime=rt, memory_mb=256) as s:
        assert s.commands.run(PROBE.format(port=8000, path="")).exit_code == 0
    before = _warm_checkpoints(rt, warm_name)
    assert len(before) == 1
    _write_template(warm_name, debian, SERVER.format(port=8001), PROBE.format(port=8001, path=""))
    with Sandbox.create(warm_name, runtime=rt, memory_mb=256) as s:
        assert s.commands.run(PROBE.format(port=8001, path="")).stdout == "served\n\n"
    after = _warm_checkpoints(rt, warm_name)
    assert len(after) == 1 and after != before, (before, after)
    assert rt.store.get(after[0]).meta[WARM_KEY] != ""


@pytest.mark.embedded
def test_start_command_that_exits_is_an_error_and_leaves_nothing(rt, debian):
    name = f"k3sys-test-warm-{uuid.uuid4().hex[:8]}"
    _write_template(name, debian, "echo starting; exit 3", "false")
    try:
        before = {i.id for i in rt.list()}
        with pytest.raises(TemplateStartError, match="exited.*starting"):
            Sandbox.create(name, runtime=rt, memory_mb=256)
        assert {i.id for i in rt.list()} == before
        assert _warm_checkpoints(rt, name) == []
    finally:
        shutil.rmtree(system_paths().templates / name)


@pytest.mark.embedded
def test_warm_checkpoint_survives_a_runtime_restart(private_root, warm_name):
    with Runtime(private_root) as first:
        with Sandbox.create(warm_name, runtime=first, memory_mb=256) as s:
            assert s.commands.run(PROBE.format(port=8000, path="")).exit_code == 0
        built = _warm_checkpoints(first, warm_name)
    with Runtime(private_root) as second:
        with Sandbox.create(warm_name, runtime=second, memory_mb=256) as s:
            assert s.commands.run(PROBE.format(port=8000, path="")).stdout == "served\n\n"
        assert _warm_checkpoints(second, warm_name) == built and len(built) == 1  # restored, not rebuilt


@pytest.mark.embedded
def test_e2b_ready_helpers_on_base(rt):
    """E2B's `set_start_cmd('python -m http.server 8000', wait_for_port(8000))` on `base` (as `user`):
    its ready helpers' commands (ss, curl, pgrep) work there, and the warm create serves at once."""
    from e2b import wait_for_port, wait_for_process, wait_for_url

    name = f"k3sys-test-warm-{uuid.uuid4().hex[:8]}"
    _write_template(name, template_rootfs("base"), "python3 -m http.server 8000", wait_for_port(8000).get_cmd(),
                    user="user")
    try:
        with Sandbox.create(name, runtime=rt, memory_mb=256) as s:
            for ready in (wait_for_url("http://127.0.0.1:8000/", 200), wait_for_process("python3")):
                assert s.commands.run(ready.get_cmd()).exit_code == 0
            assert [p.cmd for p in s.commands.list() if p.running] == ["python3 -m http.server 8000"]
            assert s.commands.run("ps -o user= -C python3").stdout.split() == ["user"]
    finally:
        shutil.rmtree(system_paths().templates / name)


@pytest.mark.embedded
def test_checkpoint_gone_between_lookup_and_restore_is_rebuilt(rt, warm_name):
    """A create whose checkpoint was superseded after its lookup (another create's rebuild deleted
    it; here the store's delete stands in for that) looks again and builds the new one."""
    with Sandbox.create(warm_name, runtime=rt, memory_mb=256):
        pass
    [old] = _warm_checkpoints(rt, warm_name)
    rt.store.delete(old)
    with Sandbox.create(warm_name, runtime=rt, memory_mb=256) as s:
        assert s.commands.run(PROBE.format(port=8000, path="")).stdout == "served\n\n"
    assert len(_warm_checkpoints(rt, warm_name)) == 1 and _warm_checkpoints(rt, warm_name) != [old]


@pytest.mark.embedded
def test_warm_create_restores_eagerly(rt, warm_name, monkeypatch):
    """A warm create brings all of the server's memory back before it returns (its image, ~10 MB, is
    past MIN_BYTES, where a resume would go lazily): no lazy-pages daemon starts for it, and the
    server answers at once."""
    if not rt.driver.lazy.supported:
        pytest.skip("this kernel or CRIU cannot restore lazily")
    spawned, spawn = [], rt.driver.lazy.spawn
    monkeypatch.setattr(rt.driver.lazy, "spawn", lambda sid, *a, **k: (spawned.append(sid), spawn(sid, *a, **k))[1])
    with Sandbox.create(warm_name, runtime=rt, memory_mb=256) as s:
        assert s.commands.run(PROBE.format(port=8000, path="")).stdout == "served\n\n"
        assert spawned == []
