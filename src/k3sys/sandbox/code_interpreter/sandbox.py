"""`Sandbox` and `AsyncSandbox` of the code interpreter: k3sys's sandboxes (every life-cycle call:
pause, checkpoint, fork, hibernate) plus `e2b_code_interpreter`'s calls with its signatures:
`run_code`, `create_code_context`, `list_code_contexts`, `restart_code_context`,
`remove_code_context`. `template` defaults to `code-interpreter-v1`, as E2B's does.

The calls are written once (`_Calls`, blocking, over transport.py's `Port`); `AsyncSandbox` runs
them in a worker thread and runs the callbacks (plain or coroutine functions) on the caller's loop.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

from k3sys.sandbox.code_interpreter.models import (
    Context,
    Execution,
    ExecutionError,
    Handlers,
    OutputHandler,
    OutputMessage,
    Result,
    parse_line,
)
from k3sys.sandbox.code_interpreter.transport import Port, lines
from k3sys.sandbox.errors import CommandTimeoutError, InvalidArgumentError, SandboxError
from k3sys.sandbox.sdk.aio import AsyncSandbox as _AsyncBase
from k3sys.sandbox.sdk.api import Sandbox as _Base

DEFAULT_TEMPLATE = "code-interpreter-v1"
DEFAULT_TIMEOUT = 300.0  # s, a run's default bound (E2B's); 0 or None... see `run_code`
REQUEST_TIMEOUT = 60.0  # s, the context calls' bound (a context's kernel starts in about a second)


class _Calls:
    """The code-interpreter calls on one sandbox, blocking (see the module docstring)."""

    def __init__(self, port: Port) -> None:
        self.port = port

    def run_code(self, code: str, language: str | None, context: Context | None, handlers: Handlers,
                 envs: dict[str, str] | None, timeout: float | None) -> Execution:
        if language and context:
            raise InvalidArgumentError("You can provide context or language, but not both at the same time.")
        timeout = None if timeout == 0 else (timeout or DEFAULT_TIMEOUT)
        body = {"code": code, "context_id": context.id if context else None, "language": language,
                "env_vars": envs}
        execution = Execution()
        try:
            # A run past `timeout` closes the connection: the server sees it go and interrupts the kernel.
            with self.port.request("POST", "/execute", body, timeout) as resp:
                last = b""
                for last in lines(resp, self.port.sid):
                    parse_line(execution, last, handlers)
            if b'"end_of_execution"' not in last:
                raise SandboxError(f"sandbox {self.port.sid}: the code interpreter's answer ended before the run "
                                   "did (its server died or the sandbox was stopped)")
        except TimeoutError:
            raise CommandTimeoutError(f"Execution timed out after {timeout} s (sandbox {self.port.sid}); the "
                                      "kernel was interrupted. The 'timeout' option can be used to increase it",
                                      "".join(execution.logs.stdout), "".join(execution.logs.stderr)) from None
        return execution

    def create_code_context(self, cwd: str | None, language: str | None, request_timeout: float | None) -> Context:
        body = {k: v for k, v in (("cwd", cwd), ("language", language)) if v}
        return Context.from_json(self.port.call("POST", "/contexts", body, request_timeout or REQUEST_TIMEOUT))

    def list_code_contexts(self) -> list[Context]:
        return [Context.from_json(c) for c in self.port.call("GET", "/contexts", None, REQUEST_TIMEOUT) or []]

    def restart_code_context(self, context: Context | str) -> None:
        cid = context.id if isinstance(context, Context) else context
        self.port.call("POST", f"/contexts/{cid}/restart", None, REQUEST_TIMEOUT)

    def remove_code_context(self, context: Context | str) -> None:
        cid = context.id if isinstance(context, Context) else context
        self.port.call("DELETE", f"/contexts/{cid}", None, REQUEST_TIMEOUT)


class Sandbox(_Base):
    """A sandbox with a code interpreter (see the module docstring):

        with Sandbox.create() as sbx:
            sbx.run_code("x = 41")
            print(sbx.run_code("x + 1").text)       # 42
    """

    @classmethod
    def create(cls, template: str | None = None, *args: Any, **kwargs: Any) -> Sandbox:
        """`k3sys.sandbox.Sandbox.create`, with `template` defaulting to code-interpreter-v1."""
        return super().create(template or DEFAULT_TEMPLATE, *args, **kwargs)

    @property
    def _calls(self) -> _Calls:
        return _Calls(Port(self._rt, self.id))

    def run_code(self, code: str, language: str | None = None, context: Context | None = None,
                 on_stdout: OutputHandler[OutputMessage] | None = None,
                 on_stderr: OutputHandler[OutputMessage] | None = None,
                 on_result: OutputHandler[Result] | None = None,
                 on_error: OutputHandler[ExecutionError] | None = None,
                 envs: dict[str, str] | None = None, timeout: float | None = None,
                 request_timeout: float | None = None) -> Execution:
        """Run `code` in `context` (or the default context of `language`, python if None); the
        callbacks get each piece as it comes. `envs`: environment variables for this run only.
        `timeout` s (default 300, 0: none): past it the kernel is interrupted and CommandTimeoutError
        (E2B's TimeoutException) raised. `request_timeout` is accepted for E2B's signature."""
        return self._calls.run_code(code, language, context, Handlers(on_stdout, on_stderr, on_result, on_error),
                                    envs, timeout)

    def create_code_context(self, cwd: str | None = None, language: str | None = None,
                            request_timeout: float | None = None) -> Context:
        """A new kernel of `language` (python if None) working in `cwd` (the user's home if None)."""
        return self._calls.create_code_context(cwd, language, request_timeout)

    def list_code_contexts(self) -> list[Context]:
        return self._calls.list_code_contexts()

    def restart_code_context(self, context: Context | str) -> None:
        """A fresh kernel in place of `context`'s (same id; its variables are gone)."""
        self._calls.restart_code_context(context)

    def remove_code_context(self, context: Context | str) -> None:
        self._calls.remove_code_context(context)


async def _invoke(callback: Callable[[Any], Any], value: Any) -> None:
    answer = callback(value)
    if inspect.isawaitable(answer):
        await answer


class AsyncSandbox(_AsyncBase):
    """`Sandbox` for asyncio: `await AsyncSandbox.create()`, `await sbx.run_code(...)`."""

    @classmethod
    async def create(cls, template: str | None = None, *args: Any, **kwargs: Any) -> AsyncSandbox:
        return await super().create(template or DEFAULT_TEMPLATE, *args, **kwargs)

    async def _call(self, name: str, *args: Any) -> Any:
        calls = _Calls(Port(self._rt.sync, self.id))
        return await asyncio.to_thread(getattr(calls, name), *args)

    async def run_code(self, code: str, language: str | None = None, context: Context | None = None,
                       on_stdout: OutputHandler[OutputMessage] | None = None,
                       on_stderr: OutputHandler[OutputMessage] | None = None,
                       on_result: OutputHandler[Result] | None = None,
                       on_error: OutputHandler[ExecutionError] | None = None,
                       envs: dict[str, str] | None = None, timeout: float | None = None,
                       request_timeout: float | None = None) -> Execution:
        """`Sandbox.run_code`; each callback (a function or a coroutine function) runs on this loop."""
        loop = asyncio.get_running_loop()

        def on_loop(cb: Callable[[Any], Any] | None) -> Callable[[Any], None] | None:
            if cb is None:
                return None
            return lambda value: asyncio.run_coroutine_threadsafe(_invoke(cb, value), loop).result()
        handlers = Handlers(on_loop(on_stdout), on_loop(on_stderr), on_loop(on_result), on_loop(on_error))
        return await self._call("run_code", code, language, context, handlers, envs, timeout)

    async def create_code_context(self, cwd: str | None = None, language: str | None = None,
                                  request_timeout: float | None = None) -> Context:
        return await self._call("create_code_context", cwd, language, request_timeout)

    async def list_code_contexts(self) -> list[Context]:
        return await self._call("list_code_contexts")

    async def restart_code_context(self, context: Context | str) -> None:
        await self._call("restart_code_context", context)

    async def remove_code_context(self, context: Context | str) -> None:
        await self._call("remove_code_context", context)
