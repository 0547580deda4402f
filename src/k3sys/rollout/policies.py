"""Policies: what decides an agent's next shell command, given the episode so far.

A policy is any callable `policy(ctx: Context) -> Action | str`. Its wall time is the "thinking"
time during which the engine pauses or hibernates the sandbox. A policy may carry `expected_think_s`
(seconds) as a prior for `pause_policy="auto"` until the engine has measured a few calls.

- `ScriptedPolicy`: the task's scripted command after a think time drawn from a distribution, for
  experiments that need a given think/act ratio.
- `ModelPolicy`: the tiny hybrid model (KDA + gated MLA + MoE) generates tokens from the transcript;
  that generation is the real thinking time. Its weights are random, so its text is not a command:
  the action is the task's scripted command for the turn, the same whatever the model wrote, and the
  text is kept in the record only to show what was generated.
- `OpenAIPolicy`: any OpenAI-compatible chat completions endpoint; the command is the first fenced
  code block of the reply (or the whole reply).

torch is imported only when a `ModelPolicy` first thinks, and httpx when an `OpenAIPolicy` does.
"""

from __future__ import annotations

import math
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from k3sys.rollout.records import TurnRecord
from k3sys.rollout.tasks import Task
from k3sys.sandbox.errors import InvalidArgumentError

_OBSERVATION_CHARS = 2000  # per turn, in prompts: enough to read a test failure, short enough to stay cheap

SYSTEM_PROMPT = ("You operate a Linux shell inside a sandbox to complete a task. Reply with exactly one shell "
                 "command in a ```sh code block. You will see its exit code and output, then choose the next one.")


@dataclass(frozen=True)
class Context:
    """What a policy sees: the task, the episode's turns so far, the episode's id and seed."""

    task: Task
    history: tuple[TurnRecord, ...]
    episode: str
    seed: int

    @property
    def turn(self) -> int:
        """Index of the turn being decided (0-based)."""
        return len(self.history)

    def messages(self) -> list[dict[str, str]]:
        """The episode as chat messages: system, task, then (command, result) per turn."""
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.task.prompt}]
        for t in self.history:
            msgs.append({"role": "assistant", "content": f"```sh\n{t.action}\n```"})
            msgs.append({"role": "user", "content": f"exit code {t.exit_code}\n{t.observation[-_OBSERVATION_CHARS:]}"})
        return msgs

    def transcript(self) -> str:
        """The episode as plain text (what a model without a chat template reads)."""
        return "".join(f"<{m['role']}>\n{m['content']}\n" for m in self.messages()) + "<assistant>\n"


@dataclass(frozen=True)
class Action:
    """A policy's decision: the shell `command` to run, and any `text` the policy produced with it."""

    command: str
    text: str = ""


class Policy(Protocol):
    def __call__(self, ctx: Context) -> Action | str: ...


DISTRIBUTIONS = ("fixed", "uniform", "exponential", "lognormal")


class ScriptedPolicy:
    """The task's scripted command, after sleeping a think time with mean `think_ms`.

    `distribution`: "fixed"; "uniform" on mean * [1 - spread, 1 + spread]; "exponential";
    "lognormal" with shape `spread` (sigma) and the given mean. Draws depend only on (`seed`, the
    episode's seed, the turn), so a rerun (or the pause_policy="none" baseline) waits the same.
    """

    def __init__(self, think_ms: float = 2000.0, distribution: str = "lognormal", spread: float = 0.5,
                 seed: int = 0) -> None:
        if isinstance(think_ms, bool) or not isinstance(think_ms, int | float) or not 0 <= think_ms < math.inf:
            raise InvalidArgumentError(f"think_ms must be a finite number >= 0, got {think_ms!r}")
        if distribution not in DISTRIBUTIONS:
            raise InvalidArgumentError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        if not isinstance(spread, int | float) or not 0 <= spread < (1 if distribution == "uniform" else 4):
            raise InvalidArgumentError(f"spread must be in [0, 1) for uniform, [0, 4) otherwise, got {spread!r}")
        self.think_ms, self.distribution, self.spread, self.seed = float(think_ms), distribution, float(spread), seed

    @property
    def expected_think_s(self) -> float:
        return self.think_ms / 1e3

    def think_s(self, ctx: Context) -> float:
        """The think time drawn for this (episode, turn), in seconds."""
        rng = random.Random(f"{self.seed}:{ctx.seed}:{ctx.turn}")
        mean = self.think_ms / 1e3
        if self.distribution == "fixed" or mean == 0:
            return mean
        if self.distribution == "uniform":
            return mean * rng.uniform(1 - self.spread, 1 + self.spread)
        if self.distribution == "exponential":
            return rng.expovariate(1 / mean)
        return rng.lognormvariate(math.log(mean) - self.spread ** 2 / 2, self.spread)

    def __call__(self, ctx: Context) -> Action:
        time.sleep(self.think_s(ctx))
        return Action(ctx.task.scripted_action(ctx.turn))


class ModelPolicy:
    """The tiny hybrid model thinks: greedy generation of `new_tokens` tokens from the last
    `context_tokens` bytes of the transcript (byte = token id). With random weights the text is not
    a command, so the action is the task's scripted one for the turn (see the module docstring).

    One model serves every episode; calls take turns on it (a lock), as requests queue at one
    inference server. `model`: a ready `HybridModel` (default: `preset` with seed `seed`). The model is
    built (torch imported) and warmed up here, so no episode's first turn pays for that.
    """

    expected_think_s = None

    def __init__(self, preset: str = "tiny", new_tokens: int = 24, context_tokens: int = 256, seed: int = 0,
                 model: Any = None) -> None:
        for name, value in (("new_tokens", new_tokens), ("context_tokens", context_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
        self.new_tokens, self.context_tokens = new_tokens, context_tokens
        self._lock = threading.Lock()
        if model is None:
            import torch

            from k3sys.model import HybridModel, ModelConfig

            cfg = ModelConfig.from_preset(preset)
            torch.manual_seed(seed)
            model = HybridModel(cfg).eval()
        if model.cfg.vocab_size < 256:
            raise InvalidArgumentError(f"model: byte tokens need vocab_size >= 256, got {model.cfg.vocab_size}")
        self.model = model
        self.generate(SYSTEM_PROMPT)

    def generate(self, text: str) -> str:
        """The model's greedy continuation of `text`, as text (non-byte tokens dropped)."""
        import torch

        from k3sys.model import generate

        prompt = text.encode()[-self.context_tokens:]
        with self._lock:
            ids = torch.tensor([list(prompt)], dtype=torch.long)
            out = generate(self.model, ids, self.new_tokens)[0, len(prompt):].tolist()
        return bytes(i for i in out if i < 256).decode("utf-8", errors="replace")

    def __call__(self, ctx: Context) -> Action:
        return Action(ctx.task.scripted_action(ctx.turn), text=self.generate(ctx.transcript()))


_FENCE = re.compile(r"```[A-Za-z]*\n(.*?)```", re.DOTALL)


def parse_command(reply: str) -> str:
    """The command in a model's reply: its first fenced code block, else the whole reply; ":" (a
    shell no-op) for an empty reply."""
    m = _FENCE.search(reply)
    cmd = (m.group(1) if m else reply).strip()
    return cmd or ":"


class OpenAIPolicy:
    """A chat model behind an OpenAI-compatible endpoint (`POST {base_url}/chat/completions`)."""

    expected_think_s = None

    def __init__(self, base_url: str, model: str, api_key: str | None = None, max_tokens: int = 256,
                 temperature: float = 0.0, timeout_s: float = 120.0) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise InvalidArgumentError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key = model, api_key
        self.max_tokens, self.temperature, self.timeout_s = max_tokens, temperature, timeout_s

    def __call__(self, ctx: Context) -> Action:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": self.model, "messages": ctx.messages(), "max_tokens": self.max_tokens,
                "temperature": self.temperature}
        r = httpx.post(self.url, json=body, headers=headers, timeout=self.timeout_s)
        r.raise_for_status()
        reply = r.json()["choices"][0]["message"]["content"] or ""
        return Action(parse_command(reply), text=reply)
