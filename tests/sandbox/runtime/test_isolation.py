"""Isolation and limits: the host's files and network stay out of reach, memory and pids limits
hold (a memory hog and a fork bomb are contained), and paths cannot escape the sandbox root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sandbox_fixtures import run_any
from waiting import wait_until

from k3sys.sandbox import PathEscapeError, Sandbox

pytestmark = pytest.mark.timeout(120)


def test_host_files_are_not_visible(sbx, tmp_path):
    secret = Path("/tmp") / f"k3sys-host-secret-{os.getpid()}"
    secret.write_text("host only")
    try:
        r = run_any(sbx, f"cat {secret}")
        assert r.exit_code != 0 and "host only" not in r.stdout
        # The sandbox's / is the template, not the host's root.
        assert sbx.commands.run("ls /").stdout.split() != sorted(os.listdir("/"))
        assert run_any(sbx, "test -e /work || test -e /opt/k3sys").exit_code == 1
    finally:
        secret.unlink()


def test_network_is_loopback_only(sbx):
    links = sbx.commands.run("ip -o link show").stdout
    assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"]
    assert "UP" in links
    assert sbx.commands.run("ip route show").stdout.strip() == ""
    # Loopback works inside; nothing outside is reachable.
    # The client retries until the listener is up (no fixed sleep: the machine may be loaded).
    r = sbx.commands.run("(nc -l -p 5000 -e echo pong &); for i in $(seq 100); do "
                         "r=$(echo ping | nc 127.0.0.1 5000 2>/dev/null) && [ -n \"$r\" ] && break; sleep 0.05; done; "
                         "echo \"$r\"")
    assert r.stdout.strip() == "pong"
    r = sbx.commands.run("wget -q -T 2 -O - http://deb.debian.org/ || echo unreachable")
    assert "unreachable" in r.stdout


def test_memory_hog_is_killed_inside_and_host_is_fine(rt):
    with Sandbox.create(runtime=rt, memory_mb=64) as s:
        # ~200 MiB of anonymous memory in one shell variable.
        r = run_any(s, "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo survived ${#x}", timeout=60)
        assert r.exit_code == 137 and "survived" not in r.stdout
        assert s.memory_bytes() <= 64 << 20
        # The sandbox itself (its init) is still alive and usable.
        assert s.state == "running"
        assert s.commands.run("echo fine").stdout == "fine\n"


def test_fork_bomb_is_contained(rt):
    with Sandbox.create(runtime=rt, pids=32, cpu=0.5) as s:
        s.commands.run("f() { f | f & }; f >/dev/null 2>&1 &", timeout=30)
        cg = next(p for p in (Path(f"/sys/fs/cgroup/pids/k3sys-{s.id}"), Path(f"/sys/fs/cgroup/k3sys-{s.id}"))
                  if p.exists())
        # The bomb did run into the limit: forks were refused.
        wait_until(lambda: int((cg / "pids.events").read_text().split()[1]) > 0, 20, "a fork refused by the limit")
        assert int((cg / "pids.current").read_text()) <= 32
        # The host can still fork freely and the runtime still answers.
        assert os.system("true") == 0
        assert s.state == "running"
    assert s not in Sandbox.list(runtime=rt)


def test_cpu_limit_is_set(rt):
    with Sandbox.create(runtime=rt, cpu=0.25) as s:
        quota = Path(f"/sys/fs/cgroup/cpu/k3sys-{s.id}/cpu.cfs_quota_us")
        if quota.exists():
            assert int(quota.read_text()) == 25_000
        limit = Path(f"/sys/fs/cgroup/memory/k3sys-{s.id}/memory.limit_in_bytes")
        if limit.exists():
            assert int(limit.read_text()) == 512 << 20


def test_paths_cannot_escape_the_root(sbx):
    with pytest.raises(PathEscapeError, match="climbs above"):
        sbx.files.read("/../etc/passwd")
    with pytest.raises(PathEscapeError):
        sbx.files.read("/tmp/../../../etc/shadow")
    with pytest.raises(PathEscapeError):
        sbx.files.write("/../host-file", b"x")
    # A relative link climbing out stops at the sandbox's root, as it does for the sandbox itself
    # (the agent resolves it inside): it reads the sandbox's files, never the host's.
    sbx.commands.run("ln -s ../../../../../ /tmp/up")
    assert sbx.files.read("/tmp/up/etc/passwd", format="bytes") == sbx.commands.run("cat /etc/passwd").stdout.encode()
    assert sbx.files.read("/tmp/up/etc/passwd", format="bytes") != Path("/etc/passwd").read_bytes()
    assert {e.name for e in sbx.files.list("/tmp/up")} == set(sbx.commands.run("ls -A /").stdout.split())
    # An absolute link means the sandbox's own root, as the sandbox itself sees it.
    sbx.commands.run("ln -s /etc /tmp/abs && ln -s /etc/passwd /tmp/pw")
    assert sbx.files.read("/tmp/abs/passwd", format="bytes") == sbx.commands.run("cat /etc/passwd").stdout.encode()
    assert sbx.files.read("/tmp/pw", format="bytes").startswith(b"root:x:0:0:root:/root:/bin/sh")
    assert sbx.files.read("/tmp/pw", format="bytes") != Path("/etc/passwd").read_bytes()
    # Writing through an absolute link lands inside the sandbox, never on the host.
    sbx.commands.run("ln -s /root/target /tmp/wlink")
    sbx.files.write("/tmp/wlink", b"inside")
    assert sbx.commands.run("cat /root/target").stdout == "inside"
    # Removing a link removes the link, not what it points to.
    sbx.files.remove("/tmp/abs")
    assert sbx.commands.run("test -f /etc/passwd").exit_code == 0
    # `..` that stays inside is fine.
    assert sbx.files.read("/etc/../etc/passwd", format="bytes").startswith(b"root:")


def test_network_true_has_a_namespace_of_its_own(rt):
    # tests/sandbox/security/test_network.py tries it as an attacker would.
    with Sandbox.create(runtime=rt, network=True) as s:
        assert s.commands.run("ls /sys/class/net").stdout.split() == ["eth0", "lo"]
        s.files.write("/root/x", "kept")
        ck = s.checkpoint()
        with Sandbox.restore(ck) as r:
            assert r.files.read_text("/root/x") == "kept"
            assert r.spec.network is True
