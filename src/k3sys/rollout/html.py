"""The rollout's HTML report: one self-contained file, plots inlined as PNG (matplotlib, no pyplot,
so no GUI backend is touched).

It renders anything shaped like a `RolloutReport` (`Report` below) and never imports report.py:
`RolloutReport.to_html` imports this module, so the dependency runs one way."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from k3sys.rollout.records import STATES, EpisodeRecord

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class Report(Protocol):
    """What the HTML report reads of a `RolloutReport`."""

    pause_policy: str
    max_live: int | None
    episodes: list[EpisodeRecord]
    mem_totals: list[tuple[float, int]]
    baseline: Report | None

    @property
    def totals(self) -> dict[str, float]: ...

    def summary_rows(self) -> list[tuple[str, str, str, str]]: ...

COLORS = {
    "setup": "#4c72b0", "fork": "#8172b2", "act": "#2ca02c", "idle": "#b7e4a8", "pausing": "#f2b26b",
    "paused": "#dd8452", "hibernating": "#9e9e9e", "hibernated": "#dcdcdc", "resuming": "#c44e52",
    "queued": "#f7f7f7",
}


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def timeline_figure(report: Report, title: str) -> Figure:
    """One row per sandbox, coloured by its state over time."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    eps = report.episodes
    fig = Figure(figsize=(10, 0.9 + 0.32 * len(eps)))
    ax = fig.add_subplot()
    for row, e in enumerate(eps):
        for state in STATES:
            spans = [(t0, t1 - t0) for s, t0, t1 in e.intervals if s == state]
            if spans:
                ax.broken_barh(spans, (row - 0.4, 0.8), facecolors=COLORS[state], edgecolor="none")
    ax.set_yticks(range(len(eps)), [f"{e.id} {e.task}" for e in eps], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time since the run started (s)")
    ax.set_title(title)
    used = [s for s in STATES if any(i[0] == s for e in eps for i in e.intervals)]
    ax.legend(handles=[Patch(facecolor=COLORS[s], edgecolor="#888", label=s) for s in used], fontsize=7,
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / max(len(eps), 1)), ncol=len(used),
              frameon=False)
    return fig


def memory_figure(report: Report) -> Figure:
    """Memory held by all sandboxes over time, this run and (when there is one) its "none" baseline."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.2))
    ax = fig.add_subplot()
    runs = [(report, f"pause_policy={report.pause_policy}", "#dd8452")]
    if report.baseline is not None:
        runs.append((report.baseline, "pause_policy=none", "#4c72b0"))
    for r, label, color in runs:
        if r.mem_totals:
            t, b = zip(*r.mem_totals, strict=True)
            ax.step(t, [x / 1e6 for x in b], where="post", color=color,
                    label=f"{label}: {r.totals['mem_gb_s']:.3f} GB*s")
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("resident memory (MB)")
    ax.set_title("memory held by sandboxes (cgroup counters)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:3px 8px}
td.n{text-align:right}pre{white-space:pre-wrap;margin:0;font-size:12px}details{margin:0.3em 0}
summary{cursor:pointer}.err{color:#b00}"""


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _episode_html(e: EpisodeRecord) -> str:
    origin = f", forked from {e.parent} after turn {e.branched_at}" if e.parent else ""
    outcome = f'<span class="err">{html.escape(e.error)}</span>' if e.error else f"reward {e.reward:.2f}"
    rows = [[str(t.turn), f"{t.think_s * 1e3:.0f}", t.suspend, f"{t.resume_s * 1e3:.1f}", f"{t.action_s * 1e3:.0f}",
             str(t.exit_code), f"<pre>{html.escape(t.action)}</pre>",
             f"<pre>{html.escape(t.observation[-600:])}</pre>", f"<pre>{html.escape(t.text[:200])}</pre>"]
            for t in e.turns]
    table = _table(["turn", "think ms", "while thinking", "resume ms", "action ms", "exit", "action", "output",
                    "policy text"], rows)
    return (f"<details><summary>episode <b>{e.id}</b> ({html.escape(e.task)}{origin}): {outcome}, "
            f"sandbox {e.sandbox_id}</summary>{table}</details>")


def _episodes(report: Report, title: str) -> list[str]:
    rows = []
    for e in report.episodes:
        s = e.state_s()
        outcome = f'<span class="err">{html.escape(e.error)}</span>' if e.error else f"{e.reward:.2f}"
        rows.append([e.id, html.escape(e.task), f"{e.parent}@{e.branched_at}" if e.parent else "", str(len(e.turns)),
                     outcome, f"{e.wall_s:.2f}", f"{e.running_s:.2f}", f"{e.waiting_s:.2f}", f"{s['paused']:.2f}",
                     f"{s['hibernated']:.2f}", f"{e.cpu_s:.3f}", f"{e.mem_gb_s:.4f}", f"{e.peak_mem_bytes / 1e6:.1f}"])
    table = _table(["episode", "task", "from", "turns", "reward", "wall s", "running s", "waiting s", "paused s",
                    "hibernated s", "CPU s", "mem GB*s", "peak MB"], rows)
    return [f"<h2>{html.escape(title)}</h2>", table] + [_episode_html(e) for e in report.episodes]


def write_html(report: Report, path: Path) -> Path:
    t = report.totals
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>k3sys rollout report</title>"
             f"<style>{_CSS}</style></head><body><h1>k3sys rollout report</h1>",
             f"<p>pause_policy <b>{report.pause_policy}</b>, max_live {report.max_live or 'unlimited'}: "
             f"{t['episodes']:.0f} episodes, {t['turns']:.0f} turns, {t['forks']:.0f} forks. CPU and memory are read "
             "from each sandbox's cgroup counters; GB = 1e9 bytes.</p>"]
    header = ["figure", report.pause_policy] + (["none (same run)", "ratio"] if report.baseline else [])
    parts.append(_table(header, [[html.escape(c) for c in row[:len(header)]] for row in report.summary_rows()]))
    parts.append("<h2>Sandbox timelines</h2>")
    parts.append(_png(timeline_figure(report, f"pause_policy={report.pause_policy}")))
    parts.append("<h2>Memory held over time</h2>")
    parts.append(_png(memory_figure(report)))
    if report.baseline is not None:
        parts.append("<h2>Baseline timelines</h2>")
        parts.append(_png(timeline_figure(report.baseline, "pause_policy=none (same episodes)")))
    parts += _episodes(report, "Episodes")
    if report.baseline is not None:
        parts += _episodes(report.baseline, "Baseline episodes (pause_policy=none)")
    parts.append("</body></html>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(parts))
    return path
