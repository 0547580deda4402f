import re
import subprocess
import sys
import tomllib
from pathlib import Path

import k3sys


def test_version_is_set():
    assert k3sys.__version__.count(".") == 2


def test_cli_lists_demo():
    out = subprocess.run([sys.executable, "-m", "k3sys.cli", "--help"], capture_output=True, text=True, check=True)
    assert "demo" in out.stdout


def _closure(extras: dict[str, list[str]], name: str) -> set[str]:
    """The distribution names an extra installs, its own `k3sys[...]` extras followed."""
    out: set[str] = set()
    for req in extras[name]:
        dist = re.split(r"[\[<>=! ;]", req, maxsplit=1)[0]
        if dist == "k3sys":
            for inner in re.search(r"\[(.*)\]", req).group(1).split(","):
                out |= _closure(extras, inner.strip())
        else:
            out.add(dist)
    return out


def test_extras_sandbox_without_torch_client_httpx_only_all_everything():
    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    assert meta["dependencies"] == []  # extras can only add: everything else is opt-in
    assert _closure(extras, "client") == {"httpx"}
    sandbox = _closure(extras, "sandbox")
    assert {"fastapi", "uvicorn", "blake3", "numpy", "typer", "httpx"} <= sandbox and "torch" not in sandbox
    assert sandbox | {"torch", "matplotlib", "safetensors"} <= _closure(extras, "all")
    assert _closure(extras, "all") <= _closure(extras, "dev")
