"""Attacks on a sandbox's own confinement (runc driver: user namespace, seccomp, capabilities,
limits): each must fail inside, leave the host and the bystander as they were, and leave the
attacked sandbox killable with nothing behind (the `arena` fixture checks the last three)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from sandbox_fixtures import run_any
from waiting import wait_until

from k3sys.sandbox import InvalidArgumentError, Sandbox
from k3sys.sandbox.runtime.drivers import confine, idmap
from k3sys.sandbox.spec import MAX_PIDS


def file_nr() -> int:
    """Host file descriptors (struct file) allocated now: the first field of /proc/sys/fs/file-nr."""
    return int(Path("/proc/sys/fs/file-nr").read_text().split()[0])


def _cgroup(sid: str) -> Path:
    """The sandbox's pids cgroup (v1) or its cgroup (v2)."""
    candidates = (Path(f"/sys/fs/cgroup/pids/k3sys-{sid}"), Path(f"/sys/fs/cgroup/k3sys-{sid}"))
    return next(p for p in candidates if p.exists())


# Python inside a debian sandbox makes raw system calls: prints `errno` (0 when the call succeeded).
_SYSCALL = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    r = libc.syscall(nr, *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return 0 if r >= 0 else ctypes.get_errno()
"""


def _py(sbx: Sandbox, body: str, timeout: float = 60) -> str:
    sbx.files.write("/tmp/attack.py", _SYSCALL + body)
    r = sbx.commands.run("python3 /tmp/attack.py", timeout=timeout)
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


def test_fork_bomb_hits_pids_limit(arena, record_property):
    record_property("attack", "fork bomb")
    s = arena.create(pids=64, cpu=0.5, memory_mb=128)
    s.commands.run("f() { f | f & }; f >/dev/null 2>&1 &", timeout=30)
    cg = _cgroup(s.id)
    refused = wait_until(lambda: int((cg / "pids.events").read_text().split()[1]), 20, "a fork refused by the limit")
    current = int((cg / "pids.current").read_text())
    assert current <= 64 and refused > 0
    record_property("figure", f"{current} tasks of pids=64, {refused} forks refused")


def test_memory_hog_killed_at_memory_mb(arena, record_property):
    record_property("attack", "memory hog")
    s = arena.create(memory_mb=64)
    r = run_any(s, "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo survived ${#x}", timeout=60)
    assert r.exit_code == 137 and "survived" not in r.stdout
    assert s.memory_bytes() <= 64 << 20
    assert s.commands.run("echo fine").stdout == "fine\n"
    record_property("figure", f"200 MB asked: killed (exit 137) at memory_mb=64, {s.memory_bytes() >> 20} MiB after")


def test_cpu_hog_is_throttled(arena, record_property):
    record_property("attack", "CPU hog")
    s = arena.create(cpu=0.25, memory_mb=64)
    s.commands.run("for i in 1 2; do (while :; do :; done) & done", timeout=10)
    c0, t0 = s.cpu_seconds(), time.monotonic()
    time.sleep(2.0)  # the measurement's window (a loaded host can only lower the share, never raise it)
    share = (s.cpu_seconds() - c0) / (time.monotonic() - t0)
    assert share <= 0.25 * 1.3, share
    record_property("figure", f"2 busy loops got {share:.2f} CPU (cpu=0.25)")


def test_proc_kcore_and_kernel_files(arena, record_property):
    record_property("attack", "/proc/kcore, /proc/sysrq-trigger, /sys/firmware")
    s = arena.create(memory_mb=64)
    assert s.commands.run("head -c 64 /proc/kcore | wc -c").stdout.strip() == "0"
    assert run_any(s, "echo b > /proc/sysrq-trigger").exit_code != 0
    assert s.commands.run("ls /sys/firmware").stdout == ""
    record_property("figure", "kcore reads 0 bytes; sysrq-trigger read-only; /sys/firmware empty")


def test_mount_module_reboot_syscalls_refused(arena, debian_template, record_property):
    record_property("attack", "mount / module / reboot / kexec / bpf syscalls")
    s = arena.create(template="debian", memory_mb=256)
    # x86_64 numbers: mount 165, init_module 175, finit_module 313, reboot 169, kexec_load 246,
    # bpf 321, swapon 167, open_by_handle_at 304, keyctl 250.
    out = _py(s, """
print(call(165, b"none", b"/mnt", b"tmpfs", 0, 0), call(175, 0, 0, b""), call(313, -1, b"", 0),
      call(169, 0xfee1dead, 672274793, 0x4321FEDC, 0), call(246, 0, 0, 0, 0), call(321, 0, 0, 0),
      call(167, b"/x", 0), call(304, -100, 0, 0), call(250, 0, 0, 0))
""")
    assert out.split() == ["1"] * 9, out  # EPERM each
    assert run_any(s, "mount -t tmpfs none /mnt").exit_code != 0
    record_property("figure", "9 of 9 calls refused with EPERM (seccomp)")


def test_io_uring_refused(arena, debian_template, record_property):
    record_property("attack", "io_uring_setup / io_uring_enter / io_uring_register")
    s = arena.create(template="debian", memory_mb=256)
    # x86_64: io_uring_setup 425 (8 entries, zeroed params), io_uring_enter 426, io_uring_register 427.
    out = _py(s, """
params = ctypes.create_string_buffer(120)
print(call(425, 8, params), call(426, -1, 1, 0, 0, 0, 0), call(427, -1, 0, 0, 0))
""")
    assert out.split() == ["1"] * 3, out  # EPERM each (unfiltered: 0, EBADF, EINVAL)
    record_property("figure", "3 of 3 io_uring calls refused with EPERM (seccomp)")


def test_mknod_refused(arena, host, record_property):
    record_property("attack", "mknod (a host block device)")
    s = arena.create(memory_mb=64)
    dev = Path(host.loop)
    major, minor = divmod(dev.stat().st_rdev, 256)
    r = run_any(s, f"mknod /tmp/disk b {major} {minor} && dd if=/dev/zero of=/tmp/disk bs=4k count=1")
    assert r.exit_code != 0 and "Operation not permitted" in r.stderr
    assert run_any(s, "mknod /tmp/null c 1 3").exit_code != 0
    record_property("figure", f"mknod b {major}:{minor} and c 1:3 refused (no CAP_MKNOD); the host loop device intact")


def test_new_user_namespace_refused_and_checkpoint_still_works(arena, debian_template, record_property):
    record_property("attack", "unshare(CLONE_NEWUSER) + mount")
    s = arena.create(template="debian", memory_mb=256)
    # unshare 272, clone 56 (flags first), clone3 435.
    out = _py(s, "print(call(272, 0x10000000), call(272, 0x00020000), call(56, 0x10000000 | 17, 0, 0, 0, 0), "
                 "call(435, 0, 0))")
    assert out.split() == ["1", "1", "1", "38"], out  # EPERM, EPERM, EPERM, ENOSYS
    assert run_any(s, "unshare -Urm mount -t tmpfs none /mnt").exit_code != 0
    kid = s.fork(1)[0]
    arena.track([kid])
    status = kid.commands.run("grep -E 'Seccomp:|NoNewPrivs' /proc/self/status").stdout.split()
    assert status == ["NoNewPrivs:", "1", "Seccomp:", "2"]
    assert _py(kid, "print(call(272, 0x10000000))") == "1"
    record_property("figure", "unshare/clone EPERM, clone3 ENOSYS; the profile and no_new_privs survive a fork")


def test_root_inside_is_not_root_outside(arena, record_property):
    record_property("attack", "root inside = root outside")
    s = arena.create(memory_mb=64)
    r = s.commands.run("sleep 30 & echo $!")
    assert r.exit_code == 0
    host_uids = []
    for pid in (_cgroup(s.id) / "cgroup.procs").read_text().split():
        status = Path(f"/proc/{pid}/status").read_text()
        host_uids.append(int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1]))
    base = arena.rt.driver.ranges.base_of(arena.rt.table.dirs(s.id).root)
    assert base is not None and base >= idmap.BASE
    assert host_uids and all(base <= u < base + idmap.SIZE for u in host_uids), host_uids
    assert s.commands.run("id -u").stdout.strip() == "0"
    # A fork child gets a range of its own; a file root writes inside is root's inside, not the host's.
    kid = s.fork(1)[0]
    arena.track([kid])
    kid_base = arena.rt.driver.ranges.base_of(arena.rt.table.dirs(kid.id).root)
    assert kid_base not in (None, base)
    assert kid.commands.run("cat /proc/self/uid_map").stdout.split() == ["0", str(kid_base), str(idmap.SIZE)]
    kid.files.write("/root/f", "x")
    assert kid.commands.run("stat -c %u /root/f").stdout.strip() == "0"
    record_property("figure", f"root inside = host uid {base}; fork child on {kid_base}; ranges of {idmap.SIZE}")


def test_many_open_files_bounded(arena, debian_template, record_property):
    record_property("attack", "many processes x many open files")
    pids = 32
    s = arena.create(template="debian", memory_mb=512, pids=pids)
    limit = confine.nofile(pids)
    assert s.commands.run("ulimit -Hn").stdout.strip() == str(limit)
    before = file_nr()
    # 24 processes each open descriptors until refused, then report how many they hold and wait.
    s.files.write("/root/fds.py", """
import os, resource, time
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
fds = []
try:
    while True:
        fds.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    os.close(fds.pop())  # one free, to report
open("/tmp/n.%d" % os.getpid(), "w").write("%d\\n" % (len(fds) + 1))
time.sleep(60)
""")
    s.commands.run("for i in $(seq 24); do python3 /root/fds.py & done", timeout=30)

    def all_counts() -> list[str]:
        counts = run_any(s, "cat /tmp/n.* 2>/dev/null").stdout.split()
        return counts if len(counts) == 24 else []

    counts = wait_until(all_counts, 90, "the 24 processes' counts", step=0.5)
    held = sum(int(c) for c in counts)
    grew = file_nr() - before
    assert len(counts) == 24 and all(int(c) <= limit for c in counts)
    assert held <= confine.FD_BUDGET and grew < confine.FD_BUDGET + 10_000
    record_property("figure", f"24 procs held {held} fds (RLIMIT_NOFILE {limit} at pids={pids}); "
                              f"sandbox bound {pids * limit} <= {confine.FD_BUDGET}; host file-nr +{grew}")


def test_ghost_file_survives_checkpoint_fork_hibernate(arena, debian_template, record_property):
    record_property("attack", "deleted-but-open 5 MB file")
    s = arena.create(template="debian", memory_mb=256)
    s.commands.run("""python3 -c '
import os, time
f = open("/root/ghost", "wb+"); f.write(os.urandom(5 << 20)); f.flush(); os.unlink("/root/ghost")
open("/root/ready", "w").write(str(os.getpid()))
while True:
    time.sleep(0.2)
' &""", timeout=10)
    wait_until(lambda: run_any(s, "test -e /root/ready").exit_code == 0, 30, "the ghost's holder ready", step=0.1)
    size = "ls -l /proc/$(cat /root/ready)/fd | grep -c 'ghost (deleted)'"
    ck = s.checkpoint()
    kid = s.fork(1)[0]
    arena.track([kid])
    assert kid.commands.run(size).stdout.strip() == "1"
    s.hibernate()
    s.resume()
    assert s.commands.run(size).stdout.strip() == "1"
    assert ck.id
    record_property("figure", "5 MiB ghost file: checkpoint, fork, hibernate+resume all work")


def test_create_parameters_bounded(sec_rt, record_property):
    record_property("attack", "pids: 4194304 at create")
    with pytest.raises(InvalidArgumentError, match=rf"pids: expected an integer in \[8, {MAX_PIDS}\].*got 4194304"):
        Sandbox.create(runtime=sec_rt, pids=4194304)
    record_property("figure", f"refused with InvalidArgumentError naming 4194304 and the bound {MAX_PIDS}")


def test_disk_filled_past_disk_mb(arena, record_property):
    record_property("attack", "dd past disk_mb")
    s = arena.create(memory_mb=64, disk_mb=64)
    image = arena.rt.table.dirs(s.id).root / "disk.img"
    assert s.commands.run("df -m / | tail -1").stdout.split()[1] in {str(n) for n in range(56, 65)}
    r = run_any(s, "dd if=/dev/zero of=/root/big bs=1M count=200", timeout=60)
    assert r.exit_code != 0 and "No space left on device" in r.stderr
    s.commands.run("sync")  # what dd wrote reaches the image, so its size below is all of it
    held = image.stat().st_blocks * 512
    assert held <= (64 + 8) << 20, held
    # Deleting inside gives the space back to the host (discard punches holes in the image).
    s.commands.run("rm /root/big && sync")
    after_rm = image.stat().st_blocks * 512
    # A checkpoint of a full disk, then kill and checkpoint delete: nothing of it stays on the host.
    run_any(s, "dd if=/dev/zero of=/root/big bs=1M count=200", timeout=60)  # refused at the quota again
    ck = s.checkpoint()
    layer = arena.rt.layers.path(ck.id)
    s.kill()
    ck.delete()
    assert not image.exists() and not layer.exists()
    record_property("figure", f"200 MB into disk_mb=64: ENOSPC; host image {held >> 20} MiB, {after_rm >> 20} MiB "
                              "after rm; all gone after kill + checkpoint delete")


def test_network_sandbox_keeps_seccomp_and_capabilities(arena, record_property):
    record_property("attack", "network=True: unshare, mknod, reconfiguring its own network")
    s = arena.create(memory_mb=64, network=True)
    status = dict(line.split(":\t", 1) for line in s.commands.run("cat /proc/self/status").stdout.splitlines()
                  if ":\t" in line)
    assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1"
    allowed = sum(1 << n for n in (0, 1, 3, 4, 5, 6, 7, 10, 18))  # the nine of confine.CAPABILITIES
    assert int(status["CapBnd"], 16) == allowed
    assert "Operation not permitted" in run_any(s, "unshare -U true").stderr
    assert "Operation not permitted" in run_any(s, "mknod /tmp/n c 1 3").stderr
    # Its network namespace belongs to its user namespace now, but root inside has no CAP_NET_ADMIN:
    # the address the host's rules expect, the route and the NAT rule inside stay as the host set them.
    for change in ("ip link set eth0 down", "ip addr add 10.201.0.6/32 dev eth0", "ip route del default"):
        assert "Operation not permitted" in run_any(s, change).stderr, change
    s.checkpoint()
    record_property("figure", f"Seccomp 2, NoNewPrivs 1, CapBnd {status['CapBnd']}; unshare, mknod and changes "
                              "to eth0 / routes refused; checkpoint works")


def test_concurrent_claims_never_share_a_uid_range(tmp_path, record_property):
    record_property("attack", "two sandboxes on one uid range (concurrent creates, stale claims)")
    from concurrent.futures import ThreadPoolExecutor

    ranges = idmap.Ranges(tmp_path / "claims")
    dirs = [tmp_path / f"sbx-{i}" for i in range(32)]
    for d in dirs:
        d.mkdir()
    with ThreadPoolExecutor(16) as pool:
        bases = list(pool.map(ranges.claim, dirs))
    assert len(set(bases)) == 32 and min(bases) >= idmap.BASE
    assert [ranges.base_of(d) for d in dirs] == bases
    # A claim whose sandbox directory is gone is taken over; a live one never is.
    dirs[3].rmdir()
    assert ranges.claim(tmp_path / "sbx-new") == bases[3]
    ranges.release(dirs[0])
    assert ranges.base_of(dirs[0]) is None
    record_property("figure", "32 concurrent claims: 32 ranges; a stale claim reused, a released one freed")


def test_concurrent_first_creates_share_one_dev_mask(tmp_path):
    """The first creates of a fresh runtime, from many threads at once, all get the one /dev mask
    layer, whole (a fresh service's 20 concurrent creates once failed here: the threads of one
    process shared a temporary directory)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        layers = list(pool.map(lambda _: idmap.dev_mask(tmp_path), range(32)))
    layer = tmp_path / "dev-mask"
    assert set(layers) == {layer}
    assert (layer / "dev" / "pts").is_dir() and (layer / "dev" / "shm").stat().st_mode & 0o7777 == 0o1777
    assert os.getxattr(layer / "dev", "trusted.overlay.opaque") == b"y"
    assert [p.name for p in tmp_path.iterdir()] == ["dev-mask"]  # no temporary directory left behind
