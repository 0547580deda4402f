"""`files.read(format="stream")` streams: the file arrives in chunks as the backend reads it, never
held whole (E2B's iterator of bytes; async: an async iterator), embedded and served; a missing file
is refused by the call itself, before any chunk."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from k3sys.sandbox import AsyncSandbox, SandboxFileNotFoundError

pytestmark = pytest.mark.timeout(180)
SIZE = 24 << 20  # bytes: many 1 MiB chunks


def _make(sbx) -> str:
    """A SIZE-byte file of pseudo-random bytes inside the sandbox; its sha256."""
    sbx.commands.run(f"head -c {SIZE} /dev/urandom > /tmp/big")
    return sbx.commands.run("sha256sum /tmp/big").stdout.split()[0]


def test_stream_arrives_in_chunks(sbx):
    digest = _make(sbx)
    chunks = sbx.files.read("/tmp/big", format="stream")
    h, sizes = hashlib.sha256(), []
    for chunk in chunks:
        h.update(chunk)
        sizes.append(len(chunk))
    assert h.hexdigest() == digest and sum(sizes) == SIZE
    assert max(sizes) <= 1 << 20 and len(sizes) >= SIZE >> 20  # never one piece of the whole file
    with pytest.raises(SandboxFileNotFoundError):
        sbx.files.read("/tmp/none", format="stream")  # raised by the call, not on the first next()


def test_async_stream_arrives_in_chunks(sbx):
    digest = _make(sbx)

    async def main() -> None:
        a = await AsyncSandbox.connect(sbx.sandbox_id, runtime=sbx._rt)
        h, n = hashlib.sha256(), 0
        async for chunk in await a.files.read("/tmp/big", format="stream"):
            assert len(chunk) <= 1 << 20
            h.update(chunk)
            n += 1
        assert h.hexdigest() == digest and n >= SIZE >> 20
        with pytest.raises(SandboxFileNotFoundError):
            await a.files.read("/tmp/none", format="stream")
        partial = await a.files.read("/tmp/big", format="stream")
        assert len(await anext(partial)) > 0
        await partial.aclose()  # stopping early closes the stream
    asyncio.run(main())
