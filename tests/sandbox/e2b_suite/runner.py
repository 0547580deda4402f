"""`make e2b-tests E2B_TESTS=<folder>`: E2B's own Python SDK tests against a fresh `k3sys sandbox
serve` on 127.0.0.1.

<folder> is the `tests/` folder of E2B's `packages/python-sdk` (github e2b-dev/E2B; never vendored
into this repository), with `sync/`, `async/`, and their `pytest.ini` one level up. The runner
starts a service on a free port with a new runtime directory and a generated API key, points the
official SDK at it (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY; E2B_DEBUG stays unset, as it would
skip most tests), runs pytest with our plugin (k3sys_e2b_plugin.py), prints the per-file table,
then stops the service and kills every sandbox it left. Extra arguments go to pytest.

    python tests/sandbox/e2b_suite/runner.py <folder> [-k cmd] [--report DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DEPS = REPO / ".cache" / "e2b-pydeps"  # plugins E2B's suite needs that our venv lacks
NEEDS = {"pytest_asyncio": "pytest-asyncio>=1.3,<2"}  # E2B's conftest imports it


def _ensure_deps() -> None:
    """Install the pytest plugins E2B's suite needs into DEPS (not the venv), once."""
    missing = [spec for mod, spec in NEEDS.items() if not any(DEPS.glob(f"{mod}/__init__.py"))]
    if missing:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(DEPS), *missing],
                       check=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def service(home: Path, key: str, log: Path) -> Iterator[str]:
    """`k3sys sandbox serve` on a free port of 127.0.0.1; its URL. On exit: stopped, and every sandbox
    of its runtime directory killed."""
    port = _free_port()
    env = {**os.environ, "K3SYS_API_KEY": key, "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "k3sys.sandbox.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--data-dir", str(home)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the service exited with {proc.returncode}; see {log}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the service did not listen within 60 s; see {log}")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        # The sandboxes outlive their service (a restarted one adopts them): kill what the tests left.
        subprocess.run([sys.executable, "-c", "import sys; from k3sys.sandbox import Runtime\n"
                        "with Runtime(sys.argv[1]) as rt: rt.kill_all()", str(home)],
                       env={**os.environ, "PYTHONPATH": str(REPO / "src")}, check=False)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", type=Path, help="E2B's packages/python-sdk/tests folder")
    ap.add_argument("--report", type=Path, default=REPO / ".cache" / "e2b-report",
                    help="where results.json, table.md and the service's log go")
    args, pytest_args = ap.parse_known_args(argv)
    args.report = args.report.resolve()  # the plugin runs in the suite's folder
    tests = args.tests.resolve()
    ini = tests.parent / "pytest.ini"
    for need in (tests / "sync", tests / "async", tests / "conftest.py", ini):
        if not need.exists():
            raise SystemExit(f"E2B_TESTS={args.tests}: no {need}; fetch github e2b-dev/E2B and give its "
                             "packages/python-sdk/tests (with pytest.ini beside it)")
    if (tests.parent / "e2b").is_dir():  # pytest would import it (rootdir on sys.path), not the wheel
        raise SystemExit(f"{tests.parent / 'e2b'}: the SDK's source beside its tests would be tested instead of "
                         "the installed `e2b`; fetch only packages/python-sdk/tests and pytest.ini")
    _ensure_deps()
    args.report.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="k3sys-e2b-"))
    key = "e2b_" + secrets.token_hex(20)  # the shape of E2B's keys
    try:
        with service(home, key, args.report / "service.log") as url:
            env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
            env |= {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key,
                    "K3SYS_E2B_REPORT": str(args.report),
                    "PYTHONPATH": os.pathsep.join([str(HERE), str(DEPS)])}
            cmd = [sys.executable, "-m", "pytest", "-c", str(ini), "--rootdir", str(tests.parent),
                   "-p", "k3sys_e2b_plugin", "-p", "no:cacheprovider", "-q", "-rfEs",
                   str(tests / "sync"), str(tests / "async"), *pytest_args]
            rc = subprocess.run(cmd, env=env, cwd=tests.parent).returncode
    finally:
        shutil.rmtree(home, ignore_errors=True)
    table = args.report / "table.md"
    if table.exists():
        print(table.read_text())
        print(f"(per-test outcomes and reasons: {args.report / 'results.json'})")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
