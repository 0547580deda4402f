"""The host-paths row of the attack suite (issue 30, item 1): the host's own paths into a sandbox (its
root bound under /run/k3sys, its overlay, its disk, its sealed layers) let no other host user read,
plant or execute anything, are mounted nosuid,nodev, and root inside is not host root, with the
network on or off.

The attack: root inside copies python3 to /tmp/p and makes it setuid (4755), and leaves a 0644 file;
then host user `nobody` tries to run `<host path>/tmp/p` (it ran with euid 0 from a `network=True`
sandbox before the fix), to read the file and to plant one, through every path in
/proc/self/mountinfo that names the sandbox. The runtime lives on a world-searchable directory (as
/var/lib/k3sys would be), so the runtime's own directory is under test too.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_fixtures import MISSING, run_any, scratch_runtime

from k3sys.sandbox.runtime.drivers import idmap

# Host user nobody. setpriv keeps root's capabilities until its exec, so the exec's own path walk
# would pass any directory: it execs a shell, which (as nobody, without capabilities) execs the command.
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "/bin/sh", "-c", 'exec "$0" "$@"']
_PLANT = "k3sys-planted-by-nobody"


@pytest.fixture(scope="module")
def open_rt() -> Iterator:
    """A runtime whose parent directory any host user may search."""
    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    with scratch_runtime("k3sys-paths-", parent_mode=0o755) as rt:
        yield rt


def _as_nobody(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([*NOBODY, *argv], capture_output=True, text=True, timeout=30)


def _mounts(sid: str) -> dict[str, set[str]]:
    """Mount point -> its per-mount options, for every host mount whose path names sandbox `sid`."""
    out = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if sid in fields[4]:
                out[fields[4]] = set(fields[5].split(","))
    return out


def _planted(root: str) -> list[Path]:
    """Setuid files named `p` under `root` (the planted binary, wherever the host holds a copy)."""
    found = []
    for d, _, files in os.walk(root):
        found += [Path(d, f) for f in files
                  if f == "p" and os.lstat(os.path.join(d, f)).st_mode & stat.S_ISUID]
    return found


def _nobody_gets(paths: list[Path]) -> dict[str, str]:
    """What host user nobody achieved through each path to the planted file (running it, reading
    the 0644 file beside it, planting one there): empty when everything was refused."""
    got = {}
    for p in paths:
        r = _as_nobody(str(p), "-c", "import os; print(os.geteuid())")
        if r.returncode == 0:
            got[f"ran {p}"] = f"euid {r.stdout.strip()}"
        r = _as_nobody("cat", str(p.parent / "secret"))
        if r.returncode == 0:
            got[f"read {p.parent / 'secret'}"] = r.stdout.strip()
        r = _as_nobody("touch", str(p.parent / _PLANT))
        if r.returncode == 0:
            got[f"planted in {p.parent}"] = "yes"
    return got


@pytest.mark.parametrize("network", [False, True], ids=["network-off", "network-on"])
def test_host_users_cannot_reach_into_a_sandbox(arena, open_rt, debian_template, network, record_property):
    record_property("attack", f"host user runs a setuid file planted inside, reads and plants files "
                              f"(network={network})")
    if network and not shutil.which("nft"):
        pytest.skip("nft missing: run scripts/install-network.sh")
    a = type(arena)(open_rt, arena.host, arena.bystander)  # the suite's checks, on this module's runtime
    s = a.create(template="debian", memory_mb=128, network=network)
    r = s.commands.run("cp /usr/bin/python3 /tmp/p && chmod 4755 /tmp/p && echo tenant > /tmp/secret && "
                       "chmod 644 /tmp/secret && /tmp/p -c 'print(1)'")
    assert (r.exit_code, r.stdout.strip()) == (0, "1"), r.stderr
    driver, dirs = open_rt.driver, open_rt.table.dirs(s.id)

    # Every host mount naming the sandbox: nosuid and nodev, so nothing of it ever runs with privilege.
    mounts = _mounts(s.id)
    assert str(dirs.rootfs) in mounts and any(m.startswith(f"{driver.reach.dir}/") for m in mounts)
    weak = {m: sorted({"nosuid", "nodev"} - opts) for m, opts in mounts.items() if not {"nosuid", "nodev"} <= opts}
    assert weak == {}

    # Root inside is not host root: every process of the sandbox runs on its own uid range.
    base = driver.ranges.base_of(dirs.root)
    assert base is not None and base >= idmap.BASE
    status = Path(f"/proc/{driver.init_pid(s.id)}/status").read_text()
    uids = [int(u) for u in next(x for x in status.splitlines() if x.startswith("Uid:")).split()[1:]]
    assert all(base <= u < base + idmap.SIZE for u in uids), uids
    assert s.commands.run("cat /proc/self/uid_map").stdout.split() == ["0", str(base), str(idmap.SIZE)]

    # The planted file, through every host path to it: the reach bind, the overlay, the disk's upper.
    live = _planted(str(driver.reach.dir / s.id)) + _planted(str(dirs.root))
    assert len(live) >= 3, live
    got = _nobody_gets(live)
    # A sealed copy (a checkpoint restored as a fork child's lower layer) holds it with canonical
    # owners: root inside is uid 0 there.
    kid = s.fork(1)[0]
    a.track([kid])
    sealed = _planted(str(open_rt.root / "layers"))
    assert sealed and all(p.stat().st_uid == 0 for p in sealed)
    got.update(_nobody_gets(sealed))
    assert got == {}
    assert run_any(s, f"ls /tmp/{_PLANT}").exit_code != 0
    assert kid.commands.run("/tmp/p -c 'print(2)'").stdout.strip() == "2"  # the child has its files
    record_property("figure", f"{len(live) + len(sealed)} host paths to the setuid file, {len(mounts)} mounts "
                              f"(nosuid,nodev): nobody ran, read and planted nothing; root inside = host uid {base}")
    a.finish()


def test_scratch_directory_made_first_by_a_host_user(arena, private_root, record_property):
    record_property("attack", "host user makes the runtime's tmpfs staging directory first (process images)")
    from k3sys.sandbox import Runtime
    from k3sys.sandbox.errors import DriverError

    with Runtime(private_root) as rt:
        a = type(arena)(rt, arena.host, arena.bystander)
        s = a.create(memory_mb=64)
        shutil.rmtree(rt.scratch, ignore_errors=True)
        r = _as_nobody("mkdir", "-m", "0777", str(rt.scratch))  # its name follows from the runtime's path
        assert r.returncode == 0, r.stderr
        with pytest.raises(DriverError, match=str(rt.scratch)):
            s.checkpoint()
        assert os.listdir(rt.scratch) == []  # no image of the tenant's memory landed there
        assert s.commands.run("echo still").stdout.strip() == "still"  # the sandbox goes on as it was
        os.rmdir(rt.scratch)
        s.checkpoint()  # made afresh, private
        assert stat.S_IMODE(os.stat(rt.scratch).st_mode) == 0o700
        record_property("figure", "checkpoint refused, naming the directory; no image written; works once removed")
        a.finish()
