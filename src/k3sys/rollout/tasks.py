"""Agent tasks with checkable outcomes: what the agent is told, how its sandbox starts, the scripted
actions that solve it, and a reward read back from the sandbox.

`builtin_tasks()` gives the suite the CLI, the demo and the benchmark run: write a file with given
content, fix a failing Python test (on the `debian` template), count the lines of a generated tree.
Each sandbox also runs a long-lived "agent service" (`resident_mb`, `poll_ms`): a stand-in for the
language server, REPL or dev server agents keep alive, which holds memory and wakes up now and then.
It is what makes pausing worth anything: an idle sandbox with nothing in it costs nothing either way.
"""

from __future__ import annotations

import hashlib
import random
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace

from k3sys.sandbox.errors import CommandExitError, InvalidArgumentError
from k3sys.sandbox.sdk.api import Sandbox

Setup = Callable[[Sandbox], None]
Reward = Callable[[Sandbox], float]


@dataclass(frozen=True)
class Task:
    """One agent task. `solution` are the shell commands a scripted agent runs, in order; after them
    it runs `check` (the command an agent verifies its work with) for the remaining turns.
    `setup` prepares a fresh sandbox (not a turn); `reward` reads the outcome from the sandbox, in [0, 1]."""

    name: str
    template: str
    prompt: str
    setup: Setup
    solution: tuple[str, ...]
    check: str
    reward: Reward

    def scripted_action(self, turn: int) -> str:
        """The scripted agent's command at `turn` (0-based)."""
        if turn < 0:
            raise InvalidArgumentError(f"turn must be >= 0, got {turn}")
        return self.solution[turn] if turn < len(self.solution) else self.check


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"{name} must be an integer >= 0, got {value!r}")


def start_service(sbx: Sandbox, resident_mb: int, poll_ms: int) -> None:
    """Start the agent service in `sbx` and wait until its memory is resident (see the module docstring).

    It holds `resident_mb` MiB of random text in a shell variable (random, so no page is a duplicate
    the checkpoint store could skip) and, every `poll_ms` ms, walks /work the way a file watcher does
    (0: it only sleeps).
    """
    _check_count("resident_mb", resident_mb)
    _check_count("poll_ms", poll_ms)
    loop = f"ls -R /work >/dev/null 2>&1; sleep {poll_ms / 1000:g}" if poll_ms else "sleep 86400"
    # base64 of 3n/4 random bytes: exactly n bytes of text (n = resident_mb MiB is a multiple of 4).
    body = (f"x=$(head -c {(resident_mb << 20) * 3 // 4} /dev/urandom | base64 -w 0); : > /tmp/.service-ready; "
            f"while :; do {loop}; done")
    try:
        sbx.commands.run(f"mkdir -p /work; sh -c {shlex.quote(body)} </dev/null >/dev/null 2>&1 & "
                         "until [ -e /tmp/.service-ready ]; do sleep 0.01; done", timeout=60)
    except CommandExitError as e:
        raise RuntimeError(f"agent service did not start in {sbx.id}: exit {e.exit_code}: {e.stderr.strip()}") from None


def _with_service(setup: Setup, resident_mb: int, poll_ms: int) -> Setup:
    def run(sbx: Sandbox) -> None:
        start_service(sbx, resident_mb, poll_ms)
        setup(sbx)

    return run


def _read(sbx: Sandbox, path: str) -> bytes | None:
    return sbx.files.read(path, format="bytes") if sbx.files.exists(path) else None


# --- write a file ---------------------------------------------------------------------------------

def write_file_task(seed: int = 0) -> Task:
    """Create /work/<name> with exact content; reward 1 when the bytes match."""
    path = f"/work/notes-{seed}.txt"
    content = f"k3sys rollout {seed}\nsandboxes sleep while the model thinks\n"

    def reward(sbx: Sandbox) -> float:
        return float(_read(sbx, path) == content.encode())

    return Task(
        name="write-file", template="busybox",
        prompt=f"Create the file {path} containing exactly this text (two lines, final newline):\n{content}",
        setup=lambda sbx: None,
        solution=("ls -la /work", f"printf %s {shlex.quote(content)} > {path}"),
        check=f"cat {path}",
        reward=reward,
    )


# --- fix a failing Python test --------------------------------------------------------------------

_CALC = '''def mean(xs):
    """Arithmetic mean of a non-empty list."""
    return sum(xs) / (len(xs) + 1)
'''
_TEST = '''import unittest

from calc import mean


class MeanTest(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([{a}, {b}, {c}]), {m})


if __name__ == "__main__":
    unittest.main()
'''


def fix_test_task(seed: int = 0) -> Task:
    """/work/test_calc.py fails against a bug in /work/calc.py; reward 1 when the test passes and the
    test file is untouched (editing the test is not a fix)."""
    rng = random.Random(seed)
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    c = 3 * rng.randint(10, 40) - a - b  # a + b + c divisible by 3: an exact integer mean
    test = _TEST.format(a=a, b=b, c=c, m=(a + b + c) // 3)
    digest = hashlib.sha256(test.encode()).hexdigest()
    run_test = "cd /work && python3 -m unittest -q test_calc"

    def setup(sbx: Sandbox) -> None:
        sbx.files.write("/work/calc.py", _CALC)
        sbx.files.write("/work/test_calc.py", test)

    def reward(sbx: Sandbox) -> float:
        untouched = hashlib.sha256(_read(sbx, "/work/test_calc.py") or b"").hexdigest() == digest
        if not untouched:
            return 0.0
        try:
            sbx.commands.run(run_test, timeout=60)
        except CommandExitError:
            return 0.0
        return 1.0

    return Task(
        name="fix-test", template="debian",
        prompt="The unit test /work/test_calc.py fails. Fix the bug in /work/calc.py (do not edit the test) so "
               f"that `{run_test}` passes.",
        setup=setup,
        solution=(run_test, "cat /work/calc.py", "sed -i 's/(len(xs) + 1)/len(xs)/' /work/calc.py"),
        check=run_test,
        reward=reward,
    )


# --- count lines in a generated tree --------------------------------------------------------------

def count_lines_task(seed: int = 0, files: int = 24) -> Task:
    """A generated tree of .txt files (and .log decoys); reward 1 when /work/answer holds the total
    line count of the .txt files."""
    rng = random.Random(seed)
    tree: dict[str, str] = {}
    for i in range(files):
        ext = "log" if rng.random() < 0.25 else "txt"
        path = f"/work/tree/{rng.choice('abc')}/{rng.choice(('', 'deep/'))}f{i:02d}.{ext}"
        tree[path] = "".join(f"line {j}\n" for j in range(rng.randint(1, 60)))
    expected = sum(text.count("\n") for path, text in tree.items() if path.endswith(".txt"))

    def setup(sbx: Sandbox) -> None:
        for path, text in tree.items():
            sbx.files.write(path, text)

    def reward(sbx: Sandbox) -> float:
        answer = (_read(sbx, "/work/answer") or b"").strip()
        return float(answer.isdigit() and int(answer) == expected)

    return Task(
        name="count-lines", template="busybox",
        prompt="Count the lines of all *.txt files under /work/tree (recursively) and write the total, a bare "
               "integer, to /work/answer.",
        setup=setup,
        solution=("find /work/tree -type f | head -n 20",
                  "find /work/tree -name '*.txt' -exec cat {} + | wc -l > /work/answer"),
        check="cat /work/answer",
        reward=reward,
    )


def builtin_tasks(seed: int = 0, resident_mb: int = 32, poll_ms: int = 100) -> list[Task]:
    """The built-in suite: write-file, fix-test (debian template), count-lines; each sandbox runs the
    agent service with `resident_mb` MiB resident, polling every `poll_ms` ms (0: never)."""
    _check_count("resident_mb", resident_mb)
    _check_count("poll_ms", poll_ms)
    tasks = [write_file_task(seed), fix_test_task(seed), count_lines_task(seed)]
    return [replace(t, setup=_with_service(t.setup, resident_mb, poll_ms)) for t in tasks]
