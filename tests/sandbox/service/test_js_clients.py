"""E2B's JS SDKs (npm `e2b` and `@e2b/code-interpreter`, pinned in tests/sandbox/js/package.json and
installed into .cache/js-clients by scripts/install-js-clients.sh; `K3SYS_JS_CLIENTS` names another
install) against the service, with E2B_DOMAIN=localhost:<port>: `getHost`'s URL parses (with 127.0.0.1
it did not) and reaches the port inside the sandbox; `runCode` answers and keeps the kernel's state.
Skipped where node or the install is missing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from service_process import ServiceProcess

REPO = Path(__file__).resolve().parents[3]
CLIENTS = Path(os.environ.get("K3SYS_JS_CLIENTS", REPO / ".cache" / "js-clients"))
ENTRY = CLIENTS / "node_modules" / "e2b" / "dist" / "index.mjs"
CI_ENTRY = CLIENTS / "node_modules" / "@e2b" / "code-interpreter" / "dist" / "index.mjs"
SCRIPT = REPO / "tests" / "sandbox" / "js" / "clients.mjs"

pytestmark = [pytest.mark.timeout(480),
              pytest.mark.skipif(not shutil.which("node") or not ENTRY.exists() or not CI_ENTRY.exists(),
                                 reason=f"node and E2B's JS SDKs (under {CLIENTS}) are needed")]


def test_js_get_host_and_run_code(tmp_path, service):  # `service` first: it skips where sandboxes cannot run
    with ServiceProcess(tmp_path / "data") as svc:
        env = {**os.environ, "E2B_API_URL": svc.url, "E2B_SANDBOX_URL": svc.url, "E2B_API_KEY": svc.key,
               "E2B_DOMAIN": f"localhost:{svc.port}", "E2B_JS_MODULE": ENTRY.as_uri(),
               "E2B_JS_CI_MODULE": CI_ENTRY.as_uri()}
        out = subprocess.run(["node", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=420)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["host"].startswith("8000-") and got["host"].endswith(f".localhost:{svc.port}")
        assert got["urlHost"] == got["host"] and got["body"] == "from js\n"
        assert got["stdout"] == ["js\n"] and got["text"] == "42", got
        svc.kill_all()
