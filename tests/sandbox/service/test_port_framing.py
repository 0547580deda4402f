"""service/ports/framing.py alone: where messages end, fed in pieces of every size."""

from __future__ import annotations

import pytest

from k3sys.sandbox.service.ports.framing import HeadError, parse_head, request_body, response_body, status_of

CHUNKED = b"5\r\nhello\r\n1a; ext=1\r\n" + b"x" * 26 + b"\r\n0\r\nTrailer: t\r\n\r\n"


def _ends_at(body, data: bytes, step: int) -> int:
    """Feed `data` `step` bytes at a time; the offset where the body ended."""
    at = 0
    while at < len(data):
        piece = memoryview(data[at:at + step])
        n = body.feed(piece)
        at += n
        if body.done:
            return at
        assert n == len(piece)  # not done yet: every byte fed belongs to the body
    return -1


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64, 4096])
def test_chunked_ends_after_its_trailer_whatever_the_pieces(step):
    head = parse_head(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked")
    assert _ends_at(request_body(head), CHUNKED + b"GET /next HTTP/1.1\r\n\r\n", step) == len(CHUNKED)


@pytest.mark.parametrize("step", [1, 5, 100])
def test_content_length_and_none(step):
    body = request_body(parse_head(b"POST / HTTP/1.1\r\nContent-Length: 10"))
    assert _ends_at(body, b"0123456789NEXT", step) == 10
    assert request_body(parse_head(b"GET / HTTP/1.1\r\nHost: x")).done


def test_response_framing_rules():
    def resp(raw: bytes, method: bytes = b"GET"):
        head = parse_head(raw)
        return response_body(head, status_of(head), method)

    assert resp(b"HTTP/1.1 200 OK\r\nContent-Length: 5", b"HEAD").done  # HEAD: no body whatever it says
    assert resp(b"HTTP/1.1 204 No Content").done and resp(b"HTTP/1.1 304 Not Modified").done
    assert resp(b"HTTP/1.1 100 Continue").done
    assert resp(b"HTTP/1.0 200 OK").until_close  # neither length nor chunks: the close ends it
    assert resp(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked").chunked


@pytest.mark.parametrize("raw", [b"POST / HTTP/1.1\r\nContent-Length: -1", b"POST / HTTP/1.1\r\nContent-Length: 1, 2",
                                 b"GET / HTTP/1.1\r\nno colon here", b"GET / HTTP/1.1\r\n Folded: x"])
def test_bad_heads_are_refused(raw):
    with pytest.raises(HeadError):
        request_body(parse_head(raw))


def test_bad_chunk_lines_are_refused():
    body = request_body(parse_head(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked"))
    with pytest.raises(HeadError, match="chunk size"):
        body.feed(memoryview(b"zz\r\n"))
    body = request_body(parse_head(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked"))
    with pytest.raises(HeadError, match="4096"):
        body.feed(memoryview(b"1" * 5000))
    with pytest.raises(HeadError, match="status line"):
        status_of(parse_head(b"SSH-2.0-OpenSSH"))
