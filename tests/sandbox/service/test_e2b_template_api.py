"""E2B's template API through the official `e2b` SDK (2.63.0, sync and async), unchanged, against a
real `k3sys sandbox serve`: `Template.exists`, `Template.build` of a `Template()` with run_cmd,
copy (the SDK's file upload), set_envs and set_workdir, then a sandbox of it; build logs to
`on_build_logs`; a failing run_cmd; build_in_background with get_build_status; list and delete with
the SDK's API client; tenants' templates apart. The service has a system directory of the test's own
(its templates/ and layers/), so the builds never touch the host's templates."""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import tarfile
import tempfile
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, AsyncTemplate, Sandbox, Template
from e2b.api.client.api.templates import delete_templates_template_id, get_templates
from e2b.api.client_sync import get_api_client
from e2b.connection_config import ConnectionConfig
from e2b.exceptions import BuildException, SandboxException, TemplateException
from e2b.template.types import TemplateBuildStatus
from service_process import ServiceProcess, add_key
from waiting import wait_until

from k3sys.sandbox.runtime.store import Store
from k3sys.sandbox.runtime.system import system_paths
from k3sys.sandbox.runtime.warm import WARM_TEMPLATE

pytestmark = pytest.mark.timeout(300)
KEY = "e2b-template-test-" + uuid.uuid4().hex
SHELL = "debian"  # templates sandboxes are made of: the SDK runs commands with bash (busybox has none)


def _name(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}"


def _system_dir(root: Path) -> Path:
    """A system directory of the test's own: etc/ and the built-in templates the real one's, bin/ a
    copy (a restore maps the agent from its path: real files, on a path a sandbox's user namespace
    can traverse, so not under pytest's 0700 temporary folder)."""
    real, mine = system_paths().root, root / "system"
    (mine / "templates").mkdir(parents=True)
    shutil.copytree(real / "bin", mine / "bin")
    for d in ("etc", "build", "stamps"):
        if (real / d).exists():
            os.symlink(real / d, mine / d)
    for t in ("busybox", "debian", "base"):
        if (real / "templates" / t / "rootfs").is_dir():
            os.symlink((real / "templates" / t).resolve(), mine / "templates" / t)
    return mine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A service (its key E2B_API_KEY, the SDK pointed at it by E2B's variables) and tenant keys."""
    from sandbox_fixtures import MISSING, leftovers

    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    root = Path(tempfile.mkdtemp(prefix="k3sys-e2btpl-", dir="/var/tmp"))
    os.chmod(root, 0o755)
    system = _system_dir(root)
    data = tmp_path_factory.mktemp("e2btpl") / "data"
    mp = pytest.MonkeyPatch()
    try:
        with ServiceProcess(data, env={"K3SYS_API_KEY": KEY, "K3SYS_SYSTEM_DIR": str(system)}) as svc:
            for k, v in {"E2B_API_URL": svc.url, "E2B_SANDBOX_URL": svc.url, "E2B_API_KEY": KEY}.items():
                mp.setenv(k, v)
            svc.system = system
            svc.tenant_keys = {t: add_key(data, t) for t in ("alice", "bob")}
            try:
                yield svc
            finally:
                mp.undo()
                ids = svc.kill_all()
        assert leftovers(data, ids) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _templates(key: str | None = None) -> list:
    with get_api_client(ConnectionConfig(api_key=key)) as api:
        r = get_templates.sync_detailed(client=api)
    assert r.status_code == 200, r.content
    return r.parsed


def _delete(name: str, key: str | None = None) -> int:
    with get_api_client(ConnectionConfig(api_key=key)) as api:
        return delete_templates_template_id.sync_detailed(name, client=api).status_code


def test_exists(server):
    assert Template.exists("base") and Template.exists("busybox")
    assert not Template.exists(_name("no-such"))
    assert asyncio.run(AsyncTemplate.exists("busybox"))
    with pytest.raises(TemplateException, match="tags"):  # refused by name, not a bare 404
        Template.assign_tags("busybox", "v2")
    with pytest.raises(BuildException, match="tags"):
        Template.build(Template().from_template("busybox"), "named:v2")


def test_build_then_create(server, tmp_path):
    (tmp_path / "hello.txt").write_text("hello from the context\n")
    t = (Template(file_context_path=str(tmp_path)).from_template(SHELL)
         .set_envs({"MODE": "e2b", "TWO": "two words"}).set_workdir("/app")
         .copy("hello.txt", "/app/")
         .run_cmd("echo built > /app/built && echo build-output-$MODE"))
    name, logs = _name("tpl"), []
    info = Template.build(t, alias=name, on_build_logs=logs.append, memory_mb=256)
    assert info.template_id == name and info.build_id
    messages = [e.message for e in logs]
    assert any("build-output-e2b" in m for m in messages), messages  # RUN's output reached on_build_logs
    assert Template.exists(name)
    with Sandbox.create(name, timeout=120) as s:
        r = s.commands.run('cat hello.txt built; echo "$MODE|$TWO"; pwd')
        assert r.stdout == "hello from the context\nbuilt\ne2b|two words\n/app\n", r
    listed = {t.template_id: t for t in _templates()}
    assert name in listed and listed[name].aliases == [name] and listed[name].build_status.value == "ready"
    assert _delete(name) == 204 and _delete(name) == 404  # E2B's SDK reads a 404 as "nothing deleted"
    assert not Template.exists(name) and name not in {t.template_id for t in _templates()}
    assert not (server.system / "templates" / name).exists()


def test_failing_run_cmd(server):
    t = Template().from_template("busybox").run_cmd("echo this-went-wrong >&2; exit 3")
    name = _name("broken")
    with pytest.raises(BuildException) as e:
        Template.build(t, alias=name, memory_mb=256)
    assert "this-went-wrong" in str(e.value) and "exited 3" in str(e.value), e.value
    assert not Template.exists(name) and not (server.system / "templates" / name).exists()


def test_start_cmd_recorded_and_name_taken(server):
    t = Template().from_template("busybox").set_start_cmd("sleep 1000", "true")
    name = _name("warm")
    Template.build(t, alias=name, memory_mb=256)
    meta = json.loads((server.system / "templates" / name / "template.json").read_text())
    assert (meta["start_cmd"], meta["ready_cmd"]) == ("sleep 1000", "true")  # what runtime/warm.py reads
    with pytest.raises(BuildException, match="exists"):  # a name is never replaced under its sandboxes
        Template.build(t, alias=name)
    assert _delete(name) == 204


def test_async_build_in_background(server):
    async def go() -> None:
        t = AsyncTemplate().from_template(SHELL).set_envs({"ASYNC": "yes"}).run_cmd("echo async > /a")
        name = _name("async")
        info = await AsyncTemplate.build_in_background(t, alias=name, memory_mb=256)
        deadline = asyncio.get_running_loop().time() + 240
        while (st := await AsyncTemplate.get_build_status(info)).status not in (
                TemplateBuildStatus.READY, TemplateBuildStatus.ERROR):
            assert asyncio.get_running_loop().time() < deadline, st
            await asyncio.sleep(0.2)
        assert st.status == TemplateBuildStatus.READY, st.reason
        assert await AsyncTemplate.exists(name)
        s = await AsyncSandbox.create(name, timeout=120)
        try:
            r = await s.commands.run('cat /a; echo "$ASYNC"')
            assert r.stdout == "async\nyes\n"
        finally:
            await s.kill()
        assert _delete(name) == 204
        with pytest.raises(BuildException, match="async-went-wrong"):  # and the waiting build, async
            await AsyncTemplate.build(AsyncTemplate().from_template("busybox").run_cmd("echo async-went-wrong; false"),
                                      alias=_name("async-broken"), memory_mb=256)

    asyncio.run(go())


def test_tenants_apart(server):
    alice, bob = server.tenant_keys["alice"], server.tenant_keys["bob"]
    name = _name("mine")
    Template.build(Template().from_template(SHELL).run_cmd("echo alice > /who"), alias=name, api_key=alice,
                   memory_mb=256)
    assert Template.exists(name, api_key=alice) and not Template.exists(name, api_key=bob)
    assert [t.aliases for t in _templates(alice)] == [[name]] and _templates(bob) == []
    with pytest.raises(SandboxException):
        Sandbox.create(name, api_key=bob, timeout=60)
    # bob cannot reach it by the name it is stored under either, nor delete it
    stored = next(t.template_id for t in _templates() if name in t.template_id)  # the admin sees all
    assert stored != name and not Template.exists(stored, api_key=bob)
    assert _delete(name, bob) == 404 and _delete(stored, bob) == 404
    for other in ("../busybox", ".busybox"):  # a path, a hidden name: no template to a tenant
        with pytest.raises(SandboxException, match="unknown template"):
            Sandbox.create(other, api_key=bob, timeout=60)
    with Sandbox.create(name, api_key=alice, timeout=60) as s:
        assert s.commands.run("cat /who").stdout == "alice\n"
    wait_until(lambda: _delete(name, alice) == 204, timeout=30, what="alice's template deleted")
    assert not Template.exists(name, api_key=alice)


def test_upload_links_and_hostile_files(server):
    """The API as the SDK speaks it, by hand: an upload link is its own credential (a changed token is
    no link), a definition naming a host path as its image is refused, and an upload whose entry
    climbs out of its directory fails the build by the layer unpacker's rules, leaving no template."""
    h, name, files_hash = {"X-API-Key": KEY}, _name("hostile"), "ab" * 32
    r = httpx.post(f"{server.url}/v3/templates", json={"name": name}, headers=h)
    assert r.status_code == 202, r.text
    tid, bid = r.json()["templateID"], r.json()["buildID"]
    link = httpx.get(f"{server.url}/templates/{tid}/files/{files_hash}", headers=h).json()
    assert link["present"] is False and "token=" in link["url"]
    assert httpx.put(link["url"].replace("token=", "token=0"), content=b"x").status_code == 404
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        entry = tarfile.TarInfo("../escape")
        entry.size = 1
        tar.addfile(entry, io.BytesIO(b"x"))
    assert httpx.put(link["url"], content=buf.getvalue()).status_code == 200
    assert httpx.get(f"{server.url}/templates/{tid}/files/{files_hash}", headers=h).json()["present"] is True
    start = f"{server.url}/v2/templates/{tid}/builds/{bid}"
    r = httpx.post(start, json={"fromImage": "oci:/etc", "steps": []}, headers=h)
    assert r.status_code == 422 and "fromImage" in r.json()["message"], r.text
    copy = {"type": "COPY", "args": ["escape", "/x"], "filesHash": files_hash, "force": False}
    assert httpx.post(start, json={"fromTemplate": "busybox", "steps": [copy]}, headers=h).status_code == 202
    status = f"{server.url}/templates/{tid}/builds/{bid}/status"
    body = wait_until(lambda: (b := httpx.get(status, headers=h).json())["status"] == "error" and b,
                      timeout=120, what="the hostile build failed")
    assert "../escape" in body["reason"]["message"], body
    assert not Template.exists(name) and not (server.system / "templates" / name).exists()


def test_run_output_streams_while_it_runs(server):
    """A RUN's lines reach the build status while it still runs: it prints, then waits for a file that
    the test writes into the build sandbox (the admin reaches it as any sandbox of the service)."""
    t = Template().from_template("busybox").run_cmd(
        "echo first-line; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo second-line")
    info = Template.build_in_background(t, alias=_name("stream"), memory_mb=256)
    seen: list[str] = []

    def poll():
        st = Template.get_build_status(info, logs_offset=len(seen))
        seen.extend(e.message for e in st.log_entries)
        return st

    st = wait_until(lambda: (s := poll()) and any("first-line" in m for m in seen) and s, timeout=120,
                    what="the RUN's first line in the build status")
    assert st.status == TemplateBuildStatus.BUILDING and not any("second-line" in m for m in seen), seen
    with server.client() as ours:
        sid, stage = next((i.id, i.spec.template) for i in ours.list() if i.spec.template.startswith("_stage-"))
        with pytest.raises(SandboxException, match="unknown template"):  # a build's state is no tenant's template
            Sandbox.create(stage, api_key=server.tenant_keys["bob"], timeout=60)
        ours.write_file(sid, "/tmp/go", b"")
    wait_until(lambda: poll().status == TemplateBuildStatus.READY, timeout=120, what="the build done")
    assert any("second-line" in m for m in seen), seen
    assert _delete(info.template_id) == 204


def test_start_cmd_makes_creates_warm(server):
    """set_start_cmd(start, ready): every create is a restore of the template's warm checkpoint, so
    the HTTP server answers the first request made after create, with no retry."""
    probe = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/', timeout=5).read())\""
    t = (Template().from_template(SHELL).run_cmd("mkdir -p /srv/www && echo served > /srv/www/index.html")
         .set_start_cmd("cd /srv/www && exec python3 -m http.server 8000 --bind 127.0.0.1", probe))
    name = _name("warm-http")
    Template.build(t, alias=name, memory_mb=256)
    for _ in range(2):  # the first create builds the checkpoint, the second restores the same
        with Sandbox.create(name, timeout=120) as s:
            assert s.commands.run(probe).stdout == "b'served\\n'\n"
            assert any("http.server" in p.cmd for p in s.commands.list())
    store = Store(server.data_dir / "store")  # read only: the service's checkpoint store
    assert len([m for m in store.list() if m.meta.get(WARM_TEMPLATE) == name]) == 1  # one served both creates
    wait_until(lambda: _delete(name) == 204, timeout=30, what="the warm template deleted")
    assert [m.id for m in store.list() if m.meta.get(WARM_TEMPLATE) == name] == []  # its checkpoint with it


def test_templates_count_in_the_tenant_disk_quota(server):
    """A tenant's templates count in its disk quota: with room for one build sandbox (8 GiB) and 1
    MiB, the first build fits; the second does not, by the template the first left."""
    carol = add_key(server.data_dir, "carol", "--disk-mb", str(8192 + 1))
    first = _name("first")
    Template.build(Template().from_template("busybox").run_cmd("head -c 3000000 /dev/urandom > /blob"), alias=first,
                   api_key=carol, memory_mb=256)
    with pytest.raises(BuildException, match="quota disk_mb"):
        Template.build(Template().from_template("busybox").run_cmd("true"), alias=_name("second"), api_key=carol,
                       memory_mb=256)
    assert _delete(first, carol) == 204


def test_shutdown_mid_build_leaves_no_build_sandbox(server, tmp_path):
    """Stopping a service while a RUN runs kills the build's sandbox (never hibernated for the next
    start to adopt: the build is gone with the process); the next start holds no sandbox."""
    with ServiceProcess(tmp_path / "data", env={"K3SYS_API_KEY": KEY, "K3SYS_SYSTEM_DIR": str(server.system)}) as svc:
        t = Template().from_template("busybox").run_cmd("echo started; while :; do sleep 0.1; done")
        info = Template.build_in_background(t, alias=_name("cut"), memory_mb=256, api_url=svc.url)
        wait_until(lambda: any("started" in e.message for e in
                               Template.get_build_status(info, logs_offset=0, api_url=svc.url).log_entries),
                   timeout=120, what="the RUN running")
        with svc.client() as ours:
            assert [i.spec.template.startswith("_stage-") for i in ours.list()] == [True]
        svc.stop()
        svc.start()
        with svc.client() as ours:
            assert ours.list() == []
    assert not (server.system / "templates" / info.template_id).exists()
