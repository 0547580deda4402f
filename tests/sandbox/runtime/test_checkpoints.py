"""Checkpoints: incremental store writes, file system semantics through sealing (deleted template
files, replaced directories), fork independence, and restores from the store alone."""

from __future__ import annotations

import pytest

from k3sys.sandbox import Runtime, Sandbox

pytestmark = pytest.mark.timeout(180)

# ~24 MiB of memory the shell keeps resident (a variable), so images are mostly pages.
# (The loop keeps the shell alive: a trailing plain `sleep` would be exec'd in its place.)
HOLD_MEMORY = ("sh -c 'x=$(head -c 25000000 /dev/zero | tr \"\\0\" b); echo ready > /tmp/ready; "
               "while :; do sleep 1000; done' >/dev/null 2>&1 &")


def wait_file(s: Sandbox, path: str) -> None:
    assert s.commands.run(f"for i in $(seq 200); do test -e {path} && exit 0; sleep 0.05; done; exit 1",
                          timeout=30).exit_code == 0


def test_second_checkpoint_writes_few_new_bytes(sbx):
    sbx.commands.run(HOLD_MEMORY)
    wait_file(sbx, "/tmp/ready")
    first = sbx.checkpoint()
    assert first.bytes_total > 25_000_000
    sbx.files.write("/root/small-change", b"x" * 10_000)
    second = sbx.checkpoint()
    assert second.parent == first.id
    assert second.bytes_total > 25_000_000
    assert second.bytes_new <= 0.05 * second.bytes_total, (second.bytes_new, second.bytes_total)


def test_file_system_changes_survive_sealing_and_restore(sbx):
    # Delete a template file, replace a template directory wholesale, add and modify files.
    script = (
        "rm /etc/group && rm -rf /home && mkdir /home && echo new > /home/only-this"
        " && echo extra >> /etc/passwd && mkdir -p /var/data && echo 1 > /var/data/one"
        " && ln -s /var/data/one /root/link && chmod 600 /var/data/one"
    )
    assert sbx.commands.run(script).exit_code == 0
    ck1 = sbx.checkpoint()

    def check(s: Sandbox) -> None:
        assert not s.files.exists("/etc/group")
        assert [e.name for e in s.files.list("/home")] == ["only-this"]
        assert s.files.read_text("/etc/passwd").endswith("extra\n")
        assert s.commands.run("stat -c %a /var/data/one; readlink /root/link").stdout == "600\n/var/data/one\n"

    with Sandbox.restore(ck1) as r1:
        check(r1)
        # A restored sandbox stands on the checkpoint's sealed layer; change more and seal again:
        # the new checkpoint must fold the layer and the new upper into one tree.
        assert r1.commands.run("rm /var/data/one && echo 2 > /var/data/two && rm /bin/vi").exit_code == 0
        ck2 = r1.checkpoint()
        assert ck2.parent == ck1.id
    with Sandbox.restore(ck2) as r2:
        assert not r2.files.exists("/etc/group") and not r2.files.exists("/var/data/one")
        assert r2.files.read_text("/var/data/two") == "2\n"
        assert not r2.files.exists("/bin/vi") and r2.files.exists("/bin/ls")
        assert [e.name for e in r2.files.list("/home")] == ["only-this"]
    # The source never saw its copies' changes.
    check(sbx)
    assert sbx.files.exists("/bin/vi")


def test_forks_are_independent(sbx):
    sbx.files.write("/shared", b"original")
    kids = sbx.fork(3)
    try:
        kids[0].files.write("/shared", b"changed in kid 0")
        kids[1].commands.run("echo kid1 > /only-kid1")
        assert sbx.files.read("/shared", format="bytes") == b"original"
        assert kids[1].files.read("/shared", format="bytes") == b"original"
        assert kids[2].files.read("/shared", format="bytes") == b"original"
        assert not sbx.files.exists("/only-kid1") and not kids[2].files.exists("/only-kid1")
        sbx.files.write("/shared", b"changed in source")
        assert [k.files.read("/shared", format="bytes") for k in kids] == [b"changed in kid 0", b"original",
                                                                         b"original"]
        # Processes are separate too: one fork's pid namespace does not see another's commands.
        kids[0].commands.run("sleep 1000 >/dev/null 2>&1 &")
        assert "sleep 1000" not in kids[1].commands.run("ps -o args").stdout
    finally:
        for k in kids:
            k.kill()


def test_fork_stores_nothing_and_its_children_stand_alone(rt, sbx):
    """A fork adds no checkpoint to the store and its children need none: each runs commands,
    checkpoints, hibernates (dropping the fork's shared layer once both have) and resumes intact."""
    sbx.files.write("/root/f", "v1")
    ck = sbx.checkpoint()
    before = [c.id for c in rt.checkpoints()]
    kids = sbx.fork(2)
    try:
        assert [c.id for c in rt.checkpoints()] == before
        # Their latest stored ancestor is the source's head, which the fork did not move.
        assert sbx.info.head == ck.id and [k.info.head for k in kids] == [ck.id, ck.id]
        for i, k in enumerate(kids):
            k.files.write("/root/k", str(i))
            assert k.commands.run("cat /root/f /root/k").stdout == f"v1{i}"
            assert k.checkpoint().parent == ck.id
            k.hibernate()
        for i, k in enumerate(kids):
            k.resume()
            assert k.commands.run("cat /root/f /root/k").stdout == f"v1{i}"
        assert len(rt.checkpoints()) == len(before) + 4  # the children's own, none of the fork's
    finally:
        for k in kids:
            k.kill()


def test_restore_from_the_store_alone(private_root):
    """A checkpoint survives its runtime: another runtime (no cached layers) restores it from the store."""
    root = private_root
    with Runtime(root) as rt:
        s = Sandbox.create(runtime=rt)
        s.commands.run("echo persisted > /root/p")
        ck = s.hibernate()
        s.kill()  # the checkpoint outlives the sandbox
        assert Sandbox.list(runtime=rt) == []
    assert not any((root / "layers").iterdir())
    with Runtime(root) as rt:
        with Sandbox.restore(ck.id, runtime=rt) as r:
            assert r.files.read_text("/root/p") == "persisted\n"
            assert r.commands.run("cat /root/p").stdout == "persisted\n"
        assert rt.store.verify() == []


def test_hibernation_of_a_sandbox_paused_right_after_a_command(sbx):
    # The host closes a call's connection after its result; a pause right then can freeze the agent
    # before it has closed its end, and CRIU cannot dump that socket. The dump of a frozen sandbox
    # lets the agent drop it first (the rollout engine's evictions hit this on most turns).
    for i in range(6):
        assert sbx.commands.run(f"echo {i} >> /root/log").exit_code == 0
        sbx.pause()
        sbx.hibernate()
        sbx.resume()
    assert sbx.files.read_text("/root/log").split() == [str(i) for i in range(6)]
