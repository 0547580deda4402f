"""Networks of sandboxes with `network=True`: a network namespace of their own, a veth pair to the
host, NAT to the outside, and an egress policy in nftables (docs/sandbox-network.md).

Per sandbox, slot `n` of a host-wide pool (10.201.0.0/16 cut into /30s; 16384 slots):

    host                                         the sandbox's network namespace
    k3sb<n> 10.201.x.y+1/30  <---- veth ---->  eth0 10.201.x.y+2/30 and 10.200.0.2/32 (the same in all)

Processes inside use 10.200.0.2 (the default route's source): a checkpoint restored into another
slot (a fork child, a resume after the slot went to someone else) finds its sockets' address again;
a rule inside the namespace rewrites it to the slot's own address on the way out, so the host can
tell sandboxes apart and answer each.

The sandbox's network namespace is runc's (CRIU's, on a restore), made inside the sandbox's user
namespace, so CRIU dumps the sandbox (as with loopback only, `--empty-ns network`). The host end is
made here, its other end `eth0` waiting in the slot's own namespace `/run/netns/k3sys-<n>`; runc's
prestart hook (`k3sys-net-up` with `_hook_args`, scripts/sandbox/k3sys-net-up.c) moves `eth0` into the
sandbox's namespace and sets the inside up, at every create and restore. The pair dies with the
sandbox's namespace (a kill), or with the teardown.

A slot is claimed by creating its namespace (`ip netns add` fails if it exists, whoever made it),
so runtimes on one host never share one; `<sandbox dir>/network.json` records it, for a kill
after a runtime restart. The host's rules live in one nftables table, `ip k3sys` (input, forward,
NAT), shared by every runtime on the host: a sandbox reaches nothing of the host's own (its
addresses, loopback), nothing link-local (169.254.0.0/16: cloud metadata), no other sandbox, and
outside only what its policy allows, and only from its own address; nothing from outside starts
a connection into a sandbox. IPv6 is off on the host ends of the veth pairs and dropped (a host service
listening on `::` would otherwise answer a sandbox at the host end's link-local address).
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import logging
import os
import random
import shutil
import subprocess
from pathlib import Path

from k3sys.sandbox.egress import EgressPolicy
from k3sys.sandbox.errors import DriverError

_log = logging.getLogger(__name__)

POOL = ipaddress.IPv4Network("10.201.0.0/16")
SLOTS = POOL.num_addresses // 4
INSIDE = "10.200.0.2"  # every sandbox's own address (see the module docstring)
TABLE = "k3sys"
NETNS_DIR = Path("/run/netns")
_LOCK = Path("/run/k3sys-network.lock")  # serialises the creation of the shared table
# Never reachable, whatever the policy: loopback (a martian on the way in anyway), "this network",
# link-local (cloud metadata at 169.254.169.254), multicast and reserved space.
BLOCKED = ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/3")

_BASE = f"""
table ip {TABLE} {{
    map egress {{ type ifname : verdict; }}
    chain input {{
        type filter hook input priority filter - 1; policy accept;
        iifname "k3sb*" ct state established,related accept
        iifname "k3sb*" drop
    }}
    chain forward {{
        type filter hook forward priority filter - 1; policy accept;
        oifname "k3sb*" ct state established,related accept
        oifname "k3sb*" drop
        iifname "k3sb*" ip daddr {{ {", ".join(BLOCKED)} }} drop
        iifname "k3sb*" iifname vmap @egress
        iifname "k3sb*" drop
    }}
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        ip saddr {POOL} oifname != "k3sb*" masquerade
    }}
}}
table ip6 {TABLE} {{
    chain input {{
        type filter hook input priority filter - 1; policy accept;
        iifname "k3sb*" drop
    }}
    chain forward {{
        type filter hook forward priority filter - 1; policy accept;
        iifname "k3sb*" drop
        oifname "k3sb*" drop
    }}
}}
"""


def names(slot: int) -> tuple[str, str]:
    """(network namespace, host end of the veth pair) of slot `slot`."""
    return f"k3sys-{slot}", f"k3sb{slot}"


def _addresses(slot: int) -> tuple[str, str]:
    """(host end, sandbox end) of slot `slot`'s /30."""
    base = int(POOL.network_address) + 4 * slot
    return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))


def _run(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise DriverError(f"{' '.join(args[:3])} failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p


class Network:
    """Sets up and tears down sandboxes' networks (see the module docstring)."""

    def __init__(self) -> None:
        self._ready = False
        self._nft = "nft"  # its path once the base is ready (runc runs hooks without a PATH search)

    def _ensure_base(self) -> None:
        """The shared table (once per host) and IPv4 forwarding on (once, logged: the host routes)."""
        if self._ready:
            return
        _LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                tables = _run(["nft", "list", "tables"]).stdout.splitlines()
                if not {f"table ip {TABLE}", f"table ip6 {TABLE}"} <= set(tables):
                    _run(["nft", "-f", "-"], _BASE)
            except FileNotFoundError:
                raise DriverError("network=True needs nftables: run scripts/install-network.sh") from None
        self._nft = shutil.which("nft") or "nft"
        forward = Path("/proc/sys/net/ipv4/ip_forward")
        if forward.read_text().strip() != "1":
            forward.write_text("1")
            _log.warning("enabled net.ipv4.ip_forward: sandboxes with network=True reach outside through NAT")
        self._ready = True

    def setup(self, root: Path, policy: EgressPolicy | None, resolv: Path) -> tuple[list[str], dict]:
        """Make the host's side of the network of the sandbox whose directory is `root`, and its
        resolv.conf at `resolv` (a new file where the sandbox's runc reaches it); returns the OCI
        config's entries for it: (the arguments of runc's prestart hook `k3sys-net-up` after argv[0],
        which set up the inside; the bind mount of the resolv.conf). Whatever was made is removed
        again if a step fails."""
        self._ensure_base()
        policy = policy or EgressPolicy()
        nameservers = policy.nameservers(_read("/etc/resolv.conf"))
        allow, deny = policy.resolve(nameservers)  # before any work: a bad host name costs nothing
        slot = self._claim(root)
        try:
            self._wire(slot, allow, deny)
        except BaseException:
            self.teardown(root)
            raise
        resolv.write_text("".join(f"nameserver {s}\n" for s in nameservers))
        return (self._hook_args(slot),
                {"destination": "/etc/resolv.conf", "type": "bind", "source": str(resolv), "options": ["rbind", "ro"]})

    def _hook_args(self, slot: int) -> list[str]:
        """`FROM DEV ADDR/LEN GATEWAY SRC -- nft RULE` of k3sys-net-up: eth0 moved from the slot's
        namespace into the sandbox's, addressed and routed there, and the inside rule: the shared
        address becomes the slot's own on the way out (replies are mapped back)."""
        host, mine = _addresses(slot)
        rule = (f"add table ip {TABLE} {{ chain out {{ type nat hook postrouting priority srcnat; "
                f"oifname \"eth0\" ip saddr {INSIDE} snat to {mine}; }}; }}")
        return [str(NETNS_DIR / names(slot)[0]), "eth0", f"{mine}/30", host, INSIDE, "--", self._nft, rule]

    def _claim(self, root: Path) -> int:
        """A free slot, claimed by creating its namespace, and recorded in `root/network.json`."""
        start = random.randrange(SLOTS)  # spread runtimes over the pool: fewer collisions to walk past
        for i in range(SLOTS):
            slot = (start + i) % SLOTS
            ns = names(slot)[0]
            if (NETNS_DIR / ns).exists():
                continue
            p = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
            if p.returncode == 0:
                # Which namespace is ours, against a later owner's of the same slot (teardown).
                (root / "network.json").write_text(json.dumps({"slot": slot, "netns": _identity(ns)}))
                return slot
            if "exists" not in p.stderr:
                raise DriverError(f"ip netns add {ns} failed: {p.stderr.strip()}")
        raise DriverError(f"no free network slot: all {SLOTS} sandbox networks of this host are in use")

    def _wire(self, slot: int, allow: list[str], deny: list[str]) -> None:
        host, mine = _addresses(slot)
        ns, veth = names(slot)
        # eth0 waits in the slot's namespace for the sandbox's runc (`_hook_args`).
        _run(["ip", "-b", "-"], f"link add {veth} type veth peer name eth0 netns {ns}\n"
                                f"addr add {host}/30 dev {veth}\nlink set {veth} up\n")
        Path(f"/proc/sys/net/ipv6/conf/{veth}/disable_ipv6").write_text("1")  # and the ip6 table drops it
        rules = [f"add rule ip {TABLE} sb{slot} ip saddr != {mine} drop"]  # no address but its own
        rules += [f"add rule ip {TABLE} sb{slot} ip daddr {{ {', '.join(nets)} }} {verdict}"
                  for nets, verdict in ((allow, "accept"), (deny, "drop")) if nets]
        _run(["nft", "-f", "-"], "\n".join([f"add chain ip {TABLE} sb{slot}", *rules,
                                             f"add rule ip {TABLE} sb{slot} accept",
                                             f"add element ip {TABLE} egress {{ \"{veth}\" : jump sb{slot} }}"]) + "\n")

    def teardown(self, root: Path) -> None:
        """Remove the network of the sandbox whose directory is `root` (its rules, veth pair and
        namespace); nothing to do when it has none. Safe on a half-made one."""
        try:
            rec = json.loads((root / "network.json").read_text())
            slot, identity = int(rec["slot"]), rec["netns"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        if not 0 <= slot < SLOTS:
            raise DriverError(f"{root / 'network.json'}: slot {slot} is outside the pool")
        ns, veth = names(slot)
        # The namespace is made first and removed last, so none of ours means nothing of ours is left;
        # another one is the slot's next owner's (a teardown that died after freeing it): not ours.
        if _identity(ns) != identity:
            os.unlink(root / "network.json")
            return
        # Made whole first (`add` is a no-op on what exists), so one transaction removes it however
        # far its setup got (even after a reboot took the table).
        _run(["nft", "-f", "-"], f"add table ip {TABLE}\nadd map ip {TABLE} egress {{ type ifname : verdict; }}\n"
                                 f"add chain ip {TABLE} sb{slot}\nflush chain ip {TABLE} sb{slot}\n"
                                 f"add element ip {TABLE} egress {{ \"{veth}\" : jump sb{slot} }}\n"
                                 f"delete element ip {TABLE} egress {{ \"{veth}\" }}\n"
                                 f"delete chain ip {TABLE} sb{slot}\n")
        # Then, not at once: deleting the namespace frees the slot, whose next owner must not find
        # our chain. The veth pair goes with the sandbox's namespace (or the slot's, before the
        # hook moved eth0), but only once the kernel has cleaned it up (asynchronously): deleted
        # first, its name is free for that next owner at once.
        links = f"link del {veth}\n" if Path(f"/sys/class/net/{veth}").exists() else ""
        p = subprocess.run(["ip", "-force", "-b", "-"], input=f"{links}netns del {ns}\n", capture_output=True,
                           text=True, timeout=30)
        # A pair whose sandbox namespace went after the check above is gone already: that is fine.
        if p.returncode != 0 and (_identity(ns) is not None or "Cannot find device" not in p.stderr):
            raise DriverError(f"ip -force -b failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
        os.unlink(root / "network.json")


def _identity(ns: str) -> list[int] | None:
    """[inode, ctime in ns] of the network namespace mounted at /run/netns/`ns` (None: none there).
    The kernel reuses a freed namespace's inode number; the time tells the two apart."""
    try:
        st = os.stat(NETNS_DIR / ns)
    except FileNotFoundError:
        return None
    return [st.st_ino, st.st_ctime_ns]


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""
