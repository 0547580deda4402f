"""SandboxFS on a plain directory: files are read through blocking descriptors, and special files
are refused at once instead of hanging the caller."""

from __future__ import annotations

import os

import pytest

from k3sys.sandbox import WrongFileTypeError
from k3sys.sandbox.runtime.sandboxfs import SandboxFS


def test_open_gives_a_blocking_reader(tmp_path):
    # The open itself is non-blocking (a FIFO must not wait for a writer); reads must not be: a
    # non-blocking read of data not yet in the page cache may fail with EAGAIN, which a file object
    # reports as no data, and the service would then stream a short file.
    (tmp_path / "log").write_bytes(b"1\n2\n")
    with SandboxFS(tmp_path).open("/log") as f:
        assert os.get_blocking(f.fileno())
        assert f.read() == b"1\n2\n"


def test_open_refuses_a_fifo_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(WrongFileTypeError, match="not a regular file in the sandbox: '/pipe'"):
        SandboxFS(tmp_path).open("/pipe")
