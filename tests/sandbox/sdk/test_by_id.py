"""E2B's class-level forms: `Sandbox.kill(sandbox_id)`, `Sandbox.get_info(id)`, ... run the instance
method on a handle made from the id (by_id.py), sync and async, embedded and served; a handle as
the first argument is the instance call; anything else is refused by name."""

from __future__ import annotations

import asyncio

import pytest

from k3sys.sandbox import AsyncSandbox, NotFoundError, Sandbox

pytestmark = pytest.mark.timeout(180)


def test_class_calls_take_a_sandbox_id(rt):
    sbx = Sandbox.create(template="busybox", runtime=rt)
    sid = sbx.sandbox_id
    assert Sandbox.get_info(sid, runtime=rt).sandbox_id == sid
    Sandbox.set_timeout(sid, 600, runtime=rt)
    assert Sandbox.pause(sid, runtime=rt) is True
    assert Sandbox.get_info(sid, runtime=rt).state == "paused"
    back = Sandbox.connect(sid, runtime=rt)
    assert back == sbx and back.get_info().state == "running"
    assert sbx.connect() == sbx  # E2B's instance form of connect
    kids = Sandbox.fork(sid, count=1, runtime=rt)
    assert len(kids) == 1 and kids[0].commands.run("echo kid").stdout == "kid\n"
    assert Sandbox.kill(kids[0], runtime=rt) is True  # a handle first: the instance call
    snap = Sandbox.create_snapshot(sid, runtime=rt)
    assert snap.snapshot_id and snap.sandbox_id == sid
    snap.delete()
    assert Sandbox.kill(sid, runtime=rt) is True
    assert Sandbox.kill(sid, runtime=rt) is False  # E2B's answer for a gone sandbox
    with pytest.raises(NotFoundError):
        Sandbox.get_info(sid, runtime=rt)


def test_async_class_calls_take_a_sandbox_id(rt):
    async def main() -> None:
        sbx = await AsyncSandbox.create(template="busybox", runtime=rt)
        sid = sbx.sandbox_id
        assert (await AsyncSandbox.get_info(sid, runtime=rt)).sandbox_id == sid
        assert await AsyncSandbox.pause(sid, runtime=rt) is True
        assert await (await AsyncSandbox.connect(sid, runtime=rt)).commands.run("echo up") is not None
        assert await sbx.connect() == sbx
        assert await AsyncSandbox.kill(sid, runtime=rt) is True
        assert await AsyncSandbox.kill(sid, runtime=rt) is False
    asyncio.run(main())


def test_class_call_refuses_what_is_not_an_id(rt):
    with pytest.raises(TypeError, match=r"Sandbox.kill: the first argument is a sandbox id \(str\) or a Sandbox, "
                                        r"got int"):
        Sandbox.kill(3, runtime=rt)
