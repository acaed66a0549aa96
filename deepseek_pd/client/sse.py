"""Server-sent events as the router writes them: `data: <json>` lines, blank-line separated,
ending with `data: [DONE]`."""
from __future__ import annotations

import json
from typing import AsyncIterable, AsyncIterator

import aiohttp

DONE = "[DONE]"


def iter_sse_json(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    """Yields each event's JSON payload until [DONE] or the end of the body."""
    return parse_sse_json(response.content.iter_any())


async def parse_sse_json(pieces: AsyncIterable[bytes]) -> AsyncIterator[dict]:
    """The parser itself: network reads may split a line (or a UTF-8 character) anywhere."""
    buffer = b""
    async for piece in pieces:
        buffer += piece
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            event = _parse_line(line)
            if event is DONE:
                return
            if event is not None:
                yield event
    event = _parse_line(buffer)
    if event is not None and event is not DONE:
        yield event


def _parse_line(raw: bytes):
    line = raw.decode("utf-8", errors="replace").strip()
    if not line.startswith("data:"):
        return None  # blank separators, comments and other fields carry nothing we use
    payload = line[len("data:"):].strip()
    if payload == DONE:
        return DONE
    return json.loads(payload)
