"""One rule for a future whose waiter may have given up on it (a timeout, a cancelled caller, a
shielded write): its outcome is marked as seen, so that asyncio does not log "exception was never
retrieved" for a failure somebody already handled by other means."""
from __future__ import annotations

import asyncio
import concurrent.futures


def retrieve(future: "asyncio.Future | concurrent.futures.Future") -> None:
    """Marks a done `future`'s exception, if any, as retrieved (as a done callback, or after a wait)."""
    if not future.cancelled():
        future.exception()
