"""A Dockerfile read into build steps (steps.py).

Parsing is E2B's own port of BuildKit's parser and shell lexer (`e2b-dockerfile-utils`: line
continuations, the escape directive, JSON and shell forms, `${VAR:-default}`), not a parser of
ours: it is what E2B's SDK reads Dockerfiles with, so a file it accepts reads the same here.

Supported: FROM (one stage: a template or an image reference), ARG (before FROM, for FROM; after it,
for the steps below, given by `build_args` or its default), ENV, RUN (shell or exec form), COPY and
ADD from the context (`--chown`, `--chmod`; ADD unpacks a local tar archive, never fetches a URL),
WORKDIR, USER, CMD, ENTRYPOINT. EXPOSE, LABEL and MAINTAINER are read and have no effect (every port
of a sandbox is reachable; labels are not kept). Anything else (SHELL, VOLUME, HEALTHCHECK, ONBUILD,
STOPSIGNAL, a second FROM, `COPY --from`, `RUN --mount`, heredocs) is refused by name with its line:
a build that silently dropped it would not be the image the file describes.
"""

from __future__ import annotations

import posixpath

from e2b_dockerfile_utils import DockerfileSyntaxError, ShellLex, parse_dockerfile_ast

from k3sys.sandbox.errors import DockerfileError
from k3sys.sandbox.runtime.oci.steps import Step

_NO_EFFECT = {"EXPOSE", "LABEL", "MAINTAINER"}
_COPY_FLAGS = ("--chown=", "--chmod=")


def _fail(line: int, name: str, why: str) -> DockerfileError:
    return DockerfileError(f"Dockerfile line {line}: {name}: {why}")


def read_dockerfile(text: str, build_args: dict[str, str] | None = None) -> list[Step]:
    """The steps of Dockerfile `text`; DockerfileError names the first instruction refused."""
    given = dict(build_args or {})
    try:
        ast = parse_dockerfile_ast(text)
    except DockerfileSyntaxError as e:
        raise DockerfileError(str(e).replace("Dockerfile parse error on line", "Dockerfile line")) from None
    esc = ast.escape_token
    steps: list[Step] = []
    meta_args: dict[str, str] = {}  # ARGs before FROM: for FROM only
    args: dict[str, str] = {}  # ARGs in scope after FROM
    env: dict[str, str] = {}
    workdir = "/"

    def expand(word: str) -> str:
        return ShellLex(esc, env={**args, **env}, skip_unset_env=False).process_word(word)

    for ins in ast.instructions:
        name, line = ins.name, ins.start_line
        text_ = ins.original.strip()
        if ins.heredocs:
            raise _fail(line, name, "heredocs are not supported")
        if name in _NO_EFFECT:
            continue
        if name == "ARG":
            for word in ins.args:
                key, eq, default = word.partition("=")
                scope = meta_args if not steps else args
                lex = ShellLex(esc, env={**meta_args} if not steps else {**args, **env}, skip_unset_env=False)
                if key in given:
                    scope[key] = given[key]
                elif eq:
                    scope[key] = lex.process_word(default)
                elif not steps and key in meta_args:
                    pass
                elif steps and key in meta_args:  # `ARG X` after FROM takes the global default
                    scope[key] = meta_args[key]
            continue
        if name == "FROM":
            if steps:
                raise _fail(line, name, "a second FROM: multi-stage builds are not supported")
            if ins.flags:
                raise _fail(line, name, f"flags {ins.flags} are not supported")
            if len(ins.args) not in (1, 3):
                raise _fail(line, name, "expected FROM SOURCE [AS NAME]")
            source = ShellLex(esc, env=meta_args, skip_unset_env=False).process_word(ins.args[0])
            steps.append(Step("from", {"source": source}, line, text_))
            continue
        if not steps:
            raise _fail(line, name, "the first instruction must be FROM (ARG may come before it)")
        if name == "ENV":
            new = {}
            for i in range(0, len(ins.args), 3):
                new[ins.args[i]] = expand(ins.args[i + 1])
                env[ins.args[i]] = new[ins.args[i]]
            steps.append(Step("env", {"env": new}, line, text_))
        elif name == "RUN":
            if ins.flags:
                raise _fail(line, name, f"flags {ins.flags} are not supported")
            cmd: str | list[str] = list(ins.args) if ins.json else ins.args[0] if ins.args else ""
            if not cmd:
                raise _fail(line, name, "no command")
            steps.append(Step("run", {"cmd": cmd, "env": {k: v for k, v in args.items() if k not in env}},
                              line, text_))
        elif name in ("COPY", "ADD"):
            steps.append(_copy(ins.flags, [expand(a) for a in ins.args], workdir, name == "ADD", line, text_))
        elif name == "WORKDIR":
            workdir = posixpath.normpath(posixpath.join(workdir, expand(ins.args[0]) if ins.args else ""))
            steps.append(Step("workdir", {"path": workdir}, line, text_))
        elif name == "USER":
            user = expand(ins.args[0]) if ins.args else ""
            if not user:
                raise _fail(line, name, "no user")
            steps.append(Step("user", {"user": user.split(":", 1)[0]}, line, text_))
        elif name in ("CMD", "ENTRYPOINT"):
            argv = list(ins.args) if ins.json else ["/bin/sh", "-c", ins.args[0]] if ins.args else []
            steps.append(Step(name.lower(), {name.lower(): argv}, line, text_))
        else:
            raise _fail(line, name, "not supported")
    if not steps:
        raise DockerfileError("Dockerfile: no FROM")
    return steps


def _copy(flags: list[str], words: list[str], workdir: str, add: bool, line: int, text: str) -> Step:
    name = "ADD" if add else "COPY"
    opts = {}
    for f in flags:
        if not f.startswith(_COPY_FLAGS):
            raise _fail(line, name, f"flag {f} is not supported (only --chown and --chmod)")
        key, _, value = f[2:].partition("=")
        opts[key] = value
    if len(words) < 2:
        raise _fail(line, name, "expected SRC... DEST")
    srcs, dest = words[:-1], words[-1]
    if add and any("://" in s for s in srcs):
        raise _fail(line, name, "a URL source: builds fetch nothing (download it into the context)")
    if opts.get("chmod") is not None:
        try:
            int(opts["chmod"], 8)
        except ValueError:
            raise _fail(line, name, f"--chmod: expected an octal mode, got {opts['chmod']!r}") from None
    absolute = posixpath.normpath(posixpath.join(workdir, dest))
    if (dest.endswith(("/", "/.")) or dest == ".") and absolute != "/":
        absolute += "/"  # a directory, whatever the sources are
    return Step("copy", {"srcs": srcs, "dest": absolute, "chown": opts.get("chown"), "chmod": opts.get("chmod"),
                         "extract": add}, line, text)
