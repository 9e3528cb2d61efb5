"""``proxima kv`` and ``proxima selfcheck --url`` against servers that misbehave: a real HTTP
server on 127.0.0.1 answers what each test says (or drips its answer a byte at a time), and
the command is run as ``proxima.cli.main``.

Nothing the server sends is trusted: an answer of the wrong shape, an error status, a body
that is not JSON or too large, and an answer that never completes are each one line on stderr
and exit 1 (the server's fault); stdout carries only a result.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from proxima.cli import main
from proxima.serve import remote

from .conftest import free_port, run_proxima

STATUS = {"policy": "auto", "granule_blocks": 32, "bytes_per_granule": 64 << 20,
          "mapped_bytes": 1 << 30, "used_bytes": 0, "reclaimable_bytes": 0, "min_bytes": 0,
          "max_bytes": 8 << 30, "pool_bytes": 8 << 30, "grows": 1, "shrinks": 0,
          "failed_grows": 0, "bytes_returned": 0, "evicted_cached": 0, "short": False,
          "steps": 12, "events": []}


class _LocalServer:
    """A real HTTP server on 127.0.0.1 with its own thread (``url``; ``close()`` ends it)."""

    def _serve(self, handler) -> None:
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Answering(_LocalServer):
    """A server whose every GET/POST gets ``(status, body, content type)``; it keeps the
    bodies of the POSTs it received."""

    def __init__(self, status: int, body: bytes, ctype: str = "application/json",
                 length: int | None = None):
        owner = self
        self.posted: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):  # noqa: N802
                owner.posted.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.do_GET()

        self._serve(Handler)


@pytest.fixture
def answering():
    servers = []

    def start(status, body, ctype="application/json", length=None):
        body = body if isinstance(body, bytes) else json.dumps(body).encode()
        servers.append(Answering(status, body, ctype, length))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def one_error_line(capsys, command: str = "kv") -> str:
    out, err = capsys.readouterr()
    assert out == "", out                               # stdout: results only
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"proxima {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_a_good_answer_is_printed_and_a_change_is_posted(answering, capsys):
    server = answering(200, STATUS)
    assert main(["kv", "--url", server.url]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("elastic KV memory (policy auto, granules of 32 blocks = 64.00 MiB)")
    assert "mapped" in out and "8.00 GiB" in out and err == ""
    assert main(["kv", "--url", server.url + "/", "--max", "2GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == STATUS
    assert server.posted == [{"max_bytes": 2 << 30}]


WRONG = [
    ([], "it is a list [], not a JSON object"),
    (None, "it is null, not a JSON object"),
    ("ok", 'it is a string "ok", not a JSON object'),
    ({}, "policy is missing (expected a string)"),
    ({**STATUS, "policy": None}, "policy is null (expected a string)"),
    ({**STATUS, "policy": 7}, "policy is an integer 7 (expected a string)"),
    ({**STATUS, "granule_blocks": 0}, "granule_blocks is an integer 0 (expected an integer from 1"),
    ({**STATUS, "mapped_bytes": "1GiB"}, 'mapped_bytes is a string "1GiB"'),
    ({**STATUS, "mapped_bytes": -1}, "mapped_bytes is an integer -1"),
    ({**STATUS, "pool_bytes": 1.5}, "pool_bytes is a number 1.5"),
    ({**STATUS, "used_bytes": [1]}, "used_bytes is a list [1]"),
    ({**STATUS, "max_bytes": 1 << 70}, "max_bytes is an integer 1180591620717411303424"),
    ({**STATUS, "grows": True}, "grows is a boolean true"),
    ({**STATUS, "short": "no"}, 'short is a string "no" (expected true or false)'),
    ({**STATUS, "error": "engine gone"}, "it carries an error with status 200: engine gone"),
]


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
@pytest.mark.parametrize("answer, message", WRONG, ids=[m.split(" (")[0] for _, m in WRONG])
def test_an_answer_of_the_wrong_shape_is_refused(answering, capsys, answer, message, as_json):
    server = answering(200, answer)
    assert main(["kv", "--url", server.url] + (["--json"] if as_json else [])) == 1
    line = one_error_line(capsys)
    assert "the server's answer is not an elastic KV status" in line and message in line, line


def test_optional_fields_may_be_null_or_missing(answering, capsys):
    status = {k: STATUS[k] for k in ("policy", "granule_blocks", "bytes_per_granule",
                                     "mapped_bytes", "pool_bytes")}
    server = answering(200, {**status, "used_bytes": None, "short": None})
    assert main(["kv", "--url", server.url]) == 0
    out = capsys.readouterr().out
    assert "mapped" in out and "used by requests" not in out


@pytest.mark.parametrize("status, body, ctype, message", [
    (500, b"<html><head><title>500 Internal Server Error</title><style>h1 {color: red}</style>"
          b"</head><body><h1>Oops &amp; gone</h1>\x1b[31m" + b"x" * 5000 + b"</body></html>",
     "text/html", "answered 500 Internal Server Error: 500 Internal Server Error Oops & gone x"),
    (404, b'{"detail": "Not Found"}', "application/json",
     "answered 404 Not Found: Not Found (is this proxima serve with --elastic?"),
    (400, b'{"error": {"message": "max_bytes\\nis bad", "type": "BadRequestError", "code": 400}}',
     "application/json", "answered 400 Bad Request: max_bytes is bad"),
    (400, b'{"error": "max_bytes 5 is below min_bytes 9", "policy": "auto"}', "application/json",
     "answered 400 Bad Request: max_bytes 5 is below min_bytes 9"),
    (503, b"", "text/plain", "answered 503 Service Unavailable: (an empty body)"),
    (302, b"", "text/plain", "answered 302 Found, a redirect, which is not followed"),
    (200, b"hello\x00<world>", "text/plain",
     "answered 200 OK with a body that is not JSON (text/plain: 'hello"),
    (200, b"[" * 100000, "application/json", "with a body that is not JSON"),
    (200, b"[" + b"0," * (1 << 20) + b"0]", "application/json",
     "answered 200 OK with a body over 1,048,576 bytes (read no further)"),
])
def test_an_error_or_a_broken_answer_is_one_sanitized_line_and_exit_1(
        answering, capsys, status, body, ctype, message):
    server = answering(status, body, ctype)
    assert main(["kv", "--url", server.url, "--json"]) == 1
    line = one_error_line(capsys)
    assert message in line, line
    assert "<" not in line.split("answered")[1] and "\x1b" not in line and len(line) < 400


def test_an_answer_cut_short_is_exit_1(answering, capsys):
    server = answering(200, json.dumps(STATUS).encode(), length=len(json.dumps(STATUS)) + 50)
    assert main(["kv", "--url", server.url]) == 1
    line = one_error_line(capsys)
    assert f"broke off mid-answer ({len(json.dumps(STATUS))} of {len(json.dumps(STATUS)) + 50} " \
           "bytes of the body came): did the server die?" in line, line


def test_an_answer_that_is_not_http_is_exit_1(capsys):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)                                  # bounded: one client, or give up

    def garbage():
        try:
            client, _ = listener.accept()
        except OSError:
            return
        with client:
            client.recv(4096)
            client.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\x1b[2J")
    thread = threading.Thread(target=garbage, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        assert main(["kv", "--url", url]) == 1
    finally:
        thread.join(timeout=30)
        listener.close()
    line = one_error_line(capsys)
    assert "broke off or did not answer HTTP (BadStatusLine: SSH-2.0-OpenSSH_9.6" in line, line
    assert "\x1b" not in line


def test_nothing_listening_is_bad_input(capsys):
    assert main(["kv", "--url", f"http://127.0.0.1:{free_port()}"]) == 2
    line = one_error_line(capsys)
    assert "cannot reach" in line and "Connection refused" in line, line


class Dripping(_LocalServer):
    """Answers every request one byte per ``tick`` seconds, at most ``total`` bytes (then it
    has sent a whole, good answer and stops). ``where``: "headers" drips the status line and
    headers, "body" sends the headers at once and drips the body. Records how many bytes it
    sent before the client hung up."""

    def __init__(self, where: str, tick: float = 0.05):
        body = json.dumps(STATUS).encode()
        head = (f"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.total = len(head) + len(body)
        self.sent = None
        self.done = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                data = head + body
                start = 0
                if where == "body":
                    self.wfile.write(head)
                    self.wfile.flush()
                    start = len(head)
                sent = start
                try:
                    for i in range(start, len(data)):       # bounded: at most len(data) ticks
                        self.wfile.write(data[i:i + 1])
                        self.wfile.flush()
                        sent = i + 1
                        time.sleep(tick)
                except OSError:
                    pass                                     # the client hung up
                finally:
                    owner.sent = sent
                    owner.done.set()

        self._serve(Handler)


@pytest.mark.parametrize("where", ["headers", "body"])
def test_timeout_bounds_the_whole_request_not_each_read(capsys, where):
    """Each byte comes well within --timeout (a per-read timeout never fires), but the whole
    answer would take ~20 times --timeout: the command gives up, hangs up, exits 1."""
    server = Dripping(where)
    try:
        assert main(["kv", "--url", server.url, "--timeout", "0.5"]) == 1
        line = one_error_line(capsys)
        assert server.done.wait(timeout=60), "the drip did not end"
    finally:
        server.close()
    assert "did not answer within --timeout 0.5 s" in line, line
    stage = "waiting for the status line and headers" if where == "headers" else "reading the body"
    assert f"(still {stage})" in line, line
    assert server.sent < server.total        # it hung up: the drip had not finished


def test_selfcheck_url_refuses_what_is_not_a_report(answering, capsys):
    for body, message in ([[], "it is '[]', not a JSON object"],
                          [{"passed": "yes", "checks": []}, 'passed is "yes"'],
                          [{"passed": True}, "checks is null, expected a list"],
                          [{"passed": True, "checks": [{"name": "gpu"}]}, "checks[0] is"],
                          [{"passed": True, "checks": [{"name": "gpu", "status": "ok",
                                                        "detail": "", "fix": 3}]}, "checks[0]"],
                          [{"passed": True, "phase": 5, "checks": []}, "phase is 5"]):
        server = answering(200, body)
        assert main(["selfcheck", "--url", server.url]) == 1
        line = one_error_line(capsys, "selfcheck")
        assert "the server's answer is not a self-check report" in line and message in line, line


def test_selfcheck_url_prints_a_report_without_the_servers_escapes(answering, capsys):
    report = {"phase": "ready", "passed": True, "checks": [
        {"name": "gpu", "status": "ok", "detail": "1 x H200\n\x1b[2Jcleared", "fix": ""}]}
    server = answering(200, report)
    assert main(["selfcheck", "--url", server.url]) == 0
    assert capsys.readouterr().out == "gpu: ok: 1 x H200 cleared\n"


@pytest.mark.parametrize("url, message", [
    ("http://[::1", "(Invalid IPv6 URL)"), ("http://[::1]:x", "Port could not be cast"),
    ("http://h:65536", "Port out of range"), ("http://h:0", "port 0"),
    ("localhost:8000", "add the scheme, http://localhost:8000"), ("ftp://h:1", "got 'ftp://h:1'"),
    ("http:///proxima", "it has no host"), ("http://h:1/#top", "drop the query or fragment"),
    ("http://h:1/\x1b[31m", "a control character"), ("   ", "give --url URL"),
])
def test_a_malformed_url_is_one_line_and_exit_2(capsys, url, message):
    for argv in (["kv", "--url", url], ["selfcheck", "--url", url]):
        assert main(argv) == 2
        line = one_error_line(capsys, argv[0])
        assert message in line, line


def test_a_base_path_is_kept_and_the_route_added():
    assert remote.server_url(" HTTP://127.0.0.1:8000/gpu1/ ") == "http://127.0.0.1:8000/gpu1"
    assert remote.server_url("http://[::1]:8000") == "http://[::1]:8000"


@pytest.mark.parametrize("command", ["kv", "selfcheck"])
def test_help_states_the_exit_status(command):
    done = run_proxima(command, "--help")
    assert done.returncode == 0, done.stderr
    text = done.stdout.split("exit status:")[1]
    for line in ("0  ", "1  ", "2  bad input"):
        assert f"\n  {line}" in text, text
    assert "runtime failure" in text
