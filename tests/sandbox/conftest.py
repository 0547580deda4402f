"""The sandbox tests' fixtures (sandbox_fixtures.py), for tests/sandbox/ and its sdk/, service/,
runtime/ and store/ folders."""

from sandbox_fixtures import (  # noqa: F401 (fixtures and a hook: pytest finds them by name here)
    _remember_sandboxes,
    debian,
    leak_check,
    private_root,
    pytest_generate_tests,
    rt,
    runtime_dir,
    sbx,
    service,
)
