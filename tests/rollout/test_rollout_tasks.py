"""Built-in tasks on real sandboxes: reward 0 before and 1 after the scripted solution, and 0 for
near misses (wrong bytes, wrong count, a "fix" that edits the test)."""

from __future__ import annotations

import pytest
from sandbox_fixtures import run_any

from k3sys.rollout import builtin_tasks
from k3sys.sandbox import InvalidArgumentError, Sandbox

pytestmark = pytest.mark.timeout(180)


def make(request, rt, name: str, **kw):
    task = {t.name: t for t in builtin_tasks(seed=3, **kw)}[name]
    if task.template == "debian":
        request.getfixturevalue("debian")
    sbx = Sandbox.create(task.template, runtime=rt, memory_mb=128)
    request.addfinalizer(sbx.kill)
    task.setup(sbx)
    return task, sbx


@pytest.mark.parametrize("name", ["write-file", "fix-test", "count-lines"])
def test_scripted_solution_earns_the_reward(request, rt, name):
    task, sbx = make(request, rt, name, resident_mb=0, poll_ms=0)
    assert task.reward(sbx) == 0.0
    for turn in range(len(task.solution)):
        run_any(sbx, task.scripted_action(turn), timeout=60)  # an agent's step may fail (a test run)
    assert task.reward(sbx) == 1.0
    assert task.scripted_action(len(task.solution)) == task.scripted_action(99) == task.check
    assert sbx.commands.run(task.check, timeout=60).exit_code == 0


@pytest.mark.parametrize("name, miss", [
    pytest.param("write-file", "printf 'k3sys rollout 3\\n' > /work/notes-3.txt", id="write-file-first-line-only"),
    pytest.param("count-lines", "find /work/tree -type f -exec cat {} + | wc -l > /work/answer",
                 id="count-lines-with-log-decoys"),
    pytest.param("fix-test", "sed -i 's/assertEqual/assertNotEqual/' /work/test_calc.py",
                 id="fix-test-by-editing-test"),
])
def test_near_misses_earn_nothing(request, rt, name, miss):
    task, sbx = make(request, rt, name, resident_mb=0, poll_ms=0)
    assert sbx.commands.run(miss, timeout=60).exit_code == 0
    if name == "fix-test":  # the edited test does pass: only the reward's integrity check catches it
        assert sbx.commands.run(task.check, timeout=60).exit_code == 0
    assert task.reward(sbx) == 0.0


def test_agent_service_holds_its_memory(request, rt):
    _, sbx = make(request, rt, "write-file", resident_mb=24, poll_ms=50)
    assert sbx.memory_bytes() >= 24 << 20
    assert "while :" in sbx.commands.run("ps -o args").stdout


def test_bad_arguments_are_rejected():
    with pytest.raises(InvalidArgumentError, match="resident_mb"):
        builtin_tasks(resident_mb=-1)
    with pytest.raises(InvalidArgumentError, match="poll_ms"):
        builtin_tasks(poll_ms=1.5)
    with pytest.raises(InvalidArgumentError, match="turn"):
        builtin_tasks()[0].scripted_action(-1)
