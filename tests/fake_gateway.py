"""A scripted OpenAI-compatible gateway for tests: a real HTTP server on 127.0.0.1.

It speaks ``POST /v1/chat/completions`` and ``GET /v1/models``; anything else is an HTML 404,
like a web server in front of an API would answer (or an HTML 200, with ``spa=True``, like a
single-page app that serves its index for every path). Chat answers follow a script: a list of
:class:`Reply` (or callables taking the request body and returning one) per model; the last entry
repeats, so ``[rate_limited()]`` means "429 forever". Every request is recorded with its time.
A reply with ``hang=True`` is never sent while the server runs: the client's own timeout is the
only way out, however slow or loaded the machine (no race between a delay and a timeout).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Union

HTML_404 = "<!DOCTYPE html><html><head><title>404 Not Found</title></head><body><h1>Not Found</h1></body></html>"
HTML_APP = "<!DOCTYPE html><html><head><title>Gateway console</title></head><body><div id=app></div></body></html>"


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: Any = None  # dict/list -> JSON; str -> sent as is
    headers: dict[str, str] = field(default_factory=dict)
    hang: bool = False  # answer only when the server stops (long after the client gave up)
    content_type: str = "application/json"


Script = list[Union[Reply, Callable[[dict[str, Any]], Reply]]]


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None
    time: float


def completion(content: str | None, *, finish_reason: str = "stop", prompt_tokens: int = 50,
               completion_tokens: int = 20) -> Reply:
    return Reply(body={
        "id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": "served-model",
        "choices": [{"index": 0, "finish_reason": finish_reason,
                     "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    })


def cases_json(*pairs: tuple[int, int]) -> str:
    return json.dumps({"cases": [{"seq_len": s, "head_dim": d} for s, d in pairs]})


def api_error(status: int, message: str, *, headers: dict[str, str] | None = None, code: str | None = None) -> Reply:
    return Reply(status=status, body={"error": {"message": message, "type": "invalid_request_error", "code": code}},
                 headers=headers or {})


def rate_limited(retry_after: str = "0.1") -> Reply:
    return api_error(429, "Rate limit reached, slow down", headers={"retry-after": retry_after})


def refuses_json_schema(*then: Reply) -> Callable[[dict[str, Any]], Reply]:
    """A gateway that rejects ``response_format: json_schema`` with 400 and answers anything else
    with the next of ``then`` (the last repeats). Script it as the model's only entry."""
    pending = list(then)

    def answer(body: dict[str, Any]) -> Reply:
        if (body.get("response_format") or {}).get("type") == "json_schema":
            return api_error(400, "response_format type 'json_schema' is not supported by this provider")
        return pending.pop(0) if len(pending) > 1 else pending[0]

    return answer


class FakeGateway:
    def __init__(self, *, models: list[str] | None = None, spa: bool = False, models_status: int = 200) -> None:
        self.models = models if models is not None else ["good-model", "claude-3-5-sonnet", "gpt-4o"]
        self.models_status = models_status  # 404: a gateway without /models; 401/403: auth on every path
        self.spa = spa
        self.scripts: dict[str, Script] = {}
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def root(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    def script(self, model: str, *replies: Reply | Callable[[dict[str, Any]], Reply]) -> None:
        self.scripts[model] = list(replies)

    def chats(self) -> list[Seen]:
        return [s for s in self.seen if s.path.endswith("/chat/completions")]

    def start(self) -> FakeGateway:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()  # releases hanging replies
        self._server.shutdown()
        self._server.server_close()

    # -- request handling (runs in the server's threads) ---------------------------------------
    def answer(self, method: str, path: str, body: dict[str, Any] | None) -> Reply:
        if path == "/v1/models" and method == "GET":
            if self.models_status != 200:
                return api_error(self.models_status, "models listing unavailable")
            return Reply(body={"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})
        if path == "/v1/chat/completions" and method == "POST":
            model = str((body or {}).get("model"))
            with self._lock:
                script = self.scripts.get(model)
                if script is None:
                    return api_error(404, f"The model `{model}` does not exist or you do not have access to it.",
                                     code="model_not_found")
                entry = script.pop(0) if len(script) > 1 else script[0]
            return entry(body or {}) if callable(entry) else entry
        if self.spa:
            return Reply(status=200, body=HTML_APP, content_type="text/html")
        return Reply(status=404, body=HTML_404, content_type="text/html")


def _handler(gateway: FakeGateway) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
            pass

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            body = json.loads(raw) if raw else None
            with gateway._lock:
                gateway.seen.append(Seen(method, self.path, {k.lower(): v for k, v in self.headers.items()}, body,
                                         time.monotonic()))
            reply = gateway.answer(method, self.path, body)
            if reply.hang:
                gateway._stopped.wait()
            payload = reply.body if isinstance(reply.body, str) else json.dumps(reply.body)
            data = payload.encode("utf-8")
            try:
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                self.send_header("Content-Length", str(len(data)))
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
                pass

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler
