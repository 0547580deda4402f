"""The kernels behind the code-interpreter server (server.py, beside this file in the sandbox):
contexts, each one Jupyter kernel (`jupyter_client.KernelManager`, ipykernel), and a run of code on
one, turned into E2B's JSON lines. Runs INSIDE the sandbox with the template's python; imports
nothing of k3sys.

Hostile code: a client that goes away mid-run (the SDK's `timeout`) interrupts the kernel, and a
kernel that stays busy `INTERRUPT_GRACE_S` later is restarted; output is bounded in the kernel
(`_PYTHON_SETUP`) and again here (`OUTPUT_CAP`, the rest counted in one last stderr line); a kernel
that died is restarted and the run answers an error saying so (its variables are gone).
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import uuid
from typing import Any, Protocol

from jupyter_client import KernelManager

OUTPUT_CAP = 32 << 20  # bytes of output one run may stream; the rest is counted, not sent
INTERRUPT_GRACE_S = 3.0  # after an interrupt, how long a kernel may stay busy before a restart
READY_TIMEOUT_S = 60.0  # a kernel's start until it answers
POLL_S = 0.05  # while a kernel is silent: how often the client's connection and the kernel are checked
# language -> kernel spec name: python always; bash when bash_kernel is installed (the template has it)
KERNELS = {"python": "python3", "bash": "bash"}
# Run silently in every new python kernel, so that output is bounded where it is made: a run
# writes at most `cap` characters to stdout and stderr together (the rest is counted, and a line on
# stderr says so at the end of the run). IPython keeps every cell's printed text in memory
# (`history_manager.outputs`, through a `write` it installs per cell), and ipykernel sends a run's
# output 0.2 s at a time, unbounded: without this a loop of prints fills the kernel's memory. The
# bound wraps IPython's per-cell `write` (installed before `pre_run_cell`), so IPython sees only
# what passes it; the kept outputs are dropped after each cell. Code that goes around it fills only
# its own kernel, which is the first the OOM killer takes (`_victim`).
_PYTHON_SETUP = """
def __k3_setup(cap):
    import sys
    ip, state = get_ipython(), {"n": 0, "dropped": 0}
    say = sys.stderr.write
    def bound(stream):
        write = stream.write
        def bounded(text, *args, **kwargs):
            room = max(cap - state["n"], 0)
            if len(text) > room:
                state["dropped"] += len(text) - room
                text = text[:room]
            state["n"] += len(text)
            return write(text, *args, **kwargs)
        stream.write = bounded
    def start(*_):
        state.update(n=0, dropped=0)
        bound(sys.stdout), bound(sys.stderr)
    def end(*_):
        ip.history_manager.outputs.clear()
        if state["dropped"]:
            say(f"[k3sys: {state['dropped']} characters of output dropped past the run's cap of {cap}]\\n")
    ip.events.register("pre_run_cell", start)
    ip.events.register("post_run_cell", end)
__k3_setup(CAP)
del __k3_setup
""".replace("CAP", str(OUTPUT_CAP // 2))
_MIME = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
         "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
         "application/json": "json", "application/javascript": "javascript", "e2b/data": "data",
         "e2b/chart": "chart"}


class Context:
    """One kernel: its id, language, working directory; one run at a time (`lock`)."""

    def __init__(self, language: str, cwd: str) -> None:
        self.id = uuid.uuid4().hex
        self.language, self.cwd = language, cwd
        self.lock = threading.Lock()
        self.km = KernelManager(kernel_name=KERNELS[language])
        # No ANSI colours in tracebacks (E2B's kernel config says the same): they are read as text.
        # No history database: its sqlite file, open in every checkpoint of the kernel, came back
        # read-only in the sandboxes restored from a warm template's (IPython printed so in a run).
        self.km.start_kernel(cwd=cwd, extra_arguments=["--InteractiveShell.colors=nocolor",
                                                       "--HistoryManager.enabled=False"])
        _victim(self.km)
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=READY_TIMEOUT_S)
        self._setup()
        # Why the kernel was replaced behind the client's back (a run past its timeout that did not
        # stop on an interrupt); the next run answers it as its error and runs nothing.
        self.notice: str | None = None

    def _setup(self) -> None:
        if self.language == "python":
            _drain(self.kc)
            self.silent(_PYTHON_SETUP)

    def restart(self) -> None:
        self.km.restart_kernel(now=True)
        _victim(self.km)
        self.kc.wait_for_ready(timeout=READY_TIMEOUT_S)
        self._setup()

    def describe(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)

    def silent(self, code: str) -> None:
        """Run `code` without output or history (the env-var set-up around a run)."""
        self.kc.execute(code, silent=True, store_history=False)
        _wait_idle(self.kc, READY_TIMEOUT_S)


def _victim(km: KernelManager) -> None:
    """Make the kernel the sandbox's first choice when it runs out of memory: user code that eats
    it all then kills its kernel (the run answers KernelDied), not this server."""
    pid = getattr(km.provisioner, "pid", None)
    if pid:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("1000")


def _drain(kc: Any) -> None:
    while True:
        try:
            kc.get_iopub_msg(timeout=0)
        except queue.Empty:
            return


def _wait_idle(kc: Any, timeout: float) -> bool:
    """Read iopub until the kernel says idle (True) or `timeout` s pass (False)."""
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        try:
            msg = kc.get_iopub_msg(timeout=min(left, POLL_S))
        except queue.Empty:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return True
    return False


class Contexts:
    """Every context of this server, and each language's default one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_id: dict[str, Context] = {}
        self.default: dict[str, str] = {}

    def create(self, language: str, cwd: str) -> Context:
        installed = [lang for lang, spec in KERNELS.items() if lang == "python" or spec in _specs()]
        if language not in installed:
            raise ValueError(f"unsupported language {language!r} (installed: {', '.join(installed)})")
        ctx = Context(language, cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def default_for(self, language: str) -> Context:
        with self.lock:
            cid = self.default.get(language)
        if cid is None or cid not in self.by_id:
            ctx = self.create(language, HOME)
            with self.lock:
                cid = self.default.setdefault(language, ctx.id)
        return self.by_id[cid]


HOME = os.environ.get("HOME") or "/"
CONTEXTS = Contexts()


def _specs() -> dict[str, str]:
    from jupyter_client.kernelspec import find_kernel_specs

    return find_kernel_specs()


def normal_language(language: str | None) -> str:
    language = (language or "python").strip().lower()
    return {"py": "python", "python3": "python", "js": "javascript", "sh": "bash"}.get(language, language)


def _result(data: dict[str, Any], main: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in data.items():
        if mime in _MIME:
            out[_MIME[mime]] = value
        else:
            extra[mime] = value
    text = out.get("text")
    # E2B's server shows a string's repr without its quotes; the SDK users' code expects that.
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        out["text"] = text[1:-1]
    if extra:
        out["extra"] = extra
    return out


class Client(Protocol):
    """Where a run's lines go: the HTTP connection of the request (server.py)."""

    def send(self, line: bytes) -> None: ...

    def gone(self) -> bool: ...


class Run:
    """One execution on `ctx`, streamed to `client` as JSON lines."""

    def __init__(self, ctx: Context, client: Client) -> None:
        self.ctx, self.client = ctx, client
        self.sent = self.dropped = 0
        self.broken = False  # the client's connection failed a write: it is gone

    def emit(self, item: dict[str, Any], capped: bool = True) -> None:
        line = json.dumps(item).encode() + b"\n"
        if capped and self.sent + len(line) > OUTPUT_CAP:
            text, room = item.get("text"), OUTPUT_CAP - self.sent - 200  # what fits beside the line's keys
            if not isinstance(text, str) or room <= 0:
                self.dropped += len(line)
                return
            self.dropped += len(text) - room // 2  # a character may take two bytes escaped: keep room/2
            line = json.dumps({**item, "text": text[:room // 2]}).encode() + b"\n"
        self.sent += len(line)
        if not self.broken:
            try:
                self.client.send(line)
            except OSError:
                self.broken = True

    def error(self, name: str, value: str) -> None:
        self.emit({"type": "error", "name": name, "value": value, "traceback": f"{name}: {value}"}, capped=False)

    def go(self, code: str, envs: dict[str, str]) -> None:
        ctx = self.ctx
        if not ctx.km.is_alive():
            ctx.restart()
            ctx.notice = "the context's kernel had died and was restarted"
        if ctx.notice is not None:
            self.error("KernelRestarted", f"{ctx.notice}: its variables are gone; the code was not run")
            ctx.notice = None
        else:
            if envs and ctx.language == "python":
                ctx.silent(f"import os as __k3\n__k3_saved = {{k: __k3.environ.get(k) for k in {list(envs)!r}}}\n"
                           f"__k3.environ.update({envs!r})")
            self.run(code, envs)
        if self.dropped:
            self.emit({"type": "stderr", "text": f"[k3sys: {self.dropped} bytes of output dropped past the "
                       f"run's cap of {OUTPUT_CAP} bytes]\n", "timestamp": time.time_ns()}, capped=False)
        self.emit({"type": "end_of_execution"}, capped=False)

    def run(self, code: str, envs: dict[str, str]) -> None:
        ctx = self.ctx
        restarted = True
        try:
            restarted = self.stream(ctx.kc.execute(code, store_history=True, allow_stdin=False, stop_on_error=True))
        finally:
            if envs and ctx.language == "python" and not restarted:
                ctx.silent("[__k3.environ.pop(k, None) if v is None else __k3.environ.__setitem__(k, v)"
                           " for k, v in __k3_saved.items()]\ndel __k3, __k3_saved")

    def stream(self, msg_id: str) -> bool:
        """Forward the run's messages until the kernel is idle; True if the kernel had to be replaced."""
        ctx, interrupted = self.ctx, None
        while True:
            try:
                msg = ctx.kc.get_iopub_msg(timeout=POLL_S)
            except queue.Empty:
                if not ctx.km.is_alive():
                    ctx.restart()
                    self.error("KernelDied", "the kernel died during this run (killed, or out of memory) and was "
                               "restarted: its variables are gone")
                    return True
                if interrupted is None and (self.broken or self.client.gone()):
                    ctx.km.interrupt_kernel()  # the client's timeout: stop the run, keep the kernel
                    interrupted = time.monotonic()
                elif interrupted is not None and time.monotonic() - interrupted > INTERRUPT_GRACE_S:
                    ctx.restart()  # deaf to SIGINT (a C loop, a signal handler): a fresh kernel
                    ctx.notice = (f"the previous run went on past its timeout and an interrupt, and its kernel was "
                                  f"restarted {INTERRUPT_GRACE_S:g} s after the interrupt")
                    return True
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                self.emit({"type": content["name"], "text": content["text"], "timestamp": time.time_ns()})
            elif kind in ("execute_result", "display_data"):
                self.emit(_result(content["data"], kind == "execute_result"))
            elif kind == "error":
                self.emit({"type": "error", "name": content["ename"], "value": content["evalue"],
                           "traceback": "\n".join(content["traceback"])}, capped=False)
            elif kind == "execute_input":
                self.emit({"type": "number_of_executions", "execution_count": content["execution_count"]},
                          capped=False)
            elif kind == "status" and content["execution_state"] == "idle":
                return False
            if self.broken and interrupted is None:
                ctx.km.interrupt_kernel()
                interrupted = time.monotonic()
