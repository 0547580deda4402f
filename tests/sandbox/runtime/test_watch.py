"""files.watch_dir: the agent's inotify watch streamed to the host, against real sandboxes: the
event kinds, recursion (into directories made later too), stop, the bound on queued events, and a
watch that carries on across a checkpoint and a hibernation."""

from __future__ import annotations

import threading

import pytest
from waiting import wait_until

from k3sys.sandbox import (
    FilesystemEvent,
    Sandbox,
    SandboxFileNotFoundError,
    WrongFileTypeError,
)
from k3sys.sandbox.errors import AgentError

pytestmark = pytest.mark.timeout(120)


def collect(w, until: FilesystemEvent, seen: list[FilesystemEvent] | None = None,
            timeout: float = 20) -> list[FilesystemEvent]:
    """Events from `w` (after `seen`) up to and including `until`."""
    seen = [] if seen is None else seen

    def reached() -> bool:
        seen.extend(w.get_new_events())
        return until in seen

    wait_until(reached, timeout, f"{until} (after {seen})", step=0.02)
    return seen


def squash(events: list[FilesystemEvent]) -> list[tuple[str, str]]:
    """(type, path) with repeats in a row folded (inotify merges unread identical events)."""
    out: list[tuple[str, str]] = []
    for e in events:
        if not out or out[-1] != (e.type, e.path):
            out.append((e.type, e.path))
    return out


@pytest.mark.embedded
def test_watch_reports_each_kind_of_change_and_stops(sbx):
    sbx.files.make_dir("/root/w")
    sbx.files.write("/root/w/old", "x")
    w = sbx.files.watch_dir("/root/w")
    sbx.commands.run("echo a > /root/w/f; echo b >> /root/w/f; mv /root/w/f /root/w/g; rm /root/w/g;"
                     " chmod 600 /root/w/old; mkdir /root/w/sub; echo deep > /root/w/sub/deep")
    events = collect(w, FilesystemEvent("create", "/root/w/sub", True))
    assert squash(events) == [("create", "/root/w/f"), ("write", "/root/w/f"), ("rename", "/root/w/f"),
                              ("create", "/root/w/g"), ("remove", "/root/w/g"), ("chmod", "/root/w/old"),
                              ("create", "/root/w/sub")]
    assert [e.is_dir for e in events if e.path == "/root/w/sub"] == [True]
    # Not recursive: nothing from inside sub. Events come in order, and sub/deep was written before
    # the marker: up to the marker's, there is none of it.
    sbx.files.make_dir("/root/w/marker")
    assert squash(collect(w, FilesystemEvent("create", "/root/w/marker", True))) == [("create", "/root/w/marker")]
    w.stop()
    with sbx.files.watch_dir("/root/w") as live:  # the change reaches a live watch; the stopped one gets none
        sbx.files.make_dir("/root/w/after")
        collect(live, FilesystemEvent("create", "/root/w/after", True))
    assert w.get_new_events() == []
    assert (w.dropped, w.overflows) == (0, 0)


@pytest.mark.embedded
def test_recursive_watch_follows_new_directories(sbx):
    sbx.commands.run("mkdir -p /root/r/a/b")
    with sbx.files.watch_dir("/root/r", recursive=True) as w:
        sbx.files.write("/root/r/a/b/x", "1")
        collect(w, FilesystemEvent("create", "/root/r/a/b/x"))
        sbx.files.make_dir("/root/r/new")
        collect(w, FilesystemEvent("create", "/root/r/new", True))
        sbx.commands.run("mv /root/r/a /root/r/new/a2 && : > /root/r/new/a2/b/y")
        events = collect(w, FilesystemEvent("create", "/root/r/new/a2/b/y"))
        assert ("rename", "/root/r/a") in squash(events) and ("create", "/root/r/new/a2") in squash(events)


@pytest.mark.embedded
def test_watch_stop_ends_the_agents_worker(sbx):
    def agent_processes() -> int:
        return int(sbx.commands.run("ps -o comm | grep -c '^agent' || true").stdout)

    idle = agent_processes()
    w = sbx.files.watch_dir("/tmp")
    assert agent_processes() == idle + 1
    w.stop()
    wait_until(lambda: agent_processes() == idle, 10, "the watch's worker ending with stop()", step=0.05)


@pytest.mark.embedded
def test_a_flood_is_bounded_and_counted(rt, sbx):
    sbx.files.make_dir("/root/flood")
    w = rt.watch_dir(sbx.id, "/root/flood", max_events=100)
    try:
        sbx.commands.run("i=0; while [ $i -lt 500 ]; do : > /root/flood/f$i; i=$((i+1)); done")
        wait_until(lambda: w.dropped >= 400, 20, "400 events dropped", step=0.05)
        events = w.get_new_events()
        assert [e.path for e in events] == [f"/root/flood/f{i}" for i in range(100)]  # the first, in order
        assert w.dropped == 400 and w.overflows == 0
    finally:
        w.stop()


def wait_gaps(w, n: int) -> None:
    """Until the watch is whole again after its `n`th cut (changes before that may be missed)."""
    wait_until(lambda: w.gaps >= n, 20, f"the watch set up again after cut {n}")


@pytest.mark.embedded
def test_watch_goes_on_across_checkpoint_and_hibernation_and_ends_with_the_sandbox(rt):
    s = Sandbox.create(runtime=rt, memory_mb=256)
    try:
        w = s.files.watch_dir("/tmp")
        s.checkpoint()
        wait_gaps(w, 1)
        s.files.write("/tmp/after-checkpoint", "1")
        collect(w, FilesystemEvent("create", "/tmp/after-checkpoint"))
        s.hibernate()
        s.resume()
        wait_gaps(w, 2)
        s.files.write("/tmp/after-resume", "1")
        collect(w, FilesystemEvent("create", "/tmp/after-resume"))
    finally:
        s.kill()

    def ended() -> bool:
        try:
            w.get_new_events()
        except AgentError:
            return True
        return False

    wait_until(ended, 10, "the watch ending with its sandbox (AgentError)", step=0.05)


@pytest.mark.embedded
def test_an_open_watch_does_not_delay_a_checkpoint(rt):
    # The agent's part of a checkpoint (closing the host's connections) used to wait out the grace
    # for calls in flight (0.5 s) on the watch, which never ends: it is cut at once now, and so
    # are output followers.
    with Sandbox.create(runtime=rt) as s:
        h = s.commands.run("sleep 60", background=True)
        follower = threading.Thread(target=lambda: list(h.stream()), daemon=True)
        follower.start()
        with s.files.watch_dir("/tmp") as w:
            s.files.write("/tmp/before", "1")
            collect(w, FilesystemEvent("create", "/tmp/before"))
            s.checkpoint()
            assert rt.timings(s.id)["agent"] < 0.25, rt.timings(s.id)
            wait_gaps(w, 1)
            s.files.write("/tmp/after", "1")
            assert "/tmp/before" not in {e.path for e in collect(w, FilesystemEvent("create", "/tmp/after"))}
            assert w.dropped == w.overflows == 0
        h.kill()
        follower.join(10)
        assert not follower.is_alive()


@pytest.mark.embedded
def test_watch_refuses_a_missing_path_or_a_file(sbx):
    with pytest.raises(SandboxFileNotFoundError, match="/nope"):
        sbx.files.watch_dir("/nope")
    sbx.files.write("/root/file", "x")
    with pytest.raises(WrongFileTypeError):
        sbx.files.watch_dir("/root/file")
