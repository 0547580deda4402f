"""`base` like E2B's (runtime/base_template.py): pip and venv, node and npm, git, curl, wget, ps and
gcc work inside as `user`; pip and npm without network fail within seconds, naming the missing
network; with network they install from the registries the host reaches; and a template whose
recipe changed is rebuilt once by `templates.main`, a shared one's link removed, never followed."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from sandbox_fixtures import run_any

from k3sys.sandbox import Sandbox
from k3sys.sandbox.runtime import base_template, templates
from k3sys.sandbox.runtime.templates import template_rootfs

pytestmark = [pytest.mark.timeout(900), pytest.mark.embedded]  # first run: builds `debian` and `base` (minutes)


@pytest.fixture(scope="module")
def base(rt):
    return template_rootfs("base")


def test_base_recipe_is_current(base):
    meta = json.loads((base.parent / "template.json").read_text())
    assert meta["recipe"] == base_template.recipe_stamp() and not templates.stale("base"), \
        "base was built by an older recipe: run `python -m k3sys.sandbox.runtime.templates base` (make system)"


def test_tools_work_as_user(rt, base):
    with Sandbox.create("base", runtime=rt, memory_mb=1024) as s:
        r = s.commands.run(
            "set -e; id -un; cd ~; pwd; python3 -m venv v && v/bin/pip --version | cut -d' ' -f1; pip --version | "
            "cut -d' ' -f1; node -e 'console.log(6*7)'; npm --version >/dev/null && echo npm; git --version | "
            "cut -d' ' -f1; curl --version | cut -d' ' -f1 | head -1; wget --version | head -1 | cut -d' ' -f1-2; "
            "ps -o comm= -p $$; printf '#include <stdio.h>\\nint main(void){puts(\"compiled\");}' > h.c && "
            "gcc -o h h.c && ./h; make --version | head -1 | cut -d' ' -f1-2", timeout=120)
        assert r.stdout.split("\n")[:-1] == ["user", "/home/user", "pip", "pip", "42", "npm", "git", "curl",
                                             "GNU Wget", "sh", "compiled", "GNU Make"], r


def test_pip_and_npm_without_network_fail_naming_it(rt, base):
    with Sandbox.create("base", runtime=rt, memory_mb=1024, network=False) as s:
        for cmd, tool in (("pip install --no-cache-dir tomli-w", "pip"), ("cd ~ && npm install is-number", "npm")):
            t0 = time.monotonic()
            r = run_any(s, cmd, timeout=120)
            assert r.exit_code != 0, r
            assert f"k3sys: {tool} failed and this sandbox has no network" in r.stderr, r
            assert time.monotonic() - t0 < 60, "no network must fail in seconds, not after minutes of retries"


def _host_reaches(name: str) -> bool:
    try:
        socket.create_connection((name, 443), timeout=5).close()
        return True
    except OSError:
        return False


def test_pip_and_npm_with_network_install(rt, base):
    if not (_host_reaches("pypi.org") and _host_reaches("registry.npmjs.org")):
        pytest.skip("this host reaches neither PyPI nor the npm registry")
    with Sandbox.create("base", runtime=rt, memory_mb=1024, network=True) as s:
        r = s.commands.run("pip install --no-cache-dir tomli-w && "
                           "python3 -c 'import tomli_w; print(tomli_w.dumps({\"a\": 1}))'", timeout=300)
        assert r.stdout.endswith("a = 1\n\n"), r
        r = s.commands.run("mkdir -p ~/p && cd ~/p && npm install is-number >/dev/null && "
                           "node -e 'console.log(require(\"is-number\")(5))'", timeout=300)
        assert r.stdout == "true\n", r


@pytest.fixture
def fake_templates(tmp_path, monkeypatch):
    """A system dir of the test's own with a recipe `fake` whose stamp the test sets; the builds it ran."""
    monkeypatch.setenv("K3SYS_SYSTEM_DIR", str(tmp_path))
    stamp, builds = ["one"], []

    def build(rootfs: Path) -> dict[str, str]:
        builds.append(stamp[0])
        (rootfs / "marker").write_text(stamp[0])
        return {"recipe": stamp[0]}

    monkeypatch.setitem(templates.BUILDERS, "fake", build)
    monkeypatch.setitem(templates._STAMPS, "fake", lambda: stamp[0])
    return tmp_path / "templates", stamp, builds


def test_changed_recipe_rebuilds_once(fake_templates):
    root, stamp, builds = fake_templates
    assert (template_rootfs("fake") / "marker").read_text() == "one"
    templates.main(["fake"])
    assert builds == ["one"]  # current: nothing to do
    stamp[0] = "two"
    assert template_rootfs("fake") == root / "fake/rootfs" and builds == ["one"]  # a create never rebuilds
    templates.main(["fake"])
    templates.main(["fake"])
    assert builds == ["one", "two"] and (root / "fake/rootfs/marker").read_text() == "two"
    aside = [p for p in root.iterdir() if p.name.startswith(".fake.replaced-")]
    assert len(aside) == 1 and (aside[0] / "rootfs/marker").read_text() == "one"  # sandboxes may stand on it
    assert templates.template_names().count("fake") == 1


def test_rebuild_replaces_a_link_without_following_it(fake_templates, tmp_path):
    root, stamp, builds = fake_templates
    shared = tmp_path / "shared/fake"
    (shared / "rootfs").mkdir(parents=True)
    (shared / "template.json").write_text(json.dumps({"recipe": "old"}))
    root.mkdir(parents=True)
    (root / "fake").symlink_to(shared)
    templates.main(["fake"])
    assert builds == ["one"] and not (root / "fake").is_symlink()
    assert json.loads((shared / "template.json").read_text()) == {"recipe": "old"}  # the shared one untouched
