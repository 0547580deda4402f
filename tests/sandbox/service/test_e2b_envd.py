"""envd, E2B's in-sandbox API, served by the sandbox service and driven by the official `e2b` SDK
(sync and async) against a real server on 127.0.0.1: commands, PTY, files, watch, health, tokens."""

from __future__ import annotations

import hashlib
import os

import pytest
from e2b import CommandExitException, ConnectionConfig, NotFoundException
from e2b import Sandbox as E2B
from packaging.version import Version
from service_process import ServiceProcess

from k3sys.sandbox.service.envd.app import access_token
from k3sys.sandbox.spec import SandboxSpec

pytestmark = pytest.mark.timeout(180)
ENVD_VERSION = Version("0.6.4")


@pytest.fixture(scope="module")
def envd_service(tmp_path_factory, service):  # `service` first: it skips where sandboxes cannot run
    root = tmp_path_factory.mktemp("envd")
    with ServiceProcess(root / "data", "--max-body-mb", "64") as svc:
        yield svc
        svc.kill_all()


def _handle(svc: ServiceProcess, sid: str, cls: type = E2B, token: str | None = "derive") -> E2B:
    """The SDK's handle of sandbox `sid`, pointed at the service (as `Sandbox.connect` makes it)."""
    token = access_token(svc.key, sid) if token == "derive" else token
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", **({"X-Access-Token": token} if token else {})}
    cfg = ConnectionConfig(api_key="unused", api_url=svc.url, sandbox_url=svc.url, extra_sandbox_headers=headers)
    return cls(sandbox_id=sid, sandbox_domain=None, envd_version=ENVD_VERSION, envd_access_token=token,
               traffic_access_token=None, connection_config=cfg)


@pytest.fixture(scope="module")
def box(envd_service):
    """One `base` sandbox (Debian with bash) for the module, and its SDK handle."""
    with envd_service.client() as c:
        sid = c.create(SandboxSpec(template="base", memory_mb=512)).id
    yield _handle(envd_service, sid)
    with envd_service.client() as c:
        c.kill(sid)


def test_run_output_env_cwd_and_exit_codes(box):
    r = box.commands.run("echo out; echo err >&2; echo $FOO; pwd", envs={"FOO": "bar"}, cwd="/tmp")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "out\nbar\n/tmp\n", "err\n")
    with pytest.raises(CommandExitException) as e:
        box.commands.run("echo partial; exit 3")
    assert e.value.exit_code == 3 and e.value.stdout == "partial\n"
    assert box.commands.run("id -un", user="root").stdout == "root\n"


def test_files_round_trip_big_and_binary(box):
    blob = os.urandom(32 << 20)
    info = box.files.write("/tmp/big.bin", blob)
    assert (info.path, info.name) == ("/tmp/big.bin", "big.bin")
    assert bytes(box.files.read("/tmp/big.bin", format="bytes")) == blob
    text = "héllo\x00wörld"
    box.files.write("/tmp/dir/t.txt", text)  # missing directories are made
    assert box.files.read("/tmp/dir/t.txt") == text
    assert box.commands.run("sha256sum /tmp/big.bin").stdout.split()[0] == hashlib.sha256(blob).hexdigest()
    with pytest.raises(NotFoundException):
        box.files.read("/tmp/nope")
