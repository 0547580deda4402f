"""What a run gives back, with the names and fields of `e2b_code_interpreter.models`, and the
parser of the server's JSON lines (server.py writes them)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, fields
from typing import Any, Literal, TypeVar

T = TypeVar("T")
RunCodeLanguage = Literal["python", "javascript", "typescript", "r", "java", "bash"] | str
OutputHandler = Callable[[T], Any] | Callable[[T], Awaitable[Any]]


class MIMEType(str):
    """A MIME type."""


@dataclass
class OutputMessage:
    """One piece of stdout or stderr: `line` (the text), `timestamp` (unix ns), `error` (stderr)."""

    line: str
    timestamp: int
    error: bool = False

    def __str__(self) -> str:
        return self.line


@dataclass
class ExecutionError:
    """An exception the code raised: its class `name`, `value` (message) and `traceback` (text)."""

    name: str
    value: str
    traceback: str

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "value": self.value, "traceback": self.traceback})


_FORMATS = ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "json", "javascript", "data", "chart")


@dataclass
class Result:
    """One displayed value: the cell's value (`is_main_result`) or a display call's (a plot). Each
    representation is a string (`png`, `jpeg`: base64) or, for `json`, `data`, `chart`, a dict."""

    text: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    png: str | None = None
    jpeg: str | None = None
    pdf: str | None = None
    latex: str | None = None
    json: dict[str, Any] | None = None
    javascript: str | None = None
    data: dict[str, Any] | None = None
    chart: dict[str, Any] | None = None
    is_main_result: bool = False
    extra: dict[str, Any] | None = None

    def __getitem__(self, item: str) -> Any:
        return getattr(self, item)

    def formats(self) -> list[str]:
        """The representations present, by field name (then `extra`'s MIME types)."""
        return [f for f in _FORMATS if getattr(self, f)] + list(self.extra or {})

    def __repr__(self) -> str:
        return f"Result({self.text})" if self.text else f"Result(Formats: {', '.join(self.formats())})"


@dataclass
class Logs:
    """Everything the run printed: `stdout` and `stderr` as the pieces the kernel sent."""

    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)


@dataclass
class Execution:
    """A run: its `results`, `logs`, `error` (None: none) and `execution_count`."""

    results: list[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: ExecutionError | None = None
    execution_count: int | None = None

    @property
    def text(self) -> str | None:
        """The text of the cell's value (its main result), if any."""
        return next((r.text for r in self.results if r.is_main_result), None)


@dataclass
class Context:
    """A kernel of its own: `id`, `language`, `cwd`."""

    id: str
    language: str
    cwd: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Context:
        return cls(str(data["id"]), str(data["language"]), str(data["cwd"]))


@dataclass
class Handlers:
    """The callbacks of one run (each may be a coroutine function in AsyncSandbox)."""

    on_stdout: OutputHandler[OutputMessage] | None = None
    on_stderr: OutputHandler[OutputMessage] | None = None
    on_result: OutputHandler[Result] | None = None
    on_error: OutputHandler[ExecutionError] | None = None


_RESULT_FIELDS = {f.name for f in fields(Result)}


def parse_line(execution: Execution, line: str | bytes, handlers: Handlers) -> Any:
    """Fold one line of /execute's answer into `execution`; returns what the matching callback
    returned (an awaitable for an async one), else None. Unknown types are skipped (newer servers)."""
    data = json.loads(line)
    kind = data.pop("type", None)
    if kind == "result":
        result = Result(**{k: v for k, v in data.items() if k in _RESULT_FIELDS})
        execution.results.append(result)
        return handlers.on_result and handlers.on_result(result)
    if kind in ("stdout", "stderr"):
        text = str(data.get("text", ""))
        getattr(execution.logs, kind).append(text)
        cb = handlers.on_stdout if kind == "stdout" else handlers.on_stderr
        return cb and cb(OutputMessage(text, int(data.get("timestamp") or 0), kind == "stderr"))
    if kind == "error":
        execution.error = ExecutionError(str(data.get("name", "")), str(data.get("value", "")),
                                         str(data.get("traceback", "")))
        return handlers.on_error and handlers.on_error(execution.error)
    if kind == "number_of_executions":
        execution.execution_count = int(data["execution_count"])
    return None
