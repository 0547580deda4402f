"""`make e2b-js-tests E2B_JS=<folder>`: E2B's own JS SDK tests against a fresh `k3sys sandbox serve`
on 127.0.0.1.

<folder> is E2B's `packages/js-sdk` (github e2b-dev/E2B; never vendored into this repository): its
tests import the SDK's TypeScript source beside them (`../src`), so the SDK under test is that
folder's version. Its npm dependencies, with vitest, msw and dotenv of its devDependencies (not the
browser and Cloudflare runners), are installed once into `.cache/e2b-js-deps` and linked in as its
`node_modules`; `vitest.k3sys.mts` (E2B's vitest config less the browser and Cloudflare projects) is
copied in beside E2B's. The service is the Python runner's (runner.py: a free port, a new runtime
directory, a generated key, every sandbox killed at the end); the SDK finds it by the same
E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (`src/connectionConfig.ts`).

Two passes: the files that mock E2B's API with msw answer only at E2B's own URL
(`https://api.e2b.app`, tests/setup.ts `apiUrl`) and fail any other request, so they run second
without E2B_API_URL and E2B_SANDBOX_URL (no request leaves: msw refuses the unhandled); every other
file runs first, against the service. Prints the per-file table of both; vitest's JSON reports and
the service's log stay in the report folder. Extra arguments go to vitest (file filters,
`--testNamePattern=...`).

    python tests/sandbox/e2b_suite/js_runner.py <folder> [--report DIR] [vitest args...]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from runner import REPO, service

HERE = Path(__file__).resolve().parent
DEPS = REPO / ".cache" / "e2b-js-deps"
DEV = ("vitest", "msw", "dotenv", "@types/node", "error-stack-parser-es")  # what the node tests import
CONFIG = "vitest.k3sys.mts"


def _ensure_deps(sdk: Path) -> None:
    """The SDK's dependencies and DEV in DEPS (npm, once), linked as `sdk/node_modules`."""
    if not (DEPS / "node_modules" / ".bin" / "vitest").exists():
        pkg = json.loads((sdk / "package.json").read_text())
        dev = pkg.get("devDependencies", {})
        DEPS.mkdir(parents=True, exist_ok=True)
        (DEPS / "package.json").write_text(json.dumps({
            "name": "k3sys-e2b-js-deps", "private": True, "type": "module",
            "dependencies": {**pkg["dependencies"], **{k: dev[k] for k in DEV if k in dev}}}, indent=2))
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--ignore-scripts", "--no-package-lock"],
                       cwd=DEPS, check=True)
    link = sdk / "node_modules"
    if not link.exists():
        link.symlink_to(DEPS / "node_modules")


def table(report: dict, sdk: Path) -> str:
    """Passed, failed and skipped per file of vitest's JSON report, as a markdown table."""
    rows, total = [], Counter()
    for f in sorted(report["testResults"], key=lambda f: f["name"]):
        n = Counter("passed" if a["status"] == "passed" else "failed" if a["status"] == "failed" else "skipped"
                    for a in f["assertionResults"])
        if not f["assertionResults"] and f.get("status") == "failed":
            n["failed"] += 1  # the file itself failed (an import or a set-up error): counted as one failure
        total += n
        name = Path(f["name"]).relative_to(sdk / "tests")
        rows.append(f"| {name} | {n['passed']} | {n['failed']} | {n['skipped']} |")
    head = ["| file | passed | failed | skipped |", "| --- | ---: | ---: | ---: |"]
    foot = f"| **all {sum(total.values())}** | {total['passed']} | {total['failed']} | {total['skipped']} |"
    return "\n".join([*head, *rows, foot]) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sdk", type=Path, help="E2B's packages/js-sdk folder")
    ap.add_argument("--report", type=Path, default=REPO / ".cache" / "e2b-js-report",
                    help="where results.json, table.md and the service's log go")
    args, vitest_args = ap.parse_known_args(argv)
    sdk, report = args.sdk.resolve(), args.report.resolve()
    for need in (sdk / "src" / "index.ts", sdk / "tests" / "setup.ts", sdk / "package.json"):
        if not need.exists():
            raise SystemExit(f"E2B_JS={args.sdk}: no {need}; fetch github e2b-dev/E2B and give its packages/js-sdk")
    if not shutil.which("npm"):
        raise SystemExit("npm not found: E2B's JS tests need Node.js (>= 20.18) and npm")
    _ensure_deps(sdk)
    shutil.copyfile(HERE / CONFIG, sdk / CONFIG)
    report.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="k3sys-e2b-js-"))
    key = "e2b_" + secrets.token_hex(20)  # the shape of E2B's keys (the SDK checks it)
    mocked = sorted(str(f.relative_to(sdk)) for f in (sdk / "tests").rglob("*.test.ts") if "from 'msw" in f.read_text())
    filters = [a for a in vitest_args if not a.startswith("-")]
    mine = [f for f in mocked if not filters or any(x in f for x in filters)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    vitest = [str(sdk / "node_modules" / ".bin" / "vitest"), "run", "--config", CONFIG, "--passWithNoTests",
              "--reporter=default", "--reporter=json"]
    for old in report.glob("results-*.json"):
        old.unlink()
    try:
        with service(home, key, report / "service.log") as url:
            served = env | {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key,
                            "K3SYS_E2B_JS_EXCLUDE": ",".join(mocked)}
            rc = subprocess.run([*vitest, f"--outputFile.json={report / 'results-served.json'}", *vitest_args],
                                env=served, cwd=sdk).returncode
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if mine:
        opts = [a for a in vitest_args if a.startswith("-")]
        rc |= subprocess.run([*vitest, f"--outputFile.json={report / 'results-mocked.json'}", *opts, *mine],
                             env=env | {"E2B_API_KEY": key}, cwd=sdk).returncode
    runs = [json.loads(f.read_text()) for f in sorted(report.glob("results-*.json"))]
    if runs:
        (report / "table.md").write_text(md := table({"testResults": [f for r in runs for f in r["testResults"]]}, sdk))
        print(md)
        print(f"(per-test outcomes and messages: {report}/results-*.json)")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
