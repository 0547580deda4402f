"""The rollout engine with the fleet as its sandbox factory: episodes run on every node, each recorded."""

from __future__ import annotations

import time

import pytest
from fleet_helpers import settled_reserved

from k3sys.rollout import RolloutEngine, Task, default_factory
from k3sys.rollout.tasks import start_service

pytestmark = pytest.mark.timeout(300)
EPISODES, TURNS = 6, 2  # the 24 episodes do not fit this 2-core CI box's budget; 2 per node


def test_rollout_over_three_nodes(fleet):
    logs: dict[str, str] = {}
    nodes: dict[str, str] = {}

    def setup(sbx):
        start_service(sbx, 0, 0)

    def reward(sbx):
        nodes[sbx.id] = fleet.node_of(sbx.id)
        logs[sbx.id] = sbx.files.read_text("/work/log")
        return 1.0

    def policy(ctx):
        time.sleep(0.05)
        return f"echo {ctx.episode}:{ctx.turn} >> /work/log"

    before = settled_reserved(fleet)
    task = Task("log", "busybox", "append to /work/log", setup, (), ":", reward)
    engine = RolloutEngine(policy, default_factory(fleet, memory_mb=64), "pause")
    report = engine.run([task], episodes=EPISODES, turns=TURNS)
    assert report.errors == []
    assert len(report.episodes) == EPISODES and all(len(e.turns) == TURNS for e in report.episodes)
    for e in report.episodes:
        assert logs[e.sandbox_id].split() == [f"{e.id}:{t}" for t in range(TURNS)], e.id
    # Spread evens out reserved memory (what other tests left running counts too); episodes start
    # at once, so allow one sandbox's worth of slack for creates the nodes' stats do not show yet.
    after = {n: mb + 64 * list(nodes.values()).count(n) for n, mb in before.items()}
    assert max(after.values()) - min(after.values()) <= 2 * 64, (nodes, before)
    assert len(set(nodes.values())) >= 2, nodes
    assert not {i.id for i in fleet.list()} & set(nodes)  # every episode's sandbox is gone
