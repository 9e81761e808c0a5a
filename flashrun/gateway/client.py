"""The LLM gateway: one OpenAI-compatible base URL, one key, models switched by name.

Every failure becomes a :class:`GatewayError` with one line and a hint, from one classification
shared by ``gen-cases`` and ``check-env --online`` (:func:`check_online`), so both give the same
diagnosis for the same broken gateway. A 404 or an HTML page is told apart as "wrong model name"
or "wrong base URL" by probing ``/models``, the only endpoint that can say which.

The key is registered with :mod:`flashrun.records.redact` as soon as it is read, and any server text put
into a message is masked (error bodies may echo the key, whole or in part).

Time is bounded: each request has a timeout, and the SDK retries 429, 5xx, timeouts and
connection failures at most ``api.max_retries`` times, honouring ``retry-after`` (it refuses to
wait when the server asks for more than two minutes). The ``openai`` package is imported here
only, lazily, because ``flashrun --help`` must stay fast.
"""

from __future__ import annotations

import difflib
import json
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from flashrun.config import Config, base_url_root, key_variable, resolve_api_key
from flashrun.errors import FlashrunError, GatewayError
from flashrun.gateway.replies import CASES_SCHEMA
from flashrun.records.redact import MASK, redact, register_secret

if TYPE_CHECKING:
    from openai import APIConnectionError, OpenAI

# Asked for in this order; a gateway that answers 400 to one falls back to the next.
MODES = ("json_schema", "json_object", "plain")

_PROBE_TIMEOUT = 10.0  # seconds; a /models probe only helps explain another failure
_MODEL_WORDS = re.compile(
    r"model_not_found|\b(unknown|invalid|unsupported|no such)\s+model|"
    r"\bmodel\b.{0,80}\b(not found|does not exist|doesn't exist|unknown|invalid|not supported|"
    r"unsupported|not available|no access)",
    re.IGNORECASE,
)
_FORMAT_WORDS = re.compile(r"response_format|response format|json_schema|json_object|structured output", re.I)


class RateLimited(GatewayError):
    """429 after the retries: the key and URL are right, the gateway is busy."""


@dataclass(frozen=True)
class Reply:
    content: str
    mode: str  # the response-format mode that produced it
    served_model: str | None  # the model as the gateway reports it (may carry a version)
    usage: dict[str, int]
    latency_s: float


class _ModeRefused(Exception):
    """The gateway answered 400 to a response_format; the next mode may work."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Gateway:
    """A client for one gateway. Remembers, per model, the response-format mode that worked."""

    def __init__(self, cfg: Config) -> None:
        self._cfg = cfg
        self.base_url = base_url_root(cfg.api.base_url)
        self._key = resolve_api_key(cfg)
        register_secret(self._key)
        self._key_grams = {self._key[i : i + 8] for i in range(len(self._key) - 7)}
        variable = key_variable(cfg)
        self._key_source = f"from {variable}" if variable else "in api.api_key"
        self._chat_timeout = cfg.request.timeout or cfg.api.timeout
        from openai import OpenAI

        # Every setting explicit: left out, the SDK would read OPENAI_BASE_URL / OPENAI_API_KEY.
        self._client: OpenAI = OpenAI(
            api_key=self._key, base_url=self.base_url, timeout=cfg.api.timeout, max_retries=cfg.api.max_retries
        )
        self.modes: dict[str, str] = {}
        self.fallbacks: dict[str, list[dict[str, str]]] = {}
        self._listed: dict[str, list[str] | None] = {}

    # -- requests ------------------------------------------------------------------------------
    def ask_cases(self, model: str, messages: list[dict[str, str]]) -> Reply:
        """One reply to ``messages``, asking for JSON as strictly as this gateway allows."""
        start = MODES.index(self.modes.get(model, MODES[0]))
        for mode in MODES[start:-1]:
            try:
                return self._remember(model, self._reply(model, messages, mode))
            except _ModeRefused as refused:
                self.fallbacks.setdefault(model, []).append({"mode": mode, "refused": refused.reason})
        return self._remember(model, self._reply(model, messages, MODES[-1]))

    def ping(self, model: str) -> float:
        """A 1-token chat; the seconds it took. Raises the classified error."""
        started = time.perf_counter()
        self._send(model, [{"role": "user", "content": "Reply with OK."}], MODES[-1], max_tokens=1)
        return time.perf_counter() - started

    def _remember(self, model: str, reply: Reply) -> Reply:
        self.modes[model] = reply.mode
        return reply

    def _reply(self, model: str, messages: list[dict[str, str]], mode: str) -> Reply:
        started = time.perf_counter()
        body = self._send(model, messages, mode, max_tokens=self._cfg.request.max_tokens)
        latency = time.perf_counter() - started
        choices = body.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if choice is None:
            raise GatewayError(f"the gateway's reply for model '{model}' holds no choices",
                               hint="is api.base_url an OpenAI-compatible API? `flashrun check-env --online` checks it")
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        content = message.get("content")
        if choice.get("finish_reason") == "length":
            raise GatewayError(
                f"model '{model}' hit the token limit (request.max_tokens = {self._cfg.request.max_tokens}) "
                "before finishing its reply (finish_reason: length)",
                hint="raise request.max_tokens, or ask for fewer cases with --count",
            )
        if not isinstance(content, str) or not content.strip():
            refusal = message.get("refusal")
            raise GatewayError(
                f"model '{model}' returned an empty reply" + (f" (refusal: {self._clean(refusal)})" if refusal else ""),
                hint="try again or another model (--model); --offline writes built-in cases without a gateway",
            )
        return Reply(content, mode, body.get("model") if isinstance(body.get("model"), str) else None,
                     _usage(body.get("usage")), latency)

    def _send(self, model: str, messages: list[dict[str, str]], mode: str, max_tokens: int) -> dict[str, Any]:
        """POST /chat/completions; the JSON body of a 200 reply, or a classified error."""
        from openai import APIConnectionError, APIStatusError

        extra: dict[str, Any] = {}
        if mode == "json_schema":
            extra["response_format"] = {
                "type": "json_schema", "json_schema": {"name": "cases", "strict": True, "schema": CASES_SCHEMA},
            }
        elif mode == "json_object":
            extra["response_format"] = {"type": "json_object"}
        try:
            raw = self._client.chat.completions.with_raw_response.create(
                model=model, messages=messages, max_tokens=max_tokens,
                temperature=self._cfg.request.temperature, timeout=self._chat_timeout, **extra,
            )
        except APIStatusError as exc:
            text = exc.response.text
            # A 400 to a structured request is taken as "format unsupported" unless it is about the
            # model: gateways word that refusal in many ways, and plain text is always understood.
            if mode != MODES[-1] and exc.status_code in (400, 422) and (
                _FORMAT_WORDS.search(text) or not _names_model(text, model)
            ):
                raise _ModeRefused(f"HTTP {exc.status_code}{self._detail(text)}") from None
            raise self._status_error(
                exc.status_code, text, model,
                retries=int(exc.response.request.headers.get("x-stainless-retry-count") or 0),
                retry_after=_retry_after(exc.response.headers.get("retry-after")),
            ) from None
        except APIConnectionError as exc:
            raise self._connection_error(exc, self._chat_timeout) from None
        try:
            body = json.loads(raw.text)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise self._not_an_api(f"HTTP {raw.status_code} with {_describe_body(raw.text)}")
        if body.get("error"):
            raise self._embedded_error(body["error"], model)
        return body

    def _probe(self, base_url: str) -> list[str] | None:
        """Best effort, never raises: it only helps explain another failure."""
        from openai import APIError

        if base_url not in self._listed:
            client = self._client.with_options(base_url=base_url, max_retries=0,
                                               timeout=min(self._cfg.api.timeout, _PROBE_TIMEOUT))
            try:
                self._listed[base_url] = _model_ids(client.models.with_raw_response.list().text)
            except APIError:
                self._listed[base_url] = None
        return self._listed[base_url]

    # -- classification ------------------------------------------------------------------------
    def _clean(self, text: str) -> str:
        """Server text made safe to show: the key and anything sharing 8 characters with it masked."""
        text = redact(" ".join(str(text).split()))
        if self._key_grams:
            text = re.sub(r"[^\s\"'`,;()\[\]{}<>]{8,}",
                          lambda m: MASK if any(m.group(0)[i : i + 8] in self._key_grams
                                                for i in range(len(m.group(0)) - 7)) else m.group(0), text)
        return text if len(text) <= 160 else text[:157] + "..."

    def _detail(self, text: str) -> str:
        message = _server_message(text)
        return f': "{self._clean(message)}"' if message else ""

    def _status_error(self, status: int, text: str, model: str, *, retries: int = 0,
                      retry_after: float | None = None) -> GatewayError:
        detail = self._detail(text)
        if status == 401:
            return GatewayError(
                f"the gateway rejected the API key {self._key_source} (401 Unauthorized){detail}",
                hint=f"{self._key_hint()}; check that the key belongs to {self._host()}",
            )
        if status == 403:
            return GatewayError(
                f"the API key {self._key_source} is not allowed to use model '{model}' (403 Forbidden){detail}",
                hint="the key lacks permission, quota or access to this model: check it on the gateway's "
                     "dashboard, or pick another model with --model",
            )
        if status == 429:
            after = retry_after
            waited = f", honouring retry-after ({after:g} s)" if after is not None and retries else ""
            # The SDK stops early when retry-after is longer than it is willing to wait.
            early = (f"; it asked to wait {after:g} s, too long to wait"
                     if after is not None and retries < self._cfg.api.max_retries else "")
            return RateLimited(
                f"rate limited by the gateway (429) on model '{model}': gave up after {_retries(retries)}"
                f"{waited}{early}{detail}",
                hint="wait a minute and run again, ask fewer models at once, or raise api.max_retries",
            )
        if status >= 500:
            return GatewayError(
                f"the gateway failed (HTTP {status}) on model '{model}' after {_retries(retries)}{detail}",
                hint="a problem on the gateway's side: try again later, or another model with --model",
            )
        if status == 404 or _names_model(text, model):
            return self._model_or_url_error(status, text, model)
        return GatewayError(
            f"the gateway refused the request for model '{model}' (HTTP {status}){detail}",
            hint="check [request] max_tokens and temperature against what this model accepts",
        )

    def _model_or_url_error(self, status: int, text: str, model: str) -> GatewayError:
        models = self._probe(self.base_url)
        if models is not None and model in models:
            return GatewayError(
                f"the gateway lists model '{model}' but refused it (HTTP {status}){self._detail(text)}",
                hint="the model may be disabled for this key or region; try another model with --model",
            )
        if models is None and not _names_model(text, model):
            return self._not_an_api(f"HTTP {status} with {_describe_body(text)}")
        if models is not None:
            close = difflib.get_close_matches(model, models, n=1, cutoff=0.5)
            shown = ", ".join(models[:8]) + (f" and {len(models) - 8} more" if len(models) > 8 else "")
            hint = (f"did you mean '{close[0]}'? " if close else "") + f"this gateway offers: {shown or 'none'}"
        else:
            hint = ("spell the model as this gateway does (claude-3-5-sonnet vs claude-3.5-sonnet); "
                    "it offers no /models list to check against")
        return GatewayError(f"the gateway does not know model '{model}' (HTTP {status}){self._detail(text)}", hint=hint)

    def _not_an_api(self, what: str) -> GatewayError:
        """The base URL answers, but not as an OpenAI-compatible API root."""
        base = self.base_url
        candidates = [base[: -len("/chat/completions")]] if base.endswith("/chat/completions") else (
            [] if re.search(r"/v\d+$", base) else [base + "/v1"])
        working = next((c for c in candidates if self._probe(c) is not None), None)
        if working:
            hint = f'set api.base_url = "{working}" (that URL answers /models)'
        elif base.endswith("/chat/completions"):
            hint = "remove /chat/completions from api.base_url: the client appends it"
        elif candidates:
            hint = f"OpenAI-compatible APIs usually sit under /v1: try api.base_url = \"{base}/v1\""
        else:
            hint = "check api.base_url against the gateway's docs: it is the root that /chat/completions hangs off"
        return GatewayError(f"{base} does not answer like an OpenAI-compatible API: "
                            f"POST /chat/completions gave {what}", hint=hint)

    def _embedded_error(self, error: Any, model: str) -> GatewayError:
        """HTTP 200 with an ``error`` object: classify by the status it carries, if any."""
        text = json.dumps({"error": error}, default=str)
        code = error.get("code", error.get("status")) if isinstance(error, dict) else None
        status = int(code) if isinstance(code, (int, str)) and str(code).isdigit() else None
        if status in (401, 403):
            classified = self._status_error(status, text, model)
            return GatewayError(classified.message + " (inside an HTTP 200 reply)", hint=classified.hint)
        return GatewayError(
            f"the gateway answered HTTP 200 carrying an error for model '{model}'{self._detail(text)}",
            hint="the gateway's own message above says what went wrong; try again, or another model with --model",
        )

    def _connection_error(self, exc: APIConnectionError, timeout: float) -> GatewayError:
        from openai import APITimeoutError

        parts = urlsplit(self.base_url)
        retries = _retries(self._cfg.api.max_retries)
        if isinstance(exc, APITimeoutError):
            setting = "request.timeout" if self._cfg.request.timeout else "api.timeout"
            return GatewayError(
                f"no reply from {self._host()} within {timeout:g} s (after {retries})",
                hint=f"check the network, proxy or VPN; a slow model may need a larger {setting}",
            )
        cause = str(exc.__cause__ or exc)
        if "refused" in cause.lower():
            return GatewayError(f"cannot connect to {parts.netloc}: connection refused (after {retries})",
                                hint="is the gateway running, and are the scheme, host and port of api.base_url right?")
        if re.search(r"name or service|nodename|getaddrinfo|name resolution|no address", cause, re.I):
            return GatewayError(f"cannot resolve the host {parts.hostname}",
                                hint="check the host name in api.base_url, and your DNS or proxy settings")
        if re.search(r"ssl|certificate|tls", cause, re.I):
            return GatewayError(f"the TLS handshake with {parts.netloc} failed: {self._clean(cause)}",
                                hint="check http vs https in api.base_url, and proxy certificates (SSL_CERT_FILE)")
        return GatewayError(f"cannot reach {self.base_url}: {self._clean(cause)}",
                            hint="check the network, proxy settings (HTTPS_PROXY) and api.base_url")

    def _key_hint(self) -> str:
        variable = key_variable(self._cfg)
        if variable is None:
            return "check the key written in api.api_key (better: keep it in a variable named by api.api_key_env)"
        return (f"is {variable} exported in this shell with the right key? An IDE, service or new terminal "
                "may not inherit your shell's variables")

    def _host(self) -> str:
        return urlsplit(self.base_url).netloc


def _server_message(text: str) -> str:
    """The human part of an error body: ``error.message`` and the like, never an HTML page."""
    try:
        body = json.loads(text)
    except ValueError:
        return "" if _looks_html(text) else text.strip()
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict):
            for key in ("message", "detail", "msg"):
                if isinstance(error.get(key), str):
                    return error[key]
        if isinstance(error, str):
            return error
    return text.strip()


def _looks_html(text: str) -> bool:
    return bool(re.match(r"\s*<(!doctype|html|head|body)", text, re.IGNORECASE))


def _describe_body(text: str) -> str:
    if _looks_html(text):
        return "an HTML page"
    return "an empty body" if not text.strip() else "a body that is not JSON"


def _model_ids(text: str) -> list[str] | None:
    try:
        body = json.loads(text)
    except ValueError:
        return None
    items = body.get("data", body.get("models")) if isinstance(body, dict) else body
    if not isinstance(items, list):
        return None
    ids = [i if isinstance(i, str) else i.get("id") for i in items if isinstance(i, (str, dict))]
    return [i for i in ids if isinstance(i, str)]


def _retries(n: int) -> str:
    return f"{n} retry" if n == 1 else f"{n} retries"


def _names_model(text: str, model: str) -> bool:
    return bool(_MODEL_WORDS.search(text)) or model.lower() in text.lower()


def _retry_after(value: str | None) -> float | None:
    """Seconds from a numeric ``retry-after`` (the HTTP-date form is left to the SDK)."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _usage(usage: Any) -> dict[str, int]:
    if not isinstance(usage, dict):
        return {}
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens") if isinstance(usage.get(k), int)}


def check_online(cfg: Config) -> tuple[str, str, str | None]:
    """``(status, detail, hint)`` for one minimal request: a 1-token chat with ``api.default_model``.

    status is "ok", "warn" (rate limited: key and URL are right) or "fail". The chat exercises
    key, base URL and model at once, and goes through the classification ``gen-cases`` uses."""
    try:
        gateway = Gateway(cfg)
        latency = gateway.ping(cfg.api.default_model)
    except FlashrunError as exc:
        status = "warn" if isinstance(exc, RateLimited) else "fail"
        return status, redact(exc.message), exc.hint and redact(exc.hint)
    return "ok", f"{gateway.base_url}: model '{cfg.api.default_model}' answered in {latency:.2f} s", None
