"""A sandbox's own confinement, as parts of its OCI config.json (docs/sandbox-security.md):
capabilities, the seccomp profile, no_new_privs, descriptor limits, the user namespace, and the
CRIU options that depend on the sandbox (its ghost-file limit).

Kept apart from the rest of config building (runc.py), which owns namespaces, mounts, cgroups and
hooks, so each can change without the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3sys.sandbox.runtime.drivers import seccomp_profile as profile
from k3sys.sandbox.runtime.drivers.idmap import SIZE
from k3sys.sandbox.spec import SandboxSpec

# What root inside a sandbox may do, and why it needs it. Everything else is dropped: MKNOD (device
# nodes), SETFCAP (file capabilities), SETPCAP, AUDIT_WRITE, NET_RAW (raw sockets), and every
# capability Docker never grants (SYS_ADMIN, SYS_PTRACE, SYS_MODULE, NET_ADMIN, ...).
CAPABILITIES: dict[str, str] = {
    "CAP_CHOWN": "package managers and `files.write` as a user give files their owners",
    "CAP_DAC_OVERRIDE": "root inside reads and writes every file of the sandbox",
    "CAP_FOWNER": "chmod / utime on files root does not own (tar, pip)",
    "CAP_FSETID": "keep setgid bits on files root writes",
    "CAP_SETUID": "the agent runs commands as the requested user",
    "CAP_SETGID": "the agent runs commands as the requested user (setgroups too)",
    "CAP_KILL": "the agent signals commands of any user inside",
    "CAP_NET_BIND_SERVICE": "servers inside listen on ports below 1024",
    "CAP_SYS_CHROOT": "build tools that chroot within the sandbox's own tree",
}

# Descriptors: every open file is a host `struct file`, and the host has one table for all
# (fs.file-max). A sandbox can hold at most pids x RLIMIT_NOFILE of them, so the per-process limit is
# this budget divided by the sandbox's pids limit (within NOFILE_MIN..NOFILE_MAX).
FD_BUDGET = 131072
NOFILE_MIN, NOFILE_MAX = 64, 65536


def nofile(pids: int) -> int:
    """The hard RLIMIT_NOFILE of every process of a sandbox with `pids` tasks at most."""
    return max(NOFILE_MIN, min(NOFILE_MAX, FD_BUDGET // pids))


def seccomp() -> dict[str, Any]:
    """The OCI `linux.seccomp` section of the default profile (seccomp_profile.py)."""
    eperm = {"action": "SCMP_ACT_ERRNO", "errnoRet": 1}
    rules: list[dict[str, Any]] = [{"names": sorted(profile.REFUSED), **eperm},
                                   {"names": list(profile.ENOSYS), "action": "SCMP_ACT_ERRNO", "errnoRet": 38}]
    for flag in profile.CLONE_NAMESPACE_FLAGS.values():
        rules.append({"names": ["clone"], **eperm,
                      "args": [{"index": 0, "value": flag, "valueTwo": flag, "op": "SCMP_CMP_MASKED_EQ"}]})
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": profile.ARCHITECTURES, "syscalls": rules}


def confine(config: dict[str, Any], uid_base: int | None) -> None:
    """Tighten `config` (built by runc.py) in place: capabilities, seccomp, no_new_privs, and with
    `uid_base` a user namespace mapping ids 0..SIZE-1 to host ids uid_base.."""
    caps = sorted(CAPABILITIES)
    process = config["process"]
    process["capabilities"] = {k: caps for k in ("bounding", "effective", "permitted")}
    process["noNewPrivileges"] = True
    linux = config["linux"]
    linux["seccomp"] = seccomp()
    if uid_base is not None:
        linux["namespaces"].append({"type": "user"})
        linux["uidMappings"] = linux["gidMappings"] = [{"containerID": 0, "hostID": uid_base, "size": SIZE}]


def criu_options(base: Path, spec: SandboxSpec) -> str:
    """The sandbox's CRIU options read after runc's: the shared ones (`base`, a file) plus a ghost-file
    limit (a deleted file a process still holds is copied into the images) of its disk size: no
    ghost can be larger than the file system it was on."""
    return base.read_text().rstrip("\n") + f"\nghost-limit {spec.disk_mb}M\n"
