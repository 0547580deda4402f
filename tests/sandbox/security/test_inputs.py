"""Oversized and malformed input against a real service on 127.0.0.1: a 100k-character file name (and
paths, ids, metadata, environment, nested JSON, Connect frames) gets a 4xx with a typed error, never a
500 (input that is merely large but valid, such as a 100k-character variable name, is served);
answers stay short however long the value they quote; the sandbox and the service work on after."""

from __future__ import annotations

import base64
import json
import socket

import httpx
import pytest
from service_process import ServiceProcess

from k3sys.sandbox.errors import MAX_MESSAGE

pytestmark = pytest.mark.timeout(240)
N = 100_000
LONG_PATH = "/tmp/" + "a" * N
URL_PATH = "/tmp/" + "a" * 30_000  # as long as a URL gets through httpx (the 100k one: see the raw test)
CONNECT_CODES = {"invalid_argument", "not_found", "failed_precondition", "out_of_range", "resource_exhausted",
                 "permission_denied", "unauthenticated", "already_exists"}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    with (ServiceProcess(tmp_path_factory.mktemp("inputs") / "svc") as s,
          httpx.Client(base_url=s.url, headers={"x-api-key": s.key}, timeout=60) as c):
        body = c.post("/sandboxes", json={"templateID": "busybox", "memoryMB": 64}).json()
        s.sid, token = body["sandboxID"], body["envdAccessToken"]
        s.envd = {"e2b-sandbox-id": s.sid, "x-access-token": token}
        yield s
        c.delete(f"/sandboxes/{s.sid}")


def framed(msg: dict) -> bytes:
    data = json.dumps(msg).encode()
    return b"\0" + len(data).to_bytes(4, "big") + data


def rpc(method: str, msg: dict | bytes) -> dict:
    body = msg if isinstance(msg, bytes) else json.dumps(msg).encode()
    return {"method": "POST", "url": f"/{method}", "content": body, "envd": True,
            "headers": {"content-type": "application/json"}}


def stream(method: str, msg: dict) -> dict:
    return {"method": "POST", "url": f"/{method}", "content": framed(msg), "envd": True,
            "headers": {"content-type": "application/connect+json"}}


START = "process.Process/Start"
SH = {"cmd": "/bin/sh", "args": ["-c", "echo hi"]}
CASES = {
    "stat-100k-path": rpc("filesystem.Filesystem/Stat", {"path": LONG_PATH}),
    "list-100k-path": rpc("filesystem.Filesystem/ListDir", {"path": LONG_PATH}),
    "mkdir-100k-path": rpc("filesystem.Filesystem/MakeDir", {"path": LONG_PATH}),
    "remove-100k-path": rpc("filesystem.Filesystem/Remove", {"path": LONG_PATH}),
    "move-to-100k-path": rpc("filesystem.Filesystem/Move", {"source": "/tmp", "destination": LONG_PATH}),
    "stat-nul": rpc("filesystem.Filesystem/Stat", {"path": "/tmp/a\0b"}),
    "stat-not-a-string": rpc("filesystem.Filesystem/Stat", {"path": 5}),
    "stat-not-json": rpc("filesystem.Filesystem/Stat", b"{nope"),
    "stat-nested-100k": rpc("filesystem.Filesystem/Stat", b"[" * N + b"]" * N),
    "listdir-huge-depth": rpc("filesystem.Filesystem/ListDir", {"path": "/", "depth": 10**12}),
    "start-100k-cwd": stream(START, {"process": {**SH, "cwd": LONG_PATH}}),
    "start-100k-env-name": stream(START, {"process": {**SH, "envs": {"A" * N: "b"}}}),
    "start-100k-cmd": stream(START, {"process": {"cmd": LONG_PATH, "args": []}}),
    "start-30k-user": {**stream(START, {"process": SH}), "headers": {
        "content-type": "application/connect+json",
        "authorization": "Basic " + base64.b64encode(b"u" * 30_000 + b":").decode()}},
    "start-3MB-args": stream(START, {"process": {"cmd": "/bin/sh", "args": ["x" * N] * 30}}),
    "start-env-nul": stream(START, {"process": {**SH, "envs": {"A": "b\0"}}}),
    "start-frame-length-lies": {"method": "POST", "url": f"/{START}", "envd": True, "content": b"\0\x7f\xff\xff\xff{}",
                                "headers": {"content-type": "application/connect+json"}},
    "files-get-30k-path": {"method": "GET", "url": "/files", "params": {"path": URL_PATH}, "envd": True},
    "files-post-30k-path": {"method": "POST", "url": "/files", "params": {"path": URL_PATH}, "envd": True,
                            "content": b"x", "headers": {"content-type": "application/octet-stream"}},
    "files-post-100k-filename": {"method": "POST", "url": "/files", "params": {"path": "/tmp/"}, "envd": True,
                                 "files": {"file": ("a" * N, b"x")}},
    "create-100k-metadata-key": {"method": "POST", "url": "/sandboxes",
                                 "json": {"templateID": "busybox", "metadata": {"k" * N: "v"}}},
    "create-100k-env-name": {"method": "POST", "url": "/sandboxes",
                             "json": {"templateID": "busybox", "envVars": {"K" * N: "v"}}},
    "create-100k-template": {"method": "POST", "url": "/sandboxes", "json": {"templateID": "t" * N}},
    "create-100k-id": {"method": "POST", "url": "/sandboxes", "json": {"templateID": "busybox", "sandboxID": "s" * N}},
    "create-nested-100k": {"method": "POST", "url": "/sandboxes", "content": b"[" * N + b"]" * N,
                           "headers": {"content-type": "application/json"}},
    "create-not-utf8": {"method": "POST", "url": "/sandboxes", "content": b"\xff\xfe{",
                        "headers": {"content-type": "application/json"}},
    "create-memory-string": {"method": "POST", "url": "/sandboxes", "json": {"templateID": "busybox", "memoryMB": "x"}},
    "get-30k-id": {"method": "GET", "url": "/sandboxes/" + "x" * 30_000},
    "snapshot-30k-id": {"method": "GET", "url": "/snapshots/" + "x" * 30_000},
    "delete-template-30k-id": {"method": "DELETE", "url": "/templates/" + "x" * 30_000},
    # E2B's template API (service/templates_api.py)
    "template-alias-30k": {"method": "GET", "url": "/templates/aliases/" + "x" * 30_000},
    "template-files-30k": {"method": "GET", "url": "/templates/" + "x" * 30_000 + "/files/" + "a" * 64},
    "template-upload-30k": {"method": "PUT", "url": "/templates/" + "x" * 30_000 + "/files/" + "a" * 64,
                            "content": b"x"},
    "template-build-30k": {"method": "POST", "url": "/v2/templates/" + "x" * 30_000 + "/builds/b", "json": {}},
    "template-status-30k": {"method": "GET", "url": "/templates/x/builds/" + "x" * 30_000 + "/status"},
    "template-new-30k-name": {"method": "POST", "url": "/v3/templates", "json": {"name": "x" * 30_000}},
    "list-30k-metadata-filter": {"method": "GET", "url": "/sandboxes", "params": {"metadata": "k=" + "v" * 30_000}},
    "list-bad-page-token": {"method": "GET", "url": "/sandboxes", "params": {"nextToken": "!" * 10_000}},
    "timeout-1e300": {"method": "POST", "url": "/sandboxes/{sid}/timeout", "json": {"timeout": 1e300}},
    "envd-30k-sandbox-id": {"method": "POST", "url": "/filesystem.Filesystem/Stat", "json": {"path": "/"},
                            "headers": {"e2b-sandbox-id": "z" * 30_000}},
}


def answer_type(r: httpx.Response) -> str:
    """Our error type (or the Connect code) of an error answer; "" if it has none."""
    if r.status_code < 400 and not r.headers.get("content-type", "").startswith("application/connect+json"):
        return "ok"
    if r.headers.get("content-type", "").startswith("application/connect+json"):
        # A stream answers 200 and carries its error in the end frame.
        data = r.content
        while len(data) >= 5:
            flags, n = data[0], int.from_bytes(data[1:5], "big")
            frame, data = data[5:5 + n], data[5 + n:]
            if flags & 2:
                end = json.loads(frame)
                return end.get("error", {}).get("code", "") if "error" in end else "ok"
        return ""
    body = r.json()
    return r.headers.get("k3sys-error-type") or str(body.get("type") or "")


@pytest.mark.parametrize("case", list(CASES))
def test_oversized_or_malformed_input_never_gets_a_500(svc, case, record_property):
    record_property("attack", "a 100k-character file name" if "100k" in case else "malformed or oversized input")
    spec = dict(CASES[case])
    envd = spec.pop("envd", False)
    headers = {"x-api-key": svc.key, **(svc.envd if envd else {}), **spec.pop("headers", {})}
    spec["url"] = spec["url"].format(sid=svc.sid)
    with httpx.Client(base_url=svc.url, timeout=60) as c:
        r = c.request(headers=headers, **spec)
        kind = answer_type(r)
        record_property("figure", f"{r.status_code} {kind}")
        if case == "envd-30k-sandbox-id":  # E2B's proxy answer for a sandbox that is not there
            assert r.status_code == 502 and "was not found" in r.text
        elif kind != "ok":  # an error: a 4xx (or a Connect stream's end frame) of a known type
            assert r.status_code < 500 and kind != "internal", r.text[:300]
            assert kind in CONNECT_CODES if r.status_code == 200 else r.status_code >= 400 and kind, r.content[:300]
        assert len(r.content) < 2 * MAX_MESSAGE + 1000  # the message quotes the value, shortened
        assert c.get("/health").status_code == 200
        assert c.post("/filesystem.Filesystem/Stat", headers={"x-api-key": svc.key, **svc.envd},
                      json={"path": "/tmp"}).status_code == 200  # the sandbox works on


def test_100k_file_name_in_the_url_gets_a_typed_431(svc, record_property):
    record_property("attack", "a 100k-character file name")
    with socket.create_connection(("127.0.0.1", svc.port), timeout=30) as s:
        s.sendall(f"GET /files?path={LONG_PATH} HTTP/1.1\r\nHost: x\r\ne2b-sandbox-id: {svc.sid}\r\n"
                  f"x-access-token: {svc.envd['x-access-token']}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 ") and json.loads(body)["type"] == "too_large"
    record_property("figure", f"GET /files?path=<{len(LONG_PATH)} characters>: 431 too_large")
