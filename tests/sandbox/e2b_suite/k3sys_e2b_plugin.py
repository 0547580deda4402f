"""A pytest plugin for E2B's own Python SDK tests run against k3sys (`make e2b-tests`, runner.py).

It skips the tests that cannot pass on a self-hosted service (k3sys_e2b_known.py says why, per test
or file; K3SYS_E2B_RUN_ALL=1 runs them too) and writes what happened to `$K3SYS_E2B_REPORT`:
results.json (each test's outcome and reason) and table.md (passed / failed / skipped per file).
No fixture of E2B's is replaced: their conftest.py runs as it is."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
from k3sys_e2b_known import cannot_pass

_results: dict[str, dict[str, str]] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("K3SYS_E2B_RUN_ALL") == "1":
        return
    for item in items:
        why = cannot_pass(item.nodeid)
        if why:
            item.add_marker(pytest.mark.skip(reason=f"cannot pass here: {why}"))


def _reason(report: pytest.TestReport) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple):  # a skip: (file, line, reason)
        return str(lr[2]).removeprefix("Skipped: ")
    crash = getattr(lr, "reprcrash", None)
    text = crash.message if crash is not None else str(lr or "")
    return " ".join(text.split())[:300]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    seen = _results.get(report.nodeid)
    # A test's outcome: its call's, unless a phase failed or skipped (the first such phase wins).
    if (report.when == "call" or report.failed or report.skipped) and (seen is None or seen["outcome"] == "passed"):
        outcome = "failed" if report.failed else "skipped" if report.skipped else "passed"
        _results[report.nodeid] = {"outcome": outcome, "reason": "" if report.passed else _reason(report),
                                   "when": report.when, "duration_s": f"{report.duration:.2f}"}


def table(results: dict[str, dict[str, str]]) -> str:
    """A markdown table: passed / failed / skipped per test file, and the totals."""
    per: dict[str, dict[str, int]] = defaultdict(lambda: {"passed": 0, "failed": 0, "skipped": 0})
    for nodeid, r in results.items():
        per[nodeid.split("::")[0]][r["outcome"]] += 1
    rows = ["| file | passed | failed | skipped |", "| --- | ---: | ---: | ---: |"]
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for f in sorted(per):
        c = per[f]
        rows.append(f"| {f} | {c['passed']} | {c['failed']} | {c['skipped']} |")
        for k in total:
            total[k] += c[k]
    rows.append(f"| **all {sum(total.values())}** | {total['passed']} | {total['failed']} | {total['skipped']} |")
    return "\n".join(rows) + "\n"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = Path(os.environ.get("K3SYS_E2B_REPORT", ".cache/e2b-report"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_results, indent=1, sort_keys=True))
    (out / "table.md").write_text(table(_results))
