"""Policies without sandboxes: scripted think-time draws, the tiny model as a policy, an
OpenAI-compatible endpoint (a real HTTP server on 127.0.0.1), and what importing rollout pulls in."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from k3sys.rollout import Action, Context, ModelPolicy, OpenAIPolicy, ScriptedPolicy, Task, TurnRecord
from k3sys.rollout.policies import parse_command
from k3sys.sandbox import InvalidArgumentError

pytestmark = pytest.mark.timeout(120)

TASK = Task("t", "busybox", "Do the thing.", lambda sbx: None, ("ls /work", "touch /work/x"), "cat /work/x",
            lambda sbx: 1.0)


def ctx(turn: int = 0, seed: int = 0, episode: str = "e0") -> Context:
    hist = tuple(TurnRecord(i, TASK.scripted_action(i), 0, f"out {i}\n", 0.0, 0.0, 0.0, 0.0, "pause")
                 for i in range(turn))
    return Context(TASK, hist, episode, seed)


@pytest.mark.parametrize("distribution", ["fixed", "uniform", "exponential", "lognormal"])
def test_scripted_think_times_have_the_asked_mean_and_repeat(distribution):
    policy = ScriptedPolicy(think_ms=200, distribution=distribution, spread=0.5, seed=1)
    draws = [policy.think_s(ctx(turn=t, seed=s)) for s in range(400) for t in range(5)]
    assert all(d >= 0 for d in draws)
    assert statistics.fmean(draws) == pytest.approx(0.2, rel=0.08)
    if distribution == "fixed":
        assert set(draws) == {0.2}
    else:
        assert statistics.pstdev(draws) > 0.02
    again = ScriptedPolicy(think_ms=200, distribution=distribution, spread=0.5, seed=1)
    assert [again.think_s(ctx(turn=t, seed=s)) for s in range(400) for t in range(5)] == draws
    if distribution != "fixed":  # another policy seed, other draws
        assert ScriptedPolicy(200, distribution, 0.5, seed=2).think_s(ctx(seed=7)) != policy.think_s(ctx(seed=7))


def test_scripted_policy_sleeps_then_follows_the_script():
    policy = ScriptedPolicy(think_ms=100, distribution="fixed")
    t0 = time.perf_counter()
    actions = [policy(ctx(turn=t)) for t in range(3)]
    assert time.perf_counter() - t0 >= 0.3
    assert actions == [Action("ls /work"), Action("touch /work/x"), Action("cat /work/x")]
    assert policy.expected_think_s == 0.1


@pytest.mark.parametrize("kwargs, arg", [
    ({"think_ms": -1}, "think_ms"), ({"think_ms": float("inf")}, "think_ms"),
    ({"distribution": "gamma"}, "distribution"), ({"distribution": "uniform", "spread": 1.5}, "spread"),
])
def test_scripted_policy_rejects_bad_arguments(kwargs, arg):
    with pytest.raises(InvalidArgumentError, match=arg):
        ScriptedPolicy(**kwargs)


def test_model_policy_thinks_with_the_hybrid_model_and_acts_from_the_script():
    a, b = (ModelPolicy(new_tokens=8, context_tokens=64, seed=0) for _ in range(2))
    t0 = time.perf_counter()
    out = a(ctx(turn=1))
    assert time.perf_counter() - t0 > 0
    assert out.command == "touch /work/x"  # the script's, whatever the random weights wrote
    assert out.text == b(ctx(turn=1)).text  # greedy decoding of the same weights: the same text
    assert out.text == a.generate(ctx(turn=1).transcript())
    with pytest.raises(InvalidArgumentError, match="new_tokens"):
        ModelPolicy(new_tokens=0, model=a.model)


def test_exports():
    import k3sys.rollout as rollout

    for name in rollout.__all__:
        assert hasattr(rollout, name), name
    assert {"RolloutEngine", "RolloutReport", "ScriptedPolicy", "ModelPolicy", "builtin_tasks"} <= set(rollout.__all__)


def test_importing_rollout_does_not_import_torch():
    code = ("import sys, k3sys.rollout as r; assert 'torch' not in sys.modules; "
            "r.ScriptedPolicy(); assert 'torch' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_transcript_and_messages_carry_every_turn():
    c = ctx(turn=2)
    msgs = c.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[1]["content"] == TASK.prompt
    assert "ls /work" in msgs[2]["content"] and msgs[3]["content"] == "exit code 0\nout 0\n"
    assert c.transcript().endswith("<assistant>\n") and "out 1" in c.transcript()


@pytest.mark.parametrize("reply, command", [
    ("Let me look.\n```sh\nls -la /work\n```\nthen more", "ls -la /work"),
    ("```\necho a\necho b\n```", "echo a\necho b"),
    ("  pwd  ", "pwd"),
    ("", ":"),
], ids=["fenced-sh", "fenced-multiline", "bare", "empty"])
def test_parse_command(reply, command):
    assert parse_command(reply) == command


class _Completions(BaseHTTPRequestHandler):
    requests: list = []
    reply = "I will list it.\n```sh\nls -la /work\n```"

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, self.headers.get("Authorization"), body))
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": self.reply}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def completions_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    _Completions.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_openai_policy_against_a_local_endpoint(completions_server):
    policy = OpenAIPolicy(completions_server, "tiny-agent", api_key="k3", max_tokens=64)
    out = policy(ctx(turn=1))
    assert out == Action("ls -la /work", _Completions.reply)
    (path, auth, body), = _Completions.requests
    assert path == "/v1/chat/completions" and auth == "Bearer k3"
    assert body["model"] == "tiny-agent" and body["max_tokens"] == 64 and body["temperature"] == 0.0
    assert body["messages"] == ctx(turn=1).messages()
    with pytest.raises(InvalidArgumentError, match="base_url"):
        OpenAIPolicy("localhost:8000", "m")
