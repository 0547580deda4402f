"""`k3sys demo`: the end-to-end tour, each design on small embedded defaults.

Each part is a module with `demo(progress) -> list[tuple[str, str]]`: it runs its design with a
Rich progress task and returns (figure, value) rows for the closing summary table. A row whose
figure is "report" names a file the part wrote; the tour ends by listing those paths.
"""

from __future__ import annotations

import importlib
import time

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# Order is the tour's order; each module owns its part.
PARTS: list[tuple[str, str]] = [
    ("KDA", "k3sys.kda.demo"),
    ("EP", "k3sys.ep.demo"),
    ("Model", "k3sys.model.demo"),
    ("Sandbox", "k3sys.sandbox.demo"),
    ("Rollout", "k3sys.rollout.demo"),
]


def run_demo(console: Console | None = None, parts: list[str] | None = None) -> list[tuple[str, str, str]]:
    """Run the tour (all parts, or those named in `parts`) and print a summary table.

    Returns the summary rows as (part, figure, value).
    """
    console = console or Console()
    wanted = {p.lower() for p in parts} if parts else None
    rows: list[tuple[str, str, str]] = []
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(), console=console,
    ) as progress:
        for name, module in PARTS:
            if wanted is not None and name.lower() not in wanted:
                continue
            t0 = time.perf_counter()
            figures = importlib.import_module(module).demo(progress)
            rows += [(name, fig, val) for fig, val in figures]
            rows.append((name, "part wall time", f"{time.perf_counter() - t0:.1f} s"))
    table = Table(title="k3sys demo: headline figures")
    for col in ("design", "figure", "value"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for name, fig, value in rows:
        if fig == "report":
            console.print(f"{name} report: [bold]{value}[/bold]")
    return rows
