"""Tenants against a real service on 127.0.0.1: keys made by `k3sys sandbox keys` and stored hashed,
two tenants that cannot see, reach or kill each other's sandboxes and checkpoints (another tenant's
id answers exactly as an unknown one), ownership kept across a restart and inherited by fork children
and restores, and per-tenant quotas refused with 429 `quota_exceeded` naming the quota."""

from __future__ import annotations

import time

import httpx
import pytest
from service_process import ServiceProcess, add_key, keys_cli

from k3sys.sandbox import HTTPBackend, InvalidArgumentError, NotFoundError, QuotaError, SandboxSpec
from k3sys.sandbox.errors import AuthError
from k3sys.sandbox.service.scope import ADMIN, authenticate
from k3sys.sandbox.service.tenants import DB_FILE, Quota, Tenant, Tenants, Usage, check_quota, key_hash

pytestmark = pytest.mark.timeout(300)
ADMIN_KEY = "admin-key-for-tests-0123456789"
SMALL = SandboxSpec(memory_mb=64, pids=64)


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    data = tmp_path_factory.mktemp("tenants") / "svc"
    keys = {"alice": add_key(data, "alice"), "bob": add_key(data, "bob"),
            "carol": add_key(data, "carol", "--sandboxes", "2", "--memory-mb", "160", "--pids", "100")}
    with ServiceProcess(data, env={"K3SYS_API_KEY": ADMIN_KEY}) as s:
        s.keys = keys
        yield s
        with s.client(ADMIN_KEY) as admin:
            for i in admin.list():
                admin.kill(i.id)
            for c in admin.checkpoints():
                admin.delete_checkpoint(c.id)


def client(svc, tenant: str) -> HTTPBackend:
    return svc.client(svc.keys[tenant] if tenant != "admin" else ADMIN_KEY)


def test_keys_are_stored_hashed_and_shown_once(tmp_path, record_property):
    record_property("attack", "one API key sees and kills every sandbox")
    record_property("figure", "keys stored as SHA-256 only; a removed key is refused")
    key = add_key(tmp_path, "dave", "--pids", "128")
    assert key.startswith("k3s_") and len(key) > 40
    stored = b"".join(p.read_bytes() for p in tmp_path.glob(DB_FILE + "*"))
    assert key.encode() not in stored and key_hash(key).encode() in stored
    assert (tmp_path / DB_FILE).stat().st_mode & 0o077 == 0
    listing = keys_cli(tmp_path, "list")
    assert listing.returncode == 0 and "dave" in listing.stdout and key not in listing.stdout + listing.stderr
    assert key_hash(key)[:12] in listing.stdout
    with Tenants(tmp_path) as t:
        assert t.authenticate(key).quota == Quota(pids=128)
        assert t.authenticate(key + "x") is None
    bad = keys_cli(tmp_path, "add", "--tenant", "../etc")
    assert bad.returncode == 2 and "tenant" in bad.stderr
    assert keys_cli(tmp_path, "remove", key_hash(key)[:12]).returncode == 0
    with Tenants(tmp_path) as t:
        assert t.authenticate(key) is None
    missing = keys_cli(tmp_path, "remove", "0" * 12)
    assert missing.returncode == 3 and "no key" in missing.stderr


def test_tenants_cannot_see_reach_or_kill_each_other(svc, record_property):
    record_property("attack", "one API key sees and kills every sandbox")
    with client(svc, "alice") as alice, client(svc, "bob") as bob, client(svc, "admin") as admin:
        a = alice.create(SMALL)
        ck = alice.checkpoint(a.id)
        b = bob.create(SMALL)
        assert [i.id for i in alice.list()] == [a.id] and [i.id for i in bob.list()] == [b.id]
        assert {a.id, b.id} <= {i.id for i in admin.list()}
        assert ck.id in {c.id for c in alice.checkpoints()} and ck.id not in {c.id for c in bob.checkpoints()}
        cid = alice.start_command(a.id, "sleep 60")
        tried = 0
        bob.kill_command(cid)  # the client's kill is quiet about a command it cannot find: it lives on
        for attempt in (lambda: bob.wait_command(cid, 1), lambda: bob.command_output(cid), lambda: bob.processes(a.id),
                        lambda: bob.info(a.id), lambda: bob.kill(a.id), lambda: bob.run(a.id, "echo pwned"),
                        lambda: bob.read_file(a.id, "/etc/hostname"), lambda: bob.write_file(a.id, "/tmp/x", b"x"),
                        lambda: bob.pause(a.id), lambda: bob.hibernate(a.id), lambda: bob.fork(a.id, 1),
                        lambda: bob.checkpoint(a.id), lambda: bob.get_checkpoint(ck.id),
                        lambda: bob.restore(ck.id), lambda: bob.delete_checkpoint(ck.id)):
            with pytest.raises(NotFoundError):
                attempt()
            tried += 1
        assert alice.info(a.id).state == "running" and alice.run(a.id, "echo ok").stdout == "ok\n"
        assert alice.command_running(cid)
        alice.kill_command(cid)
        assert alice.get_checkpoint(ck.id).id == ck.id
        # Another tenant's id answers byte for byte as an id that does not exist.
        with httpx.Client(base_url=svc.url, headers={"x-api-key": svc.keys["bob"]}, timeout=30) as h:
            theirs, nobody = h.get(f"/sandboxes/{a.id}"), h.get(f"/sandboxes/{'z' * len(a.id)}")
            assert theirs.status_code == nobody.status_code == 404
            assert theirs.text.replace(a.id, "ID") == nobody.text.replace("z" * len(a.id), "ID")
        # Children and restores belong to the caller.
        kids = alice.fork(a.id, 1)
        again = alice.restore(ck.id)
        mine = {i.id for i in alice.list()}
        assert {k.id for k in kids} | {again.id, a.id} == mine and not mine & {i.id for i in bob.list()}
        with pytest.raises(NotFoundError):
            bob.kill(kids[0].id)
        record_property("figure", f"{tried} cross-tenant operations refused with 404; forks and restores owned")
        # Ownership survives a restart of the service.
        svc.stop()
        svc.start()
    with client(svc, "alice") as alice, client(svc, "bob") as bob:
        assert {i.id for i in alice.list()} == mine and [i.id for i in bob.list()] == [b.id]
        with pytest.raises(NotFoundError):
            bob.kill(a.id)
        for sid in mine:
            alice.kill(sid)
        bob.kill(b.id)
        # An id another tenant owned stays its own while a checkpoint of it exists: refused to bob as
        # any id in use is, so ownership never changes hands.
        with pytest.raises(InvalidArgumentError, match="already exists"):
            bob.create(SMALL, a.id)
        alice.delete_checkpoint(ck.id)


def test_quotas_refuse_with_429_naming_the_quota(svc, record_property):
    record_property("attack", "pids: 4194304 accepted at create")
    with client(svc, "carol") as carol, httpx.Client(base_url=svc.url, timeout=30,
                                                     headers={"x-api-key": svc.keys["carol"]}) as h:
        # Past every spec's bound (spec.MAX_PIDS) it is refused before any call; within it, by the quota.
        with pytest.raises(InvalidArgumentError, match=r"pids: .*2048.*got 4194304"):
            SandboxSpec(memory_mb=64, pids=4194304)
        with pytest.raises(QuotaError, match=r"quota pids: .*at most 100 .*pids=2048"):
            carol.create(SandboxSpec(memory_mb=64, pids=2048))
        r = h.post("/sandboxes", json={"templateID": "busybox", "memoryMB": 64, "pids": 101})
        assert r.status_code == 429 and "quota_exceeded" in r.text and "pids" in r.text
        with pytest.raises(QuotaError, match=r"quota memory_mb: .*at most 160 MiB"):
            carol.create(SandboxSpec(memory_mb=192, pids=64))
        first = carol.create(SMALL)
        with pytest.raises(QuotaError, match=r"quota sandboxes: .*holds 1 of at most 2"):
            carol.fork(first.id, 2)
        second = carol.create(SMALL)
        with pytest.raises(QuotaError, match=r"quota sandboxes: .*holds 2 of at most 2"):
            carol.create(SMALL)
        # A hibernated sandbox holds no memory: room again; resuming it is admitted like a create.
        carol.hibernate(second.id)
        third = carol.create(SMALL)
        with pytest.raises(QuotaError, match="quota sandboxes"):
            carol.resume(second.id)
        # Another tenant's quota is its own; the admin is bound by the service's limits only.
        with client(svc, "alice") as alice:
            other = alice.create(SMALL)
            alice.kill(other.id)
        record_property("figure", "pids 4194304 > 2048 (spec bound); 2048 / 101 > 100, memory 192 > 160 MiB, "
                                  "3rd sandbox of 2: 429")
        for sid in (first.id, second.id, third.id):
            carol.kill(sid)


def test_disk_quota_counts_hibernated_sandboxes_too(record_property):
    record_property("attack", "one API key sees and kills every sandbox")
    record_property("figure", "disk_mb quota: 1024 + 1024 of 2048 MiB fits, one more is refused")
    if "disk_mb" not in SandboxSpec.__dataclass_fields__:
        pytest.skip("SandboxSpec.disk_mb comes with the runtime's hardening (issue 15)")
    spec = SandboxSpec(memory_mb=64, disk_mb=1024)
    t = Tenant("erin", Quota(disk_mb=2048))
    check_quota(t, Usage(0, 0, 1024), 1, spec)
    with pytest.raises(QuotaError, match=r"quota disk_mb: .*holds 2048 MiB of at most 2048 MiB"):
        check_quota(t, Usage(0, 0, 2048), 1, spec)


def test_admin_key_and_wrong_keys(svc, record_property):
    record_property("attack", "one API key sees and kills every sandbox")
    with svc.client("k3s_" + "A" * 43) as wrong, pytest.raises(AuthError, match="wrong API key"):
        wrong.list()
    t0 = time.monotonic()
    with httpx.Client(base_url=svc.url, timeout=30) as h:
        assert h.get("/sandboxes").status_code == 401
        assert h.get("/health").status_code == 200
        # Service-wide counts (every tenant's sandboxes) are the admin's.
        assert h.get("/metrics", headers={"x-api-key": ADMIN_KEY}).status_code == 200
        refused = h.get("/metrics", headers={"x-api-key": svc.keys["alice"]})
        assert refused.status_code == 403 and refused.json()["type"] == "permission_denied"
    record_property("figure", f"unknown key and no key: 401 ({(time.monotonic() - t0) * 1e3:.0f} ms)")


def test_official_e2b_sdk_sees_only_its_tenant(svc, monkeypatch, record_property):
    record_property("attack", "one API key sees and kills every sandbox")
    from e2b import Sandbox
    from e2b.exceptions import NotFoundException, SandboxException

    monkeypatch.setenv("E2B_API_URL", svc.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", svc.url)
    alice, bob = svc.keys["alice"], svc.keys["bob"]
    s = Sandbox.create("busybox", api_key=alice, timeout=120)
    try:
        assert s.sandbox_id in {i.sandbox_id for i in Sandbox.list(api_key=alice).next_items()}
        assert s.sandbox_id not in {i.sandbox_id for i in Sandbox.list(api_key=bob).next_items()}
        with pytest.raises(NotFoundException):
            Sandbox.connect(s.sandbox_id, api_key=bob)
        with pytest.raises(NotFoundException):
            Sandbox.get_info(s.sandbox_id, api_key=bob)
        assert Sandbox.kill(s.sandbox_id, api_key=bob) is False  # E2B's answer to a 404
        assert s.is_running() and Sandbox.get_info(s.sandbox_id, api_key=alice).sandbox_id == s.sandbox_id
        # Snapshot names are per tenant: bob's "golden" neither moves alice's nor reaches her snapshot.
        mine = s.create_snapshot(name="golden")
        assert mine.names == ["golden"]
        assert Sandbox.delete_snapshot("golden", api_key=bob) is False
        assert Sandbox.delete_snapshot(mine.snapshot_id, api_key=bob) is False
        for tid in ("golden", mine.snapshot_id):  # to bob, neither is a snapshot: an unknown template
            with pytest.raises(SandboxException, match="unknown template"):
                Sandbox.create(tid, api_key=bob, timeout=60)
        b = Sandbox.create("busybox", api_key=bob, timeout=120)
        assert b.create_snapshot(name="golden").names == ["golden"]
        b.kill()
        assert Sandbox.delete_snapshot("golden", api_key=alice) is True  # alice's "golden" is still hers
        record_property("figure", "e2b SDK with another tenant's key: list hides it, connect/get_info/kill 404; "
                                  "snapshot names per tenant")
    finally:
        s.kill()


def test_who_a_key_stands_for(tmp_path, record_property):
    record_property("attack", "one API key sees and kills every sandbox")
    record_property("figure", "admin, tenant, wrong and missing keys resolved; an open service serves no one "
                              "once a tenant key exists")
    with Tenants(tmp_path) as t:
        # No admin key and no tenant keys: an open service (loopback only), everyone is the admin.
        assert authenticate(None, t, None) is ADMIN
        key = t.add_key("frank", Quota(sandboxes=3))
        assert authenticate("admin", t, "admin") is ADMIN
        assert authenticate("admin", t, key).tenant == Tenant("frank", Quota(sandboxes=3))
        for given in ("wrong", key[:-1], key + "x"):
            with pytest.raises(AuthError, match="wrong API key"):
                authenticate("admin", t, given)
        # Once a tenant key exists, a service without an admin key serves no one, its tenants neither
        # (their sandboxes' envd would have no token): test_envd_auth.py runs it against a real service.
        for given in (None, key, "admin"):
            with pytest.raises(AuthError, match=r"--no-auth.*1 tenant holds keys.*k3sys sandbox keys"):
                authenticate(None, t, given)


def test_owners_are_kept_while_a_checkpoint_names_them(tmp_path, record_property):
    record_property("attack", "one API key sees and kills every sandbox")
    record_property("figure", "ownership on disk; pruned only for ids neither alive nor checkpointed")
    with Tenants(tmp_path) as t:
        t.add_key("gina")
        t.claim(["a", "b", "c"], "gina")
        t.claim(["d"], None)  # the admin's: no row
        assert t.owned("gina") == {"a", "b", "c"} and t.owner("d") is None and t.owned("nobody") == set()
        assert t.prune({"a", "c"}) == 1 and t.owned("gina") == {"a", "c"}
    with Tenants(tmp_path) as t:  # on disk
        assert t.owner("c") == "gina"
        assert t.remove_tenant("gina") == 1  # its key goes; its sandboxes stay (the admin reaches them)
        assert t.owner("c") == "gina" and not t.has_keys()
        with pytest.raises(NotFoundError, match="no tenant"):
            t.remove_tenant("gina")


def test_every_route_naming_a_sandbox_or_checkpoint_is_scoped(record_property):
    """Scoping lives in deps.py's path dependencies: a new route that takes `{sid}` as a plain `str`
    would reach every tenant's sandboxes, so the app's route table is checked here."""
    record_property("attack", "one API key sees and kills every sandbox")
    from fastapi.routing import APIRoute

    from k3sys.sandbox.service import control, deps, server

    def calls(dependant) -> set:
        return {d.call for d in dependant.dependencies} | {c for d in dependant.dependencies for c in calls(d)}

    needs = {"{sid}": deps._reachable_sandbox, "{ck}": deps._reachable_checkpoint, "{tid}": deps.authorize}
    routes = [r for router in (control.router, server.router) for r in router.routes if isinstance(r, APIRoute)]
    checked = 0
    for r in routes:
        found = calls(r.dependant)
        assert deps.authorize in found, r.path
        for param, dep in needs.items():
            if param in r.path:
                assert dep in found, f"{sorted(r.methods)} {r.path} takes {param} without {dep.__name__}"
                checked += 1
    assert checked >= 20
    record_property("figure", f"{checked} routes naming a sandbox or checkpoint, every one scoped")
