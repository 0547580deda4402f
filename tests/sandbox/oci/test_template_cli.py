"""`k3sys sandbox template import / build / list / rm / prune` from the shell, with their exit codes."""

from __future__ import annotations

import os
import subprocess

import pytest
from image_maker import Entry, oci_layout, tree_entries
from typer.testing import CliRunner

from k3sys.cli import app
from k3sys.sandbox.runtime.system import system_paths

pytestmark = pytest.mark.timeout(300)


def cli(*args: str):
    return CliRunner().invoke(app, ["sandbox", "template", *args])


def listed() -> set[str]:
    """The template names `template list` prints (its table's first column)."""
    out = cli("list").stdout.splitlines()
    return {ln.split()[0] for ln in out if ln.strip() and ln.split()[0] not in ("name",) and "─" not in ln}


def test_import_build_list_rm_prune(leak_check, system_dir, tmp_path):
    busybox = system_paths().templates / "busybox" / "rootfs"
    layout = oci_layout(tmp_path / "img", [tree_entries(busybox), [Entry("etc/motd", data=b"motd\n")]])
    r = cli("import", f"oci:{layout}:latest", "-t", "imported")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("imported\t") and "layer 2/2" in r.stderr
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM imported\nARG N=0\nCOPY hello /hello\nRUN echo n=$N >> /hello\n")
    (ctx / "hello").write_text("hello\n")
    r = cli("build", "-t", "built", "--build-arg", "N=5", str(ctx))
    assert r.exit_code == 0, r.output
    assert r.stdout == "built\n" and "2 step(s) ran" in r.stderr
    rootfs = system_dir / "templates/built/rootfs"
    assert (rootfs / "hello").read_text() == "hello\nn=5\n" and (rootfs / "etc/motd").read_text() == "motd\n"
    assert leak_check(system_dir / "layers") == [] and not list((system_dir / "layers").glob(".runtime-*"))
    assert {"imported", "built", "busybox"} <= listed()
    # refusals: a taken name (wrong state), a bad Dockerfile and an unknown template (bad arguments)
    assert cli("import", str(layout), "-t", "built").exit_code == 4
    (ctx / "Dockerfile").write_text("FROM imported\nVOLUME /x\n")
    r = cli("build", "-t", "other", str(ctx))
    assert r.exit_code == 2 and "line 2: VOLUME" in r.stderr
    assert cli("rm", "no-such").exit_code == 2
    assert cli("rm", "busybox").exit_code == 2
    assert cli("rm", "built", "imported").exit_code == 0
    assert not {"imported", "built"} & listed()
    r = cli("prune")
    assert r.exit_code == 0 and [p for p in (system_dir / "layers").iterdir() if not p.name.startswith(".")] == []


def test_sweep_removes_what_a_dead_build_left(leak_check, system_dir):
    from k3sys.sandbox.runtime.oci.builder import sweep

    dead = subprocess.Popen(["true"])
    dead.wait()
    (system_dir / "layers" / f".runtime-{dead.pid}").mkdir(parents=True)
    (system_dir / "templates" / f"_stage-{dead.pid}-abc" / "rootfs").mkdir(parents=True)
    (system_dir / "templates" / f"_stage-{os.getpid()}-abc" / "rootfs").mkdir(parents=True)  # a live build's
    assert sorted(sweep(system_dir / "layers")) == [f".runtime-{dead.pid}", f"_stage-{dead.pid}-abc"]
    assert (system_dir / "templates" / f"_stage-{os.getpid()}-abc").is_dir()
    assert leak_check(system_dir / "layers" / f".runtime-{dead.pid}") == []
