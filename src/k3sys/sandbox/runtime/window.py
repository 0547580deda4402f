"""The host's window on a command's output: the newest bytes a reader fetched from the agent's ring,
bounded per stream (`WINDOW`), so nothing grows on the host while nobody reads (commands.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from k3sys.sandbox.runtime.agent_protocol import Exit, Gap
from k3sys.sandbox.spec import CommandResult

WINDOW = 16 << 20  # bytes of a command's output the host keeps per stream, at most


def decode(b: bytes) -> str:
    """`b` as text (UTF-8; what is not, replaced)."""
    return b.decode("utf-8", errors="replace")


def result(out: bytes, err: bytes, end: Exit, dropped: int) -> CommandResult:
    """A command's result from its whole output (`dropped`: bytes lost in the sandbox's ring)."""
    return CommandResult(decode(out), decode(err), end.exit, dropped)


@dataclass
class Window:
    """The newest output the host fetched, per stream: `out[i]` is stdout byte `out_base + i`.
    `pos` is the agent offset fetched up to; `end` is set once the command ended and all is here."""

    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    out_base: int = 0
    err_base: int = 0
    pos: int = 0
    end: Exit | None = None

    def add(self, piece: tuple[str, bytes] | Gap | Exit) -> None:
        if isinstance(piece, Exit):
            self.end = piece
        elif isinstance(piece, Gap):
            self.pos += piece.n  # dropped in the sandbox before anyone read it
        else:
            buf = self.out if piece[0] == "stdout" else self.err
            buf += piece[1]
            self.pos += len(piece[1])
            if len(buf) > WINDOW:
                cut = len(buf) - WINDOW
                del buf[:cut]
                if piece[0] == "stdout":
                    self.out_base += cut
                else:
                    self.err_base += cut

    def since(self, out: int, err: int) -> tuple[bytes, bytes]:
        return bytes(self.out[max(0, out - self.out_base):]), bytes(self.err[max(0, err - self.err_base):])
