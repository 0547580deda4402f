"""The code-interpreter server that runs INSIDE a `code-interpreter-v1` sandbox, on port 49999.

It speaks the protocol of E2B's `e2b-code-interpreter` SDK (docs/code_interpreter.md) over
`http.server`; kernels.py (beside it) backs every context with a real Jupyter kernel, so all state
lives in the sandbox's processes and follows it through pause, hibernate, checkpoint and fork.
Standalone: the template's python runs it with the standard library and jupyter_client (the
template copies this directory to /usr/local/lib/k3sys/code_interpreter; nothing of k3sys).

    POST   /execute                 {"code", "context_id"?, "language"?, "env_vars"?} -> JSON lines
    POST   /contexts                {"language"?, "cwd"?} -> {"id", "language", "cwd"}
    GET    /contexts                -> [context, ...]
    DELETE /contexts/<id>
    POST   /contexts/<id>/restart
    GET    /health                  -> OK

/execute streams one JSON object per line, in the kernel's order: {"type": "stdout"|"stderr",
"text", "timestamp" (unix ns)}, {"type": "result", "text", "html", "png", "json", ...,
"is_main_result"}, {"type": "error", "name", "value", "traceback"}, {"type":
"number_of_executions", "execution_count"}, then {"type": "end_of_execution"}. A client that closes
its connection mid-run interrupts the kernel (`gone`, polled by kernels.Run).
"""

from __future__ import annotations

import json
import select
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kernels import CONTEXTS, HOME, Run, normal_language  # beside this file: kernels.py

PORT = 49999
BODY_MAX = 16 << 20  # a request body (the code) larger than this is refused


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # a run's lines are small writes: each goes out at once

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        pass  # one line per request on stderr is noise in the sandbox's log

    def end_headers(self) -> None:
        # A client that asked for `Connection: close` is told so: a proxy between keeps no
        # connection this server is about to close (it would fail the next request on it).
        if self.close_connection:
            self.send_header("Connection", "close")
        super().end_headers()

    def _reply(self, status: int, body: Any = None) -> None:
        data = b"" if body is None else (body.encode() if isinstance(body, str) else json.dumps(body).encode())
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict[str, Any]:
        n = int(self.headers.get("Content-Length") or 0)
        if n > BODY_MAX:
            raise ValueError(f"request body of {n} bytes is over {BODY_MAX}")
        raw = self.rfile.read(n) if n else b""
        body = json.loads(raw) if raw.strip() else {}
        if not isinstance(body, dict):
            raise ValueError("expected a JSON object")
        return body

    def do_GET(self) -> None:
        if self.path == "/health":
            return self._reply(200, "OK")
        if self.path == "/contexts":
            return self._reply(200, [c.describe() for c in list(CONTEXTS.by_id.values())])
        self._reply(404, f"no GET {self.path}")

    def do_DELETE(self) -> None:
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "contexts":
            with CONTEXTS.lock:
                ctx = CONTEXTS.by_id.pop(parts[1], None)
            if ctx is None:
                return self._reply(404, f"Context {parts[1]} not found")
            with ctx.lock:
                ctx.shutdown()
            return self._reply(204)
        self._reply(404, f"no DELETE {self.path}")

    def do_POST(self) -> None:
        try:
            body = self._body()
        except ValueError as e:
            return self._reply(400, str(e))
        parts = self.path.strip("/").split("/")
        try:
            if parts == ["execute"]:
                return self._execute(body)
            if parts == ["contexts"]:
                ctx = CONTEXTS.create(normal_language(body.get("language")), body.get("cwd") or HOME)
                return self._reply(200, ctx.describe())
            if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart":
                ctx = CONTEXTS.by_id.get(parts[1])
                if ctx is None:
                    return self._reply(404, f"Context {parts[1]} not found")
                with ctx.lock:
                    ctx.restart()
                return self._reply(204)
        except ValueError as e:
            return self._reply(400, str(e))
        except Exception as e:  # a kernel that would not start: the client gets why
            return self._reply(500, f"{type(e).__name__}: {e}")
        self._reply(404, f"no POST {self.path}")

    def _execute(self, body: dict[str, Any]) -> None:
        code, cid, language = body.get("code"), body.get("context_id"), body.get("language")
        if not isinstance(code, str):
            return self._reply(400, "code: expected a string")
        if cid and language:
            return self._reply(400, "Only one of context_id or language can be provided")
        if cid:
            ctx = CONTEXTS.by_id.get(cid)
            if ctx is None:
                return self._reply(404, f"Context {cid} not found")
        else:
            ctx = CONTEXTS.default_for(normal_language(language))
        envs = body.get("env_vars") or {}
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with ctx.lock:
            run = Run(ctx, self)
            try:
                run.go(code, {str(k): str(v) for k, v in envs.items()})
            except Exception as e:  # the server's own failure: the client gets it as the run's error
                run.error("ServerError", f"{type(e).__name__}: {e}")
                run.emit({"type": "end_of_execution"}, capped=False)
        if run.broken:
            self.close_connection = True
        else:
            self._chunk(b"")

    def send(self, line: bytes) -> None:
        self._chunk(line)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def gone(self) -> bool:
        """Whether the client closed its connection (readable with nothing to read)."""
        sock = self.connection
        try:
            if not select.select([sock], [], [], 0)[0]:
                return False
            return sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


def main() -> int:
    port = int(sys.argv[1]) if len(sys.argv) > 1 else PORT
    CONTEXTS.default_for("python")  # the default context is up before the port answers: listening = ready
    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    server.daemon_threads = True
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
