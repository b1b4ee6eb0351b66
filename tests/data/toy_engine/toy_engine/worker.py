"""A toy engine worker on the standard library's HTTP server.

``python -m toy_engine.worker --role aggregated|prefill|decode`` listens on
a free port of 127.0.0.1 and prints it. Output token ``i`` of a prompt is
``(sum(prompt) + i) % 1000``. A prefill worker answers only prefill legs,
with the handle ``kv-<len>-<sum>`` of the prompt; a decode worker answers
only legs carrying their prompt's handle. ``GET /served`` counts the
generate requests answered.
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def handle_of(tokens: list[int]) -> str:
    return f"kv-{len(tokens)}-{sum(tokens)}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    role = "aggregated"
    served = 0

    def log_message(self, *args) -> None:
        pass

    def _json(self, status: int, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._json(200, {})
        elif self.path == "/info":
            self._json(200, {"model": "toy", "max_model_len": 4096})
        elif self.path == "/served":
            self._json(200, {"served": Handler.served})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        obj = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))) or b"{}")
        if self.path == "/abort":
            self._json(200, {})
            return
        if self.path != "/toy_generate":
            self._json(404, {"error": "not found"})
            return
        tokens, prefill = obj["tokens"], obj.get("prefill") is True
        if prefill != (self.role == "prefill") or (self.role == "decode" and obj.get("handle") != handle_of(tokens)):
            self._json(400, {"error": f"a {self.role} worker cannot take this leg"})
            return
        Handler.served += 1
        if prefill:
            self._json(200, {"handle": handle_of(tokens)})
            return
        out = [(sum(tokens) + i) % 1000 for i in range(obj["max"])]
        if not obj.get("stream"):
            self._json(200, {"t": out, "done": "length"})
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        events = [{"t": [t], "done": "length" if i == len(out) - 1 else None} for i, t in enumerate(out)]
        for data in [json.dumps(e) for e in events] + ["[DONE]"]:
            chunk = f"data: {data}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=("aggregated", "prefill", "decode"), default="aggregated")
    args = parser.parse_args()
    Handler.role = args.role
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(server.server_address[1], flush=True)
    sys.stdout.close()
    server.serve_forever()


if __name__ == "__main__":
    main()
