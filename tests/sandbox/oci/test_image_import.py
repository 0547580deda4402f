"""`k3sys sandbox template import`: an OCI layout and a `docker save` archive made by the test from
the busybox template's files become one template each, their layers unpacked once and shared; a
multi-layer image's whiteouts (plain and opaque) apply; the image config becomes the sandboxes'
defaults (env, working directory, user) at create."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import tarfile

import pytest
from image_maker import Entry, docker_archive, oci_layout, tree_entries

from k3sys.sandbox import Sandbox
from k3sys.sandbox.errors import ImageError, InvalidStateError
from k3sys.sandbox.runtime.oci import catalog
from k3sys.sandbox.runtime.system import system_paths

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="layers keep owners and whiteout devices: root")

BUSYBOX = system_paths().templates / "busybox" / "rootfs"
CONFIG = {"Env": ["PATH=/bin:/usr/bin", "GREETING=hello from the image"], "WorkingDir": "/srv/app",
          "User": "65534:65534", "Entrypoint": ["/bin/sh"], "Cmd": ["-c", "echo hi"]}


@pytest.fixture(scope="module")
def busybox_layer() -> list[Entry]:
    if not BUSYBOX.is_dir():
        pytest.skip("the busybox template is not built (scripts/install-sandbox.sh)")
    return tree_entries(BUSYBOX)


APP = [Entry("srv", "dir", mode=0o755), Entry("srv/app", "dir", mode=0o755, uid=65534, gid=65534),
       Entry("srv/app/data.txt", data=b"payload\n"), Entry("tmp/made-by-layer-2", data=b"x")]


def test_oci_layout_and_docker_archive_share_layers(system_dir, tmp_path, busybox_layer):
    layout = oci_layout(tmp_path / "layout", [busybox_layer, APP], CONFIG)
    archive = docker_archive(tmp_path / "image.tar", [busybox_layer, APP], CONFIG)
    rootfs = catalog.import_image(f"oci:{layout}", "from-layout", log=lambda _: None)
    assert (rootfs / "srv/app/data.txt").read_text() == "payload\n"
    assert (rootfs / "bin/busybox").read_bytes() == (BUSYBOX / "bin/busybox").read_bytes()
    # /tmp of layer 1 keeps its 1777 under layer 2, which only added a file in it
    assert stat.S_IMODE((rootfs / "tmp").stat().st_mode) == 0o1777
    assert (rootfs / "srv/app").stat().st_uid == 65534
    layers = sorted((system_dir / "layers").iterdir())
    assert len(layers) == 2
    other = catalog.import_image(str(archive), "from-archive", log=lambda _: None)
    assert sorted((system_dir / "layers").iterdir()) == layers, "the same diff_ids: no layer unpacked twice"
    # the two templates' files are one inode each (composed by hard links from the shared layers)
    assert (other / "bin/busybox").stat().st_ino == (rootfs / "bin/busybox").stat().st_ino
    meta = json.loads((system_dir / "templates/from-layout/template.json").read_text())
    assert meta["env"]["GREETING"] == "hello from the image" and meta["cwd"] == "/srv/app"
    assert meta["user"] == "65534" and meta["entrypoint"] == ["/bin/sh"] and meta["cmd"] == ["-c", "echo hi"]
    listed = {t.name: t for t in catalog.list_templates()}
    assert listed["from-layout"].layers == 2 and listed["from-layout"].bytes > 1 << 20
    with pytest.raises(InvalidStateError, match="exists"):
        catalog.import_image(str(archive), "from-archive", log=lambda _: None)
    catalog.remove("from-layout")
    assert len(list((system_dir / "layers").iterdir())) == 2, "still used by from-archive"
    catalog.remove("from-archive")
    assert list((system_dir / "layers").iterdir()) == []


def test_whiteouts_plain_and_opaque(system_dir, tmp_path):
    lower = [Entry("a", "dir", mode=0o755), Entry("a/x", data=b"x"), Entry("a/sub", "dir", mode=0o755),
             Entry("a/sub/deep", data=b"d"), Entry("b", "dir", mode=0o755), Entry("b/z", data=b"z"),
             Entry("b/keep", data=b"k"), Entry("c", data=b"c"), Entry("d", "dir", mode=0o700)]
    upper = [Entry("a", "dir", mode=0o750), Entry("a/.wh..wh..opq"), Entry("a/new", data=b"n"),
             Entry(".wh.c"), Entry("b/.wh.z"), Entry(".wh.d"), Entry("d", data=b"d is a file now")]
    top = [Entry("b/.wh.keep"), Entry("c", data=b"c again")]
    layout = oci_layout(tmp_path / "img", [lower, upper, top], gzipped=False)
    rootfs = catalog.import_image(str(layout), "whiteouts", log=lambda _: None)
    assert sorted(os.listdir(rootfs / "a")) == ["new"]
    assert stat.S_IMODE((rootfs / "a").stat().st_mode) == 0o750
    assert os.listdir(rootfs / "b") == []
    assert (rootfs / "c").read_text() == "c again"
    assert (rootfs / "d").read_text() == "d is a file now"
    # the composed tree is plain: no whiteout device or overlay attribute is left in it
    for p in rootfs.rglob("*"):
        st = p.lstat()
        assert not stat.S_ISCHR(st.st_mode), p
        assert not [x for x in os.listxattr(p, follow_symlinks=False) if x.startswith("trusted.")], p


def test_tampered_blob_refused_and_no_template(system_dir, tmp_path):
    layout = oci_layout(tmp_path / "img", [[Entry("f", data=b"original")]], gzipped=False)
    blob = max((layout / "blobs/sha256").iterdir(), key=lambda p: b"original" in p.read_bytes())
    blob.write_bytes(blob.read_bytes().replace(b"original", b"tampered"))
    with pytest.raises(ImageError, match="does not match its digest"):
        catalog.import_image(str(layout), "tampered", log=lambda _: None)
    assert not (system_dir / "templates/tampered").exists()
    # a blob that is a link (to a host file) is not read through
    blob.unlink()
    os.symlink("/etc/os-release", blob)
    with pytest.raises(ImageError, match="a link"):
        catalog.import_image(str(layout), "tampered", log=lambda _: None)
    with pytest.raises(ImageError, match="does not exist"):
        catalog.import_image(str(tmp_path / "nothing"), "nothing", log=lambda _: None)


def test_registry_reference_needs_a_reachable_registry(system_dir):
    # No registry is reachable from the tests: the failure names skopeo and what it said.
    with pytest.raises(ImageError, match="skopeo"):
        catalog.import_image("docker://127.0.0.1:9/none/such:latest", "pulled", log=lambda _: None)
    assert not (system_dir / "templates/pulled").exists()


@pytest.mark.embedded
def test_config_applied_at_create(rt, system_dir, tmp_path, busybox_layer):
    layout = oci_layout(tmp_path / "img", [busybox_layer, APP], CONFIG)
    catalog.import_image(str(layout), "configured", log=lambda _: None)
    with Sandbox.create("configured", runtime=rt, memory_mb=256) as s:
        r = s.commands.run('echo "$GREETING"; pwd; id -u; cat data.txt')
        assert r.stdout == "hello from the image\n/srv/app\n65534\npayload\n", r
        # a call's own env, cwd and user win over the template's
        r = s.commands.run('echo "$GREETING"; pwd; id -u', envs={"GREETING": "mine"}, cwd="/tmp", user="root")
        assert r.stdout == "mine\n/tmp\n0\n", r


def test_oci_archive_and_zstd_layers(system_dir, tmp_path):
    layout = oci_layout(tmp_path / "layout", [[Entry("a", data=b"plain")]], gzipped=False)
    # the layer blob recompressed with zstd (a registry's newer media type), its digest renamed
    blobs = layout / "blobs/sha256"
    layer = next(p for p in blobs.iterdir() if b"plain" in p.read_bytes() and p.read_bytes()[:5] != b'{"sch')
    zst = subprocess.run(["zstd", "-q", "-c", str(layer)], capture_output=True, check=True).stdout
    zdigest = hashlib.sha256(zst).hexdigest()
    (blobs / zdigest).write_bytes(zst)
    manifest_path = next(p for p in blobs.iterdir() if layer.name.encode() in p.read_bytes())
    manifest = manifest_path.read_bytes().replace(layer.name.encode(), zdigest.encode())
    mdigest = hashlib.sha256(manifest).hexdigest()
    (blobs / mdigest).write_bytes(manifest)
    index = (layout / "index.json").read_text().replace(manifest_path.name, mdigest)
    (layout / "index.json").write_text(index)
    archive = tmp_path / "image.oci.tar"
    with tarfile.open(archive, "w") as tf:
        tf.add(layout, ".")
    rootfs = catalog.import_image(f"oci-archive:{archive}:latest", "zstd", log=lambda _: None)
    assert (rootfs / "a").read_text() == "plain"


@pytest.mark.embedded
def test_defaults_survive_checkpoint_and_restore(rt, system_dir, tmp_path, busybox_layer):
    layout = oci_layout(tmp_path / "img", [busybox_layer, APP], CONFIG)
    catalog.import_image(str(layout), "kept", log=lambda _: None)
    with Sandbox.create("kept", runtime=rt, memory_mb=256) as s:
        s.files.write("/srv/app/note", "written")
        ck = s.checkpoint()
        with pytest.raises(InvalidStateError, match="1 running sandbox"):
            catalog.remove("kept")
    with Sandbox.restore(ck, runtime=rt) as r:
        out = r.commands.run('echo "$GREETING"; pwd; id -u; cat note')
        assert out.stdout == "hello from the image\n/srv/app\n65534\nwritten", out
    ck.delete()
    catalog.remove("kept")  # nothing stands on it now
