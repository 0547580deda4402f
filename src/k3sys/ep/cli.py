"""`k3sys ep ...`: expert-parallel planning from the command line."""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Expert parallelism: plan redundant experts.")


@app.command("plan")
def plan_cmd(
    ranks: Annotated[int, typer.Option("--ranks", "-R", help="EP ranks.")] = 8,
    experts: Annotated[int, typer.Option("--experts", "-E", help="Routed experts (>= R; any count).")] = 64,
    top_k: Annotated[int, typer.Option("--top-k", "-K", help="Experts per token.")] = 8,
    tokens: Annotated[int, typer.Option("--tokens", "-s", help="Tokens per rank.")] = 1024,
    maxvio: Annotated[float, typer.Option(help="Target imbalance max_e(T_e / mean T_e) - 1.")] = 2.0,
    strategy: Annotated[str, typer.Option(help="device (ours), match (exact host oracle) or greedy (MoonEP).")] = (
        "device"),
    tolerance: Annotated[float, typer.Option(help="Let ranks reach (1 + tolerance) * cap.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Routing seed.")] = 0,
) -> None:
    """Build a routing at the given imbalance, plan it, print each rank's slots and replicas."""
    from rich.console import Console
    from rich.table import Table

    from k3sys.ep import balancedness, make_routing, plan, tokens_per_expert
    from k3sys.ep import maxvio as maxvio_of

    try:
        tpe = tokens_per_expert(make_routing(ranks, tokens, experts, top_k, maxvio, seed=seed), experts)
        p = plan(tpe, top_k, strategy=strategy, tolerance=tolerance)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    greedy = plan(tpe, top_k, strategy="greedy")
    homes = p.homes
    home = homes.group_sum(tpe.sum(0))
    table = Table(title=f"Plan ({p.strategy}) for R={ranks}, E={experts}, K={top_k}, s={tokens}, "
                  f"realised maxvio {maxvio_of(tpe.sum(0)):.2f}")
    for col in ("rank", "home load", "cap", "slots", "sent away", "replicas (expert:pairs)"):
        table.add_column(col, justify="left" if col.startswith("replicas") else "right")
    for r in range(ranks):
        own = p.alloc[homes.start(r) : homes.start(r + 1)]
        sent = int((own.sum(1) - own[:, r]).sum())
        reps = [f"{e}:{int(p.alloc[e, r])}" for e in p.replicas[r].tolist() if e >= 0]
        table.add_row(str(r), str(int(home[r])), str(int(p.cap[r])), str(int(p.loads[r])), str(sent), " ".join(reps))
    console = Console()
    console.print(table)
    console.print(
        f"balancedness {balancedness(home):.3f} -> {balancedness(p.loads):.3f}; moved {p.moved_tokens:,} pairs "
        f"(lower bound {p.moved_lower_bound:,}, greedy {greedy.moved_tokens:,}); copies {p.num_copies} "
        f"(greedy {greedy.num_copies}); buffer rows {p.buffer_rows:,}"
    )
