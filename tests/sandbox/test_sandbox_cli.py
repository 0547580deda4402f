"""`k3sys sandbox ...` end to end, embedded (a runtime directory of the test's own) and against the
session's service, with the exit codes scripts rely on."""

from __future__ import annotations

import json

import pytest
from service_process import free_port
from typer.testing import CliRunner

from k3sys.cli import app
from k3sys.sandbox import errors
from k3sys.sandbox.cli import EXIT_CODES, exit_code

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(params=["embedded", "remote"])
def cli(request, private_root):
    """`cli(command, *args)`: run `k3sys sandbox command [backend options] *args` in-process."""
    if request.param == "embedded":
        backend = ["--data-dir", str(private_root)]
    else:
        svc = request.getfixturevalue("service")
        backend = ["--api-url", svc.url, "--api-key", svc.key]
    runner = CliRunner()
    return lambda command, *args: runner.invoke(app, ["sandbox", command, *backend, *args])


def ok(result) -> str:
    assert result.exit_code == 0, (result.exit_code, result.output)
    return result.stdout


def test_life_cycle_and_exit_codes(cli, tmp_path):
    sid = ok(cli("create", "--memory-mb", "64")).strip()
    r = cli("exec", sid, "echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr) == (7, "out\n", "err\n")
    assert ok(cli("exec", sid, "echo", "two words")) == "two words\n"  # joined for `sh -c`, as ssh does
    assert ok(cli("exec", "--env", "A=1", "--cwd", "/tmp", sid, "echo $A $PWD")) == "1 /tmp\n"
    assert cli("exec", "--timeout", "0.5", sid, "sleep 5").exit_code == 124
    r = cli("exec", "--stream", sid, "for i in 1 2 3; do echo $i; sleep 0.1; done; exit 3")
    assert (r.exit_code, r.stdout) == (3, "1\n2\n3\n")
    assert cli("exec", "--stream", "--timeout", "0.5", sid, "echo a; sleep 5").exit_code == 124

    src, back = tmp_path / "in.bin", tmp_path / "back.bin"
    src.write_bytes(b"payload\x00\xff" * 1000)
    ok(cli("cp", str(src), f"{sid}:/root/in.bin"))
    ok(cli("cp", f"{sid}:/root/in.bin", str(back)))
    assert back.read_bytes() == src.read_bytes()
    assert ok(cli("cp", f"{sid}:/root/in.bin", "-")).startswith("payload")
    assert cli("cp", str(src), str(back)).exit_code == 2  # one side must be in a sandbox

    listed = {d["id"]: d for d in json.loads(ok(cli("ls", "--json")))}
    assert listed[sid]["state"] == "running" and listed[sid]["spec"]["memory_mb"] == 64
    assert sid in ok(cli("ls"))
    ck = ok(cli("checkpoint", sid)).strip()
    assert ck.startswith("ck-") and ck in ok(cli("ls", "--checkpoints"))
    kids = ok(cli("fork", "-n", "2", sid)).split()
    assert len(kids) == 2 and all(ok(cli("exec", k, "cat /root/in.bin")).startswith("payload") for k in kids)
    ok(cli("kill", *kids))

    ok(cli("pause", sid))
    assert cli("pause", sid).exit_code == 4
    assert cli("exec", sid, "true").exit_code == 125  # k3sys could not run it (paused)
    ok(cli("resume", sid))
    assert ok(cli("hibernate", sid)).startswith("ck-")
    assert json.loads(ok(cli("ls", "--json")))[0]["state"] == "hibernated"
    ok(cli("resume", sid))
    new = ok(cli("restore", ck)).strip()
    assert ok(cli("exec", new, "head -c 7 /root/in.bin")) == "payload"
    ok(cli("kill", sid, new))

    assert cli("kill", sid).exit_code == 3
    assert cli("restore", "ck-nope").exit_code == 3
    assert cli("exec", "nope", "true").exit_code == 125
    assert cli("create", "--memory-mb", "1").exit_code == 2
    assert cli("create", "--template", "nope").exit_code == 2
    assert json.loads(ok(cli("ls", "--json"))) == []


def test_exit_codes_of_the_service(service, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["sandbox", "ls", "--api-url", service.url, "--api-key", "wrong"])
    assert r.exit_code == 5 and "wrong API key" in r.stderr
    r = runner.invoke(app, ["sandbox", "ls", "--api-url", f"http://127.0.0.1:{free_port()}", "--api-key", "k"])
    assert r.exit_code == 7
    # The service holds its directory: embedded use of it is refused with a hint.
    r = runner.invoke(app, ["sandbox", "ls", "--data-dir", str(service.data_dir)])
    assert r.exit_code == 7 and "--api-url" in r.stderr


def test_exit_code_table():
    assert {exit_code(cls("m")) for cls in EXIT_CODES} == {2, 3, 4, 5, 6, 7}
    assert exit_code(errors.CapacityError("m")) == 6 and exit_code(errors.UnknownTemplateError("m")) == 2
    assert exit_code(errors.CheckpointNotFoundError("m")) == 3 and exit_code(errors.DriverError("m")) == 1


def test_a_host_file_that_cannot_be_read_is_one_line(private_root, tmp_path):
    """`cp /nonexistent sbx:/a` once printed a traceback: a bad host path is a bad argument."""
    r = CliRunner().invoke(app, ["sandbox", "cp", "--data-dir", str(private_root), str(tmp_path / "nope"), "sbx:/a"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip() == f"error: No such file or directory: {tmp_path / 'nope'}"


def test_exec_refuses_an_option_after_the_sid():
    """`exec SID --timeout 1 sleep 5` once ran `--timeout 1 sleep 5` in the sandbox (`/bin/sh: -c requires an
    argument`); options go before SID, as in `docker exec`, and one put after it is named."""
    r = CliRunner().invoke(app, ["sandbox", "exec", "sbx-1", "--timeout", "1", "sleep", "5"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip() == "error: '--timeout' comes after SID: options go before it " \
                               "(k3sys sandbox exec [OPTIONS] SID COMMAND...)"
