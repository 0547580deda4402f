"""E2B's template definition (the e2b SDK's `Template()` builder, as `Template.to_json` writes it and
its `Template.build` sends it: the body of `POST /v2/templates/{id}/builds/{build}`) read into the
same build steps a Dockerfile gives (steps.py), so one builder serves both.

    {"fromTemplate": "base" | "fromImage": "python:3.12", "force": bool,
     "steps": [{"type": "RUN" | "COPY" | "ENV" | "WORKDIR" | "USER", "args": [...], "force": bool,
                "filesHash": "..."}], "startCmd": "...", "readyCmd": "..."}

RUN's args are [command, user?] (the SDK's `apt_install`, `pip_install`, `npm_install` are RUNs as
root); COPY's [src, dest, user, mode] with src relative to the SDK's file context; a step's `force`
(or the template's) skips the cache for it. `fromImage` is a registry reference (pulled by skopeo),
or one of our image sources (oci:, docker-archive:, ...). `startCmd` / `readyCmd` are returned
beside the steps: a warm template's start is its builder's, not a step. A private registry
(`fromImageRegistry`) and unknown step types are refused by name.
"""

from __future__ import annotations

import posixpath

from k3sys.sandbox.errors import InvalidArgumentError
from k3sys.sandbox.runtime.oci.steps import Step

_SOURCES = ("oci:", "oci-archive:", "docker-archive:", "docker://")


def _fail(i: int, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"E2B template step {i}: {why}")


def read_e2b_template(doc: dict) -> tuple[list[Step], dict[str, str]]:
    """The build steps of E2B template definition `doc`, and its {"start_cmd", "ready_cmd"} (those given)."""
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"E2B template: expected an object, got {type(doc).__name__}")
    if doc.get("fromImageRegistry"):
        raise InvalidArgumentError("E2B template: fromImageRegistry (private registry credentials) is not supported")
    force = bool(doc.get("force"))
    if doc.get("fromTemplate"):
        source = str(doc["fromTemplate"])
    elif doc.get("fromImage"):
        image = str(doc["fromImage"])
        source = image if image.startswith(_SOURCES) else f"docker://{image}"
    else:
        raise InvalidArgumentError("E2B template: neither fromTemplate nor fromImage")
    steps = [Step("from", {"source": source}, 0, f"FROM {source}")]
    workdir = "/"
    for i, s in enumerate(doc.get("steps") or [], 1):
        kind, args = s.get("type"), [str(a) for a in s.get("args") or []]
        extra = {"force": True} if force or s.get("force") else {}
        text = f"{kind} {' '.join(args)}"
        if kind == "RUN" and args:
            steps.append(Step("run", {"cmd": args[0], "env": {}, "user": args[1] if len(args) > 1 and args[1]
                                      else None, **extra}, 0, text))
        elif kind == "COPY" and len(args) >= 2:
            dest = posixpath.normpath(posixpath.join(workdir, args[1])) + ("/" if args[1].endswith("/") else "")
            steps.append(Step("copy", {"srcs": [args[0]], "dest": dest.replace("//", "/"),
                                       "chown": args[2] if len(args) > 2 and args[2] else None,
                                       "chmod": args[3] if len(args) > 3 and args[3] else None, "extract": False,
                                       **extra}, 0, text))
        elif kind == "ENV" and len(args) % 2 == 0:
            steps.append(Step("env", {"env": dict(zip(args[::2], args[1::2], strict=True))}, 0, text))
        elif kind == "WORKDIR" and len(args) == 1:
            workdir = posixpath.normpath(posixpath.join(workdir, args[0]))
            steps.append(Step("workdir", {"path": workdir, **extra}, 0, text))
        elif kind == "USER" and len(args) == 1:
            steps.append(Step("user", {"user": args[0]}, 0, text))
        else:
            raise _fail(i, f"{kind!r} with {len(args)} argument(s) is not supported")
    start = {k: str(doc[f]) for k, f in (("start_cmd", "startCmd"), ("ready_cmd", "readyCmd")) if doc.get(f)}
    return steps, start
