"""A build, described once: the steps every front end produces (a Dockerfile: dockerfile.py; E2B's
`Template()` builder: e2b_template.py, served over HTTP by service/templates_api.py) and the builder
runs (builder.py).

Steps are resolved: no variable is left to expand, paths are absolute, so a step's `key` (with its
parent's) names exactly what it makes, and the same input is the same cache entry whichever front
end wrote it.

    op          args
    from        source: a template name or an image reference (image.py)
    run         cmd: a shell string or an argv; env: variables of this step only (build args)
    copy        srcs: paths in the context; dest: absolute; chown: "user[:group]" or None;
                chmod: an octal string or None; extract: ADD's unpacking of a local tar archive
    env         env: variables set from here on
    workdir     path: absolute (made if missing)
    user        user: a name or uid
    cmd         cmd: an argv
    entrypoint  entrypoint: an argv
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

OPS = ("from", "run", "copy", "env", "workdir", "user", "cmd", "entrypoint")


@dataclass(frozen=True)
class Step:
    """One build step: `op` and its `args` (see the module docstring); `line` where it was written
    (a Dockerfile's line; 0: none) and `text` as written, for logs and errors."""

    op: str
    args: dict = field(default_factory=dict)
    line: int = 0
    text: str = ""

    def where(self) -> str:
        return f"line {self.line}: {self.text}" if self.line else self.text or self.op

    def key(self, parent: str, inputs: str = "") -> str:
        """The cache key of this step after `parent`'s: sha256 over the parent key, the op, its args
        and `inputs` (the hash of what it reads beyond its args: a COPY's files)."""
        doc = json.dumps([parent, self.op, self.args, inputs], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(doc.encode()).hexdigest()
