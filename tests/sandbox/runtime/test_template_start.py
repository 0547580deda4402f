"""A template's start command (template.json `start_cmd`, `ready_cmd`; runtime/startup.py): create
returns once the ready check passes, and fails with TemplateStartError, its sandbox killed, when the
start command exits first or the check never passes. On busybox, with the template's fields
replaced (the start path reads them through `startup.template_start`)."""

from __future__ import annotations

import pytest

from k3sys.sandbox import Sandbox
from k3sys.sandbox.errors import TemplateStartError
from k3sys.sandbox.runtime import startup

pytestmark = [pytest.mark.embedded, pytest.mark.timeout(180)]


def _with_start(monkeypatch, start: str, ready: str | None) -> None:
    monkeypatch.setattr(startup, "template_start", lambda name: (start, ready) if name == "busybox" else None)


def test_create_waits_for_the_ready_check(rt, monkeypatch):
    # The start command makes the file the ready check looks for only after a while.
    _with_start(monkeypatch, "sleep 0.3; touch /tmp/up; sleep 1000", "test -e /tmp/up")
    with Sandbox.create(runtime=rt, memory_mb=128) as sbx:
        assert sbx.files.exists("/tmp/up")
        assert any("sleep 1000" in p.cmd for p in sbx.commands.list())


def test_a_start_command_that_exits_fails_the_create_with_its_output(rt, monkeypatch):
    _with_start(monkeypatch, "echo no config >&2; exit 3", "false")
    before = {i.id for i in rt.list()}
    with pytest.raises(TemplateStartError, match="exited before 'false' passed.*no config"):
        Sandbox.create(runtime=rt, memory_mb=128)
    assert {i.id for i in rt.list()} == before  # the half-started sandbox is gone


def test_a_ready_check_that_never_passes_is_bounded(rt, monkeypatch):
    _with_start(monkeypatch, "sleep 1000", "false")
    monkeypatch.setattr(startup, "READY_TIMEOUT_S", 1.0)
    before = {i.id for i in rt.list()}
    with pytest.raises(TemplateStartError, match="did not pass within"):
        Sandbox.create(runtime=rt, memory_mb=128)
    assert {i.id for i in rt.list()} == before
