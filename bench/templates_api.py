"""The `api` section of bench/templates.py (run it there: `--sections api`).

- `bench_api`: one build through E2B's template API (the e2b SDK's `Template.build` against
  `k3sys sandbox serve`) against the same steps through the CLI (`k3sys sandbox template build`, a
  Dockerfile): bench/templates.py's DOCKERFILE (FROM busybox, COPY of a 10 MB context, a RUN writing
  10 MB and 100 files, WORKDIR, a RUN). Each build is cold (a fresh system directory: no layer
  cached), 512 MiB build sandboxes, the two interleaved per run; medians of `--runs`. The API's
  time is the SDK's call, from the build request to "ready": the context's upload (a gzip tar), the
  definition, the service's build worker (its RUN sandboxes with network, as E2B's builds), and the
  SDK's polling of the status every 0.2 s. The CLI's is the command's, its Python start and the
  opening and closing of its private runtime included. The service's start is not timed.

Needs root, runc and our CRIU (scripts/install-sandbox.sh).
"""

from __future__ import annotations

import os
import secrets
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import httpx

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _serve(data: Path, key: str) -> tuple[subprocess.Popen, str]:
    """`k3sys sandbox serve` on a free port of 127.0.0.1 (this process's K3SYS_SYSTEM_DIR); its URL once up."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "K3SYS_API_KEY": key, "PYTHONPATH": SRC}
    proc = subprocess.Popen([sys.executable, "-m", "k3sys.sandbox.cli", "serve", "--port", str(port),
                             "--data-dir", str(data)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the service did not come up")
        time.sleep(0.05)


def _api_build(work: Path, ctx: Path, run_data: str, r: int) -> float:
    from e2b import Template

    key = "bench-" + secrets.token_hex(16)
    proc, url = _serve(work / f"svc-{r}", key)
    try:
        t = (Template(file_context_path=str(ctx)).from_template("busybox").copy("ctx", "/ctx").run_cmd(run_data)
             .set_workdir("/app").run_cmd("echo one > /app/last"))
        t0 = time.perf_counter()
        Template.build(t, alias="api", memory_mb=512, api_key=key, api_url=url)
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(120)


def _cli_build(ctx: Path, dockerfile: str) -> float:
    (ctx / "Dockerfile").write_text(dockerfile)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "k3sys.sandbox.cli", "template", "build", "-t", "cli", "--memory-mb",
                    "512", str(ctx)], env={**os.environ, "PYTHONPATH": SRC}, check=True, capture_output=True)
    return time.perf_counter() - t0


def bench_api(work: Path, runs: int, ctx: Path, dockerfile: str, run_data: str,
              system_dir: Callable[[Path], AbstractContextManager[Path]]) -> dict:
    """Seconds of a cold build of the same steps through E2B's API and through the CLI (medians);
    `dockerfile` the CLI's, `run_data` its first RUN's command (the E2B template's run_cmd)."""
    rows: dict[str, list[float]] = {"api_cold_s": [], "cli_cold_s": []}
    for r in range(runs):
        with system_dir(work):
            rows["cli_cold_s"].append(_cli_build(ctx, dockerfile))
        with system_dir(work):
            rows["api_cold_s"].append(_api_build(work, ctx, run_data, r))
    out = {k: round(statistics.median(v), 3) for k, v in rows.items()}
    out["api_over_cli"] = round(out["api_cold_s"] / out["cli_cold_s"], 2)
    return out
