"""E2B's SDK surface on k3sys's `Sandbox`: a program written for `from e2b import Sandbox` runs with
only the import changed, embedded (no server), and gives what it gives through the official `e2b`
SDK against a served k3sys. Then every E2B-shaped method, and each k3sys alias of one."""

from __future__ import annotations

import asyncio
import inspect
import textwrap
import time

import pytest

import k3sys.sandbox as sandbox_pkg
from k3sys.sandbox import (
    AsyncSandbox,
    CommandExitError,
    CommandExitException,
    CommandResult,
    InvalidArgumentError,
    Sandbox,
    SandboxFileNotFoundError,
    TimeoutException,
    WriteInfo,
)

pytestmark = pytest.mark.timeout(180)

# One program, written for E2B's SDK; `template` and `conn` are what differs between the two runs.
PROGRAM = textwrap.dedent('''
    def program(Sandbox, CommandExitException, template, conn):
        kind = lambda t: getattr(t, "value", t)  # E2B's FileType enum, or k3sys's str
        out = []
        sbx = Sandbox.create(template=template, metadata={"job": "t"}, envs={"GREETING": "hi"}, **conn)
        try:
            r = sbx.commands.run('echo "$GREETING $EXTRA"; echo warn >&2', envs={"EXTRA": "there"}, cwd="/tmp")
            out.append(("run", r.stdout, r.stderr, r.exit_code))
            try:
                sbx.commands.run("echo partial; exit 7")
            except CommandExitException as e:
                out.append(("exit", e.stdout, e.exit_code))
            seen = []
            r = sbx.commands.run("echo one; echo two", on_stdout=seen.append)
            out.append(("callback", "".join(seen), r.stdout))
            h = sbx.commands.run("echo bg; sleep 0.1; echo done", background=True)
            out.append(("handle", h.wait().stdout))
            w = sbx.files.write("/tmp/dir/a.txt", "alpha")
            out.append(("write", w.name, kind(w.type), w.path))
            raw = bytes(sbx.files.read("/tmp/dir/a.txt", format="bytes"))
            out.append(("read", sbx.files.read("/tmp/dir/a.txt"), raw))
            out.append(("exists", sbx.files.exists("/tmp/dir/a.txt"), sbx.files.exists("/tmp/nope")))
            out.append(("make_dir", sbx.files.make_dir("/tmp/made"), sbx.files.make_dir("/tmp/made")))
            moved = sbx.files.rename("/tmp/dir/a.txt", "/tmp/made/b.txt")
            out.append(("rename", moved.name, moved.path, kind(sbx.files.get_info("/tmp/made/b.txt").type)))
            out.append(("list", sorted(e.name for e in sbx.files.list("/tmp/made"))))
            sbx.files.remove("/tmp/made")
            out.append(("removed", sbx.files.exists("/tmp/made")))
            out.append(("running", sbx.is_running(), sbx.get_info().sandbox_id == sbx.sandbox_id))
        finally:
            sbx.kill()
        return out
''')

EXPECTED = [
    ("run", "hi there\n", "warn\n", 0),
    ("exit", "partial\n", 7),
    ("callback", "one\ntwo\n", "one\ntwo\n"),
    ("handle", "bg\ndone\n"),
    ("write", "a.txt", "file", "/tmp/dir/a.txt"),
    ("read", "alpha", b"alpha"),
    ("exists", True, False),
    ("make_dir", True, False),
    ("rename", "b.txt", "/tmp/made/b.txt", "file"),
    ("list", ["b.txt"]),
    ("removed", False),
    ("running", True, True),
]


def _program():
    scope: dict = {}
    exec(PROGRAM, scope)
    return scope["program"]


@pytest.mark.embedded
def test_e2b_program_runs_embedded(rt):
    assert _program()(Sandbox, CommandExitException, None, {"runtime": rt}) == EXPECTED


def test_e2b_program_runs_on_the_official_sdk_against_a_served_k3sys(service, monkeypatch):
    e2b = pytest.importorskip("e2b")
    for k, v in {"E2B_API_URL": service.url, "E2B_SANDBOX_URL": service.url, "E2B_API_KEY": service.key}.items():
        monkeypatch.setenv(k, v)
    # E2B runs commands with `bash -l`: the `base` template (E2B's default), which has bash.
    assert _program()(e2b.Sandbox, e2b.CommandExitException, "base", {}) == EXPECTED


def test_exceptions_carry_e2b_names():
    for name in sandbox_pkg.errors.E2B_NAMES:
        assert name in sandbox_pkg.__all__ and issubclass(getattr(sandbox_pkg, name), Exception), name
    assert issubclass(CommandExitException, sandbox_pkg.SandboxException)
    assert TimeoutException is sandbox_pkg.CommandTimeoutError


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.name != "self" and p.kind is not p.VAR_KEYWORD]


@pytest.mark.parametrize("ours, theirs", [
    ("sdk.commands.Commands.run", "sandbox_sync.commands.command.Commands.run"),
    ("sdk.commands.Commands.connect", "sandbox_sync.commands.command.Commands.connect"),
    ("sdk.commands.Commands.list", "sandbox_sync.commands.command.Commands.list"),
    ("sdk.commands.CommandHandle.wait", "sandbox_sync.commands.command_handle.CommandHandle.wait"),
    *[(f"sdk.files.Files.{m}", f"sandbox_sync.filesystem.filesystem.Filesystem.{m}")
      for m in ("read", "write", "write_files", "list", "exists", "get_info", "remove", "rename", "make_dir")],
    ("sdk.api.Sandbox.create", "sandbox_sync.main.Sandbox.create"),
])
def test_signatures_follow_e2b(ours, theirs):
    """E2B's parameters (names, order, defaults) open each E2B-shaped method's signature; what
    follows them is k3sys's, by keyword. Read from the installed `e2b` package."""
    import importlib

    pytest.importorskip("e2b")

    def resolve(root: str, dotted: str):
        mod, *attrs = dotted.rsplit(".", 2) if dotted.count(".") > 1 else (dotted, )
        obj = importlib.import_module(f"{root}.{mod}")
        for a in attrs:
            obj = getattr(obj, a)
        return obj
    mine, e2bs = _params(resolve("k3sys.sandbox", ours)), _params(resolve("e2b", theirs))
    e2bs = [(n, d) for n, d in e2bs if n not in ("retain_output", "gzip", "use_octet_stream", "metadata",
                                                  "stream_idle_timeout", "include_entry", "allow_network_mounts")
            or theirs.endswith("create")]
    names = [n for n, _ in e2bs]
    if theirs.endswith("create"):  # E2B's first six; its MCP, IAM, volumes and the like have no k3sys meaning
        e2bs, names = e2bs[:6], names[:6]
    assert [n for n, _ in mine[:len(e2bs)]] == names, (mine, names)
    for (n, d), (_, theirs_d) in zip(mine, e2bs, strict=False):  # a default where E2B has none is k3sys's
        assert theirs_d is inspect.Parameter.empty or d == theirs_d, (n, d, theirs_d)


def test_handle_iteration_disconnect_kill_and_pid(sbx):
    h = sbx.commands.run("echo out; echo err >&2; sleep 1000", background=True)
    assert isinstance(h.pid, int) and h.pid > 0
    got: list = []
    for event in h:
        got.append(event)
        if ("out\n", None, None) in got and (None, "err\n", None) in got:
            h.disconnect()  # the iteration ends; the command runs on
    assert h.running
    assert h.kill() is True
    with pytest.raises(CommandExitError, match="code 137"):
        h.wait(timeout=10)
    assert sbx.commands.kill(h.pid) is False


def test_run_as_user_with_open_stdin(sbx):
    assert sbx.commands.run("id -u", user="1000").stdout == "1000\n"
    sbx.files.write("/tmp/mine", "x", user="1000")
    assert sbx.files.get_info("/tmp/mine", user="1000").uid == 1000
    h = sbx.commands.run("read x; echo got:$x; cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "abc\n")
    sbx.commands.send_stdin(h.pid, b"rest")
    sbx.commands.close_stdin(h.pid)
    assert h.wait(on_stderr=print).stdout == "got:abc\nrest"


def test_read_formats_write_files_and_stream(sbx):
    infos = sbx.files.write_files([{"path": "/w/a", "data": b"\xff1"}, {"path": "/w/b", "data": "2"}])
    assert infos == [WriteInfo("a", "file", "/w/a"), WriteInfo("b", "file", "/w/b")]
    assert sbx.files.read("/w/a") == "\ufffd1" and sbx.files.read("/w/a", format="bytes") == b"\xff1"
    assert b"".join(sbx.files.read("/w/b", format="stream")) == b"2"
    with pytest.raises(InvalidArgumentError, match="format"):
        sbx.files.read("/w/a", format="json")
    with pytest.raises(SandboxFileNotFoundError):
        sbx.files.get_info("/w/none")


def test_command_timeout_is_e2b_timeout_exception(sbx):
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=0.5)


def test_create_metadata_envs_connect_list_pause_snapshot_fork(rt):
    sbx = Sandbox.create(template="busybox", timeout=600, metadata={"owner": "me"}, envs={"E": "1"}, runtime=rt)
    try:
        info = sbx.get_info()
        assert info.deadline is not None and info.deadline - time.time() > 500
        listed = Sandbox.list(runtime=rt)
        assert sbx in listed and listed.has_next
        assert sbx.sandbox_id in {i.sandbox_id for i in listed.next_items()} and not listed.has_next
        e2b = pytest.importorskip("e2b")
        assert Sandbox.list(e2b.SandboxQuery(metadata={"owner": "me"}), runtime=rt) == [sbx]
        assert Sandbox.list(e2b.SandboxQuery(metadata={"owner": "you"}), runtime=rt) == []
        assert sbx.pause() is True and sbx.get_info().state == "paused"
        back = Sandbox.connect(sbx.sandbox_id, runtime=rt)
        assert back.get_info().state == "running"
        assert back.commands.run("echo $E").stdout == "1\n"
        snap = sbx.create_snapshot()
        restored = Sandbox.create(template=snap.snapshot_id, runtime=rt)
        try:
            assert restored.sandbox_id != sbx.sandbox_id and restored.is_running()
        finally:
            restored.kill()
        kids = sbx.fork(count=2, timeout=600)
        try:
            assert len(kids) == 2 and all(k.commands.run("echo $E").stdout == "1\n" for k in kids)
        finally:
            for k in kids:
                k.kill()
    finally:
        assert sbx.kill() is True


def test_create_keeps_metadata(rt):
    with Sandbox.create(metadata={"owner": "me"}, runtime=rt) as sbx:
        assert sbx.get_info().metadata == {"owner": "me"}
        assert Sandbox.get(sbx.id, runtime=rt).get_info().template_id == "busybox"


def test_aliases_of_the_earlier_k3sys_names(sbx):
    """Each k3sys name that E2B spells differently still works: env= (envs=), stdin bytes (E2B:
    a bool), wait(timeout) positional, read_text, info, timeout_s= (timeout=), fork(n)."""
    assert sbx.commands.run("echo $A", env={"A": "old"}).stdout == "old\n"
    with pytest.raises(InvalidArgumentError, match="envs"):
        sbx.commands.run("true", env={"A": "1"}, envs={"A": "2"})
    assert sbx.commands.run("cat", stdin=b"piped").stdout == "piped"
    assert sbx.commands.run("cat", stdin="text").stdout == "text"
    assert sbx.commands.run("echo w", background=True).wait(10).stdout == "w\n"
    sbx.files.write("/t", "x")
    assert sbx.files.read_text("/t") == "x"
    assert sbx.info.id == sbx.get_info().id == sbx.sandbox_id
    assert [e.name for e in sbx.files.list("/")] and sbx.files.watch_dir("/tmp", True).recursive
    with pytest.raises(InvalidArgumentError, match="timeout"):
        Sandbox.create(timeout=5, timeout_s=5, runtime=sbx._rt)
    (kid,) = sbx.fork(1)
    kid.kill()


def test_async_sandbox_has_the_same_surface(rt):
    async def main() -> list:
        sbx = await AsyncSandbox.create(envs={"E": "a"}, runtime=rt)
        try:
            r = await sbx.commands.run("echo $E")
            with pytest.raises(CommandExitError):
                await sbx.commands.run("exit 2")
            seen: list = []
            await sbx.commands.run("echo cb", on_stdout=seen.append)
            await sbx.files.write("/x", "1")
            made = await sbx.files.make_dir("/d")
            infos = await sbx.files.write_files([{"path": "/d/a", "data": "a"}])
            return [r.stdout, seen, await sbx.files.read("/x"), made, infos, (await sbx.get_info()).state]
        finally:
            await sbx.kill()
    assert asyncio.run(main()) == ["a\n", ["cb\n"], "1", True, [WriteInfo("a", "file", "/d/a")], "running"]


def test_command_result_has_e2b_fields():
    assert CommandResult("o", "e", 0).error is None


@pytest.mark.parametrize("sync_cls, async_cls", [
    (sandbox_pkg.sdk.files.Files, sandbox_pkg.sdk.files.AsyncFiles),
    (sandbox_pkg.sdk.commands.Commands, sandbox_pkg.sdk.commands.AsyncCommands),
])
def test_async_siblings_say_what_they_return(sync_cls, async_cls):
    """Each asyncio method is a coroutine function with its blocking sibling's parameters and return
    hint (not a sync hint over an awaitable)."""
    names = {n for n in vars(sync_cls) if not n.startswith("_")}
    assert names == {n for n in vars(async_cls) if not n.startswith("_")}
    for n in names:
        s, a = inspect.signature(getattr(sync_cls, n)), inspect.signature(getattr(async_cls, n))
        assert inspect.iscoroutinefunction(getattr(async_cls, n)), n
        assert list(s.parameters) == list(a.parameters), n
        assert s.return_annotation == a.return_annotation.replace("AsyncCommandHandle", "CommandHandle"), n
