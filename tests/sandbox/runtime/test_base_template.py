"""The `base` template (E2B's default name): Debian with bash, python3, git and the user `user`
(uid 1000, /home/user), whom commands and file calls run as unless they name another user; a
sandbox with a process of `user` running checkpoints, hibernates and resumes, and one restored from
its checkpoint keeps the default user."""

from __future__ import annotations

import pytest

from k3sys.sandbox import Sandbox
from k3sys.sandbox.errors import PermissionDeniedError
from k3sys.sandbox.runtime.templates import template_names, template_rootfs, template_user

pytestmark = pytest.mark.timeout(600)  # the first run builds `debian` (minutes) unless cached


@pytest.fixture(scope="module")
def base(rt):
    return template_rootfs("base")


def test_template_has_user_bash_python_git(base):
    assert "base" in template_names()
    for tool in ("bin/bash", "usr/bin/python3", "usr/bin/git", "bin/ls"):
        assert (base / tool).exists(), tool
    passwd = dict(line.split(":", 1) for line in (base / "etc/passwd").read_text().splitlines())
    assert passwd["user"] == "x:1000:1000::/home/user:/bin/bash"
    assert "user:x:1000:" in (base / "etc/group").read_text().splitlines()
    home = base / "home/user"
    assert (home.stat().st_uid, home.stat().st_gid) == (1000, 1000)
    assert (home / ".bashrc").stat().st_uid == 1000
    assert template_user("base") == "user"
    assert template_user("busybox") is None and template_user("no-such-template") is None


def test_sandbox_runs_as_user_by_default_root_on_request(rt, base):
    with Sandbox.create("base", runtime=rt, memory_mb=256) as s:
        r = s.commands.run("id -un; id -u; bash -c 'echo $BASH_VERSION' | cut -c1; python3 -c 'print(6*7)'; "
                           "git --version | cut -d' ' -f1-2")
        assert r.stdout.split("\n")[:5] == ["user", "1000", "5", "42", "git version"], r
        # Files too: written as `user` (owned by 1000), refused where only root may write.
        s.files.write("/home/user/notes.txt", "hi")
        assert s.commands.run("stat -c %u:%g /home/user/notes.txt").stdout.strip() == "1000:1000"
        with pytest.raises(PermissionDeniedError):
            s.files.write("/root/x", "no")
        # A checkpoint with a live process of `user` (CRIU reads its rlimits from /proc where the
        # host withholds CAP_SYS_RESOURCE: scripts/sandbox/patches/criu-4.1-4-*).
        bg = s.commands.run("sleep 600", background=True)
        pid = bg.pid
        ck = s.checkpoint()
        s.hibernate()
        s.resume()
        assert bg.running
    with Sandbox.restore(ck, runtime=rt) as r2:
        assert r2.commands.run("id -un").stdout == "user\n"
        assert r2.files.read_text("/home/user/notes.txt") == "hi"
        assert [p.pid for p in r2.commands.list() if p.running] == [pid]


@pytest.mark.embedded
def test_root_on_request(rt, base):
    with Sandbox.create("base", runtime=rt, memory_mb=256) as s:
        # A call that names a user overrides the template's (E2B's `user="root"` reaches the agent so).
        agent = rt.agents.get(s.id)
        out, end = agent.run("id -u; touch /root/ok", user="root")
        assert (out.text("stdout"), end.exit) == (b"0\n", 0)
        assert agent.stat("/root/ok", user="root")["uid"] == "0"
        assert s.commands.run("id -u").stdout == "1000\n"  # the default is untouched
