import subprocess
import sys

import k3sys


def test_version_is_set():
    assert k3sys.__version__.count(".") == 2


def test_cli_lists_demo():
    out = subprocess.run([sys.executable, "-m", "k3sys.cli", "--help"], capture_output=True, text=True, check=True)
    assert "demo" in out.stdout
