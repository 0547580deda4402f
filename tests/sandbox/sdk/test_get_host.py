"""`Sandbox.get_host(port)` of the k3sys SDK, embedded (a forwarder in this process) and over the
service (E2B's host form, which the service routes itself)."""

from __future__ import annotations

import httpx
import pytest
from waiting import wait_until


def test_get_host_reaches_a_port_inside(sbx):
    sbx.commands.run("mkdir -p /tmp/w && echo hello > /tmp/w/index.html && (busybox httpd -p 8000 -h /tmp/w &)")
    host = sbx.get_host(8000)
    if host.startswith("127.0.0.1:"):  # embedded: a forwarder of this process
        url, headers = f"http://{host}/index.html", {}
    else:  # remote: `8000-<id>.localhost:<service port>`, sent to the service's address
        assert host.startswith(f"8000-{sbx.id}.localhost:")
        url, headers = f"http://127.0.0.1:{host.rsplit(':', 1)[1]}/index.html", {"Host": host}

    def fetched() -> str:
        try:
            return httpx.get(url, headers=headers, timeout=30).text
        except httpx.TransportError:
            return ""

    assert wait_until(fetched, 30, "the page through get_host") == "hello\n"
    assert sbx.get_host(8000) == host  # one forwarder per sandbox and port
    with pytest.raises(ValueError, match="port"):
        sbx.get_host(0)
