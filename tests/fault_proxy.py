"""An HTTP proxy in front of moto's server that injects S3 faults, for tests over real HTTP.

    proxy = FaultProxy(s3_server.endpoint).start()
    proxy.fail("PUT", r"/results/", status=503, code="SlowDown", times=3)   # throttled 3 times
    proxy.fail("GET", r"/shards/shard-00001\\.jsonl$", status=403, code="AccessDenied")  # always
    env["AWS_ENDPOINT_URL"] = proxy.endpoint    # a worker's S3 goes through the proxy

Each request is matched against the rules in order (method, and a regex searched in the path);
the first rule with tries left answers with its status and an S3 error document, the others
are forwarded to moto untouched. `hits(rule)` says how often a rule answered. Path-style
addressing only (what boto3 uses with a custom endpoint and moto).
"""

from __future__ import annotations

import http.client
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
               "proxy-authorization", "proxy-authenticate"}  # fmt: skip


@dataclass
class Rule:
    method: str
    path: re.Pattern
    status: int
    code: str
    times: int | None  # None: every time
    hits: int = 0


class FaultProxy:
    def __init__(self, upstream: str):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.rules: list[Rule] = []
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self.server is not None, "start() the proxy first"
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def fail(self, method: str, path: str, *, status: int, code: str,
             times: int | None = None) -> Rule:  # fmt: skip
        rule = Rule(method.upper(), re.compile(path), status, code, times)
        with self.lock:
            self.rules.append(rule)
        return rule

    def _match(self, method: str, path: str) -> Rule | None:
        with self.lock:
            for rule in self.rules:
                if rule.method == method and rule.path.search(path):
                    if rule.times is not None and rule.hits >= rule.times:
                        continue
                    rule.hits += 1
                    return rule
        return None

    def start(self) -> FaultProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = urlsplit(self.path).path
                rule = proxy._match(self.command, path)
                if rule is not None:
                    return self._answer_error(rule, path)
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in _HOP_BY_HOP}  # fmt: skip
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                            self.send_header(k, v)
                    if self.command == "HEAD":
                        length = resp.getheader("Content-Length")
                        self.send_header("Content-Length", length or "0")
                        self.end_headers()
                    else:
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data)
                finally:
                    conn.close()

            def _answer_error(self, rule: Rule, path: str):
                body = (
                    '<?xml version="1.0" encoding="UTF-8"?>\n'
                    f"<Error><Code>{rule.code}</Code><Message>injected by tests/fault_proxy.py"
                    f"</Message><Resource>{path}</Resource><RequestId>fault</RequestId></Error>"
                ).encode()
                self.send_response(rule.status)
                self.send_header("Content-Type", "application/xml")
                self.send_header(
                    "Content-Length", "0" if self.command == "HEAD" else str(len(body))
                )
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
