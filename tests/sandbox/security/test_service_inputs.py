"""A tenant's inputs that made the service misbehave (issue 30, item 9), against a real service on
127.0.0.1 with two tenants: `GET /files` of a file the user may not read (answered 200, then the
connection cut, a traceback in the log), and metadata / envVars at their old bounds (4 MiB each per
sandbox, so that a list of 16 sandboxes was 64 MiB and 8 concurrent lists took the server to ~1 GB).
Each checks the other tenant's sandbox works on and nothing of the attacker's is left."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException
from service_process import ServiceProcess

from k3sys.sandbox import SandboxSpec
from k3sys.sandbox.service.e2b_models import MAX_ATTRS_BYTES, PAGE_MAX
from k3sys.sandbox.service.tenants import Quota, Tenants

pytestmark = pytest.mark.timeout(300)
ADMIN_KEY = "admin-key-for-service-inputs-0123456789"


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    """The service, the attacker's connection options for the e2b SDK (`svc.e2b`) and a bystander
    sandbox of another tenant (`svc.bystander`, its client `svc.bob`)."""
    from sandbox_fixtures import MISSING, leftovers

    if MISSING:
        pytest.skip(f"sandbox runtime unavailable: {MISSING}")
    data = tmp_path_factory.mktemp("service-inputs") / "svc"
    with Tenants(data) as tenants:
        mallory, bob = tenants.add_key("mallory", Quota(sandboxes=24)), tenants.add_key("bob")
    with ServiceProcess(data, env={"K3SYS_API_KEY": ADMIN_KEY}) as s, s.client(bob) as s.bob:
        s.mallory = mallory
        s.e2b = {"api_url": s.url, "sandbox_url": s.url, "api_key": mallory}
        s.bystander = s.bob.create(SandboxSpec(memory_mb=64))
        yield s
        ids = s.kill_all()  # the admin's key: every tenant's
    assert leftovers(data, ids) == []


def _bystander_works(svc) -> None:
    cid = svc.bob.start_command(svc.bystander.id, "echo alive")
    assert svc.bob.wait_command(cid).stdout == "alive\n"


def _mallory_left_nothing(svc) -> None:
    with svc.client(svc.mallory) as mallory:
        assert mallory.list() == []


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_unreadable_file_gets_403_before_the_body(svc, record_property):
    record_property("attack", "GET /files of a file the user may not read")
    log_at = len(svc.log_tail(1 << 30))
    s = Sandbox.create("base", timeout=120, **svc.e2b)
    try:
        s.files.write("/tmp/secret", "only root", user="root")
        assert s.commands.run("chmod 600 /tmp/secret", user="root").exit_code == 0
        envd = {"e2b-sandbox-id": s.sandbox_id, "x-access-token": s._envd_access_token}
        with httpx.Client(base_url=svc.url, headers=envd, timeout=60) as c:
            for path in ("/etc/shadow", "/tmp/secret"):
                r = c.get("/files", params={"path": path, "username": "user"})
                assert r.status_code == 403, (path, r.status_code, r.text[:200])
                assert r.headers["content-type"].startswith("application/json")
                body = r.json()
                assert body["code"] == 403 and path in body["message"], body
            assert c.get("/files", params={"path": "/etc/shadow", "username": "root"}).status_code == 200
        with pytest.raises(SandboxException, match="ermission"):  # an answer, not a cut connection
            s.files.read("/tmp/secret", user="user")
        assert s.files.read("/tmp/secret", user="root") == "only root"
    finally:
        s.kill()
    log = svc.log_tail(1 << 30)[log_at:]
    assert "Traceback" not in log and "PermissionDeniedError" not in log, log[-2000:]
    _bystander_works(svc)
    _mallory_left_nothing(svc)
    record_property("figure", f"/etc/shadow and a 0600 root file as `user`: {r.status_code} "
                              f"{{code, message}} before any byte; no traceback in the log")


def test_metadata_and_env_over_the_bound_refused(svc, record_property):
    record_property("attack", "metadata + envVars of 8 MiB per sandbox")
    half = {f"k{i}": "v" * 16000 for i in range(3)}  # 48 KB each: under the old bound, over the new one together
    with httpx.Client(base_url=svc.url, headers={"x-api-key": svc.mallory}, timeout=60) as c:
        r = c.post("/sandboxes", json={"templateID": "busybox", "metadata": half, "envVars": half})
        if r.status_code == 201:
            c.delete(f"/sandboxes/{r.json()['sandboxID']}")
        assert r.status_code in (400, 422) and str(MAX_ATTRS_BYTES) in r.json()["message"], r.text[:300]
        assert r.json()["type"] == "invalid_argument"
    _bystander_works(svc)
    _mallory_left_nothing(svc)
    record_property("figure", f"96 KB of metadata + envVars: {r.status_code} naming the bound of "
                              f"{MAX_ATTRS_BYTES} bytes per sandbox")


def test_list_is_paged_and_server_memory_bounded(svc, record_property):
    record_property("attack", "8 concurrent lists of 16 sandboxes with max-size metadata")
    n, pages_of = 16, 5
    # As close to the bound as a create goes: 63 values of 1000 characters + their keys.
    meta = {f"m{i:02}": "x" * 1000 for i in range(MAX_ATTRS_BYTES // 1040)}
    made: list[Sandbox] = []
    try:
        for _ in range(n):
            made.append(Sandbox.create("busybox", timeout=300, metadata=meta, **svc.e2b))
        ids = {s.sandbox_id for s in made}
        with httpx.Client(base_url=svc.url, headers={"x-api-key": svc.mallory}, timeout=60) as c:
            assert c.get("/v2/sandboxes", params={"limit": PAGE_MAX + 1}).status_code in (400, 422)
            first = c.get("/v2/sandboxes", params={"limit": pages_of})
            assert len(first.json()) == pages_of and first.headers["x-next-token"]
        paginator, walked = Sandbox.list(limit=pages_of, **svc.e2b), []
        while paginator.has_next:
            walked.append([i.sandbox_id for i in paginator.next_items()])
        assert [len(p) for p in walked] == [5, 5, 5, 1] and {x for p in walked for x in p} == ids
        assert all(i.metadata == meta for i in Sandbox.list(**svc.e2b).next_items())

        def walk(_: int) -> int:
            with httpx.Client(base_url=svc.url, headers={"x-api-key": svc.mallory}, timeout=120) as c:
                got, token = 0, None
                for _ in range(20):  # 20 pages of 5: every sandbox, 5 times over
                    r = c.get("/v2/sandboxes", params={"limit": pages_of, **({"nextToken": token} if token else {})})
                    r.raise_for_status()
                    got += len(r.json())
                    if not (token := r.headers.get("x-next-token")):
                        token = None
                return got

        before = _rss_mb(svc.proc.pid)
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            counts = list(pool.map(walk, range(8)))
        took = time.monotonic() - t0
        after = _rss_mb(svc.proc.pid)
        assert counts == [5 * n] * 8
        assert after - before < 64, (before, after)
    finally:
        for s in made:
            s.kill()
    _bystander_works(svc)
    _mallory_left_nothing(svc)
    record_property("figure", f"{n} sandboxes x {MAX_ATTRS_BYTES >> 10} KiB: pages of {pages_of} (at most "
                              f"{PAGE_MAX}); 8 x 20 pages in {took:.1f} s, server RSS {before:.0f} -> {after:.0f} MB")
