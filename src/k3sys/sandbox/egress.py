"""The egress policy of a sandbox with `network=True` (`EgressPolicy`), in the shape of E2B's
`network` create options: `allow_out` / `deny_out` lists of IPv4 addresses, CIDR blocks or host
names, and `dns_servers`.

Semantics (E2B's): with no lists everything outside is reachable; an address in `allow_out` is
reachable even when `deny_out` covers it (`deny_out=["0.0.0.0/0"], allow_out=[...]` is an allow
list). Host names are resolved when the sandbox's network is set up (create, restore, fork,
resume), to the IPv4 addresses the host's resolver gives then; when `allow_out` names a host, the
sandbox's DNS servers are allowed too. Whatever the policy, the host itself, its loopback, the
link-local / metadata range and other sandboxes stay out of reach (drivers/network.py).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Any

from k3sys.sandbox.errors import InvalidArgumentError

ALL_TRAFFIC = "0.0.0.0/0"
MAX_ENTRIES = 256  # per list: the rules are built from them, and a caller chooses them
MAX_ADDRESSES_PER_HOST = 32  # addresses of one host name kept (a resolver's answer is not ours to trust)
DEFAULT_DNS = ("8.8.8.8",)  # E2B's default nameserver, when the host's own are loopback-only
_HOST = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def _entries(name: str, value: object, *, hosts: bool) -> tuple[str, ...]:
    """`value` as a tuple of valid entries (IPv4 addresses / CIDR blocks, and host names if `hosts`)."""
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise InvalidArgumentError(f"{name}: expected a list of addresses, CIDR blocks or host names, got {value!r}")
    if len(value) > MAX_ENTRIES:
        raise InvalidArgumentError(f"{name}: at most {MAX_ENTRIES} entries, got {len(value)}")
    out = []
    for e in value:
        if not isinstance(e, str) or not e:
            raise InvalidArgumentError(f"{name}: expected strings, got {e!r}")
        try:
            net = ipaddress.ip_network(e, strict=False)
        except ValueError:
            if hosts and _HOST.match(e.lower()) and not e.replace(".", "").isdigit():
                out.append(e.lower())
                continue
            what = "an IPv4 address, CIDR block or host name" if hosts else "an IPv4 address"
            raise InvalidArgumentError(f"{name}: {e!r} is not {what}") from None
        if net.version != 4:
            raise InvalidArgumentError(f"{name}: {e!r} is IPv6; sandboxes have IPv4 only")
        out.append(str(net))
    return tuple(out)


def is_host(entry: str) -> bool:
    """Whether a validated entry is a host name (addresses are normalised to CIDR blocks: `a.b.c.d/n`)."""
    return "/" not in entry


@dataclass(frozen=True)
class EgressPolicy:
    """What a sandbox may reach outside (see the module docstring).

    `allow_out`, `deny_out`: IPv4 addresses, CIDR blocks (`"10.0.0.0/8"`, `ALL_TRAFFIC`) or host
    names; `dns_servers`: the nameservers written to the sandbox's /etc/resolv.conf (None: the
    host's, or 8.8.8.8 when the host's are on its loopback).
    """

    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()
    dns_servers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place once
        set_(self, "allow_out", _entries("allow_out", self.allow_out, hosts=True))
        set_(self, "deny_out", _entries("deny_out", self.deny_out, hosts=True))
        if self.dns_servers is not None:
            servers = _entries("dns_servers", self.dns_servers, hosts=False)
            if len(servers) > 10 or any(not s.endswith("/32") for s in servers):
                raise InvalidArgumentError(f"dns_servers: expected at most 10 IPv4 addresses, got {self.dns_servers!r}")
            set_(self, "dns_servers", tuple(s.removesuffix("/32") for s in servers))

    @classmethod
    def from_json(cls, d: object) -> EgressPolicy:
        if isinstance(d, EgressPolicy):
            return d
        if not isinstance(d, dict) or not set(d) <= {"allow_out", "deny_out", "dns_servers"}:
            raise InvalidArgumentError(f"egress: expected an object with allow_out, deny_out, dns_servers; got {d!r}")
        return cls(**d)

    @classmethod
    def from_e2b(cls, network: dict[str, Any] | None, allow_internet_access: bool | None = None) -> EgressPolicy | None:
        """The policy an E2B create body asks for: its `network` object (`allowOut`, `denyOut`,
        `dnsServers`; other keys are not egress filtering and are ignored here) and its
        `allow_internet_access` (False is `deny_out=[ALL_TRAFFIC]`). None when it asks for nothing."""
        network = network or {}
        deny = network.get("denyOut") or ()
        if allow_internet_access is False and ALL_TRAFFIC not in deny:
            deny = (*_entries("deny_out", deny, hosts=True), ALL_TRAFFIC)
        allow = network.get("allowOut") or ()
        dns = network.get("dnsServers")
        if not allow and not deny and dns is None:
            return None
        return cls(allow, deny, dns)  # __post_init__ checks each (a string is no list) and makes tuples

    def nameservers(self, host_resolv: str) -> tuple[str, ...]:
        """The sandbox's nameservers: ours, else the host's (from its resolv.conf text) that are not
        on its loopback (a sandbox cannot reach those), else `DEFAULT_DNS`."""
        if self.dns_servers is not None:
            return self.dns_servers
        found = []
        for line in host_resolv.splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "nameserver":
                try:
                    ip = ipaddress.ip_address(words[1])
                except ValueError:
                    continue
                if ip.version == 4 and not ip.is_loopback and not ip.is_link_local:
                    found.append(str(ip))
        return tuple(found[:3]) or DEFAULT_DNS

    def resolve(self, nameservers: tuple[str, ...]) -> tuple[list[str], list[str]]:
        """(allow, deny) as collapsed IPv4 CIDR blocks, host names resolved now; the nameservers join
        `allow` when it names a host. InvalidArgumentError naming a host that does not resolve."""
        allow = [a for e in self.allow_out for a in _addresses(e)]
        if any(is_host(e) for e in self.allow_out):
            allow += [f"{s}/32" for s in nameservers]
        deny = [a for e in self.deny_out for a in _addresses(e)]
        return _collapse(allow), _collapse(deny)


def _addresses(entry: str) -> list[str]:
    if not is_host(entry):
        return [entry]
    try:
        infos = socket.getaddrinfo(entry, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        raise InvalidArgumentError(f"egress: host name {entry!r} does not resolve: {e}") from None
    return sorted({f"{info[4][0]}/32" for info in infos})[:MAX_ADDRESSES_PER_HOST]


def _collapse(cidrs: list[str]) -> list[str]:
    """Overlapping blocks merged (nftables refuses overlapping intervals in one set)."""
    return [str(n) for n in ipaddress.collapse_addresses(ipaddress.IPv4Network(c) for c in cidrs)]
