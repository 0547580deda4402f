"""The `warm` section of bench/templates.py (run it there: `--sections warm`).

- `bench_warm`: create-to-ready of a warm template (runtime/warm.py) against a cold start of the same
  command. The template serves HTTP (`python3 -m http.server 8000` on the `debian` template's
  files); ready = the first HTTP answer to a request made inside the sandbox (bash's /dev/tcp, a
  real GET, ~2 ms of shell: no interpreter start in the measurement). Per run, medians over
  `--repeats`: *warm*: `create` (a restore of the template's checkpoint) then one request, which
  must be answered at once; *cold*: `create` of the same files without a start command, the start
  command run in the background, and the request tried every 5 ms until answered; *floor*: a cold
  create of the same files with no server at all. Also the warm checkpoint's build (the first
  create) and the runtime's phases of a warm create. Target: warm create <= 100 ms here, ready included.

Needs root, runc and our CRIU (scripts/install-sandbox.sh) and the `debian` template (built on first use).
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
import uuid
from collections.abc import Callable

from k3sys.sandbox import Runtime, SandboxSpec
from k3sys.sandbox.runtime.system import system_paths
from k3sys.sandbox.runtime.templates import template_rootfs

SERVER = "mkdir -p /srv/www && cd /srv/www && echo served > index.html && exec python3 -m http.server 8000"
# One HTTP GET from inside the sandbox: exits 0 once the server answers.
REQUEST = ("bash -c 'exec 3<>/dev/tcp/127.0.0.1/8000 && printf \"GET / HTTP/1.0\\r\\n\\r\\n\" >&3 && "
           "head -1 <&3 | grep -q \"200 OK\"'")


def _template(name: str, start: str | None) -> str:
    """A template `name` in the system dir on the debian template's files; `start`: its start command."""
    d = system_paths().templates / name
    d.mkdir()
    (d / "rootfs").symlink_to(template_rootfs("debian"))
    meta = {"name": name, "built": time.time(), **({"start_cmd": start, "ready_cmd": REQUEST} if start else {})}
    (d / "template.json").write_text(json.dumps(meta))
    return name


def _ms(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def _summary(runs: list[float]) -> dict[str, object]:
    return {"median_ms": round(statistics.median(runs), 1), "min_ms": round(min(runs), 1),
            "runs_ms": [round(r, 1) for r in runs]}


def bench_warm(rt: Runtime, repeats: int) -> dict[str, object]:
    """The `warm` section (see the module docstring)."""
    tag = uuid.uuid4().hex[:6]
    warm, cold = _template(f"bench-warm-{tag}", SERVER), _template(f"bench-cold-{tag}", None)
    spec = {"memory_mb": 256}
    try:
        build_ms, info = _ms(lambda: rt.create(SandboxSpec(template=warm, **spec)))
        rt.kill(info.id)
        runs: dict[str, list[float]] = {k: [] for k in ("warm_create", "warm_ready", "cold_create", "cold_ready",
                                                        "floor_create")}
        phases: list[dict[str, float]] = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            sid = rt.create(SandboxSpec(template=warm, **spec)).id
            t1 = time.perf_counter()
            first = rt.run(sid, REQUEST, timeout=30)
            t2 = time.perf_counter()
            assert first.exit_code == 0, f"warm: the first request was not answered: {first}"
            runs["warm_create"].append((t1 - t0) * 1e3)
            runs["warm_ready"].append((t2 - t0) * 1e3)
            phases.append({k: v * 1e3 for k, v in rt.timings(sid).items()})
            rt.kill(sid)

            t0 = time.perf_counter()
            sid = rt.create(SandboxSpec(template=cold, **spec)).id
            t1 = time.perf_counter()
            rt.start_command(sid, SERVER)
            while rt.run(sid, REQUEST, timeout=30).exit_code != 0:
                time.sleep(0.005)
            t2 = time.perf_counter()
            runs["cold_create"].append((t1 - t0) * 1e3)
            runs["cold_ready"].append((t2 - t0) * 1e3)
            rt.kill(sid)

            ms, info = _ms(lambda: rt.create(SandboxSpec(template=cold, **spec)))
            runs["floor_create"].append(ms)
            rt.kill(info.id)
        keys = sorted({k for p in phases for k in p})
        out: dict[str, object] = {k: _summary(v) for k, v in runs.items()}
        out["warm_build_ms"] = round(build_ms, 1)
        out["warm_phases_median_ms"] = {k: round(statistics.median(p[k] for p in phases if k in p), 2) for k in keys}
        out["ready_speedup"] = round(statistics.median(runs["cold_ready"]) / statistics.median(runs["warm_ready"]), 1)
        out["target_ms"] = 100
        return out
    finally:
        for name in (warm, cold):
            shutil.rmtree(system_paths().templates / name, ignore_errors=True)

