"""A loopback HTTP receiver of the approval webhook (tests, and anyone trying
APPROVAL_WEBHOOK_URL by hand): it checks each POST's ``X-Agent-Recovery-Signature`` against its
secret the way a receiver should (HMAC-SHA256 of the raw body, compared in constant time),
answers 401 when it does not match, 503 to the first ``fail_first`` POSTs, 204 otherwise, and
keeps every POST it saw.

    with WebhookReceiver(secret="s3cret", fail_first=2) as hook:
        ... APPROVAL_WEBHOOK_URL=hook.url ...
        hook.accepted  # the JSON bodies it took, in order
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SIGNATURE_HEADER = "X-Agent-Recovery-Signature"


@dataclass
class Seen:
    """One POST as received: its body, whether its signature matched, the status answered."""

    body: bytes
    signed: bool
    status: int

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class WebhookReceiver:
    secret: str
    fail_first: int = 0
    seen: list[Seen] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _httpd: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._httpd is not None
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/hooks/approvals"

    @property
    def accepted(self) -> list[Any]:
        with self._lock:
            return [s.json() for s in self.seen if s.status == 204]

    def answer(self, body: bytes, signature: str) -> int:
        expected = "sha256=" + hmac.new(self.secret.encode("utf-8"), body, hashlib.sha256).hexdigest()
        signed = hmac.compare_digest(expected, signature)
        with self._lock:
            failing = signed and sum(1 for s in self.seen if s.signed) < self.fail_first
            status = 401 if not signed else 503 if failing else 204
            self.seen.append(Seen(body, signed, status))
        return status

    def __enter__(self) -> WebhookReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                status = receiver.answer(body, self.headers.get(SIGNATURE_HEADER, ""))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                return

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
