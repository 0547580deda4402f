"""The `k3sys` command line: `demo` plus one sub-command group per design."""

from __future__ import annotations

from typing import Annotated

import typer

from k3sys.ep.cli import app as ep_app
from k3sys.fleet.cli import app as fleet_app
from k3sys.model.cli import memory
from k3sys.rollout.cli import rollout
from k3sys.sandbox.cli import app as sandbox_app

app = typer.Typer(no_args_is_help=True, add_completion=False, help="k3sys: Kimi K3's system designs, runnable.")
app.add_typer(ep_app, name="ep")
app.add_typer(sandbox_app, name="sandbox")
app.add_typer(fleet_app, name="fleet")


@app.callback()
def main() -> None:
    """k3sys: KDA, MoonEP-style expert parallelism and AgentENV-style sandboxes."""


@app.command()
def demo(part: Annotated[list[str] | None, typer.Option("--part", help="Run only these parts.")] = None) -> None:
    """Run the end-to-end tour on small embedded defaults and print the headline figures."""
    from k3sys.demo import run_demo

    run_demo(parts=part)


app.command()(memory)
app.command()(rollout)


if __name__ == "__main__":
    app()
