"""kopf's own log lines about one object, for tests that must wait on a step of kopf's cycle
that leaves no trace in the API (e.g. it has seen a deletion and stopped the object's timers)."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


class _Collect(logging.Handler):
    def __init__(self, name: str, into: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self._name, self._into = name, into

    def emit(self, record: logging.LogRecord) -> None:
        if (getattr(record, "k8s_ref", None) or {}).get("name") == self._name:
            self._into.append(record.getMessage())


@contextlib.contextmanager
def object_log(name: str) -> Iterator[list[str]]:
    """Yields a list that fills with kopf's messages (debug ones too) about `name`, in order."""
    messages: list[str] = []
    logger = logging.getLogger("kopf.objects")
    handler, level = _Collect(name, messages), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
