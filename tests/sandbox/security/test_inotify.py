"""inotify is a host-wide resource (issue 30, item 4): every sandbox's inotify instances count against
host root's limit (runc and CRIU make their user namespaces as root), so one sandbox's
`inotify_init1` loop, or its API watchers, could leave every other tenant's watch and the host's own
root processes with EMFILE. Each sandbox's user namespace has a limit per user inside, the host's is
raised to the sandboxes' budget, and API watches are budgeted per sandbox, tenant and service, past
which the answer is 429 naming the budget (runtime/drivers/inotify.py, runtime/watch.py)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from sandbox_fixtures import MISSING
from service_process import ServiceProcess
from test_tenants import add_key
from waiting import wait_until

from k3sys.sandbox import QuotaError, SandboxLimitError, SandboxSpec
from k3sys.sandbox.errors import CapacityError
from k3sys.sandbox.runtime.drivers import inotify
from k3sys.sandbox.runtime.watch import MAX_WATCHES
from k3sys.sandbox.service.envd import filesystem
from k3sys.sandbox.service.envd.app import access_token
from k3sys.sandbox.service.envd.rpc import EnvdState

ADMIN_KEY = "admin-key-for-inotify-tests-0123456789"
LOOP_N = 300
# Makes LOOP_N inotify instances (as root), keeps them, and writes how many it got and the errno.
LOOP = f"""
import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
fds = []
while len(fds) < {LOOP_N}:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    fds.append(fd)
err = ctypes.get_errno() if len(fds) < {LOOP_N} else 0
with open("/tmp/got.new", "w") as f:
    f.write(f"{{len(fds)}} {{err}}")
__import__("os").rename("/tmp/got.new", "/tmp/got")
time.sleep(3600)
"""
_libc = ctypes.CDLL(None, use_errno=True)


def host_opens(n: int) -> int:
    """How many of `n` new inotify instances host root gets now (closed again at once)."""
    fds = []
    try:
        while len(fds) < n and (fd := _libc.inotify_init1(os.O_CLOEXEC)) >= 0:
            fds.append(fd)
        return len(fds)
    finally:
        for fd in fds:
            os.close(fd)


def host_instances_in_use() -> int:
    """inotify instances held on the host, every process's (an upper bound: a shared one counts twice)."""
    n = 0
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        with contextlib.suppress(OSError):
            n += os.readlink(fd) == "anon_inode:inotify"
    return n


def own_userns(rt, sid: str) -> bool:
    pid = rt.driver.init_pid(sid)
    return os.stat(f"/proc/{pid}/ns/user").st_ino != os.stat("/proc/self/ns/user").st_ino


def hold_instances(s) -> tuple[int, int]:
    """Run LOOP in sandbox `s` in the background: (instances it holds, the errno that stopped it)."""
    s.files.write("/tmp/loop.py", LOOP)
    s.commands.run("python3 /tmp/loop.py", background=True)
    text = wait_until(lambda: s.files.exists("/tmp/got") and s.files.read("/tmp/got"), 60, "the loop's count")
    got, err = text.split()
    return int(got), int(err)


def still_watches(s, where: str = "/tmp") -> bool:
    """Whether sandbox `s` can watch `where` and see a change in it."""
    with s.files.watch_dir(where) as w:
        s.files.write(f"{where}/poke", "x")
        wait_until(lambda: [e for e in w.get_new_events() if e.path == f"{where}/poke"], 20, "the watch's event")
    return True


@pytest.fixture
def budgeted():
    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    assert inotify.host_shortfall() is None, inotify.host_shortfall()


def test_install_script_states_the_drivers_budget():
    script = (Path(__file__).resolve().parents[3] / "scripts" / "install-sandbox.sh").read_text()
    assert int(re.search(r"^INOTIFY_INSTANCES=(\d+)", script, re.M).group(1)) == inotify.HOST_INSTANCES
    assert int(re.search(r"^INOTIFY_WATCHES=(\d+)", script, re.M).group(1)) == inotify.HOST_WATCHES


@pytest.mark.parametrize("network", [False, True], ids=["hardened", "network"])
def test_inotify_loop_inside_runs_out_of_its_own_count(budgeted, arena, sec_rt, debian_template, network,
                                                         record_property):
    if network and not shutil.which("nft"):
        pytest.skip("nft missing: run scripts/install-network.sh")
    record_property("attack", f"inotify_init1 x{LOOP_N} inside{' a network=True sandbox' if network else ''}, "
                              "held: the host's and other sandboxes' inotify")
    s = arena.create(template="debian", memory_mb=256, network=network)
    got, err = hold_instances(s)
    assert own_userns(sec_rt, s.id), "every sandbox (network=True too) has a user namespace of its own"
    assert (got, err) == (inotify.INSTANCES_PER_USER, errno.EMFILE)  # its own count ran out, per user inside
    with pytest.raises(SandboxLimitError, match="max_inotify_instances: 128 per user"):
        s.files.watch_dir("/tmp")  # the agent's watch runs as root inside too: told what ran out
    wait_until(lambda: sec_rt.file_service.watches.open(s.id) == 0, 60, "the refused watch's budget given back")
    assert host_opens(256) == 256, "host root cannot make inotify instances"
    assert still_watches(arena.bystander, "/root")
    in_use = host_instances_in_use()
    assert inotify.HOST_INSTANCES - in_use >= inotify.HOST_OWN_INSTANCES  # the host's own share is left
    record_property("figure", f"the loop got {got} (EMFILE: its own limit, 128 per user"
                              f"); host root still opens 256; bystander watches; {in_use} held on the host of "
                              f"{inotify.HOST_INSTANCES}")


ONE_MORE = "python3 -c 'import ctypes, os; os.setuid({uid}); print(ctypes.CDLL(None).inotify_init1(0) >= 0)'"
LIMITS = "cat /proc/sys/user/max_inotify_instances /proc/sys/user/max_inotify_watches"


def test_limits_hold_across_fork_and_hibernate(budgeted, arena, debian_template, record_property):
    record_property("attack", "inotify limits dropped by a restore (fork, hibernate) or raised from inside")
    s = arena.create(template="debian", memory_mb=256)
    assert hold_instances(s) == (inotify.INSTANCES_PER_USER, errno.EMFILE)
    want = f"{inotify.INSTANCES_PER_USER}\n{inotify.WATCHES_PER_USER}\n"
    raised = s.commands.run("echo 100000 > /proc/sys/user/max_inotify_instances; echo $?")
    assert raised.stdout.strip() != "0" and s.commands.run(LIMITS).stdout == want
    (child,) = s.fork(1)
    arena.track([child])
    s.hibernate()
    s.resume()
    for box in (child, s):  # restored: CRIU made their user namespaces anew, the driver limited them again
        assert box.commands.run(LIMITS).stdout == want
        assert box.commands.run(ONE_MORE.format(uid=0)).stdout == "False\n"  # the restored loop holds root's 128
        assert box.commands.run(ONE_MORE.format(uid=1000)).stdout == "True\n"  # another user's count is its own
    record_property("figure", f"limits {want.split()} inside after fork and hibernate+resume; "
                              "writing them from inside refused; the restored loop still holds root's 128")


def test_api_watches_budgeted_per_sandbox(budgeted, arena, sec_rt, record_property):
    record_property("attack", "API watchers by the hundred on one sandbox")
    s = arena.create(memory_mb=64)
    held = [s.files.watch_dir("/tmp") for _ in range(MAX_WATCHES)]
    try:
        with pytest.raises(SandboxLimitError, match=f"budget of API watches is {MAX_WATCHES}") as refused:
            s.files.watch_dir("/tmp")
        assert still_watches(arena.bystander, "/root")
        held.pop().stop()
        assert still_watches(s)  # a slot given back is usable again
        s.kill()  # with 31 watches open: they end, and so does their count
        wait_until(lambda: sec_rt.file_service.watches.open(s.id) == 0, 60, "the killed sandbox's budget given back")
    finally:
        for w in held:
            w.stop()
    record_property("figure", f"watch {MAX_WATCHES + 1} refused: {str(refused.value)[:90]}...; bystander watches")


def test_tenant_and_service_watch_budgets(record_property):
    """envd's budgets over all of a tenant's sandboxes and the whole service (no sandbox needed)."""
    record_property("attack", "one tenant's watchers over many sandboxes starve the service's")
    owners = {"a1": "alice", "a2": "alice", "b1": "bob", "x": None}
    svc = SimpleNamespace(tenants=SimpleNamespace(owner=owners.get))
    state = EnvdState()

    def admit(sid: str) -> object:
        return filesystem._admit(SimpleNamespace(svc=svc, state=state, sid=sid))

    for i in range(filesystem.TENANT_WATCHES):
        admit("a1" if i % 2 else "a2")
    with pytest.raises(QuotaError, match=f"'alice' holds {filesystem.TENANT_WATCHES} watches.*TENANT_WATCHES"):
        admit("a1")
    assert admit("b1") is not None  # another tenant is untouched
    while len(state.watch_slots) < filesystem.MAX_WATCHES:
        admit("x")
    with pytest.raises(CapacityError, match="MAX_WATCHES"):
        admit("b1")
    record_property("figure", f"tenant refused at {filesystem.TENANT_WATCHES} (429 quota_exceeded), another "
                              f"tenant admitted; the service refused at {filesystem.MAX_WATCHES} (429 capacity)")


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    data = tmp_path_factory.mktemp("inotify") / "svc"
    keys = {"alice": add_key(data, "alice"), "bob": add_key(data, "bob")}
    with ServiceProcess(data, env={"K3SYS_API_KEY": ADMIN_KEY}) as s:
        s.keys = keys
        yield s
        s.kill_all()


def _envd(svc, sid: str, method: str, body: dict) -> httpx.Response:
    headers = {"E2b-Sandbox-Id": sid, "X-Access-Token": access_token(ADMIN_KEY, sid)}
    return httpx.post(f"{svc.url}/filesystem.Filesystem/{method}", json=body, headers=headers, timeout=60)


def test_api_watchers_over_the_service_answer_429(budgeted, svc, record_property):
    record_property("attack", f"{MAX_WATCHES * 4} CreateWatcher calls on one sandbox through the service")
    sids = {}
    for tenant in ("alice", "bob"):
        with svc.client(svc.keys[tenant]) as c:
            sids[tenant] = c.create(SandboxSpec(memory_mb=64)).id
    flood, other = sids["alice"], sids["bob"]
    ids: list[str] = []
    try:
        answers = []
        for _ in range(MAX_WATCHES * 4):
            r = _envd(svc, flood, "CreateWatcher", {"path": "/tmp"})
            answers.append(r.status_code)
            if r.status_code == 200:
                ids.append(r.json()["watcherId"])
            else:
                refused = r
        assert answers.count(200) == MAX_WATCHES and set(answers) == {200, 429}
        assert refused.headers["k3sys-error-type"] == "sandbox_limit"
        assert f"budget of API watches is {MAX_WATCHES}" in refused.json()["message"]
        r = _envd(svc, other, "CreateWatcher", {"path": "/tmp"})  # another tenant's sandbox still watches
        assert r.status_code == 200
        assert _envd(svc, other, "RemoveWatcher", {"watcherId": r.json()["watcherId"]}).status_code == 200
    finally:
        for wid in ids:
            assert _envd(svc, flood, "RemoveWatcher", {"watcherId": wid}).status_code == 200
    assert _envd(svc, flood, "CreateWatcher", {"path": "/tmp"}).status_code == 200  # the budget came back
    assert "Traceback" not in svc.log.read_text()
    record_property("figure", f"{answers.count(200)} watchers made, {answers.count(429)} answered 429 "
                              f"sandbox_limit; another sandbox watches")
