"""The code interpreter: E2B's `e2b_code_interpreter` SDK surface on k3sys sandboxes.

    from k3sys.sandbox.code_interpreter import Sandbox     # was: from e2b_code_interpreter import Sandbox

    with Sandbox.create() as sbx:                          # template "code-interpreter-v1"
        sbx.run_code("import pandas as pd; df = pd.DataFrame({'a': [1, 2]})")
        ex = sbx.run_code("df", on_stdout=print)           # Execution(results=[Result(text, html)], logs, error)
        kid = sbx.fork(1)[0]                               # a running copy of the live kernel

The name mirrors E2B's package (`e2b_code_interpreter` -> `k3sys.sandbox.code_interpreter`) so code
written for it changes only its import. Each sandbox of the template runs inside/server.py (Jupyter
kernels, inside/kernels.py, behind E2B's protocol on port 49999; never imported on the host);
sandbox.py holds the SDK calls, models.py the result types, transport.py how the host reaches the
port (docs/code_interpreter.md).
"""

from k3sys.sandbox.code_interpreter.models import (
    Context,
    Execution,
    ExecutionError,
    Logs,
    MIMEType,
    OutputHandler,
    OutputMessage,
    Result,
    RunCodeLanguage,
)
from k3sys.sandbox.code_interpreter.sandbox import DEFAULT_TEMPLATE, AsyncSandbox, Sandbox

__all__ = ["DEFAULT_TEMPLATE", "AsyncSandbox", "Context", "Execution", "ExecutionError", "Logs", "MIMEType",
           "OutputHandler", "OutputMessage", "Result", "RunCodeLanguage", "Sandbox"]
