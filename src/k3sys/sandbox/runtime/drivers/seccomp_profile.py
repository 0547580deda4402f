"""The default seccomp profile of every sandbox, as data (written for k3sys; the choice of WHICH
system calls to refuse follows what Docker's default profile refuses to a container without extra
capabilities). `confine.py` turns it into the OCI `linux.seccomp` section.

The profile is a deny list: every call not named here is allowed, and a refused call fails with
EPERM (ENOSYS for `clone3`, so C libraries fall back to `clone`, whose flags a filter can read).
A deny list, rather than Docker's allow list, because the agent, CRIU's restorer and whatever the
sandbox's user installs must keep working with calls newer than this file; what is refused is what
reaches kernel state outside the sandbox or that a container has no business touching.
"""

from __future__ import annotations

# name -> why it is refused. All fail with EPERM.
REFUSED: dict[str, str] = {
    # Kernel modules and the running kernel.
    "init_module": "load a kernel module", "finit_module": "load a kernel module",
    "delete_module": "unload a kernel module", "create_module": "obsolete module call",
    "get_kernel_syms": "obsolete module call", "query_module": "obsolete module call",
    "kexec_load": "replace the running kernel", "kexec_file_load": "replace the running kernel",
    "reboot": "reboot or halt the host", "swapon": "host swap", "swapoff": "host swap",
    "syslog": "the kernel log (host addresses)", "acct": "process accounting to a host file",
    "bpf": "load eBPF programs", "perf_event_open": "perf counters (side channels, kernel addresses)",
    "lookup_dcookie": "kernel profiling", "userfaultfd": "stall the kernel on a page fault (exploit aid)",
    "iopl": "raw I/O ports", "ioperm": "raw I/O ports", "vm86": "obsolete", "vm86old": "obsolete",
    "uselib": "obsolete loader call", "ustat": "obsolete", "sysfs": "obsolete", "_sysctl": "obsolete",
    "nfsservctl": "obsolete", "quotactl": "host disk quotas", "quotactl_fd": "host disk quotas",
    # Clocks shared with the host.
    "settimeofday": "the host clock", "stime": "the host clock", "clock_settime": "the host clock",
    "clock_adjtime": "the host clock", "adjtimex": "the host clock",
    # Keyrings are not namespaced.
    "add_key": "kernel keyrings", "request_key": "kernel keyrings", "keyctl": "kernel keyrings",
    # Namespaces and mounts: the sandbox's shape is fixed by the host (a nested user namespace would
    # hand its creator every capability inside it, and CRIU cannot dump what it then mounts).
    "unshare": "new namespaces", "setns": "join namespaces",
    "mount": "mounts", "umount": "mounts", "umount2": "mounts", "pivot_root": "mounts",
    "fsopen": "mounts", "fsconfig": "mounts", "fsmount": "mounts", "fspick": "mounts",
    "move_mount": "mounts", "open_tree": "mounts", "mount_setattr": "mounts",
    "open_by_handle_at": "open host files by handle (the 'shocker' escape)",
    "name_to_handle_at": "file handles (pairs with open_by_handle_at)",
    "fanotify_init": "file system wide notification", "kcmp": "compare kernel objects (address leaks)",
    "get_mempolicy": "NUMA policy of the host", "set_mempolicy": "NUMA policy of the host",
    "mbind": "NUMA policy of the host", "move_pages": "move pages between host NUMA nodes",
    "pidfd_getfd": "take descriptors out of other processes",
    # io_uring: a second system call interface (work queued in shared rings, done by kernel threads
    # this filter never sees) and a steady source of kernel exploits; Docker refuses it too, and CRIU
    # cannot dump a ring, so a sandbox holding one could not be checkpointed. EPERM is what a host
    # with `kernel.io_uring_disabled` answers, so programs (libuv, liburing users) fall back already.
    "io_uring_setup": "io_uring (unfiltered system calls)", "io_uring_enter": "io_uring (unfiltered system calls)",
    "io_uring_register": "io_uring (unfiltered system calls)",
}

# `clone3` passes its flags in memory a filter cannot read: refused with ENOSYS so libc uses clone.
ENOSYS = ("clone3",)

# clone(2) flags that make a new namespace; clone is refused when any is set (one rule per flag:
# a seccomp rule compares one masked value for equality).
CLONE_NAMESPACE_FLAGS: dict[str, int] = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}  # (CLONE_NEWTIME is 0x80, inside clone's exit-signal byte: only unshare and clone3 take it)

ARCHITECTURES = ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
