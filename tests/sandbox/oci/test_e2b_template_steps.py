"""E2B's `Template()` builder (the real e2b SDK, offline: `Template.to_json`) read into build steps and
built by the same builder as a Dockerfile: envs, workdir, copy with a mode, run_cmd as a given user,
set_user, force; its start and ready commands handed back, not run."""

from __future__ import annotations

import json
import os

import pytest
from e2b import Template

from k3sys.sandbox import Sandbox
from k3sys.sandbox.errors import InvalidArgumentError
from k3sys.sandbox.runtime.oci.builder import Builder
from k3sys.sandbox.runtime.oci.e2b_template import read_e2b_template

pytestmark = [pytest.mark.embedded, pytest.mark.timeout(300)]


def test_sdk_template_built(rt, system_dir, tmp_path):
    (tmp_path / "app.sh").write_text("#!/bin/sh\necho app\n")
    t = (Template(file_context_path=str(tmp_path)).from_template("busybox")
         .set_envs({"MODE": "e2b", "TWO": "two words"}).set_workdir("/app")
         .copy("app.sh", "/app/", mode=0o755)
         .run_cmd(["id -un > /tmp/who", "echo built > /app/built"], user="root")
         .run_cmd("id -un > /tmp/as-nobody", user="nobody")
         .set_user("nobody").set_start_cmd("sleep 1000", "true"))
    steps, start = read_e2b_template(json.loads(Template.to_json(t)))
    assert start == {"start_cmd": "sleep 1000", "ready_cmd": "true"}
    b = Builder(rt, log=lambda _: None, memory_mb=256)
    first = b.build(steps, "from-e2b", tmp_path)
    root = system_dir / "templates/from-e2b/rootfs"
    assert (root / "tmp/who").read_text() == "root\n" and (root / "tmp/as-nobody").read_text() == "nobody\n"
    assert os.stat(root / "app/app.sh").st_mode & 0o777 == 0o755
    with Sandbox.create("from-e2b", runtime=rt, memory_mb=256) as s:
        r = s.commands.run('echo "$MODE $TWO"; pwd; id -un; ./app.sh; cat built')
        assert r.stdout == "e2b two words\n/app\nnobody\napp\nbuilt\n", r
    # the same definition again: every step cached; with force, the forced step (and those after) run
    again = b.build(steps, "from-e2b-again", tmp_path)
    assert again.steps.count("ran") == 0 and again.layers == first.layers
    forced = json.loads(Template.to_json(t))
    forced["steps"][3]["force"] = True  # the first run_cmd
    steps, _ = read_e2b_template(forced)
    assert b.build(steps, "from-e2b-forced", tmp_path).steps.count("ran") == 2


def test_refused():
    with pytest.raises(InvalidArgumentError, match="fromImageRegistry"):
        read_e2b_template({"fromImage": "x", "fromImageRegistry": {"type": "aws"}, "steps": []})
    with pytest.raises(InvalidArgumentError, match="step 1: 'HEALTH'"):
        read_e2b_template({"fromTemplate": "base", "steps": [{"type": "HEALTH", "args": []}]})
    steps, _ = read_e2b_template({"fromImage": "python:3.12", "steps": []})
    assert steps[0].args == {"source": "docker://python:3.12"}
