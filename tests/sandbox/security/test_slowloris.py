"""Slowloris and friends against a real service on 127.0.0.1 over real sockets: many half-open
connections (8x the server's cap, scaled down from the 21,000 of the issue so the test holds on a
shared 2-core machine; it is the cap that is tested), a header dripped a byte at a time, an oversized
header, and a flood of malformed requests. /health keeps answering, the server's descriptors stay
bounded, and the log stays short."""

from __future__ import annotations

import logging
import os
import socket
import statistics
import threading
import time

import pytest
from service_process import ServiceProcess
from waiting import wait_until

from k3sys.sandbox.service.guard import ConnectionLimits
from k3sys.sandbox.service.logfilter import RateLimit

pytestmark = pytest.mark.timeout(240)
CAP, SHARE = 256, 64  # the server's --max-connections and --max-connections-per-client here
ATTACK = 8 * CAP  # half-open connections held at once by the attacker
REOPEN_PER_S = 200  # how fast it replaces those the server drops (slowloris.py: its count per 15 s)
HEADER_TIMEOUT_S = 3.0
LIMITS = ConnectionLimits(CAP, HEADER_TIMEOUT_S, SHARE)
PARTIAL = b"GET /sandboxes HTTP/1.1\r\nHost: victim\r\nX-Slow: "  # a header that never ends


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    data = tmp_path_factory.mktemp("slowloris") / "svc"
    with ServiceProcess(data, "--max-connections", str(CAP), "--max-connections-per-client", str(SHARE),
                        "--header-timeout", str(HEADER_TIMEOUT_S), "--log-level", "info") as s:
        yield s


def server_fds(svc) -> int:
    return len(os.listdir(f"/proc/{svc.proc.pid}/fd"))


def probe(port: int, timeout: float = 5.0, source: str = "127.0.0.2") -> tuple[float, int]:
    """(seconds, status) of one GET /health on a fresh connection from `source` (not the attacker's)."""
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    return time.perf_counter() - t0, int(data.split(b" ", 2)[1]) if data else 0


class Attacker(threading.Thread):
    """Opens `n` half-open connections from `source` at once, then goes on opening new ones at
    `per_s` a second (keeping its newest `n`), as slowloris replaces the ones the server drops."""

    def __init__(self, port: int, n: int, per_s: float, source: str = "127.0.0.1") -> None:
        super().__init__(daemon=True)
        self.port, self.n, self.per_s, self.source = port, n, per_s, source
        self.socks: list[socket.socket] = []
        self.opened = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.opened >= self.n:
                time.sleep(1 / self.per_s)
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=5, source_address=(self.source, 0))
                s.sendall(PARTIAL)
                s.setblocking(False)
            except OSError:
                continue
            self.socks.append(s)
            self.opened += 1
            if len(self.socks) > self.n:
                self.socks.pop(0).close()

    def dropped_by_server(self) -> int:
        n = 0
        for s in list(self.socks):
            try:
                n += s.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:  # reset by the server
                n += 1
        return n

    def close(self) -> None:
        self.stop.set()
        self.join(10)
        for s in self.socks:
            s.close()


def test_health_answers_during_half_open_flood(svc, record_property):
    record_property("attack", "21,000 half-open connections (slowloris)")
    idle_fds = server_fds(svc)
    attacker = Attacker(svc.port, ATTACK, REOPEN_PER_S)
    attacker.start()
    try:
        wait_until(lambda: attacker.opened >= ATTACK, 60, f"{ATTACK} connections opened", step=0.05)
        latencies, fds = [], []
        for _ in range(30):  # from 127.0.0.2, while the attacker keeps reopening what the server drops
            seconds, status = probe(svc.port)
            assert status == 200
            latencies.append(seconds)
            fds.append(server_fds(svc))
            time.sleep(0.05)
        dropped = attacker.dropped_by_server()
    finally:
        attacker.close()
    p50, p90 = statistics.median(latencies), statistics.quantiles(latencies, n=10)[-1]
    record_property("figure", f"{attacker.opened} half-open connections, {ATTACK} held, {REOPEN_PER_S}/s "
                              f"reopened (server cap {CAP}, {SHARE} per client): /health p50 {p50 * 1e3:.1f} ms, "
                              f"p90 {p90 * 1e3:.1f} ms, max {max(latencies) * 1e3:.0f} ms; server fds {idle_fds} "
                              f"idle, at most {max(fds)} under attack")
    # Unguarded, the server stops answering (timeouts); guarded it answers in milliseconds on a quiet
    # machine. The bound sits between the two, loose enough for a loaded one.
    assert p90 < 1.0, latencies
    # The server holds at most the attacker's share (plus what is being accepted or closed: guard.py's
    # bound), never the attacker's count; the rest were evicted by newer ones or timed out.
    assert max(fds) <= idle_fds + SHARE + 3 * LIMITS.backlog < ATTACK
    assert dropped >= ATTACK - SHARE - 3 * LIMITS.backlog
    assert probe(svc.port)[1] == 200


def test_many_addresses_are_held_by_the_total_cap(svc, record_property):
    record_property("attack", "21,000 half-open connections (slowloris)")
    idle_fds = server_fds(svc)
    # 8 addresses x 2 shares each: 4x the total cap, every address within its own share twice over.
    attackers = [Attacker(svc.port, 2 * SHARE, REOPEN_PER_S / 8, f"127.0.1.{i}") for i in range(1, 9)]
    for a in attackers:
        a.start()
    try:
        deadline = time.monotonic() + 60
        while sum(a.opened for a in attackers) < 16 * SHARE and time.monotonic() < deadline:
            time.sleep(0.05)
        latencies, fds = [], []
        for _ in range(20):
            latencies.append(probe(svc.port)[0])
            fds.append(server_fds(svc))
            time.sleep(0.05)
    finally:
        for a in attackers:
            a.close()
    p90 = statistics.quantiles(latencies, n=10)[-1]
    record_property("figure", f"8 addresses x {2 * SHARE} half-open (total cap {CAP}): /health p90 "
                              f"{p90 * 1e3:.1f} ms; server fds at most {max(fds)}")
    assert p90 < 1.0, latencies  # as above: no stall, on a loaded machine too
    assert max(fds) <= idle_fds + CAP + 3 * LIMITS.backlog < idle_fds + 16 * SHARE


def test_dripped_header_is_cut_at_the_header_timeout(svc, record_property):
    record_property("attack", "a request header sent a byte at a time")
    with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as s:
        t0 = time.monotonic()
        closed_after = None
        for b in PARTIAL * 4:  # a byte every 0.25 s: each read is quick, the header never ends
            try:
                s.sendall(bytes([b]))
                s.settimeout(0.25)
                if s.recv(1) == b"":
                    closed_after = time.monotonic() - t0
                    break
            except TimeoutError:
                continue
            except OSError:
                closed_after = time.monotonic() - t0
                break
    record_property("figure", f"closed after {closed_after:.2f} s (header timeout {HEADER_TIMEOUT_S} s)")
    assert closed_after is not None and HEADER_TIMEOUT_S - 0.2 <= closed_after <= HEADER_TIMEOUT_S + 2


def test_oversized_header_gets_a_typed_431(svc, record_property):
    record_property("attack", "oversized request header")
    big = LIMITS.max_header_bytes + 1
    with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * big + b"\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ") and b"k3sys-error-type: too_large" in head
    assert b'"type": "too_large"' in body and str(big - 1).encode() in body
    record_property("figure", f"{big} header bytes: 431 too_large")
    assert probe(svc.port)[1] == 200


def test_malformed_request_flood_logs_a_few_lines(svc, record_property):
    record_property("attack", "log flood (malformed requests)")
    before = svc.log.stat().st_size
    n = 600
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as s:
            s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            while s.recv(4096):
                pass
    time.sleep(1.2)  # the bucket refills: the next line passes and says how many were dropped
    with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        while s.recv(4096):
            pass

    def logged() -> list[str]:
        lines = svc.log.read_bytes()[before:].decode(errors="replace").splitlines()
        return lines if any("more like it, not logged" in line for line in lines) else []

    new = wait_until(logged, 10, "the line counting what was dropped")
    invalid = [line for line in new if "Invalid HTTP request" in line]
    record_property("figure", f"{n + 1} malformed requests: {len(invalid)} log lines, {len(''.join(new))} bytes")
    assert 1 <= len(invalid) <= 20 and any("more like it, not logged" in line for line in invalid)
    assert probe(svc.port)[1] == 200


def test_rate_limit_filter_counts_what_it_drops(record_property):
    record_property("attack", "log flood (malformed requests)")
    record_property("figure", "3 at once, then 2/s per template; the next line counts the 7 dropped")
    clock = [0.0]
    f = RateLimit(per_second=2.0, burst=3, clock=lambda: clock[0])

    def rec(msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, args, None)

    passed = [f.filter(rec("bad request from %s", i)) for i in range(10)]
    assert passed == [True] * 3 + [False] * 7
    assert f.filter(rec("another template"))  # a bucket per template, not per argument
    clock[0] = 0.5  # one token back
    r = rec("bad request from %s", 99)
    assert f.filter(r) and r.getMessage() == "bad request from 99 [and 7 more like it, not logged]"
    assert not f.filter(rec("bad request from %s", 100))
