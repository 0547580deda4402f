"""A server the port-proxy tests run inside a sandbox (python3 port_server.py PORT [HOST]), standard
library only: HTTP/1.1 with keep-alive, and a WebSocket echo on /ws.

GET /bytes?n=N       N bytes (b"0123456789abcdef" repeated), Content-Length, written 64 KiB at a time;
                     with &log=1 the bytes written so far are kept in /tmp/sent-PORT (the slow-reader test)
POST /sum            the body's length and sha256 as JSON (Content-Length or chunked bodies)
POST /echo           the body back, chunked, as it is read
POST /execute        a stand-in for the code interpreter's: {"code": C} -> NDJSON stdout, result C.upper()
GET /sse?n=N         N server-sent events, one every 10 ms, then the end; n=0: for ever
GET /pid             this server's pid
GET /peer            the client's port (which connection of the proxy's this is)
GET /forge           "ok", then (50 ms later, on the same connection) a forged answer nobody asked for
GET /switch          101 Switching Protocols to a plain GET
GET /ws              a WebSocket echo (text and binary; answers a close with a close)
"""

import base64
import hashlib
import json
import os
import socket
import struct
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PATTERN = b"0123456789abcdef" * 4096  # 64 KiB
WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # a head and a body in two writes must not wait for a delayed ACK

    def log_message(self, *args):
        pass

    def _query(self):
        return {k: v[0] for k, v in parse_qs(urlparse(self.path).query).items()}

    def _reply(self, status, body, ctype="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body_pieces(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return
                left = size
                while left:
                    piece = self.rfile.read(min(left, 1 << 16))
                    left -= len(piece)
                    yield piece
                self.rfile.readline()
        left = int(self.headers.get("Content-Length") or 0)
        while left:
            piece = self.rfile.read(min(left, 1 << 16))
            if not piece:
                return
            left -= len(piece)
            yield piece

    def do_GET(self):
        path = urlparse(self.path).path
        if path == "/bytes":
            n = int(self._query().get("n", "0"))
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(n))
            self.end_headers()
            sent, log = 0, f"/tmp/sent-{self.server.server_address[1]}" if self._query().get("log") else None
            while sent < n:
                piece = PATTERN[: min(len(PATTERN), n - sent)]
                self.wfile.write(piece)
                sent += len(piece)
                if log:
                    with open(log + ".tmp", "w") as f:
                        f.write(str(sent))
                    os.replace(log + ".tmp", log)
        elif path == "/sse":
            n = int(self._query().get("n", "5"))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            i = 0
            while n == 0 or i < n:
                event = b"data: %d\n\n" % i
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                i += 1
                time.sleep(0.01)
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/pid":
            self._reply(200, str(os.getpid()).encode(), "text/plain")
        elif path == "/peer":
            self._reply(200, str(self.client_address[1]).encode(), "text/plain")
        elif path == "/forge":  # a hostile server: an answer nobody asked for, after the real one
            self._reply(200, b"ok", "text/plain")
            self.wfile.flush()
            time.sleep(0.05)
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 21\r\n\r\n"
                             b'{"status": "forged!"}')
            self.wfile.flush()
            open("/tmp/forged", "w").close()
        elif path == "/switch":  # a hostile server: 101 to a request that asked for no upgrade
            self.send_response(101)
            self.end_headers()
            self.wfile.write(b"raw bytes")
        elif path == "/ws":
            self._websocket()
        else:
            self._reply(404, b'{"error": "no such path"}')

    def do_POST(self):
        path = urlparse(self.path).path
        if path == "/sum":
            h, n = hashlib.sha256(), 0
            for piece in self._body_pieces():
                h.update(piece)
                n += len(piece)
            self._reply(200, json.dumps({"length": n, "sha256": h.hexdigest()}).encode())
        elif path == "/execute":  # a stand-in for the code interpreter's /execute: NDJSON, streamed
            code = json.loads(b"".join(self._body_pieces()))["code"]
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for line in ({"type": "stdout", "text": f"running {code}\n", "timestamp": 0},
                         {"type": "result", "text": code.upper(), "is_main_result": True},
                         {"type": "number_of_executions", "execution_count": 1}):
                data = json.dumps(line).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/echo":
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in self._body_pieces():
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._reply(404, b'{"error": "no such path"}')

    def _websocket(self):
        key = self.headers["Sec-WebSocket-Key"].encode()
        accept = base64.b64encode(hashlib.sha1(key + WS_GUID).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            opcode, n = head[0] & 0x0F, head[1] & 0x7F
            if n == 126:
                n = struct.unpack(">H", self.rfile.read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
            out = bytes([0x80 | opcode])
            out += bytes([len(data)]) if len(data) < 126 else (
                b"\x7e" + struct.pack(">H", len(data)) if len(data) < 65536 else b"\x7f" + struct.pack(">Q", len(data)))
            self.wfile.write(out + data)
            self.wfile.flush()
            if opcode == 8:
                return


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self):
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        super().server_bind()


if __name__ == "__main__":
    Server((sys.argv[2] if len(sys.argv) > 2 else "0.0.0.0", int(sys.argv[1])), Handler).serve_forever()
