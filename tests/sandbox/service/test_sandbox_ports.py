"""The port proxy (service/ports/): any port of a sandbox through the service, by E2B's host form
`P-S.<domain>` and by its headers, with the official `e2b` SDK making the sandboxes, for sandboxes
with and without a network. The server inside is port_server.py (standard library only)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox as E2B
from service_process import ServiceProcess, add_key
from waiting import wait_until
from websockets.sync.client import connect as ws_connect

from k3sys.sandbox import HTTPBackend
from k3sys.sandbox.spec import SandboxSpec

pytestmark = pytest.mark.timeout(300)
SERVER = Path(__file__).with_name("port_server.py").read_bytes()
PATTERN = b"0123456789abcdef"
MiB = 1 << 20


@pytest.fixture(scope="module")
def ports_service(tmp_path_factory, service):  # `service` first: it skips where sandboxes cannot run
    root = tmp_path_factory.mktemp("ports")
    # A 1 MiB body limit for the control plane: a port's bodies stream past it.
    with ServiceProcess(root / "data", "--max-body-mb", "1") as svc:
        yield svc
        svc.kill_all()


def sdk(svc: ServiceProcess) -> dict[str, str]:
    """The e2b SDK's connection options for the service (E2B_DOMAIN = localhost:<its port>)."""
    return {"api_key": svc.key, "api_url": svc.url, "sandbox_url": svc.url, "domain": f"localhost:{svc.port}"}


def headers(sid: str, port: int = 8000) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)}


def serve(sbx: E2B, url: str, port: int = 8000, extra: dict[str, str] | None = None) -> None:
    """Start port_server.py on `port` inside `sbx` and wait until it answers through the proxy."""
    sbx.files.write("/tmp/port_server.py", SERVER)
    sbx.commands.run(f"python3 /tmp/port_server.py {port}", background=True)
    h = {**headers(sbx.sandbox_id, port), **(extra or {})}
    wait_until(lambda: httpx.get(f"{url}/pid", headers=h).status_code == 200, 30, f"port {port} serving")


@pytest.fixture(scope="module", params=[False, True], ids=["no-network", "network"])
def box(request, ports_service):
    """A `base` sandbox (network off, then on) running port_server.py on port 8000."""
    sbx = E2B.create("base", allow_internet_access=request.param, **sdk(ports_service))
    serve(sbx, ports_service.url)
    yield sbx
    sbx.kill()


def test_the_issues_repros_reach_the_port(ports_service, box):
    """Before: the host form answered 404, the headers envd's `envd has no GET /index.html`, and
    port 49999 envd's 401."""
    url, sid = ports_service.url, box.sandbox_id
    pid = httpx.get(f"{url}/pid", headers=headers(sid)).text
    assert pid.isdigit()
    r = httpx.get(f"{url}/pid", headers={"Host": f"8000-{sid}.localhost:{ports_service.port}"})
    assert (r.status_code, r.text) == (200, pid)
    r = httpx.get(f"{url}/pid", headers=headers(sid, 49999))
    assert r.status_code == 502 and "nothing listens on port 49999" in r.json()["message"]


@pytest.mark.parametrize("size", [0, MiB, 100 * MiB], ids=["0B", "1MiB", "100MiB"])
def test_get_and_post_bodies(ports_service, box, size):
    url, h = ports_service.url, headers(box.sandbox_id)
    with httpx.stream("GET", f"{url}/bytes?n={size}", headers=h) as r:
        assert r.status_code == 200 and r.headers["content-length"] == str(size)
        got, want = hashlib.sha256(), hashlib.sha256()
        n = 0
        for piece in r.iter_bytes():
            got.update(piece)
            n += len(piece)
    want.update((PATTERN * (size // len(PATTERN) + 1))[:size])
    assert (n, got.hexdigest()) == (size, want.hexdigest())
    body = bytes(range(256)) * (size // 256)
    r = httpx.post(f"{url}/sum", headers=h, content=body, timeout=120)
    assert r.json() == {"length": len(body), "sha256": hashlib.sha256(body).hexdigest()}


def test_streaming_both_ways(ports_service, box):
    url, h = ports_service.url, headers(box.sandbox_id)
    # An endless event stream: only a proxy that streams can hand its first events on.
    with httpx.stream("GET", f"{url}/sse?n=0", headers=h) as r:
        assert r.headers["content-type"] == "text/event-stream"
        events = []
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line)
            if len(events) == 3:
                break
    assert events == ["data: 0", "data: 1", "data: 2"]
    pieces = [b"a" * 1000, b"b" * 70000, b"c"]
    r = httpx.post(f"{url}/echo", headers=h, content=iter(pieces))  # chunked up, chunked down
    assert r.content == b"".join(pieces)
    r = httpx.post(f"{url}/sum", headers=h, content=iter(pieces))
    assert r.json()["length"] == 71001


def test_websocket_echo(ports_service, box):
    sid, port = box.sandbox_id, ports_service.port
    with ws_connect(f"ws://127.0.0.1:{port}/ws", additional_headers=headers(sid)) as ws:
        ws.send("hello")
        assert ws.recv() == "hello"
        ws.send(b"\x01" * 200_000)
        assert ws.recv() == b"\x01" * 200_000
    host = box.get_host(8000)  # the host form, connected to the service's address
    with ws_connect(f"ws://{host}/ws", sock=socket.create_connection(("127.0.0.1", port))) as ws:
        ws.send("by host")
        assert ws.recv() == "by host"


def test_one_connection_carries_ports_envd_and_the_control_plane(ports_service, box):
    """Routing is per request: the SDKs' one pool sends everything behind E2B_SANDBOX_URL over the
    same connections, so one connection goes port -> control plane -> envd -> port -> control -> port."""
    url, sid = ports_service.url, box.sandbox_id
    with httpx.Client(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1), timeout=60) as c:
        pid = c.get(f"{url}/pid", headers=headers(sid)).text
        assert c.get(f"{url}/health").json()["status"] == "ok"
        assert c.get(f"{url}/health", headers={"E2b-Sandbox-Id": sid}).status_code == 204  # envd's
        assert c.post(f"{url}/sum", headers=headers(sid), content=b"abc").json()["length"] == 3
        assert c.get(f"{url}/pid", headers=headers(sid)).text == pid
        r = c.get(f"{url}/sandboxes/{sid}", headers={"X-API-Key": ports_service.key})
        assert r.json()["sandboxID"] == sid
        assert c.get(f"{url}/pid", headers=headers(sid)).text == pid
        assert c.get(f"{url}/nope", headers=headers(sid, 8999)).status_code == 502  # refusals close it


def test_a_sandbox_cannot_answer_requests_it_was_not_sent(ports_service, box):
    """Bytes a server inside sends between exchanges never reach the client (who would read them as
    the answer to its next request, perhaps to the control plane), nor does a 101 it was not asked for."""
    url, sid = ports_service.url, box.sandbox_id
    box.commands.run("rm -f /tmp/forged")
    with httpx.Client(limits=httpx.Limits(max_connections=1, max_keepalive_connections=1), timeout=60) as c:
        assert c.get(f"{url}/forge", headers=headers(sid)).text == "ok"
        wait_until(lambda: box.files.exists("/tmp/forged"), 30, "the forged answer sent")
        assert c.get(f"{url}/health").json()["status"] == "ok"
    r = httpx.get(f"{url}/switch", headers=headers(sid))
    assert r.status_code == 502 and "asked for no upgrade" in r.json()["message"]


def test_the_code_interpreter_sdk_reaches_port_49999(ports_service, box):
    """e2b-code-interpreter's `run_code` (its own HTTP/1.1 transport, `E2b-Sandbox-Port: 49999` to
    E2B_SANDBOX_URL) through the proxy, against a stand-in /execute (the real server: issue 26's
    code-interpreter part)."""
    from e2b_code_interpreter import Sandbox as CodeInterpreter

    serve(box, ports_service.url, 49999)
    ci = CodeInterpreter.connect(box.sandbox_id, **sdk(ports_service))
    seen: list[str] = []
    run = ci.run_code("x = 1", on_stdout=lambda m: seen.append(m.line))
    assert (run.text, run.logs.stdout, seen, run.execution_count) == ("X = 1", ["running x = 1\n"],
                                                                      ["running x = 1\n"], 1)


def test_clients_one_after_another_reuse_the_upstream_connection(ports_service, box):
    """A client that closes its connection after each request (curl, `httpx.get`) still gets a kept
    upstream connection: the one the previous client left (upstream.py's pool)."""
    url, h = ports_service.url, headers(box.sandbox_id)
    seen: set[str] = set()

    def reused() -> bool:
        peer = httpx.get(f"{url}/peer", headers=h).text
        again = peer in seen
        seen.add(peer)
        return again

    wait_until(reused, 30, "a request on a connection an earlier client left")


def test_fifty_concurrent_connections(ports_service, box):
    url, h = ports_service.url, headers(box.sandbox_id)

    async def main() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            return await asyncio.gather(*(client.get(f"{url}/bytes?n={i * 1000}", headers=h) for i in range(50)))

    rs = asyncio.run(main())
    assert [(r.status_code, len(r.content)) for r in rs] == [(200, i * 1000) for i in range(50)]


def test_no_listener_is_a_502_naming_the_port(ports_service, box):
    url, sid = ports_service.url, box.sandbox_id
    r = httpx.get(f"{url}/", headers=headers(sid, 8999))
    assert r.status_code == 502 and "port 8999" in r.json()["message"]
    with pytest.raises(Exception, match="502"):
        ws_connect(f"ws://127.0.0.1:{ports_service.port}/ws", additional_headers=headers(sid, 8999))
    r = httpx.get(f"{url}/", headers=headers("sbx-nosuchsandbox", 8000))
    assert r.status_code == 404 and "sbx-nosuchsandbox" in r.json()["message"]


def test_get_host_from_the_sdk(ports_service, box):
    """E2B_DOMAIN=localhost:<port>: curl (as browsers do) resolves `*.localhost` to loopback itself."""
    host = box.get_host(8000)
    assert host == f"8000-{box.sandbox_id}.localhost:{ports_service.port}"
    out = subprocess.run(["curl", "-sS", "--max-time", "60", f"http://{host}/pid"], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0 and out.stdout.isdigit(), out.stderr


def test_pipelined_requests_and_100_continue(ports_service, box, tmp_path):
    """Two requests in one write come back as two answers in order; curl's `Expect: 100-continue`
    upload gets the server's interim 100 and then its answer."""
    sid, port = box.sandbox_id, ports_service.port
    head = f"Host: 8000-{sid}.localhost:{port}\r\n".encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"GET /pid HTTP/1.1\r\n" + head + b"\r\n" + b"POST /sum HTTP/1.1\r\n" + head
                  + b"Content-Length: 3\r\n\r\nabc")
        got = b""
        while got.count(b"HTTP/1.1 200") < 2 or not got.endswith(b"}"):
            piece = s.recv(65536)
            assert piece, got
            got += piece
    assert got.index(b"text/plain") < got.index(b'"length": 3')
    blob = tmp_path / "blob"
    blob.write_bytes(b"z" * (2 * MiB))
    out = subprocess.run(["curl", "-sS", "--max-time", "60", "-H", "Expect: 100-continue", "--data-binary",
                          f"@{blob}", f"http://{box.get_host(8000)}/sum"], capture_output=True, text=True, timeout=90)
    assert json.loads(out.stdout)["length"] == 2 * MiB, out.stderr


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_slow_reader_keeps_host_memory_bounded(ports_service, box):
    """A 2 GiB answer read 1 MiB and then not at all: the server inside ends up blocked (its sent
    count stops well short), and the service's memory grows by buffers, not by the answer."""
    url, h, size = ports_service.url, headers(box.sandbox_id), 2 << 30
    box.commands.run("rm -f /tmp/sent-8000")
    before = _rss_bytes(ports_service.proc.pid)
    with httpx.Client(timeout=120) as client, client.stream("GET", f"{url}/bytes?n={size}&log=1", headers=h) as r:
        stream = r.iter_raw(64 << 10)
        read = 0
        while read < MiB:
            read += len(next(stream))

        def sent() -> int:
            try:
                return int(box.files.read("/tmp/sent-8000") or 0)
            except Exception:  # noqa: BLE001 (not written yet)
                return 0

        last = [-1, time.monotonic()]

        def stalled() -> bool:  # the count stood still for 2 s: every buffer on the way is full
            now = sent()
            if now != last[0]:
                last[:] = [now, time.monotonic()]
                return False
            return time.monotonic() - last[1] > 2

        wait_until(stalled, 120, "the server inside blocking on a full connection", step=0.2)
        grown = _rss_bytes(ports_service.proc.pid) - before
    assert last[0] < 256 * MiB, f"the server sent {last[0]} bytes to a reader that took 1 MiB"
    assert grown < 64 * MiB, f"the service grew by {grown} bytes"


def test_pause_cuts_open_connections_and_a_reconnect_after_resume_works(ports_service):
    """An open stream and an open WebSocket at E2B's pause (a background hibernation: a CRIU dump):
    the dump succeeds (the proxy reset them first), a request while paused is a 502 naming the
    state, and after `connect` the same server answers again."""
    url = ports_service.url
    sbx = E2B.create("base", allow_internet_access=False, **sdk(ports_service))
    try:
        serve(sbx, url)
        sid, h = sbx.sandbox_id, headers(sbx.sandbox_id)
        pid = httpx.get(f"{url}/pid", headers=h).text
        with (ws_connect(f"ws://127.0.0.1:{ports_service.port}/ws", additional_headers=h) as ws,
              httpx.stream("GET", f"{url}/sse?n=0", headers=h, timeout=120) as r):
            lines = r.iter_lines()
            assert next(lines) == "data: 0"
            sbx.pause()
            with pytest.raises(httpx.HTTPError):  # cut: the stream ends before its end
                for _ in lines:
                    pass
            with pytest.raises(Exception):  # noqa: B017 (the socket's own error, whichever it is)
                ws.recv(timeout=60)
        client = HTTPBackend(url, ports_service.key)
        wait_until(lambda: client.info(sid).state == "hibernated", 120, "the hibernation")
        assert not client.info(sid).reason  # CRIU did not fail on the proxied connections
        r = httpx.get(f"{url}/pid", headers=h)
        assert r.status_code == 502 and "hibernated" in r.json()["message"]
        E2B.connect(sid, **sdk(ports_service))
        assert httpx.get(f"{url}/pid", headers=h).text == pid
        with ws_connect(f"ws://127.0.0.1:{ports_service.port}/ws", additional_headers=h) as ws:
            ws.send("again")
            assert ws.recv() == "again"
    finally:
        sbx.kill()


def test_checkpoint_with_open_connections_keeps_the_sandbox_running(ports_service, box):
    url, h = ports_service.url, headers(box.sandbox_id)
    with ws_connect(f"ws://127.0.0.1:{ports_service.port}/ws", additional_headers=h) as ws:
        with HTTPBackend(url, ports_service.key) as client:
            client.checkpoint(box.sandbox_id)
        with pytest.raises(Exception):  # noqa: B017 (the socket's own error, whichever it is)
            ws.recv(timeout=60)
    assert httpx.get(f"{url}/pid", headers=h).status_code == 200


def test_auto_resume_on_a_request(ports_service):
    sbx = E2B.create("base", allow_internet_access=False, lifecycle={"on_timeout": "pause", "auto_resume": True},
                     **sdk(ports_service))
    try:
        serve(sbx, ports_service.url)
        sbx.pause()
        r = httpx.get(f"{ports_service.url}/pid", headers=headers(sbx.sandbox_id), timeout=120)
        assert r.status_code == 200 and r.text.isdigit()
    finally:
        sbx.kill()


def test_traffic_token_when_traffic_is_not_public(ports_service):
    url = ports_service.url
    sbx = E2B.create("base", allow_internet_access=False, network={"allow_public_traffic": False},
                     **sdk(ports_service))
    try:
        token = sbx.traffic_access_token
        assert token
        serve(sbx, url, extra={"E2B-Traffic-Access-Token": token})
        h = headers(sbx.sandbox_id)
        r = httpx.get(f"{url}/pid", headers=h)
        assert r.status_code == 403 and "traffic access token" in r.json()["message"]
        assert httpx.get(f"{url}/pid", headers={**h, "E2B-Traffic-Access-Token": "x"}).status_code == 403
        assert httpx.get(f"{url}/pid", headers={**h, "E2B-Traffic-Access-Token": token}).status_code == 200
        assert httpx.get(f"{url}/pid", headers={**h, "X-API-Key": ports_service.key}).status_code == 200
    finally:
        sbx.kill()


def test_another_tenants_sandbox_is_an_unknown_id(tmp_path, service):
    with ServiceProcess(tmp_path / "data") as svc:
        key_a, key_b = add_key(svc.data_dir, "a"), add_key(svc.data_dir, "b")
        with HTTPBackend(svc.url, key_a) as a:
            sid = a.create(SandboxSpec(template="base", memory_mb=256)).id
            a.write_file(sid, "/tmp/port_server.py", SERVER)
            a.start_command(sid, "python3 /tmp/port_server.py 8000")
        url, h = svc.url, headers(sid)
        wait_until(lambda: httpx.get(f"{url}/pid", headers=h).status_code == 200, 30, "port 8000 serving")
        assert httpx.get(f"{url}/pid", headers={**h, "X-API-Key": key_a}).status_code == 200
        r = httpx.get(f"{url}/pid", headers={**h, "X-API-Key": key_b})
        unknown = httpx.get(f"{url}/pid", headers=headers("sbx-000000000000"))
        assert r.status_code == unknown.status_code == 404
        assert json.loads(r.text)["message"] == f"sandbox {sid!r} not found"
        svc.kill_all()
