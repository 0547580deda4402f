"""The tests of E2B's Python SDK suite that cannot pass against a self-hosted k3sys service, each
with the reason (docs/sandbox_e2b.md lists them). Keys are test file paths relative to the suite's
`tests/` folder (the whole file) or full pytest node ids (one test); the first match wins."""

from __future__ import annotations

CANNOT_PASS: dict[str, str] = {}


def cannot_pass(nodeid: str) -> str:
    """Why the test `nodeid` cannot pass here; '' if it should."""
    path = nodeid.split("::")[0]
    rel = path.split("tests/", 1)[1] if "tests/" in path else path
    test = rel + nodeid[len(path):]
    for key in (test, test.split("[")[0], rel):
        if key in CANNOT_PASS:
            return CANNOT_PASS[key]
    return ""
