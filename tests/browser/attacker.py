"""A site of another origin for the CSRF tests: a tiny HTTP server (the standard library's, in a
thread) on a host and port of its own, whose one page is a form that posts itself to the
console as soon as it loads. The attacker's page is its own: inline script runs there (the
console's Content-Security-Policy protects only the console's pages)."""

from __future__ import annotations

import contextlib
import html
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def forging_page(action: str, fields: Mapping[str, str]) -> bytes:
    """A page whose form POSTs ``fields`` to ``action`` when it loads."""
    inputs = "".join(
        f'<input type="hidden" name="{html.escape(name)}" value="{html.escape(value)}">'
        for name, value in fields.items()
    )
    return (
        "<!doctype html><html><head><title>You won a prize</title></head><body>"
        f'<form id="forged" method="post" action="{html.escape(action)}">{inputs}</form>'
        '<script>document.getElementById("forged").submit();</script>'
        "</body></html>"
    ).encode()


@contextlib.contextmanager
def attacker_site(host: str, page: bytes) -> Iterator[str]:
    """Serve ``page`` at ``http://<host>:<a free port>/`` until the block ends; its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/html; charset=utf-8")
            self.send_header("content-length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, format: str, *args: object) -> None:
            pass  # (quiet)

    server = ThreadingHTTPServer((host, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="attacker", daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
