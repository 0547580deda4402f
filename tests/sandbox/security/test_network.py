"""The network row of the attack suite: a sandbox with `network=True` has a namespace of its own with
NAT to the outside; the host (its loopback, its addresses), the link-local / metadata range and other
sandboxes are out of reach; the egress policy holds; the network follows the life cycle (checkpoint,
restore, fork, pause, hibernate, recovery) and a kill leaves nothing behind.

With no internet here, "outside" is a network namespace of the test's own behind a veth pair
(198.51.100.0/24, TEST-NET-2), serving on TCP port 7000 (answers with the address it sees the
client at, then closes), 7001 (the same, then holds the connection open) and 7003 (the source
addresses of the UDP datagrams it received on 7002 since the last ask).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
from sandbox_fixtures import MISSING, run_any
from waiting import wait_until

from k3sys.sandbox import Runtime, Sandbox
from k3sys.sandbox.egress import ALL_TRAFFIC, EgressPolicy
from k3sys.sandbox.errors import InvalidArgumentError
from k3sys.sandbox.runtime.drivers.network import INSIDE, NETNS_DIR, TABLE, _addresses, names
from k3sys.sandbox.runtime.templates import template_rootfs
from k3sys.sandbox.spec import SandboxSpec

NEEDS = MISSING or (None if shutil.which("nft") else "nft missing: run scripts/install-network.sh")
pytestmark = [pytest.mark.timeout(300)]
OUT_HOST, OUT_A, OUT_B, OUT_LINK_LOCAL = "198.51.100.1", "198.51.100.2", "198.51.100.3", "169.254.77.77"

_SERVER = """
import socket, sys, threading
def serve(port, hold):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c, (ip, _) = s.accept()
        def one(c=c, ip=ip):
            with c:
                c.sendall(ip.encode() + b"\\n")
                while hold and c.recv(4096):
                    pass
        threading.Thread(target=one, daemon=True).start()
seen = set()
def udp():
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", 7002))
    while True:
        seen.add(u.recvfrom(100)[1][0])
def report():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 7003)); s.listen(8)
    while True:
        c, _ = s.accept()
        with c:
            c.sendall((" ".join(sorted(seen)) + "\\n").encode()); seen.clear()
threading.Thread(target=udp, daemon=True).start()
threading.Thread(target=report, daemon=True).start()
threading.Thread(target=serve, args=(7001, True), daemon=True).start()
threading.Timer(0.2, lambda: print("ready", flush=True)).start()
serve(7000, False)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def outside():
    """The outside world: a namespace with OUT_A, OUT_B and OUT_LINK_LOCAL, the host at OUT_HOST."""
    if NEEDS:
        pytest.skip(f"sandbox networks unavailable: {NEEDS}")
    ns, veth = f"k3t-out-{os.getpid()}", f"k3t{os.getpid() % 1_000_000}"  # never "k3s*": sandboxes' prefix
    _ip("netns", "add", ns)
    server = None
    try:
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("addr", "add", f"{OUT_HOST}/24", "dev", veth)
        _ip("link", "set", veth, "up")
        addrs = [["addr", "add", a, "dev", "eth0"] for a in (f"{OUT_A}/24", f"{OUT_B}/24", f"{OUT_LINK_LOCAL}/32")]
        for cmd in (["link", "set", "lo", "up"], *addrs, ["link", "set", "eth0", "up"]):
            _ip("-n", ns, *cmd)
        _ip("route", "add", f"{OUT_LINK_LOCAL}/32", "via", OUT_A)  # the host reaches it; sandboxes must not
        server = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", _SERVER],
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        yield ns
    finally:
        if server is not None:
            server.kill()
            server.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes the veth pair with it


@pytest.fixture(scope="module")
def net_rt(outside):
    """An embedded runtime of this module's own; every sandbox is killed at the end."""
    root = Path(tempfile.mkdtemp(prefix="k3sys-net-"))
    rt = Runtime(root)
    yield rt
    rt.kill_all()
    rt.close()
    shutil.rmtree(root, ignore_errors=True)


def _reach(rt, sid: str, ip: str, port: int = 7000, wait_s: int = 2) -> str:
    """What a client inside the sandbox reads from ip:port ("" when it cannot connect)."""
    return rt.run(sid, f"nc -w {wait_s} {ip} {port} </dev/null 2>/dev/null", timeout=30).stdout.strip()


def _host_reach(ip: str, port: int, timeout: float = 2.0) -> str:
    """What the host reads from ip:port ("" when it cannot connect)."""
    try:
        with socket.create_connection((ip, port), timeout=timeout) as c:
            return c.recv(100).decode().strip()
    except OSError:
        return ""


def _slot(rt: Runtime, sid: str) -> int:
    return json.loads((rt.root / "sandboxes" / sid / "network.json").read_text())["slot"]


def _address(rt: Runtime, sid: str) -> str:
    """The sandbox's own address on its veth (the host reaches its listeners there)."""
    return _addresses(_slot(rt, sid))[1]


def _leftovers(slot: int) -> list[str]:
    """What of slot `slot`'s network is still on the host."""
    ns, veth = names(slot)
    found = [f"namespace {ns}"] if (NETNS_DIR / ns).exists() else []
    found += [f"veth {veth}"] if Path(f"/sys/class/net/{veth}").exists() else []
    table = subprocess.run(["nft", "list", "table", "ip", TABLE], capture_output=True, text=True).stdout
    found += [f"chain sb{slot}"] if f"chain sb{slot} " in table else []
    found += [f"map element {veth}"] if f'"{veth}"' in table else []
    return found


def _listen(rt, sid: str, port: int = 8080) -> None:
    """A server inside the sandbox on 0.0.0.0:port that answers "hi" to every connection."""
    rt.run(sid, f"nc -ll -p {port} -e echo hi </dev/null >/dev/null 2>&1 &")
    wait_until(lambda: ":8080" in rt.run(sid, "netstat -ltn").stdout, 10, "the listener inside", step=0.05)


def test_own_namespace_and_nat_egress(net_rt, record_property):
    record_property("attack", "network=True shares the host's network namespace")
    sid = net_rt.create(SandboxSpec(network=True, memory_mb=128)).id
    links = net_rt.run(sid, "ls /sys/class/net").stdout.split()
    assert links == ["eth0", "lo"]
    assert net_rt.run(sid, "ip -4 route show default").stdout.split()[-1] == INSIDE  # the shared source address
    seen = _reach(net_rt, sid, OUT_A)
    assert seen == OUT_HOST  # the outside sees the host's address: NAT
    resolv = net_rt.run(sid, "cat /etc/resolv.conf").stdout
    servers = [line.split()[1] for line in resolv.splitlines() if line.startswith("nameserver")]
    assert servers and not any(s.startswith("127.") for s in servers)
    assert net_rt.run(sid, "echo x > /etc/resolv.conf").exit_code != 0  # read-only
    record_property("figure", f"links {links}; outside sees {seen} (NAT); nameservers {servers}")
    net_rt.kill(sid)


def test_host_loopback_addresses_and_ports_out_of_reach(net_rt, record_property):
    record_property("attack", "network=True reaches host loopback services and binds host ports")
    servers = []
    for family, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        s = socket.socket(family)
        s.bind((addr, 0))
        s.listen(8)
        servers.append(s)
    lo_port, any_port, v6_port = (s.getsockname()[1] for s in servers)

    def answer() -> None:
        for s in servers:
            s.settimeout(0.05)
        while servers:
            for s in list(servers):
                with contextlib.suppress(OSError):
                    c, _ = s.accept()
                    c.sendall(b"host\n")
                    c.close()

    threading.Thread(target=answer, daemon=True).start()
    sid = net_rt.create(SandboxSpec(network=True, memory_mb=128)).id
    try:
        gateway = _addresses(_slot(net_rt, sid))[0]
        assert _host_reach("127.0.0.1", lo_port) == "host" and _host_reach(OUT_HOST, any_port) == "host"
        # The link-local IPv6 address the host end of the veth pair would have (EUI-64 of its MAC).
        veth = names(_slot(net_rt, sid))[1]
        mac = bytes.fromhex(Path(f"/sys/class/net/{veth}/address").read_text().strip().replace(":", ""))
        eui = bytes([mac[0] ^ 2]) + mac[1:3] + b"\xff\xfe" + mac[3:]
        link_local = "fe80::" + ":".join(eui[i:i + 2].hex() for i in range(0, 8, 2))
        assert "inet6" not in subprocess.run(["ip", "-6", "addr", "show", "dev", veth], capture_output=True,
                                             text=True).stdout
        tried = {f"127.0.0.1:{lo_port}": _reach(net_rt, sid, "127.0.0.1", lo_port),
                 f"{gateway}:{any_port}": _reach(net_rt, sid, gateway, any_port),
                 f"{OUT_HOST}:{any_port}": _reach(net_rt, sid, OUT_HOST, any_port),
                 f"[{link_local}%eth0]:{v6_port}": _reach(net_rt, sid, f"{link_local}%eth0", v6_port)}
        assert tried == dict.fromkeys(tried, "")
        # Its ports are its own: it listens on the host's busy port, and the host keeps its own.
        _listen(net_rt, sid, 8080)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("0.0.0.0", 8080))  # free on the host while the sandbox listens on it
        assert net_rt.run(sid, f"nc -l -p {lo_port} </dev/null & sleep 0.2; netstat -ltn").stdout.count(
            f":{lo_port} ") == 1
        record_property("figure", f"refused/dropped: {sorted(tried)}; sandbox port 8080 not bound on the host")
    finally:
        servers.clear()
        net_rt.kill(sid)


def test_metadata_range_unreachable(net_rt, record_property):
    record_property("attack", "network=True reaches the metadata address range (169.254.0.0/16)")
    assert _host_reach(OUT_LINK_LOCAL, 7000) == OUT_HOST  # the server is there, for the host
    sid = net_rt.create(SandboxSpec(network=True, memory_mb=128)).id
    tried = {f"{OUT_LINK_LOCAL}:7000": _reach(net_rt, sid, OUT_LINK_LOCAL),
             "169.254.169.254:80": _reach(net_rt, sid, "169.254.169.254", 80, wait_s=1)}
    # Even a policy that allows it explicitly does not open it.
    opened = EgressPolicy(allow_out=("169.254.0.0/16",))
    sid2 = net_rt.create(SandboxSpec(network=True, memory_mb=128, egress=opened)).id
    tried["allow_out=169.254.0.0/16"] = _reach(net_rt, sid2, OUT_LINK_LOCAL)
    assert tried == dict.fromkeys(tried, "")
    assert _reach(net_rt, sid, OUT_A) == OUT_HOST  # the rest of the outside still works
    record_property("figure", f"unreachable: {sorted(tried)}")
    net_rt.kill(sid)
    net_rt.kill(sid2)


def test_egress_policy(net_rt, record_property):
    record_property("attack", "egress policy (allow/deny CIDRs, host names) per sandbox")
    deny = net_rt.create(SandboxSpec(network=True, memory_mb=128, egress=EgressPolicy(deny_out=(f"{OUT_A}/32",)))).id
    only = net_rt.create(SandboxSpec(network=True, memory_mb=128,
                                     egress=EgressPolicy(allow_out=(OUT_B,), deny_out=(ALL_TRAFFIC,)))).id
    free = net_rt.create(SandboxSpec(network=True, memory_mb=128)).id
    try:
        got = {(name, ip): _reach(net_rt, sid, ip) for name, sid in (("deny A", deny), ("only B", only), ("none", free))
               for ip in (OUT_A, OUT_B)}
        assert got == {("deny A", OUT_A): "", ("deny A", OUT_B): OUT_HOST, ("only B", OUT_A): "",
                       ("only B", OUT_B): OUT_HOST, ("none", OUT_A): OUT_HOST, ("none", OUT_B): OUT_HOST}
        # Other sandboxes are not "outside": unreachable whatever the policy.
        _listen(net_rt, free)
        assert _host_reach(_address(net_rt, free), 8080) == "hi"
        assert _reach(net_rt, deny, _address(net_rt, free), 8080) == ""
        # A host name that does not resolve fails the create, naming it, and leaves nothing.
        before = set(os.listdir(NETNS_DIR))
        with pytest.raises(InvalidArgumentError, match="no-such-host.invalid"):
            net_rt.create(SandboxSpec(network=True, egress=EgressPolicy(allow_out=("no-such-host.invalid",))))
        assert set(os.listdir(NETNS_DIR)) == before
        record_property("figure", "deny_out blocks, allow_out overrides deny_out=0.0.0.0/0, "
                                  "sandbox-to-sandbox dropped, unresolvable host refused")
    finally:
        for sid in (deny, only, free):
            net_rt.kill(sid)


# Every way to send from an address not its own that a sandbox's process may try: IP_FREEBIND (no
# capability; the kernel then refuses to route it), IP_TRANSPARENT (needs CAP_NET_ADMIN/NET_RAW), a
# raw socket (CAP_NET_RAW). Prints what each got; the outside's view is what the test asserts.
_SPOOF = """
import socket, sys
src, dst = sys.argv[1], sys.argv[2]
for name, opt in (("freebind", 15), ("transparent", 19)):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_IP, opt, 1)
        s.bind((src, 0))
        s.sendto(b"x", (dst, 7002))
        print(name, "sent")
    except OSError as e:
        print(name, e.errno)
try:
    socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
    print("raw", "opened")
except OSError as e:
    print("raw", e.errno)
"""


def test_source_address_spoofing_dropped(net_rt, record_property):
    record_property("attack", "network=True sandbox sends with another sandbox's or a foreign source address")
    template_rootfs("debian")  # python3 inside (built on first use, then cached)
    victim = net_rt.create(SandboxSpec(network=True, memory_mb=128)).id
    sid = net_rt.create(SandboxSpec("debian", network=True, memory_mb=256)).id
    try:
        net_rt.write_file(sid, "/tmp/spoof.py", _SPOOF)
        seen, tries = {}, {}
        for src in (_address(net_rt, victim), "192.0.2.77", INSIDE):  # the last: its own, the control
            tries[src] = net_rt.run(sid, f"python3 /tmp/spoof.py {src} {OUT_A}").stdout.split("\n")
            if src != INSIDE:  # then one from its own address: a spoofed one let out would have arrived before it
                net_rt.run(sid, f"python3 /tmp/spoof.py {INSIDE} {OUT_A}")
            got: set[str] = set()  # the sources the outside received datagrams from
            wait_until(lambda got=got: got.update(_host_reach(OUT_A, 7003).split()) or OUT_HOST in got, 10,
                       f"the datagram from its own address (after {src}'s)", step=0.05)
            seen[src] = got
        spoofed = [_address(net_rt, victim), "192.0.2.77"]
        assert seen == dict.fromkeys([*spoofed, INSIDE], {OUT_HOST})
        assert "freebind sent" in tries[INSIDE] and "raw 1" in tries[INSIDE]  # EPERM: no CAP_NET_RAW
        record_property("figure", f"datagrams from spoofed sources {spoofed} never left the host; tried: "
                                  f"{tries['192.0.2.77']}")
    finally:
        net_rt.kill(sid)
        net_rt.kill(victim)


def test_listener_and_connections_across_checkpoint_restore_and_fork(net_rt, record_property):
    record_property("attack", "network=True sandbox through checkpoint, restore and fork")
    sid = net_rt.create(SandboxSpec(network=True, memory_mb=128)).id
    _listen(net_rt, sid)
    # An open outbound connection: the children restore it on the shared inside address.
    net_rt.run(sid, f"sleep 600 | nc {OUT_A} 7001 >/dev/null 2>&1 &")
    wait_until(lambda: "ESTABLISHED" in net_rt.run(sid, "netstat -tn").stdout, 10, "the outbound connection",
               step=0.05)
    ck = net_rt.checkpoint(sid).id
    restored = net_rt.restore(ck).id
    kids = [i.id for i in net_rt.fork(sid, 2)]
    family = [sid, restored, *kids]
    try:
        addresses = [_address(net_rt, s) for s in family]
        assert len(set(addresses)) == len(family)  # each its own slot
        inside = {net_rt.run(s, "ip -4 -o addr show eth0").stdout.count(f"{INSIDE}/32") for s in family}
        assert inside == {1}
        assert [_host_reach(a, 8080) for a in addresses] == ["hi"] * len(family)  # the listener came back
        assert [_reach(net_rt, s, OUT_B) for s in family] == [OUT_HOST] * len(family)
        slots = [_slot(net_rt, s) for s in family]
        record_property("figure", f"{len(family)} sandboxes, distinct addresses {addresses}, listener answers in "
                                  "each; an open outbound TCP connection did not stop the restore")
    finally:
        for s in family:
            net_rt.kill(s)
    assert [x for slot in slots for x in _leftovers(slot)] == []


def test_pause_hibernate_recovery_and_kill(outside, tmp_path, record_property):
    record_property("attack", "network=True through pause, hibernate, runtime restart and kill")
    root = tmp_path / "rt"
    rt = Runtime(root)
    try:
        sid = rt.create(SandboxSpec(network=True, memory_mb=128, egress=EgressPolicy(deny_out=(f"{OUT_A}/32",)))).id
        _listen(rt, sid)
        rt.pause(sid)
        rt.resume(sid)
        assert _reach(rt, sid, OUT_B) == OUT_HOST
        first = _slot(rt, sid)
        rt.hibernate(sid)
        assert _leftovers(first) == []  # a hibernated sandbox holds no network
        rt.resume(sid)
        assert _host_reach(_address(rt, sid), 8080) == "hi"
        assert (_reach(rt, sid, OUT_A), _reach(rt, sid, OUT_B)) == ("", OUT_HOST)  # the policy came back too
    finally:
        rt.close()
    rt = Runtime(root)  # adopts the running sandbox (recovery)
    try:
        assert _reach(rt, sid, OUT_B) == OUT_HOST
        slot = _slot(rt, sid)
        rt.kill(sid)
        assert _leftovers(slot) == []
        record_property("figure", f"slot {first} released at hibernate, resumed in slot {slot}; kill left nothing")
    finally:
        rt.kill_all()
        rt.close()


def test_remote_create_with_egress(outside, service, record_property):
    record_property("attack", "egress policy through the service (remote create)")
    policy = EgressPolicy(allow_out=(OUT_B,), deny_out=(ALL_TRAFFIC,))
    with Sandbox.create(network=True, memory_mb=128, egress=policy, api_url=service.url, api_key=service.key) as s:
        assert s.info.spec.egress == policy
        got = [run_any(s, f"nc -w 2 {ip} 7000 </dev/null 2>/dev/null").stdout.strip() for ip in (OUT_A, OUT_B)]
        assert got == ["", OUT_HOST]
    # Bad policies over HTTP: a typed 422 naming the value, and no sandbox.
    with httpx.Client(base_url=service.url, headers={"authorization": f"Bearer {service.key}"}, timeout=60) as http:
        before = http.get("/sandboxes").json()
        for body, what in (({"allowOut": ["::1"]}, "'::1' is IPv6"), ({"denyOut": [7]}, "deny_out"),
                           ({"allowOut": "1.2.3.4"}, "allow_out: expected a list")):
            r = http.post("/sandboxes", json={"templateID": "busybox", "network": body})
            assert (r.status_code, r.json()["type"]) == (422, "invalid_argument") and what in r.text, r.text
        assert http.get("/sandboxes").json() == before
    record_property("figure", "policy round-trips through the SDK and the HTTP create body, and holds; "
                              "bad policies get 422 invalid_argument")


@pytest.mark.parametrize(("egress", "message"), [
    ({"allow_out": "1.2.3.4"}, r"allow_out: expected a list"),
    ({"deny_out": ["::1"]}, r"deny_out: '::1' is IPv6"),
    ({"deny_out": ["not a host"]}, r"deny_out: 'not a host' is not an IPv4 address, CIDR block or host name"),
    ({"allow_out": ["1.2.3.4"] * 257}, r"allow_out: at most 256 entries, got 257"),
    ({"dns_servers": ["10.0.0.0/8"]}, r"dns_servers: expected at most 10 IPv4 addresses"),
    ({"dns_servers": ["example.com"]}, r"dns_servers: 'example.com' is not an IPv4 address"),
    ({"allow": ["1.2.3.4"]}, r"egress: expected an object with allow_out, deny_out, dns_servers"),
])
def test_egress_policy_rejects_bad_input(egress, message, record_property):
    record_property("attack", "malformed egress policy")
    with pytest.raises(InvalidArgumentError, match=message):
        SandboxSpec(network=True, egress=egress)
    record_property("figure", message)


def test_egress_policy_shape():
    with pytest.raises(InvalidArgumentError, match="egress: a policy needs network=True"):
        SandboxSpec(egress=EgressPolicy(deny_out=(ALL_TRAFFIC,)))
    spec = SandboxSpec(network=True, egress={"allow_out": ["Example.COM", "10.1.2.3"], "deny_out": ["10.0.0.0/8"]})
    assert spec.egress == EgressPolicy(allow_out=("example.com", "10.1.2.3/32"), deny_out=("10.0.0.0/8",))
    assert SandboxSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    # E2B's create body: network.allowOut / denyOut / dnsServers, allow_internet_access=False.
    assert EgressPolicy.from_e2b({"allowOut": ["1.1.1.1"]}, allow_internet_access=False) == EgressPolicy(
        allow_out=("1.1.1.1",), deny_out=(ALL_TRAFFIC,))
    assert EgressPolicy.from_e2b({"maskRequestHost": "x"}) is None
    # Nameservers: ours, else the host's that a sandbox can reach, else 8.8.8.8.
    assert EgressPolicy().nameservers("nameserver 127.0.0.53\nnameserver 10.9.9.9\n") == ("10.9.9.9",)
    assert EgressPolicy().nameservers("nameserver 127.0.0.53\n") == ("8.8.8.8",)
    assert EgressPolicy(dns_servers=("1.1.1.1",)).nameservers("nameserver 10.9.9.9") == ("1.1.1.1",)
    # Overlapping blocks merged; the nameservers are allowed only when allow_out names a host.
    policy = EgressPolicy(allow_out=("10.0.0.0/8", "10.1.0.0/16", "localhost"))
    assert policy.resolve(("9.9.9.9",)) == (["9.9.9.9/32", "10.0.0.0/8", "127.0.0.1/32"], [])
    assert EgressPolicy(allow_out=("10.0.0.0/8",)).resolve(("9.9.9.9",)) == (["10.0.0.0/8"], [])


def test_cli_create_with_egress(outside, tmp_path, record_property):
    from typer.testing import CliRunner

    from k3sys.cli import app
    from k3sys.sandbox.cli import exit_code

    record_property("attack", "egress policy through the CLI")
    runner = CliRunner()

    def cli(*args: str):
        return runner.invoke(app, ["sandbox", args[0], "--data-dir", str(tmp_path / "rt"), *args[1:]])

    r = cli("create", "--deny-out", ALL_TRAFFIC)  # a policy without --network
    assert (r.exit_code, "egress: a policy needs network=True" in r.output) == (
        exit_code(InvalidArgumentError("")), True)
    r = cli("create", "--network", "--memory-mb", "128", "--deny-out", ALL_TRAFFIC, "--allow-out", OUT_B)
    assert r.exit_code == 0, r.output
    sid = r.stdout.strip()
    try:
        got = [cli("exec", sid, f"nc -w 2 {ip} 7000 </dev/null").stdout.strip() for ip in (OUT_A, OUT_B)]
        assert got == ["", OUT_HOST]
    finally:
        assert cli("kill", sid).exit_code == 0
    record_property("figure", "--allow-out/--deny-out hold; a policy without --network refused")


def test_teardown_never_takes_a_later_owners_slot(outside, tmp_path, record_property):
    record_property("attack", "a stale network record names a slot another sandbox owns now")
    from k3sys.sandbox.runtime.drivers.network import Network

    net = Network()
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir()
    theirs.mkdir()
    net.setup(mine, None, mine / "resolv.conf")
    stale = (mine / "network.json").read_text()
    net.teardown(mine)
    net.setup(theirs, None, theirs / "resolv.conf")
    slot = json.loads((theirs / "network.json").read_text())["slot"]
    # Our record, from before our teardown freed the slot, now naming the later owner's slot.
    (mine / "network.json").write_text(json.dumps({**json.loads(stale), "slot": slot}))
    net.teardown(mine)
    assert not (mine / "network.json").exists()
    assert len(_leftovers(slot)) == 4  # namespace, veth, chain, map element: all still the owner's
    net.teardown(theirs)
    assert _leftovers(slot) == []
    record_property("figure", "a stale record's teardown touched nothing of the slot's new owner")
