"""`ConnectionConfig` resolves where SDK calls go, and the two HTTP backends are siblings that walk a
list's pages (no server: resolving a URL builds a client but sends nothing; lists go to a mock)."""

import asyncio

import httpx
import pytest

from k3sys.sandbox import AsyncHTTPBackend, ConnectionConfig, HTTPBackend, InvalidArgumentError, SandboxSpec
from k3sys.sandbox._wire import sandbox_json
from k3sys.sandbox.sdk.client import connect
from k3sys.sandbox.sdk.connection import Threaded
from k3sys.sandbox.types import SandboxInfo

URL = "http://127.0.0.1:9"


def test_backend_object_url_and_async_handle_resolve_to_a_blocking_backend():
    marker = object()
    assert ConnectionConfig(runtime=marker).backend() is marker
    remote = ConnectionConfig(api_url=URL, api_key="k").backend()
    assert isinstance(remote, HTTPBackend) and (remote.api_url, remote.api_key) == (URL, "k")
    assert ConnectionConfig(api_url=URL, api_key="k").backend() is remote  # one pooled client per (url, key)
    assert ConnectionConfig(runtime=Threaded(marker)).backend() is marker


def test_async_backends_are_per_event_loop_and_know_their_blocking_twin():
    async def resolve(runtime):
        return ConnectionConfig(runtime=runtime).async_backend()

    sync = connect(URL, "k")
    a1, a2 = asyncio.run(resolve(sync)), asyncio.run(resolve(sync))
    assert isinstance(a1, AsyncHTTPBackend) and a1 is not a2  # a client must stay on its own loop
    assert (a1.api_url, a1.api_key) == (URL, "k") and a1.sync is sync
    marker = object()
    threaded = asyncio.run(resolve(marker))
    assert isinstance(threaded, Threaded) and threaded.sync is marker
    assert asyncio.run(resolve(threaded)) is threaded


def test_sync_and_async_http_backends_are_siblings():
    # Neither inherits the other's methods: an async backend has no blocking call that would
    # silently return a coroutine, a sync one no coroutine method.
    assert not issubclass(AsyncHTTPBackend, HTTPBackend) and not issubclass(HTTPBackend, AsyncHTTPBackend)
    assert not hasattr(AsyncHTTPBackend, "close") and not hasattr(AsyncHTTPBackend, "__enter__")
    assert not hasattr(HTTPBackend, "aclose") and not hasattr(HTTPBackend, "__aenter__")


def test_bad_url_is_rejected_naming_it():
    with pytest.raises(InvalidArgumentError, match="api_url.*'ftp://x'"):
        ConnectionConfig(api_url="ftp://x").backend()


def _paging_service(ids: list[str], page: int) -> httpx.MockTransport:
    """A service that lists sandboxes `ids` `page` at a time (its token: the index to go on from)."""

    def answer(request: httpx.Request) -> httpx.Response:
        start = int(request.url.params.get("nextToken", 0))
        end = start + page
        infos = [SandboxInfo(i, "running", SandboxSpec(), 1.0, None) for i in ids[start:end]]
        headers = {"x-next-token": str(end)} if end < len(ids) else {}
        return httpx.Response(200, json=[{"sandboxID": i.id, "k3sys": sandbox_json(i)} for i in infos],
                              headers=headers)

    return httpx.MockTransport(answer)


def test_lists_walk_every_page():
    ids = [f"sbx-{i}" for i in range(7)]

    class Sync(HTTPBackend):
        def _client(self, **kw):
            return httpx.Client(transport=_paging_service(ids, 3), **kw)

    class Async(AsyncHTTPBackend):
        def _client(self, **kw):
            return httpx.AsyncClient(transport=_paging_service(ids, 3), **kw)

    with Sync(URL, "k") as sync:
        assert [i.id for i in sync.list()] == ids
    assert [i.id for i in asyncio.run(Async(URL, "k").list())] == ids
