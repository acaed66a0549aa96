"""HTTP client for the router: `/generate` (SGLang native) and `/v1/chat/completions` (OpenAI).

Every call returns a result with the text, token ids when the API gives them, the finish reason,
and client-side timing (time to first token, arrival time of every streamed piece), which is what
`bench serving` measures. A non-200 answer or an error event inside a stream raises `RouterError`.
`get_json` reads the router's JSON endpoints (`/v1/models`, `/workers`) by content, whatever
Content-Type they carry.

    async with RouterClient("http://127.0.0.1:30000", model="tiny") as client:
        result = await client.generate(text="Hello", max_new_tokens=16, temperature=0.0)
        print(result.text, result.output_ids)
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import aiohttp

from deepseek_pd.client.sse import iter_sse_json
from deepseek_pd.errors import UserError


class RouterError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


@dataclass
class GenerateResult:
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # with return_logprob=True
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    start_time: float = 0.0
    first_token_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each piece with tokens
    chunk_token_counts: list[int] = field(default_factory=list)
    end_time: float = 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.start_time

    @property
    def latency(self) -> float:
        return self.end_time - self.start_time


@dataclass
class ChatResult(GenerateResult):
    content: str = ""


def _finish_reason(meta: dict) -> str | None:
    reason = meta.get("finish_reason")
    if isinstance(reason, dict):
        return reason.get("type")
    return reason


def parse_json_body(body: bytes, what: str) -> Any:
    """JSON judged by content, not by its Content-Type: sglang-router 0.3.2 sends JSON labelled
    `text/plain`. A body that is not JSON is a `UserError` naming `what` and quoting the body."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        snippet = body[:200].decode("utf-8", "replace")
        raise UserError(f"{what} did not answer JSON (got {snippet!r})") from None


class RouterClient:
    def __init__(self, base_url: str, model: str = "", timeout_s: float = 600.0,
                 session: aiohttp.ClientSession | None = None, api_key: str | None = None,
                 admin_key: str | None = None) -> None:
        """`api_key` is sent on the serving routes (`up --api-key-file`), `admin_key` on the
        control plane's (`/workers`: the key `up` writes to `<log dir>/control-plane-key`)."""
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._api_headers = _bearer(api_key)
        self._admin_headers = _bearer(admin_key)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> "RouterClient":
        if self._session is None:
            # The default connector allows 100 connections; benchmarks need more in flight.
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use `async with RouterClient(...)` (or pass a session)")
        return self._session

    async def get_json(self, path: str, admin: bool = False) -> Any:
        """GET `path` (e.g. "/v1/models", or "/workers" with `admin`); non-200 raises `RouterError`."""
        headers = self._admin_headers if admin else self._api_headers
        async with self.session.get(f"{self.base_url}{path}", headers=headers) as response:
            await _raise_for_status(response)
            return parse_json_body(await response.read(), f"{self.base_url}{path}")

    async def post_json(self, path: str, body: Any) -> Any:
        """POST `body` as JSON to a serving route (e.g. "/v1/tokenize"); non-200 raises `RouterError`."""
        async with self.session.post(f"{self.base_url}{path}", json=body, headers=self._api_headers) as response:
            await _raise_for_status(response)
            return parse_json_body(await response.read(), f"{self.base_url}{path}")

    async def generate(self, text: str | None = None, input_ids: Sequence[int] | None = None,
                       stream: bool = False, on_text: Callable[[str], None] | None = None,
                       return_logprob: bool = False, **sampling: Any) -> GenerateResult:
        """POST /generate. `sampling` goes into sampling_params (max_new_tokens, temperature, ...)."""
        body: dict[str, Any] = {"model": self.model, "sampling_params": sampling, "stream": stream,
                                "return_logprob": return_logprob}
        if text is not None:
            body["text"] = text
        if input_ids is not None:
            body["input_ids"] = list(input_ids)
        result = GenerateResult(start_time=time.perf_counter())
        async with self.session.post(f"{self.base_url}/generate", json=body,
                                     headers=self._api_headers) as response:
            await _raise_for_status(response)
            if not stream:
                payload = await response.json()
                item = payload[0] if isinstance(payload, list) else payload
                self._apply_generate_item(result, item, incremental=False)
                if result.output_ids:
                    result.first_token_time = time.perf_counter()
            else:
                async for event in iter_sse_json(response):
                    _raise_on_event_error(event)
                    before = len(result.text)
                    self._apply_generate_item(result, event, incremental=True)
                    if on_text is not None and len(result.text) > before:
                        on_text(result.text[before:])
        result.end_time = time.perf_counter()
        return result

    def _apply_generate_item(self, result: GenerateResult, item: dict, incremental: bool) -> None:
        ids = list(item.get("output_ids") or [])
        now = time.perf_counter()
        meta = item.get("meta_info") or {}
        # [[logprob, token_id], ...] for this item's tokens; the router repeats the last entry on
        # the final streamed event, which carries no tokens, so only items with ids count.
        logprobs = [float(entry[0]) for entry in (meta.get("output_token_logprobs") or [])][:len(ids)]
        if incremental:
            if ids:
                if result.first_token_time is None:
                    result.first_token_time = now
                result.chunk_times.append(now)
                result.chunk_token_counts.append(len(ids))
            result.output_ids.extend(ids)
            result.output_logprobs.extend(logprobs)
        else:
            result.output_ids = ids
            result.output_logprobs = logprobs
            result.chunk_times.append(now)
            result.chunk_token_counts.append(len(ids))
        # The router's streamed "text" is cumulative; non-streamed it is the whole answer.
        result.text = item.get("text", result.text)
        result.finish_reason = _finish_reason(meta) or result.finish_reason
        result.prompt_tokens = meta.get("prompt_tokens", result.prompt_tokens)
        result.completion_tokens = meta.get("completion_tokens", result.completion_tokens)
        result.cached_tokens = meta.get("cached_tokens", result.cached_tokens)

    async def chat(self, messages: list[dict], stream: bool = False,
                   on_text: Callable[[str], None] | None = None, **options: Any) -> ChatResult:
        """POST /v1/chat/completions; `options` are OpenAI fields (max_tokens, temperature, ...)."""
        body = {"model": self.model, "messages": messages, "stream": stream, **options}
        if stream:
            body.setdefault("stream_options", {"include_usage": True})
        result = ChatResult(start_time=time.perf_counter())
        async with self.session.post(f"{self.base_url}/v1/chat/completions", json=body,
                                     headers=self._api_headers) as response:
            await _raise_for_status(response)
            if not stream:
                payload = await response.json()
                choice = payload["choices"][0]
                result.content = result.text = choice["message"].get("content") or ""
                result.finish_reason = choice.get("finish_reason")
                result.first_token_time = time.perf_counter()
                self._apply_usage(result, payload.get("usage"))
            else:
                async for event in iter_sse_json(response):
                    _raise_on_event_error(event)
                    self._apply_usage(result, event.get("usage"))
                    for choice in event.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content") or ""
                        if piece:
                            now = time.perf_counter()
                            if result.first_token_time is None:
                                result.first_token_time = now
                            result.chunk_times.append(now)
                            result.chunk_token_counts.append(1)
                            result.content += piece
                            if on_text is not None:
                                on_text(piece)
                        result.finish_reason = choice.get("finish_reason") or result.finish_reason
                result.text = result.content
        result.end_time = time.perf_counter()
        return result

    @staticmethod
    def _apply_usage(result: GenerateResult, usage: dict | None) -> None:
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
            result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _raise_for_status(response: aiohttp.ClientResponse) -> None:
    if response.status == 200:
        return
    text = await response.text()
    message = text
    try:
        payload = await response.json(content_type=None)
        error = payload.get("error", payload) if isinstance(payload, dict) else payload
        message = error.get("message", text) if isinstance(error, dict) else str(error)
    except Exception:  # not JSON: keep the raw body
        pass
    raise RouterError(response.status, message)


def _raise_on_event_error(event: dict) -> None:
    error = event.get("error")
    if error:
        message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
        status = error.get("code", 500) if isinstance(error, dict) else 500
        raise RouterError(status if isinstance(status, int) else 500, message)
