"""A sandbox's output against its PID 1 and its callers (issue 30, items 6 and 7).

- Floods of background output nobody reads once grew the agent's rings (16 MiB per process, no
  total) until the memory limit's OOM killer took PID 1 and the sandbox died. The rings now share
  a total (1/8 of the sandbox's memory, at most 64 MiB: the oldest unread output goes first,
  counted), what the agent starts is the OOM killer's first choice (oom_score_adj 1000) and the
  host lowers PID 1's to -1000 where it may (CAP_SYS_RESOURCE).
- A foreground command's output was cut where the ring wrapped (`seq 1 3000000`: 17.1 MB of
  22.9 through the e2b SDK, exit 0, no error). A followed process is now held back instead
  (back-pressure from the reader to the writer), so all of it arrives, embedded, through the k3sys
  client and the e2b SDK, while the service holds about a message per stream.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sandbox_fixtures import run_any
from service_process import ServiceProcess
from waiting import wait_until

pytestmark = pytest.mark.timeout(300)
LINES = 3_000_000
SEQ = f"seq 1 {LINES}"
EXPECTED = "".join(f"{i}\n" for i in range(1, LINES + 1))  # 22.9 MB


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def _can_lower_oom_scores() -> bool:
    """Whether this host process has CAP_SYS_RESOURCE (some container hosts drop it)."""
    eff = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff:"))
    return bool(int(eff.split()[1], 16) >> 24 & 1)


def _wait_all_ended(s, n: int, timeout: float = 180) -> None:
    wait_until(lambda: sum(not p.running for p in s.commands.list()) >= n, timeout, f"{n} background commands ending",
               step=0.2)


def test_background_floods_leave_pid1_alive(arena, record_property):
    record_property("attack", "PID 1 OOM-killed by its own output rings (background floods nobody reads)")
    s = arena.create(memory_mb=256)
    init = arena.rt.driver.init_pid(s.id)
    n, size = 16, 32_000_000  # 512 MB of output in a 256 MB sandbox: 16 full rings were all of it
    handles = [s.commands.run(f"yes flood-{i} | head -c {size}", background=True) for i in range(n)]
    _wait_all_ended(s, n)
    rss = _rss_mib(init)
    assert arena.rt.driver.init_pid(s.id) == init, "the same PID 1: the sandbox never died"
    assert s.commands.run("echo alive").stdout == "alive\n"
    assert rss < 256 / 8 + 16, f"the agent's rings stay within their total: {rss:.0f} MiB"
    results = [h.wait(timeout=60) for h in handles]
    assert all(r.exit_code == 0 and len(r.stdout) + r.dropped == size for r in results)
    dropped = sum(r.dropped for r in results)
    assert dropped > 0, "what did not fit is counted, never reported as 0"
    record_property("figure", f"{n} x {size / 1e6:.0f} MB unread in 256 MB: PID 1 alive, agent RSS {rss:.0f} MiB, "
                              f"{dropped / 1e6:.0f} MB of oldest output dropped and counted")


def test_a_memory_hog_is_killed_instead_of_pid1(arena, record_property):
    record_property("attack", "memory limit's OOM killer picks PID 1")
    s = arena.create(memory_mb=128)
    init = arena.rt.driver.init_pid(s.id)
    want = -1000 if _can_lower_oom_scores() else 0
    assert int(Path(f"/proc/{init}/oom_score_adj").read_text()) == want
    assert s.commands.run("cat /proc/self/oom_score_adj").stdout == "1000\n", "what it starts goes first"
    r = run_any(s, "x=$(head -c 300000000 /dev/zero | tr '\\0' c); echo kept", timeout=120)
    assert r.exit_code == 128 + 9 and "kept" not in r.stdout
    assert arena.rt.driver.init_pid(s.id) == init and s.commands.run("echo alive").stdout == "alive\n"
    # A restored PID 1 is spared again (CRIU's own restore of the value fails in a user namespace).
    s.hibernate()
    s.resume()
    init = arena.rt.driver.init_pid(s.id)
    assert int(Path(f"/proc/{init}/oom_score_adj").read_text()) == want
    assert s.commands.run("cat /proc/self/oom_score_adj").stdout == "1000\n"
    record_property("figure", f"300 MB hog in 128 MB: the hog killed (137), PID 1 alive; oom_score_adj PID 1 "
                              f"{want}, its children 1000 (also after a restore)")


def test_foreground_output_arrives_whole_embedded(arena, record_property):
    record_property("attack", "foreground output silently cut (seq 1 3000000)")
    s = arena.create(memory_mb=256)
    r = s.commands.run(SEQ, timeout=120)
    assert (r.exit_code, r.dropped, len(r.stdout)) == (0, 0, len(EXPECTED)) and r.stdout == EXPECTED
    record_property("figure", f"embedded: {r.stdout.count(chr(10)):,} of {LINES:,} lines, dropped 0")


@pytest.fixture(scope="module")
def svc(tmp_path_factory, sec_rt):  # `sec_rt` first: it skips where sandboxes cannot run
    with ServiceProcess(tmp_path_factory.mktemp("output") / "svc") as s:
        yield s
        s.kill_all()


def test_foreground_output_arrives_whole_over_the_service(svc, monkeypatch, record_property):
    record_property("attack", "foreground output silently cut (seq 1 3000000)")
    from e2b import Sandbox as E2B

    from k3sys.sandbox import Sandbox

    monkeypatch.setenv("E2B_API_URL", svc.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", svc.url)
    bystander = Sandbox.create(memory_mb=64, api_url=svc.url, api_key=svc.key)
    ours = Sandbox.create(memory_mb=256, api_url=svc.url, api_key=svc.key)
    theirs = E2B.create("base", api_key=svc.key, timeout=300)  # the SDK runs `bash -l -c`
    try:
        r = ours.commands.run(SEQ, timeout=120)
        assert (r.exit_code, r.dropped, r.stdout == EXPECTED) == (0, 0, True), "the k3sys client gets it all"

        # The e2b SDK, read slowly at first: the service holds about a message, not the output.
        base, peak, done = _rss_mib(svc.proc.pid), [0.0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss_mib(svc.proc.pid))
                time.sleep(0.02)

        seen = []

        def slow(text: str) -> None:
            if len(seen) < 40:
                time.sleep(0.05)  # ~2 s of a slow reader while the command could write all of it
            seen.append(len(text))

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            e = theirs.commands.run(SEQ, timeout=240, request_timeout=240, on_stdout=slow)
        finally:
            done.set()
            sampler.join()
        assert e.exit_code == 0 and e.stdout == EXPECTED and sum(seen) == len(EXPECTED), "the e2b SDK gets it all"
        assert peak[0] - base < 64, f"service RSS {base:.0f} -> {peak[0]:.0f} MiB while a client read slowly"

        # Output nobody followed (a background start) that the ring dropped is counted, never 0.
        h = ours.commands.run(SEQ, background=True)
        _wait_all_ended(ours, 1)
        late = h.wait(timeout=120)
        assert late.dropped > 0 and len(late.stdout) + late.dropped == len(EXPECTED)
        assert late.stdout == EXPECTED[late.dropped:]
        assert bystander.commands.run("echo fine").stdout == "fine\n"
        record_property("figure", f"k3sys client and e2b SDK: {LINES:,} of {LINES:,} lines; service RSS "
                                  f"+{peak[0] - base:.0f} MiB under a slow reader; unread ring loss counted "
                                  f"({late.dropped / 1e6:.1f} MB)")
    finally:
        theirs.kill()
        ours.kill()
        bystander.kill()
