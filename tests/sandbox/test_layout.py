"""The sandbox package's shape (issue 12): three rooms with no import cycle, modules a reader takes in
one sitting, a remote client that loads none of the runtime, and a CLI and server that start without
torch or ray."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
K3SYS = SRC / "k3sys"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for f in K3SYS.rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """Every k3sys module `path` imports, at any depth of its code (lazy and TYPE_CHECKING imports
    count); `from package import submodule` counts the submodule, not the package."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
            out |= subs
            if node.module in mods and len(subs) < len(node.names):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names} & mods.keys()
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (modules in import order), or [] if there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    mods = _modules()
    graph = {m: _imports(f, mods) for m, f in mods.items()}
    assert _cycle(graph) == []


def test_rooms_depend_one_way():
    # The SDK never imports the service or the runtime (the embedded runtime is opened by name, lazily,
    # in connection.default_runtime); the runtime never imports the SDK or the service.
    mods = _modules()
    for m, f in mods.items():
        deps = _imports(f, mods)
        if m.startswith("k3sys.sandbox.sdk"):
            assert not {d for d in deps if d.startswith("k3sys.sandbox.service")}, m
            assert {d for d in deps if d.startswith("k3sys.sandbox.runtime")} <= {"k3sys.sandbox.runtime.runtime"}, m
        if m.startswith("k3sys.sandbox.runtime"):
            assert not {d for d in deps if d.startswith(("k3sys.sandbox.sdk", "k3sys.sandbox.service"))}, m


def test_modules_fit_in_one_sitting():
    # A longer module must say why at its top ("Over 400 lines: ...").
    long = {str(f.relative_to(SRC)): n for f in (K3SYS / "sandbox").rglob("*.py")
            if (n := len(f.read_text().splitlines())) > MAX_LINES and "Over 400 lines" not in f.read_text()[:3000]}
    assert long == {}


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_remote_client_loads_neither_the_runtime_nor_torch_numpy_blake3():
    heavy = ("torch", "numpy", "blake3", "k3sys.sandbox.runtime.runtime", "k3sys.sandbox.runtime.store")
    out = _run(f"import sys, k3sys.sandbox.sdk.client, k3sys.sandbox; from k3sys.sandbox import Sandbox, AsyncSandbox\n"
               f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    assert out == "[]"


# Imports the modules with torch and ray unimportable (a meta-path finder refusing them), as on a
# `k3sys[sandbox]` node, and prints which of the heavy packages got loaded; after a "--", runs the
# `k3sys` command line with the remaining words instead.
_BLOCKED = """
import importlib, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "ray"):
            raise ImportError(name + " is blocked in this test")
sys.meta_path.insert(0, Refuse())
args = sys.argv[1:]
if "--" in args:
    from k3sys.cli import app
    app(args[args.index("--") + 1:], prog_name="k3sys")
for m in args:
    importlib.import_module(m)
print(sorted(m for m in ("torch", "ray", "triton", "matplotlib", "safetensors") if m in sys.modules))
"""


def _blocked(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCKED, *args], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "COLUMNS": "200"})


@pytest.mark.parametrize("module", ["k3sys.cli", "k3sys.sandbox.cli", "k3sys.sandbox.service.server",
                                    "k3sys.sandbox.runtime.runtime", "k3sys.fleet.cli"])
def test_sandbox_cli_server_and_runtime_start_without_torch_or_ray(module):
    r = _blocked(module, "k3sys.sandbox")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("args", [["--help"], ["sandbox", "--help"], ["sandbox", "keys", "--help"],
                                  ["fleet", "--help"]])
def test_the_command_line_starts_without_torch_or_ray(args):
    r = _blocked("--", *args)
    assert r.returncode == 0, r.stderr
    assert "Usage: k3sys" in r.stdout and "Traceback" not in r.stdout + r.stderr


def test_the_fleet_without_ray_is_one_line():
    r = _blocked("--", "fleet", "nodes")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip() == "error: the fleet needs ray, which is not installed: pip install 'k3sys[fleet]'"


@pytest.mark.parametrize("module", ["k3sys.kda", "ray"])
def test_the_blocker_blocks(module):
    r = _blocked(module)
    assert r.returncode != 0 and "is blocked in this test" in r.stderr
