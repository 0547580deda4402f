"""`k3sys sandbox template build`: every supported Dockerfile instruction, each step cached by the
hash of its input (a changed last step re-runs only that step), a failing RUN that reports its
output and leaves no template, refused instructions named with their line, and COPY that never
follows the context's links out of it."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest
from image_maker import Entry, oci_layout, tree_entries

from k3sys.sandbox import Sandbox
from k3sys.sandbox.errors import BuildError, DockerfileError, LayerEntryError
from k3sys.sandbox.runtime.oci.builder import Builder
from k3sys.sandbox.runtime.oci.dockerfile import read_dockerfile
from k3sys.sandbox.runtime.system import system_paths

pytestmark = [pytest.mark.embedded, pytest.mark.timeout(300)]


def build(rt, text: str, name: str, context: Path | None = None, **args: str):
    return Builder(rt, log=lambda _: None, memory_mb=256).build(read_dockerfile(text, args), name, context)


@pytest.fixture
def context(tmp_path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "site/css").mkdir(parents=True)
    (ctx / "app.sh").write_text("#!/bin/sh\necho app $1\n")
    (ctx / "site/index.html").write_text("<h1>hi</h1>")
    (ctx / "site/css/a.css").write_text("a{}")
    (ctx / "site/secret.key").write_text("never copied")
    os.symlink("/etc/shadow", ctx / "site/shadow-link")  # copied as a link, never read
    (ctx / ".dockerignore").write_text("**/*.key\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        ti = tarfile.TarInfo("pkg/README")
        ti.size = 6
        tf.addfile(ti, io.BytesIO(b"readme"))
    (ctx / "pkg.tar.gz").write_bytes(buf.getvalue())
    return ctx


EVERYTHING = """\
# every supported instruction
ARG BASE=busybox
FROM ${BASE} AS main
ARG GREETING=hello
ENV MESSAGE="$GREETING from the build" EMPTY=
LABEL org.example=ignored
EXPOSE 8080
WORKDIR /srv
WORKDIR www
COPY site ./
COPY --chmod=0755 app.sh /usr/local/bin/app
COPY --chown=nobody:nogroup app.sh /srv/owned.sh
ADD pkg.tar.gz /opt/
RUN echo "$MESSAGE" > message && echo "arg=$GREETING" > arg && mkdir -p /var/data
RUN ["/bin/sh", "-c", "app exec-form > exec.txt"]
USER nobody
CMD ["app", "serve"]
ENTRYPOINT ["/bin/sh", "-c"]
"""


def test_every_instruction(rt, system_dir, context):
    r = build(rt, EVERYTHING, "everything", context, GREETING="bonjour")
    root = system_dir / "templates/everything/rootfs"
    assert sorted(os.listdir(root / "srv/www")) == ["arg", "css", "exec.txt", "index.html", "message", "shadow-link"]
    assert os.readlink(root / "srv/www/shadow-link") == "/etc/shadow"
    assert (root / "srv/www/message").read_text() == "bonjour from the build\n"
    assert (root / "srv/www/arg").read_text() == "arg=bonjour\n"
    assert (root / "srv/www/exec.txt").read_text() == "app exec-form\n"
    assert (root / "usr/local/bin/app").stat().st_mode & 0o777 == 0o755
    assert ((root / "srv/owned.sh").stat().st_uid, (root / "srv/owned.sh").stat().st_gid) == (65534, 65534)
    assert (root / "opt/pkg/README").read_text() == "readme"
    assert (root / "var/data").is_dir() and not (root / ".k3sys").exists()
    assert oct((root / "tmp").stat().st_mode & 0o7777) == "0o1777"  # untouched by the layers above
    assert r.steps.count("ran") == 9 and len(r.layers) == 9  # FROM, 2 WORKDIRs, 4 COPY / ADD, 2 RUNs
    with Sandbox.create("everything", runtime=rt, memory_mb=256) as s:
        out = s.commands.run('echo "$MESSAGE"; pwd; id -un; app x')
        assert out.stdout == "bonjour from the build\n/srv/www\nnobody\napp x\n", out
    meta = (system_dir / "templates/everything/template.json").read_text()
    assert '"cmd": ["app", "serve"]' in meta and '"entrypoint": ["/bin/sh", "-c"]' in meta


def test_from_an_imported_image(rt, system_dir, tmp_path):
    busybox = system_paths().templates / "busybox" / "rootfs"
    layout = oci_layout(tmp_path / "img", [tree_entries(busybox), [Entry("etc/motd", data=b"from the image\n")]],
                        {"Env": ["PATH=/bin", "FROM_IMAGE=yes"], "WorkingDir": "/etc"})
    build(rt, f"FROM oci:{layout}\nRUN cat motd > /copied && echo $FROM_IMAGE >> /copied\n", "on-image")
    root = system_dir / "templates/on-image/rootfs"
    assert (root / "copied").read_text() == "from the image\nyes\n"
    # the image's two layers are shared with the build's, not copied
    assert len([p for p in (system_dir / "layers").iterdir() if p.name.startswith("sha256-")]) == 2


def test_cache_reruns_only_the_changed_last_step(rt, system_dir, context):
    head = "FROM busybox\nCOPY site /site\nRUN cat /proc/sys/kernel/random/uuid > /stamp\n"
    first = build(rt, head + "RUN echo one > /last\n", "cache-a", context)
    assert first.steps == ["ran", "ran", "ran", "ran"]  # FROM: the busybox rootfs taken as a layer
    second = build(rt, head + "RUN echo two > /last\n", "cache-b", context)
    assert second.steps == ["cached", "cached", "cached", "ran"]
    a, b = system_dir / "templates/cache-a/rootfs", system_dir / "templates/cache-b/rootfs"
    assert (a / "stamp").read_text() == (b / "stamp").read_text()  # the same layer: not run again
    assert ((a / "last").read_text(), (b / "last").read_text()) == ("one\n", "two\n")
    # a changed file of the context is a changed COPY input: that step and the ones after it run again
    (context / "site/index.html").write_text("<h1>changed</h1>")
    third = build(rt, head + "RUN echo two > /last\n", "cache-c", context)
    assert third.steps == ["cached", "ran", "ran", "ran"]


def test_failing_run_reports_output_and_leaves_no_template(rt, system_dir):
    before = {i.id for i in rt.list()}
    with pytest.raises(BuildError, match="exited 3") as e:
        build(rt, "FROM busybox\nRUN echo partial > /p\nRUN echo about to fail; echo on stderr >&2; exit 3\n",
              "broken")
    assert "line 3: RUN echo about to fail" in str(e.value)
    assert "about to fail" in str(e.value) and "on stderr" in str(e.value)
    assert not (system_dir / "templates/broken").exists()
    assert [p.name for p in (system_dir / "templates").iterdir() if p.name.startswith(("_", ".b"))] == []
    assert {i.id for i in rt.list()} == before, "the build sandbox is gone"


@pytest.mark.parametrize(("text", "line", "what"), [
    ("FROM busybox\nSHELL [\"/bin/bash\", \"-c\"]\n", 2, "SHELL: not supported"),
    ("FROM busybox\nRUN true\nVOLUME /data\n", 3, "VOLUME: not supported"),
    ("FROM busybox\nHEALTHCHECK CMD true\n", 2, "HEALTHCHECK: not supported"),
    ("FROM busybox\nONBUILD RUN true\n", 2, "ONBUILD: not supported"),
    ("FROM busybox\nSTOPSIGNAL SIGKILL\n", 2, "STOPSIGNAL: not supported"),
    ("FROM busybox AS a\nFROM busybox\n", 2, "multi-stage"),
    ("FROM busybox\nCOPY --from=a /x /y\n", 2, "--from=a is not supported"),
    ("FROM busybox\nRUN --mount=type=cache,target=/c true\n", 2, "not supported"),
    ("FROM busybox\nRUN <<EOF\necho hi\nEOF\n", 2, "heredocs"),
    ("FROM busybox\nADD https://example.com/x /x\n", 2, "URL"),
    ("FROM busybox\nFOO bar\n", 2, "unknown instruction: FOO"),
    ("RUN true\n", 1, "must be FROM"),
], ids=["shell", "volume", "healthcheck", "onbuild", "stopsignal", "multistage", "copy-from", "run-mount",
        "heredoc", "add-url", "unknown", "no-from"])
def test_refused_instructions(text, line, what):
    with pytest.raises(DockerfileError, match=f"Dockerfile line {line}") as e:
        read_dockerfile(text)
    assert what in str(e.value)


def test_copy_never_follows_the_contexts_links_out(rt, system_dir, tmp_path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    os.symlink("/etc", ctx / "etc-link")
    (tmp_path / "outside").write_text("outside the context")
    for src, why in (("etc-link/passwd", "symbolic link"), ("../outside", "leaves the context"),
                     ("missing", "not in the context")):
        with pytest.raises(BuildError, match=why):
            build(rt, f"FROM busybox\nCOPY {src} /x\n", "escape", ctx)
        assert not (system_dir / "templates/escape").exists()


def test_add_of_a_hostile_tar_refused(rt, system_dir, tmp_path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    with tarfile.open(ctx / "evil.tar", "w") as tf:
        ti = tarfile.TarInfo("../../../../../../../../tmp/k3sys-add-escape")
        ti.size = 1
        tf.addfile(ti, io.BytesIO(b"x"))
    with pytest.raises(LayerEntryError, match="'..' in the path"):
        build(rt, "FROM busybox\nADD evil.tar /opt/\n", "evil-add", ctx)
    assert not Path("/tmp/k3sys-add-escape").exists() and not (system_dir / "templates/evil-add").exists()
