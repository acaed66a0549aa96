"""Awaiting one step of a request's way while watching for the events that end it early.

Both engines wait on things (a handshake, pages, a transfer, the next token) that an abort, a
peer's failure or a timeout must cut short; this is that rule, written once.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

T = TypeVar("T")


class Interrupted(Exception):
    """`stop` completed before the awaited step did; the step was cancelled."""

    def __init__(self, stop: asyncio.Future) -> None:
        super().__init__("interrupted")
        self.stop = stop


async def unless(awaitable: Awaitable[T], *stops: asyncio.Future) -> T:
    """Awaits `awaitable`, unless one of `stops` is (or becomes) done first: then cancels it and
    raises `Interrupted(that stop)`.

    A stop that is already done wins at once, without starting the step: a consumer that lags
    behind always finds a queued event, and `asyncio.wait` would hand that over instead.
    """
    for stop in stops:
        if stop.done():
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never started: nothing to undo
            raise Interrupted(stop)
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait({task, *stops}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Interrupted(next(stop for stop in stops if stop.done()))
    return task.result()
