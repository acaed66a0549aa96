"""The prefill side's pick in a negotiation the decode side opens (the KV cipher, the KV MAC):
decode offers what it runs, preferred first; the prefill side takes the first it has too."""
from __future__ import annotations

from typing import Sequence


def first_offered(offered: Sequence[str], have: Sequence[str], refusal: str) -> str:
    """The first of `offered` in `have` ("" when nothing is offered: an older decode worker, or a
    transport without the feature); raises ValueError(`refusal`, then both lists) when none is."""
    if not offered:
        return ""
    for name in offered:
        if name in have:
            return name
    raise ValueError(f"{refusal}: decode offers {list(offered)}, this prefill worker has {list(have)}; "
                     f"run one version on both")
