"""The control plane through the official `e2b` SDK (2.63.0, sync and async), unchanged, against a
real `k3sys sandbox serve` on 127.0.0.1: create, info, list with filters and pages, kill, timeouts,
pause -> connect, snapshots -> create from one, fork, and the errors the SDK maps to its exceptions;
then background commands through pause, snapshot and fork with envd (commands and files in the SDK).
The first tests look inside through our own client (`ours`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime

import httpx
import pytest
from e2b import AsyncSandbox, Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException
from e2b.sandbox.commands.command_handle import CommandExitException
from service_process import ServiceProcess
from waiting import wait_until

from k3sys.sandbox import InvalidStateError

pytestmark = pytest.mark.timeout(180)
TEMPLATE = "busybox"
KEY = "e2b-control-test-" + uuid.uuid4().hex


def _point_sdk(mp: pytest.MonkeyPatch, url: str) -> None:
    """E2B's environment variables, as a user sets them, for a service at `url` with key KEY."""
    for k, v in {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": KEY}.items():
        mp.setenv(k, v)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A service whose key is E2B_API_KEY, the SDK pointed at it by E2B's environment variables."""
    from sandbox_fixtures import MISSING, leftovers

    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    root = tmp_path_factory.mktemp("e2bsvc")
    mp = pytest.MonkeyPatch()
    with ServiceProcess(root, env={"K3SYS_API_KEY": KEY}) as svc:
        _point_sdk(mp, svc.url)
        try:
            yield svc
        finally:
            mp.undo()
            ids = svc.kill_all()
    assert leftovers(root, ids) == []


@pytest.fixture
def ours(server):
    """The k3sys client of the same service."""
    with server.client() as c:
        yield c


@pytest.fixture
def sbx(server):
    with Sandbox.create(TEMPLATE, timeout=120) as s:  # killed on the way out
        yield s


def _tag() -> str:
    return uuid.uuid4().hex[:8]


def test_create_info_kill(server):
    before = datetime.now(UTC)
    s = Sandbox.create(TEMPLATE, timeout=90, metadata={"who": "test", "odd key": "a b&c=d/é"})
    info = s.get_info()
    assert info.sandbox_id == s.sandbox_id and info.state == SandboxState.RUNNING
    assert info.template_id == TEMPLATE and info.metadata == {"who": "test", "odd key": "a b&c=d/é"}
    assert before.timestamp() - 1 <= info.started_at.timestamp() <= time.time() + 1
    assert abs((info.end_at - info.started_at).total_seconds() - 90) < 5
    assert info.memory_mb > 0 and info.cpu_count >= 1 and info.envd_version >= "0.6"
    assert s._envd_access_token and Sandbox.get_info(s.sandbox_id).sandbox_id == s.sandbox_id
    assert s.kill() is True
    assert Sandbox.kill(s.sandbox_id) is False  # 404: already gone
    with pytest.raises(NotFoundException):
        Sandbox.get_info(s.sandbox_id)


def test_wrong_key_and_missing_sandbox(server):
    with pytest.raises(AuthenticationException):
        Sandbox.create(TEMPLATE, api_key="not-the-key")
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="not-the-key").next_items()
    r = httpx.get(f"{server.url}/v2/sandboxes", timeout=30)  # no key at all
    assert r.status_code == 401 and r.json()["code"] == 401 and r.json()["type"] == "unauthorized"
    for call in (lambda: Sandbox.connect("sbx-nonexistent"), lambda: Sandbox.set_timeout("sbx-nonexistent", 10),
                 lambda: Sandbox.pause("sbx-nonexistent"), lambda: Sandbox.fork("sbx-nonexistent", count=2)):
        with pytest.raises(NotFoundException):
            call()


def test_bad_input_is_refused_by_name(server):
    with pytest.raises(SandboxException, match="no-such-template"):
        Sandbox.create("no-such-template")
    h = {"x-api-key": KEY}
    r = httpx.post(f"{server.url}/v2/sandboxes", json={"templateID": TEMPLATE, "bogus": 1}, headers=h, timeout=30)
    assert r.status_code == 422 and "bogus" in r.json()["message"] and r.json()["code"] == 422
    r = httpx.post(f"{server.url}/v2/sandboxes", json={"templateID": TEMPLATE, "mcp": {"x": {}}}, headers=h,
                   timeout=30)
    assert r.status_code == 422 and "mcp" in r.json()["message"]
    r = httpx.post(f"{server.url}/v2/sandboxes", headers=h, timeout=30,
                   json={"templateID": TEMPLATE, "metadata": {f"k{i}": "v" for i in range(300)}})
    assert r.status_code == 422 and "metadata" in r.json()["message"]
    r = httpx.get(f"{server.url}/v2/sandboxes", params={"nextToken": "garbage!", "limit": 1}, headers=h, timeout=30)
    assert r.status_code == 422 and "nextToken" in r.json()["message"]
    r = httpx.get(f"{server.url}/v2/sandboxes", params={"state": "sleeping"}, headers=h, timeout=30)
    assert r.status_code == 422 and "sleeping" in r.json()["message"]
    with Sandbox.create(TEMPLATE, timeout=30) as s, pytest.raises(SandboxException, match="network: not supported"):
        s.update_network({"deny_out": ["0.0.0.0/0"]})


def test_list_filters_and_pages(server):
    tag = _tag()
    boxes = [Sandbox.create(TEMPLATE, timeout=120, metadata={"group": tag, "i": str(i)}) for i in range(3)]
    try:
        mine = SandboxQuery(metadata={"group": tag})
        pages, paginator = [], Sandbox.list(query=mine, limit=2)
        while paginator.has_next:
            pages.append([i.sandbox_id for i in paginator.next_items()])
        assert [len(p) for p in pages] == [2, 1]
        assert [x for p in pages for x in p] == [b.sandbox_id for b in reversed(boxes)]  # newest first, no repeats
        pages, paginator = [], Sandbox.list(query=mine, limit=1, order="asc")
        while paginator.has_next:
            pages.append([i.sandbox_id for i in paginator.next_items()])
        assert pages == [[b.sandbox_id] for b in boxes]
        one = Sandbox.list(query=SandboxQuery(metadata={"group": tag, "i": "1"})).next_items()
        assert [i.sandbox_id for i in one] == [boxes[1].sandbox_id]
        since = boxes[1].get_info().started_at  # exactly as sent: that sandbox is "started after" it
        later = Sandbox.list(query=SandboxQuery(metadata={"group": tag}, started_after=since)).next_items()
        assert {i.sandbox_id for i in later} == {boxes[1].sandbox_id, boxes[2].sandbox_id}
        assert boxes[2].pause() is True
        paused = Sandbox.list(query=SandboxQuery(metadata={"group": tag}, state=[SandboxState.PAUSED])).next_items()
        running = Sandbox.list(query=SandboxQuery(metadata={"group": tag}, state=[SandboxState.RUNNING])).next_items()
        assert [i.sandbox_id for i in paused] == [boxes[2].sandbox_id]
        assert {i.sandbox_id for i in running} == {boxes[0].sandbox_id, boxes[1].sandbox_id}
        assert Sandbox.list(query=SandboxQuery(metadata={"group": "nobody-" + tag})).next_items() == []
    finally:
        for b in boxes:
            b.kill()


def test_timeout_and_metrics(sbx):
    t0 = time.time()
    sbx.set_timeout(40)
    info = sbx.get_info()
    assert t0 + 40 - 1 <= info.end_at.timestamp() <= time.time() + 40 + 1  # bracketed: the calls may be slow
    (m,) = sbx.get_metrics()
    assert m.mem_total == info.memory_mb << 20 and 0 < m.mem_used <= m.mem_total and 0 <= m.cpu_used_pct <= 100


def test_timeout_kills_when_it_runs_out(server):
    s = Sandbox.create(TEMPLATE, timeout=120, lifecycle={"on_timeout": "kill"})
    s.set_timeout(1)

    def gone() -> bool:
        try:
            Sandbox.get_info(s.sandbox_id)
        except NotFoundException:
            return True
        return False

    wait_until(gone, 20, "the sandbox's timeout killing it", step=0.1)


def test_timeout_pauses_with_lifecycle_pause(server, ours):
    s = Sandbox.create(TEMPLATE, timeout=2, lifecycle={"on_timeout": "pause"})
    try:
        assert s.get_info().lifecycle["on_timeout"] == "pause"
        ours.write_file(s.sandbox_id, "/tmp/kept", b"yes")
        wait_until(lambda: ours.info(s.sandbox_id).state == "hibernated", 30, "the pause by its timeout", step=0.1)
        assert s.get_info().state == SandboxState.PAUSED
        back = Sandbox.connect(s.sandbox_id, timeout=60)
        assert back.get_info().state == SandboxState.RUNNING
        assert ours.read_file(s.sandbox_id, "/tmp/kept") == b"yes"
    finally:
        s.kill()


def test_env_vars_reach_commands(server, ours):
    s = Sandbox.create(TEMPLATE, timeout=60, envs={"GREETING": "hello e2b", "OTHER": "1"})
    try:
        assert ours.run(s.sandbox_id, "echo $GREETING-$OTHER").stdout == "hello e2b-1\n"
        assert ours.run(s.sandbox_id, "echo $GREETING", env={"GREETING": "call wins"}).stdout == "call wins\n"
    finally:
        s.kill()


def test_pause_connect_keeps_processes(sbx, ours):
    sid = sbx.sandbox_id
    # /tmp/n written whole (a rename): a read never meets the file truncated and not yet written.
    loop = "i=0; while :; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.1; done"
    cid = ours.start_command(sid, f"sh -c '{loop}'")
    wait_until(lambda: ours.run(sid, "cat /tmp/n 2>/dev/null").stdout.strip(), 20, "the counter's first count")
    assert sbx.pause() is True
    # Answered once frozen; the hibernation follows in the background (test_e2b_pause.py times it).
    assert sbx.get_info().state == SandboxState.PAUSED and ours.info(sid).state in ("paused", "hibernating")
    assert ours.info(sid).then_hibernate
    assert sbx.pause() is False  # 409: already paused
    with pytest.raises(InvalidStateError):  # nothing runs while paused
        ours.run(sid, "cat /tmp/n")
    same = Sandbox.connect(sid, timeout=100)  # 201: resumed
    assert same.sandbox_id == sid and same.get_info().state == SandboxState.RUNNING
    assert ours.command_running(cid)
    n = int(ours.run(sid, "cat /tmp/n").stdout)
    wait_until(lambda: int(ours.run(sid, "cat /tmp/n").stdout) > n, 20, "the same loop counting on")
    again = sbx.connect()  # 200: already running
    assert again.get_info().state == SandboxState.RUNNING


def test_snapshot_then_create_from_it(server, sbx, ours):
    sid = sbx.sandbox_id
    ours.write_file(sid, "/tmp/mark", b"before")
    snap = sbx.create_snapshot()
    ours.write_file(sid, "/tmp/mark", b"after")
    assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sid).next_items()]
    assert [s.snapshot_id for s in sbx.list_snapshots(name=snap.snapshot_id).next_items()] == [snap.snapshot_id]
    copy = Sandbox.create(snap.snapshot_id, timeout=60, metadata={"from": "snapshot"},
                          lifecycle={"on_timeout": "pause"})
    try:
        info = copy.get_info()
        assert copy.sandbox_id != sid and info.template_id == snap.snapshot_id
        assert info.lifecycle["on_timeout"] == "pause" and info.metadata == {"from": "snapshot"}
        r = httpx.post(f"{server.url}/v2/sandboxes", json={"templateID": snap.snapshot_id, "memoryMB": 4096},
                       headers={"x-api-key": KEY}, timeout=30)
        assert r.status_code == 422 and "memoryMB" in r.json()["message"]
        assert ours.read_file(copy.sandbox_id, "/tmp/mark") == b"before"
        assert ours.read_file(sid, "/tmp/mark") == b"after"  # the source ran on
    finally:
        copy.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False
    with pytest.raises(SandboxException, match="not supported"):
        sbx.create_snapshot(mode="filesystem")


def test_named_snapshots(sbx, ours):
    name = f"snap-{_tag()}"
    first = sbx.create_snapshot(name=name)
    assert first.names == [name] and first.snapshot_id != name
    ours.write_file(sbx.sandbox_id, "/tmp/mark", b"second")
    second = sbx.create_snapshot(name=name)  # the name moves to the newer snapshot
    assert [s.snapshot_id for s in Sandbox.list_snapshots(name=name).next_items()] == [second.snapshot_id]
    assert Sandbox.list_snapshots(name=name + "-nothing").next_items() == []
    with Sandbox.create(name, timeout=60) as copy:
        assert ours.read_file(copy.sandbox_id, "/tmp/mark") == b"second"
    assert Sandbox.delete_snapshot(name) is True  # by name: the snapshot it names
    assert Sandbox.list_snapshots(name=name).next_items() == []
    assert Sandbox.delete_snapshot(first.snapshot_id) is True
    with pytest.raises(SandboxException, match="name"):
        sbx.create_snapshot(name="../bad name")


def test_fork_two(sbx, ours):
    ours.write_file(sbx.sandbox_id, "/tmp/mark", b"parent")
    t0 = time.time()
    kids = sbx.fork(count=2, timeout=60)
    try:
        assert len(kids) == 2 and all(isinstance(k, Sandbox) for k in kids)
        ids = {k.sandbox_id for k in kids}
        assert len(ids) == 2 and sbx.sandbox_id not in ids
        for k in kids:
            assert ours.read_file(k.sandbox_id, "/tmp/mark") == b"parent"
            info = k.get_info()
            assert info.state == SandboxState.RUNNING and t0 + 59 <= info.end_at.timestamp() <= time.time() + 61
        assert len({k._envd_access_token for k in kids} | {sbx._envd_access_token}) == 3
    finally:
        for k in kids:
            if isinstance(k, Sandbox):
                k.kill()


def test_async_life_cycle(server):
    async def main() -> None:
        tag = _tag()
        s = await AsyncSandbox.create(TEMPLATE, timeout=60, metadata={"group": tag})
        try:
            assert (await s.get_info()).state == SandboxState.RUNNING
            listed = await AsyncSandbox.list(query=SandboxQuery(metadata={"group": tag})).next_items()
            assert [i.sandbox_id for i in listed] == [s.sandbox_id]
            assert await s.pause() is True
            assert (await AsyncSandbox.get_info(s.sandbox_id)).state == SandboxState.PAUSED
            back = await AsyncSandbox.connect(s.sandbox_id)
            assert (await back.get_info()).state == SandboxState.RUNNING
        finally:
            assert await s.kill() is True
        with pytest.raises(NotFoundException):
            await AsyncSandbox.get_info(s.sandbox_id)

    asyncio.run(main())


# --- with envd: the same life cycle, commands and files through the SDK alone ---------------------------

SHELL = "debian"  # the SDK runs commands with bash (busybox has none)
# /tmp/n written whole (a rename): a snapshot taken between a truncation and its write would keep an
# empty file, which a cold boot (files kept, processes not) then shows.
COUNTER = "i=0; while :; do i=$((i+1)); echo $i; echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.1; done"


def _count(s: Sandbox) -> int:
    return int(s.files.read("/tmp/n").strip() or 0) if s.files.exists("/tmp/n") else 0


def _counting(s: Sandbox) -> None:
    """The counter of `COUNTER` moves on in `s` (its process alive after whatever happened)."""
    n = _count(s)
    wait_until(lambda: _count(s) > n, 30, "the counter moving on", step=0.1)


def _reattach(s: Sandbox, pid: int) -> None:
    """`commands.connect(pid)` streams the process's output again; killing it ends the stream."""
    h = s.commands.connect(pid, timeout=30)
    first = next(out for out, _, _ in h if out)
    assert first.split()[0].isdigit()
    assert s.commands.kill(pid) is True
    with pytest.raises(CommandExitException):
        h.wait()


@pytest.fixture
def dsbx(server):
    with Sandbox.create(SHELL, timeout=120) as s:  # killed on the way out
        yield s


def test_background_command_through_pause_and_connect(dsbx):
    sbx = dsbx
    h = sbx.commands.run(COUNTER, background=True)
    _counting(sbx)
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("exit 7")
    assert e.value.exit_code == 7
    assert sbx.pause() is True and sbx.is_running() is False  # envd answers 502 while paused
    back = Sandbox.connect(sbx.sandbox_id)
    assert back.is_running() and sbx.is_running()
    _counting(back)  # the same process, resumed from the hibernation
    _reattach(back, h.pid)


def test_background_command_through_snapshot_and_fork(dsbx):
    sbx = dsbx
    h = sbx.commands.run(COUNTER, background=True)
    sbx.files.write("/tmp/big.bin", bytes(range(256)) * 4096)  # 1 MiB, binary
    _counting(sbx)
    snap = sbx.create_snapshot()
    copy = Sandbox.create(snap.snapshot_id, timeout=60)
    kids = sbx.fork(count=2, timeout=60)
    try:
        for s in (copy, *kids):
            assert s.files.read("/tmp/big.bin", format="bytes") == bytes(range(256)) * 4096
            _counting(s)  # the counter runs on in each copy
            _reattach(s, h.pid)
        _counting(sbx)  # and in the source
    finally:
        for s in (copy, *kids):
            s.kill()
        Sandbox.delete_snapshot(snap.snapshot_id)


def _stopped(s: Sandbox) -> None:
    """No counter runs in `s` (its processes did not survive a cold boot), but its files did. Asked of
    the process list, not of the counter's file over a pause: no wait can prove a file stays still."""
    assert _count(s) > 0
    assert [p for p in s.commands.list() if COUNTER in p.args] == []


def test_filesystem_only_pause_and_reboot_resume(dsbx, server):
    sbx = dsbx
    h = sbx.commands.run(COUNTER, background=True)
    _counting(sbx)
    assert sbx.pause(mode="filesystem") is True
    r = httpx.get(f"{server.url}/sandboxes/{sbx.sandbox_id}", headers={"x-api-key": KEY}, timeout=30)
    assert r.json()["pauseMode"] == "filesystem"
    back = Sandbox.connect(sbx.sandbox_id)  # boots cold: files kept, processes not
    _stopped(back)
    assert h.pid not in [p.pid for p in back.commands.list()]
    assert back.commands.run("echo fresh").stdout == "fresh\n"
    h = back.commands.run(COUNTER, background=True)  # a full pause keeps them again
    assert back.pause() is True
    _counting(Sandbox.connect(sbx.sandbox_id))
    assert back.pause() is True
    _stopped(Sandbox.connect(sbx.sandbox_id, on_resume="reboot"))  # memory ignored when asked


def test_auto_pause_filesystem_only_boots_cold(server, ours):
    s = Sandbox.create(TEMPLATE, timeout=2, lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}})
    try:
        loop = "while :; do date +%s%N > /tmp/t.new && mv /tmp/t.new /tmp/t; sleep 0.1; done"
        ours.start_command(s.sandbox_id, f"sh -c '{loop}'")
        wait_until(lambda: ours.info(s.sandbox_id).state == "hibernated", 30, "the pause by its timeout", step=0.1)
        Sandbox.connect(s.sandbox_id, timeout=60)
        assert ours.read_file(s.sandbox_id, "/tmp/t")  # the file is kept
        assert [p for p in ours.processes(s.sandbox_id) if p.running] == []  # the loop did not come back
    finally:
        s.kill()


def test_attributes_and_names_survive_a_restart(tmp_path, monkeypatch):
    from sandbox_fixtures import leftovers

    root = tmp_path / "svc"
    svc = ServiceProcess(root, env={"K3SYS_API_KEY": KEY}).start()
    try:
        _point_sdk(monkeypatch, svc.url)
        s = Sandbox.create(TEMPLATE, timeout=120, metadata={"keep": "me"}, envs={"V": "1"})
        snap = s.create_snapshot(name="survivor")
        token = s._envd_access_token
        svc.stop()  # hibernates the sandbox (on_shutdown)
        svc.start()  # on another port
        _point_sdk(monkeypatch, svc.url)
        info = Sandbox.get_info(s.sandbox_id)
        assert info.metadata == {"keep": "me"} and info.state == SandboxState.PAUSED
        back = Sandbox.connect(s.sandbox_id)
        assert back._envd_access_token == token
        with svc.client() as ours:
            assert ours.run(s.sandbox_id, "echo $V").stdout == "1\n"
        assert [x.snapshot_id for x in Sandbox.list_snapshots(name="survivor").next_items()] == [snap.snapshot_id]
    finally:
        ids = svc.kill_all() if svc.proc and svc.proc.poll() is None else set()
        svc.stop()
    assert leftovers(root, ids) == []
