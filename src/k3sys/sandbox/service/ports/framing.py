"""Where HTTP/1.1 messages begin and end in a byte stream, so the port proxy can pass bytes on
untouched (no parse into events and back) and still know when an exchange is over: a head is read
whole (bounded), a body is only measured (`Body.feed` counts, never copies).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_HEAD = 64 << 10  # bytes of a request or response head
_MAX_LINE = 4096  # a chunk-size line or a trailer line


class HeadError(ValueError):
    """A head (or chunk framing) that is not HTTP/1.1 as this proxy reads it."""


@dataclass(frozen=True)
class Head:
    """A message head: its first line, its header lines as received, and the headers by lower-case
    name (a repeated name: the values joined with ", ")."""

    first: bytes
    lines: tuple[bytes, ...]
    fields: dict[bytes, bytes]

    def has_token(self, name: bytes, token: bytes) -> bool:
        return token in (t.strip().lower() for t in self.fields.get(name, b"").split(b","))


def parse_head(raw: bytes) -> Head:
    """The head in `raw` (without its blank line)."""
    first, *lines = raw.split(b"\r\n")
    fields: dict[bytes, bytes] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise HeadError(f"malformed header line {line[:60]!r}")
        name = name.lower()
        fields[name] = fields[name] + b", " + value.strip() if name in fields else value.strip()
    return Head(first, tuple(lines), fields)


class Body:
    """One message body's framing: `feed(data)` returns how many of `data`'s first bytes belong to
    the body (the rest follows it); `done` once it ended. `length`: Content-Length; `chunked`;
    `until_close`: a response delimited by the end of the connection."""

    def __init__(self, length: int = 0, chunked: bool = False, until_close: bool = False) -> None:
        self.left = length
        self.chunked, self.until_close = chunked, until_close
        self.done = not chunked and not until_close and length == 0
        self._state = "size"  # chunked: size -> data -> size ... -> trailer
        self._line = bytearray()

    def feed(self, data: memoryview) -> int:
        if self.done:
            return 0
        if self.until_close:
            return len(data)
        if not self.chunked:
            n = min(self.left, len(data))
            self.left -= n
            self.done = self.left == 0
            return n
        i = 0
        while i < len(data) and not self.done:
            if self._state == "data":
                n = min(self.left, len(data) - i)
                self.left -= n
                i += n
                if self.left == 0:
                    self._state = "size"
                continue
            nl = bytes(data[i:i + _MAX_LINE + 1]).find(b"\n")
            take = len(data) - i if nl < 0 else nl + 1
            self._line += data[i:i + take]
            i += take
            if len(self._line) > _MAX_LINE:
                raise HeadError("chunk framing line over 4096 bytes")
            if nl < 0:
                break
            line, self._line = bytes(self._line).strip(), bytearray()
            if self._state == "trailer":
                self.done = not line
                continue
            try:
                size = int(line.split(b";", 1)[0], 16)
            except ValueError:
                raise HeadError(f"bad chunk size line {line[:40]!r}") from None
            if size == 0:
                self._state = "trailer"
            else:
                self.left, self._state = size + 2, "data"  # the data and its CRLF
        return i


def request_body(head: Head) -> Body:
    """The framing of a request's body (none unless Content-Length or chunked says)."""
    if head.has_token(b"transfer-encoding", b"chunked"):
        return Body(chunked=True)
    return Body(length=_length(head))


def response_body(head: Head, status: int, method: bytes) -> Body:
    """The framing of a response's body to a `method` request (RFC 9112 6.3)."""
    if method == b"HEAD" or status in (204, 304) or 100 <= status < 200:
        return Body()
    if head.has_token(b"transfer-encoding", b"chunked"):
        return Body(chunked=True)
    if b"content-length" in head.fields:
        return Body(length=_length(head))
    return Body(until_close=True)


def _length(head: Head) -> int:
    raw = head.fields.get(b"content-length", b"0")
    values = {v.strip() for v in raw.split(b",")}
    if len(values) != 1 or not (v := values.pop()).isdigit():
        raise HeadError(f"bad Content-Length {raw[:40]!r}")
    return int(v)


def status_of(head: Head) -> int:
    """A response head's status code."""
    parts = head.first.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise HeadError(f"bad status line {head.first[:60]!r}")
    return int(parts[1])
