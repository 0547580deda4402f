"""Live-slot bookkeeping (eviction order, no deadlock between forking episodes) and the cgroup
counter integration (sample and hold, counter restarts after a hibernation)."""

from __future__ import annotations

import threading
import time

import pytest
from waiting import wait_until

from k3sys.rollout.slots import Slots
from k3sys.rollout.usage import UsageSampler
from k3sys.sandbox import InvalidArgumentError

pytestmark = pytest.mark.timeout(30)


def now():
    return time.perf_counter()


def in_thread(fn, *args):
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    return t


def test_uncapped_slots_never_block_and_count_the_peak():
    slots = Slots(None, evict=lambda k: pytest.fail("nothing to evict without a cap"))
    for k in "abc":
        slots.acquire(k, now)
    slots.acquire("a", now, extra=2)
    assert slots.peak == 5


def test_capped_slots_evict_the_most_recently_idled():
    evicted = []
    slots = Slots(2, evict=evicted.append)
    slots.acquire("a", now)
    slots.acquire("b", now)
    slots.set_idle("a", 1.0)
    slots.set_idle("b", 2.0)  # idled last: the longest wait still ahead
    slots.acquire("c", now)
    assert evicted == ["b"]
    slots.acquire("a", now)  # still live: no wait, no eviction
    assert evicted == ["b"] and slots.peak == 2
    done = threading.Event()
    t = in_thread(lambda: (slots.acquire("b", now), done.set()))
    assert not done.wait(0.2)  # a and c are busy: b must wait
    slots.release("c")
    t.join(5)
    assert done.is_set() and evicted == ["b"]


def test_two_forking_episodes_do_not_deadlock():
    """a and b are live and each asks for 2 more slots of 3: one of them is evicted while it waits."""
    evicted = []
    slots = Slots(3, evict=evicted.append)
    slots.acquire("a", now)
    slots.acquire("b", now)
    got = []
    threads = [in_thread(lambda k=k: (slots.acquire(k, now, extra=2), got.append(k))) for k in "ab"]
    first = wait_until(lambda: got, 10, "one episode's slots granted")[0]
    assert evicted == ["b" if first == "a" else "a"]
    slots.release(first)  # the first group finishes: its parent and its two reserved slots free up
    slots.unreserve(2)
    for t in threads:
        t.join(5)
    assert sorted(got) == ["a", "b"] and slots.peak <= 3


class Counters:
    """Stands in for a sandbox's cgroup: readings set by the test."""

    def __init__(self) -> None:
        self.mem, self.cpu = 0, 0.0

    def memory_bytes(self) -> int:
        return self.mem

    def cpu_seconds(self) -> float:
        return self.cpu


def test_usage_holds_each_sample_and_survives_counter_restarts():
    clock = [0.0]
    sampler = UsageSampler(interval_s=1.0, clock=lambda: clock[0])
    cg = Counters()
    cg.mem, cg.cpu = 100, 1.0
    sampler.track("e0", cg)
    for t, mem, cpu in ((1, 300, 1.5), (2, 0, 0.0), (3, 50, 0.2), (5, 50, 0.7)):  # t=2: hibernated, new cgroup
        clock[0], cg.mem, cg.cpu = float(t), mem, cpu
        sampler.sample("e0")
    u = sampler.untrack("e0")
    # Counted from 0: the cgroup was made for this episode; after the restart, from 0 again.
    assert u.cpu_s == pytest.approx(1.0 + 0.5 + 0.0 + 0.2 + 0.5)
    assert u.byte_s == pytest.approx(100 * 1 + 300 * 1 + 0 * 1 + 50 * 2)
    assert u.peak_bytes == 300 and [m for _, m in u.series] == [100, 300, 0, 50, 50, 50]  # + untrack's


def test_usage_sampler_thread_samples_at_its_interval():
    cg = Counters()
    cg.mem = 1000
    sampler = UsageSampler(interval_s=0.01)
    sampler.track("e0", cg)
    t0 = time.monotonic()
    sampler.start()
    time.sleep(0.3)
    sampler.stop()
    elapsed = time.monotonic() - t0  # a loaded machine oversleeps: bound by what really passed
    u = sampler.untrack("e0")
    assert 5 <= len(sampler.totals) <= elapsed / 0.01 + 5 and all(b == 1000 for _, b in sampler.totals)
    assert u.byte_s == pytest.approx(1000 * (u.series[-1][0] - u.series[0][0]), rel=1e-9)
    with pytest.raises(InvalidArgumentError, match="interval_s"):
        UsageSampler(interval_s=0)
