"""Agent-RL rollouts whose sandboxes sleep while the model thinks, with real resource accounting.

    from k3sys.rollout import RolloutEngine, ScriptedPolicy, builtin_tasks

    engine = RolloutEngine(ScriptedPolicy(think_ms=2000), pause_policy="pause")
    report = engine.run(builtin_tasks(), episodes=8, turns=6, compare_none=True)
    print(report.totals["cpu_s"], report.baseline.totals["cpu_s"])
    report.to_html("rollout.html")

- `RolloutEngine` (engine.py): pause_policy none | pause | hibernate | auto, `max_live`, `branch` forks.
- `RolloutReport` (report.py), `EpisodeRecord`, `TurnRecord` (records.py): CPU and memory from cgroup
  counters (usage.py), timelines, the HTML report (html.py).
- Policies (policies.py): `ScriptedPolicy`, `ModelPolicy` (the tiny hybrid model; imports torch only
  when built), `OpenAIPolicy`. Tasks (tasks.py): `Task`, `builtin_tasks()`.
"""

from k3sys.rollout.engine import PAUSE_POLICIES, Episode, RolloutEngine, default_factory
from k3sys.rollout.policies import Action, Context, ModelPolicy, OpenAIPolicy, Policy, ScriptedPolicy
from k3sys.rollout.records import EpisodeRecord, TurnRecord
from k3sys.rollout.report import RolloutReport
from k3sys.rollout.tasks import Task, builtin_tasks
from k3sys.rollout.usage import UsageSampler

__all__ = [
    "PAUSE_POLICIES",
    "Action",
    "Context",
    "Episode",
    "EpisodeRecord",
    "ModelPolicy",
    "OpenAIPolicy",
    "Policy",
    "RolloutEngine",
    "RolloutReport",
    "ScriptedPolicy",
    "Task",
    "TurnRecord",
    "UsageSampler",
    "builtin_tasks",
    "default_factory",
]
