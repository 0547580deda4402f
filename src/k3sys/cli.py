"""The `k3sys` command line: `demo` plus one sub-command group per design.

Each sub-command's module is imported only when that sub-command runs (`LazyGroup`): a
`k3sys[sandbox]` node has neither torch nor ray, and `k3sys --help` or `k3sys sandbox ...` must not
import the designs that need them (tests/sandbox/test_layout.py blocks both).
"""

from __future__ import annotations

from importlib import import_module
from typing import Annotated, Any

import click
import typer
from typer.core import TyperGroup

from k3sys.demo import PARTS, run_demo  # rich only: the parts are imported as they run

# name -> ("module:attribute", the one-line help `k3sys --help` lists without importing the module).
# The attribute is a Typer app (a group) or a command function; tests/test_cli.py checks that each
# line matches the help of the command it stands for.
LAZY: dict[str, tuple[str, str]] = {
    "ep": ("k3sys.ep.cli:app", "Expert parallelism: plan redundant experts."),
    "sandbox": ("k3sys.sandbox.cli:app", "Agent sandboxes: create, exec, cp, pause, resume, hibernate, "
                                         "checkpoint, fork, restore, kill; `serve` runs the HTTP service."),
    "fleet": ("k3sys.fleet.cli:app", "Sandboxes over many machines on Ray (needs k3sys\\[fleet])."),
    "memory": ("k3sys.model.cli:memory", "Decode-cache bytes by layer kind (KDA state vs MLA latent KV) "
                                         "beside all-MLA and all-MHA models."),
    "rollout": ("k3sys.rollout.cli:rollout", "Agent-RL rollout: the policy thinks while sandboxes are paused or "
                                             "hibernated; CPU and memory held by sandboxes are read from their "
                                             "cgroups, beside the same run with no pausing."),
}


def load(name: str) -> click.Command:
    """The click command of lazy sub-command `name`, its module imported now."""
    module, _, attr = LAZY[name][0].partition(":")
    obj: Any = getattr(import_module(module), attr)
    if isinstance(obj, typer.Typer):  # a group, even with one command (`k3sys ep plan`)
        cmd: click.Command = typer.main.get_group(obj)
    else:  # a command function: a one-command app is that command
        single = typer.Typer(add_completion=False)
        single.command(name)(obj)
        cmd = typer.main.get_command(single)
    cmd.name = name
    return cmd


class LazyGroup(TyperGroup):
    """A group listing the `LAZY` sub-commands by their help line and importing one only to run it
    (or to show its own help)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in LAZY:  # what listings and completion see: the name and its help line
            return click.Command(cmd_name, help=LAZY[cmd_name][1])
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None,
                                                                            list[str]]:
        name, cmd, rest = super().resolve_command(ctx, args)
        return name, load(name) if name in LAZY else cmd, rest


app = typer.Typer(cls=LazyGroup, no_args_is_help=True, add_completion=False,
                  help="k3sys: Kimi K3's system designs, runnable.")


@app.callback()
def main() -> None:
    """k3sys: KDA, MoonEP-style expert parallelism and AgentENV-style sandboxes."""


@app.command()
def demo(part: Annotated[list[str] | None, typer.Option(
        "--part", help=f"Run only these parts: {', '.join(name for name, _ in PARTS)}.")] = None) -> None:
    """Run the end-to-end tour on small embedded defaults and print the headline figures."""
    names = {name.lower() for name, _ in PARTS}
    if unknown := [p for p in part or [] if p.lower() not in names]:
        typer.echo(f"error: no demo part {', '.join(map(repr, unknown))}; the parts are "
                   f"{', '.join(name for name, _ in PARTS)}", err=True)
        raise typer.Exit(2)
    run_demo(parts=part)


if __name__ == "__main__":
    app()
