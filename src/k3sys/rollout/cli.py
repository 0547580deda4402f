"""`k3sys rollout`: run agent episodes with sleeping sandboxes, print the tables, write the HTML report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress

POLICIES = ("scripted", "model", "openai")


def rollout(
    episodes: Annotated[int, typer.Option(min=1, help="Episodes run at once.")] = 8,
    turns: Annotated[int, typer.Option(min=0, help="Turns per episode.")] = 6,
    policy: Annotated[str, typer.Option(help=f"Policy: {', '.join(POLICIES)}.")] = "scripted",
    think_ms: Annotated[float, typer.Option(help="Scripted policy: mean think time per turn (ms).")] = 2000.0,
    distribution: Annotated[str, typer.Option(help="Scripted policy: fixed, uniform, exponential, lognormal.")]
    = "lognormal",
    pause_policy: Annotated[str, typer.Option(help="none, pause, hibernate or auto.")] = "pause",
    max_live: Annotated[int | None, typer.Option(min=1, help="Most sandboxes holding memory at once.")] = None,
    group: Annotated[int, typer.Option(min=1, help="Fork each episode into a group of this size.")] = 1,
    branch_at: Annotated[int, typer.Option(min=0, help="Turn after which a group forks.")] = 0,
    resident_mb: Annotated[int, typer.Option(min=0, help="Memory the agent service holds per sandbox (MiB).")] = 32,
    poll_ms: Annotated[int, typer.Option(min=0, help="Agent service poll period (ms); 0: it only sleeps.")] = 100,
    baseline: Annotated[bool, typer.Option(help="Also run the same episodes with pause_policy none.")] = True,
    new_tokens: Annotated[int, typer.Option(min=1, help="Model policy: tokens generated per turn.")] = 24,
    base_url: Annotated[str | None, typer.Option(help="OpenAI policy: endpoint base URL (.../v1).")] = None,
    model_name: Annotated[str, typer.Option("--model-name", help="OpenAI policy: model name.")] = "default",
    api_url: Annotated[str | None, typer.Option(help="Sandbox service to run on (key: K3SYS_API_KEY); default "
                                                     "K3SYS_API_URL, else embedded.")] = None,
    fleet: Annotated[str | None, typer.Option(help="Run on a sandbox fleet: its Ray cluster address (HOST:PORT "
                                                   "or auto); needs k3sys\\[fleet].")] = None,
    html: Annotated[Path, typer.Option(help="Where to write the HTML report.")] = Path("k3sys-rollout.html"),
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the report as JSON here.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of tasks and think times.")] = 0,
) -> None:
    """Agent-RL rollout: the policy thinks while sandboxes are paused or hibernated; CPU and memory
    held by sandboxes are read from their cgroups, beside the same run with no pausing."""
    import os

    from k3sys.rollout import (
        ModelPolicy,
        OpenAIPolicy,
        RolloutEngine,
        ScriptedPolicy,
        builtin_tasks,
        default_factory,
    )
    from k3sys.sandbox.errors import InvalidArgumentError
    from k3sys.sandbox.runtime.system import system_paths

    console = Console()
    api_url = api_url or os.environ.get("K3SYS_API_URL")
    missing = None if api_url or fleet else system_paths().missing()
    if missing:
        console.print(f"[red]sandboxes are unavailable here: {missing}[/red]")
        raise typer.Exit(2)
    try:
        if policy == "scripted":
            pol = ScriptedPolicy(think_ms, distribution, seed=seed)
        elif policy == "model":
            pol = ModelPolicy(new_tokens=new_tokens, seed=seed)
        elif policy == "openai":
            if base_url is None:
                raise InvalidArgumentError("--base-url is required with --policy openai")
            pol = OpenAIPolicy(base_url, model_name, api_key=os.environ.get("OPENAI_API_KEY"))
        else:
            raise InvalidArgumentError(f"policy must be one of {POLICIES}, got {policy!r}")
        if fleet:
            from k3sys.fleet.cli import connect

            connect(fleet)  # fails fast, naming the address, where Fleet's ray.init would retry for minutes
            from k3sys.fleet import Fleet

            factory = default_factory(runtime=Fleet(fleet))
        elif api_url:
            from k3sys.sandbox.sdk.client import connect

            factory = default_factory(runtime=connect(api_url))
        else:
            factory = default_factory()
        engine = RolloutEngine(pol, factory, pause_policy=pause_policy, max_live=max_live)
        tasks = builtin_tasks(seed, resident_mb, poll_ms)
        runs = 2 if baseline and pause_policy != "none" else 1
        total = runs * episodes * (turns + (group - 1) * max(turns - branch_at, 0))
        with Progress(console=console, transient=True) as progress:
            bar = progress.add_task(f"rollout ({pause_policy}{', then none' if baseline else ''})", total=total)
            report = engine.run(tasks, episodes, turns, group=group, branch_at=branch_at, seed=seed,
                                compare_none=baseline, on_turn=lambda *_: progress.advance(bar))
    except InvalidArgumentError as e:
        raise typer.BadParameter(str(e)) from e
    console.print(report.episode_table())
    console.print(report.summary_table())
    path = report.to_html(html)
    console.print(f"HTML report: [bold]{path.resolve()}[/bold]")
    if json_out is not None:
        json_out.write_text(json.dumps(report.to_json()))
    for ep, err in report.errors + (report.baseline.errors if report.baseline else []):
        console.print(f"[red]episode {ep} failed: {err}[/red]")
    if report.errors or (report.baseline and report.baseline.errors):
        raise typer.Exit(1)
