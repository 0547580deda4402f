"""The rollout engine runs on sandboxes: its tests use the sandbox tests' fixtures (the session's
runtime, embedded and over HTTP; the debian template; the leak check)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandbox"))  # sandbox_fixtures, service_process

from sandbox_fixtures import *  # noqa: E402, F403 (pytest finds the fixtures and the hook by name here)
