"""Hostile image layers: whatever a layer's tar says, nothing lands outside the template's root, and
the refusal is a LayerEntryError naming the layer and the entry. No template is left behind."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from image_maker import Entry, oci_layout

from k3sys.sandbox.errors import ImageError, LayerEntryError
from k3sys.sandbox.runtime.oci import catalog
from k3sys.sandbox.runtime.oci.unpack import MAX_HEADER

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="layers keep owners and whiteout devices: root")

ESCAPE = f"k3sys-escape-{uuid.uuid4().hex}"
DEEP = "../" * 12 + "tmp/" + ESCAPE  # from any layer directory, up to / and into /tmp

HOSTILE = {
    "dotdot": ([Entry(DEEP, data=b"pwned")], "'..' in the path"),
    "absolute": ([Entry(f"/tmp/{ESCAPE}", data=b"pwned")], "absolute path"),
    "write through a symlink": ([Entry("lnk", "symlink", link="/tmp"), Entry(f"lnk/{ESCAPE}", data=b"pwned")],
                                "symbolic link"),
    "write through a relative symlink": ([Entry("d", "dir", mode=0o755),
                                          Entry("d/up", "symlink", link="../" * 12 + "tmp"),
                                          Entry(f"d/up/{ESCAPE}", data=b"pwned")], "symbolic link"),
    "hard link outside": ([Entry("h", "hardlink", link="../" * 12 + "etc/passwd")], "'..' in the path"),
    "hard link absolute": ([Entry("h", "hardlink", link="/etc/passwd")], "absolute path"),
    "hard link to a lower layer's file": ([Entry("h", "hardlink", link="bin/busybox")], "not in this layer"),
    "hard link through a symlink": ([Entry("etc", "symlink", link="/etc"), Entry("h", "hardlink", link="etc/passwd")],
                                    "symbolic link"),
    "hard link to a directory": ([Entry("d", "dir", mode=0o755), Entry("h", "hardlink", link="d")], "not a file"),
    "device node": ([Entry("usr/bin/mem", "chr", mode=0o666)], "device node 1:3"),
    "whiteout of ..": ([Entry("a", "dir", mode=0o755), Entry("a/.wh...")], "not a plain name"),
    "whiteout outside": ([Entry("../" * 12 + ".wh.etc")], "'..' in the path"),
    "huge pax header": ([Entry("big", data=b"x", pax={"comment": "y" * (MAX_HEADER + 1)})], "tar header"),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=lambda c: c.replace(" ", "-"))
def test_hostile_layer_refused(system_dir, tmp_path, case):
    entries, why = HOSTILE[case]
    layout = oci_layout(tmp_path / "img", [[Entry("ok", data=b"fine")], entries])
    with pytest.raises(LayerEntryError, match="layer sha256:") as e:
        catalog.import_image(str(layout), "hostile", log=lambda _: None)
    assert why in str(e.value)
    assert not Path("/tmp", ESCAPE).exists()
    assert not (system_dir / "templates/hostile").exists()
    leftover = [p for p in (system_dir / "layers").iterdir() if p.name.startswith(".")]
    assert leftover == [], "a refused layer leaves no half-unpacked directory"


def test_refusal_names_the_entry(system_dir, tmp_path):
    layout = oci_layout(tmp_path / "img", [[Entry("lnk", "symlink", link="/etc"), Entry("lnk/shadow", data=b"")]])
    with pytest.raises(LayerEntryError, match=r"entry 'lnk/shadow': 'lnk' is a symbolic link"):
        catalog.import_image(str(layout), "hostile", log=lambda _: None)


def test_links_out_are_kept_as_links_never_followed(system_dir, tmp_path):
    # A symlink may point anywhere: it is read inside the sandbox only. A later entry replacing it
    # replaces the link, not what it points at.
    canary = tmp_path / "canary"
    canary.write_text("untouched")
    layout = oci_layout(tmp_path / "img", [[Entry("passwd", "symlink", link=str(canary)),
                                            Entry("passwd", data=b"replaced")],
                                           [Entry("out", "symlink", link=str(canary))]])
    rootfs = catalog.import_image(str(layout), "links", log=lambda _: None)
    assert (rootfs / "passwd").read_text() == "replaced" and not (rootfs / "passwd").is_symlink()
    assert os.readlink(rootfs / "out") == str(canary)
    assert canary.read_text() == "untouched"


def test_a_later_entry_replaces_a_directory(system_dir, tmp_path):
    # tar's rule: the last entry for a path wins, a link replacing a directory (and what was in it)
    layout = oci_layout(tmp_path / "img", [[Entry("a", "dir", mode=0o755), Entry("a/b", "dir", mode=0o755),
                                            Entry("a/b/f", data=b"x"), Entry("a", "symlink", link="/tmp")]])
    rootfs = catalog.import_image(str(layout), "replaced", log=lambda _: None)
    assert os.readlink(rootfs / "a") == "/tmp"


def test_overlay_xattrs_of_a_layer_dropped(system_dir, tmp_path):
    # A layer cannot speak to overlayfs (an opaque or redirect attribute of its own choosing).
    pax = {"SCHILY.xattr.trusted.overlay.redirect": "/etc", "SCHILY.xattr.user.note": "kept"}
    layout = oci_layout(tmp_path / "img", [[Entry("f", data=b"x", pax=pax)]])
    rootfs = catalog.import_image(str(layout), "xattrs", log=lambda _: None)
    assert os.listxattr(rootfs / "f") == ["user.note"]


def test_dev_nodes_skipped(system_dir, tmp_path):
    # debootstrap's /dev nodes: not created (a sandbox's /dev is runc's), the image still imports
    layout = oci_layout(tmp_path / "img", [[Entry("dev", "dir", mode=0o755), Entry("dev/null", "chr", mode=0o666),
                                            Entry("f", data=b"x")]])
    rootfs = catalog.import_image(str(layout), "devs", log=lambda _: None)
    assert os.listdir(rootfs / "dev") == [] and (rootfs / "f").read_text() == "x"


def test_not_an_image(system_dir, tmp_path):
    (tmp_path / "junk").write_bytes(b"\0" * 10)
    with pytest.raises(ImageError):
        catalog.import_image(str(tmp_path / "junk"), "junk", log=lambda _: None)
