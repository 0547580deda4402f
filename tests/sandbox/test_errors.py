"""Bad input and operations in the wrong state raise typed errors that name the problem."""

from __future__ import annotations

import pytest

from k3sys.sandbox import (
    CheckpointNotFoundError,
    InvalidArgumentError,
    InvalidStateError,
    NotFoundError,
    Runtime,
    RuntimeLockedError,
    Sandbox,
    SandboxError,
    SandboxSpec,
    UnknownTemplateError,
    WrongFileTypeError,
)
from k3sys.sandbox.errors import error_from_code

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"memory_mb": -1}, r"memory_mb: .*got -1"),
        ({"memory_mb": 1.5}, r"memory_mb: expected an integer"),
        ({"cpu": 0}, r"cpu: .*got 0"),
        ({"cpu": float("nan")}, r"cpu: .*got nan"),
        ({"pids": -5}, r"pids: .*got -5"),
        ({"pids": True}, r"pids: .*got True"),
        ({"network": "yes"}, r"network: expected a bool, got 'yes'"),
        ({"timeout_s": -1}, r"timeout_s: .*got -1"),
        ({"template": ""}, r"template: "),
    ],
    ids=["memory-negative", "memory-float", "cpu-zero", "cpu-nan", "pids-negative", "pids-bool", "network-str",
         "timeout-negative", "template-empty"],
)
def test_bad_spec_is_rejected(kwargs, pattern):
    with pytest.raises(InvalidArgumentError, match=pattern) as e:
        SandboxSpec(**kwargs)
    assert isinstance(e.value, ValueError) and isinstance(e.value, SandboxError)


def test_unknown_template_names_it(rt):
    before = Sandbox.list(runtime=rt)
    known = r"\(known: base, busybox, code-interpreter-v1, debian"
    with pytest.raises(UnknownTemplateError, match=r"unknown template 'no-such-os' " + known):
        Sandbox.create("no-such-os", runtime=rt)
    with pytest.raises(UnknownTemplateError):
        Sandbox.create("../etc", runtime=rt)
    assert Sandbox.list(runtime=rt) == before


def test_bad_ids(rt, sbx):
    with pytest.raises(InvalidArgumentError, match=r"id: .*got 'Bad ID!'"):
        Sandbox.create(runtime=rt, id="Bad ID!")
    with pytest.raises(InvalidArgumentError, match="already exists"):
        Sandbox.create(runtime=rt, id=sbx.id)
    with pytest.raises(NotFoundError, match="no sandbox 'nope'"):
        Sandbox.get("nope", runtime=rt)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint 'ck-nope'"):
        Sandbox.restore("ck-nope", runtime=rt)
    with pytest.raises(NotFoundError):  # a checkpoint miss is also a plain NotFoundError
        Sandbox.restore("ck-nope", runtime=rt)


def test_bad_command_arguments(sbx):
    with pytest.raises(InvalidArgumentError, match="cmd: "):
        sbx.commands.run("")
    with pytest.raises(InvalidArgumentError, match="cwd: .*got 'relative'"):
        sbx.commands.run("true", cwd="relative")
    with pytest.raises(InvalidArgumentError, match="timeout: .*got -3"):
        sbx.commands.run("true", timeout=-3)
    with pytest.raises(InvalidArgumentError, match="env: "):
        sbx.commands.run("true", env={"A=B": "c"})
    with pytest.raises(InvalidArgumentError, match="path: "):
        sbx.files.read("")
    with pytest.raises(InvalidArgumentError, match="n: .*got 0"):
        sbx.fork(0)


def test_wrong_file_types(sbx):
    with pytest.raises(WrongFileTypeError, match="is a directory in the sandbox: '/etc'"):
        sbx.files.read("/etc")
    with pytest.raises(WrongFileTypeError, match="is a directory"):
        sbx.files.write("/etc", "x")
    with pytest.raises(WrongFileTypeError, match="not a directory"):
        sbx.files.list("/etc/passwd")
    with pytest.raises(WrongFileTypeError, match="not a regular file"):
        sbx.files.read("/dev/null")
    assert isinstance(WrongFileTypeError("x"), InvalidArgumentError)


def test_operations_in_the_wrong_state(sbx):
    with pytest.raises(InvalidStateError, match=r"cannot resume sandbox .*: it is running \(needs paused or hib"):
        sbx.resume()
    sbx.pause()
    with pytest.raises(InvalidStateError, match="cannot pause"):
        sbx.pause()
    sbx.resume()
    ck = sbx.hibernate()
    for op in (sbx.pause, sbx.checkpoint, sbx.hibernate, lambda: sbx.fork(1), lambda: sbx.files.list("/")):
        with pytest.raises(InvalidStateError, match="hibernated"):
            op()
    with pytest.raises(InvalidStateError, match="kill or resume it first"):
        ck.delete()
    sbx.resume()
    assert sbx.commands.run("echo alive").stdout == "alive\n"


@pytest.mark.embedded
def test_one_runtime_per_directory(runtime_dir, rt):
    with pytest.raises(RuntimeLockedError, match="in use"):
        Runtime(runtime_dir)


def test_error_codes_round_trip():
    for cls in (NotFoundError, InvalidStateError, UnknownTemplateError, CheckpointNotFoundError):
        e = error_from_code(cls.code, "msg")
        assert type(e) is cls and str(e) == "msg"
    assert type(error_from_code("made-up", "m")) is SandboxError
