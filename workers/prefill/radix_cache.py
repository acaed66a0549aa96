"""Prefix cache for the prefill worker: a page-granular radix tree over prompt token ids.

Each node below the root stands for one full KV page: its key is the page's `page_size` token
ids, its value the pool page holding their latent KV. A path from the root spells a prompt
prefix, so two prompts sharing their first k full pages share k nodes and k pages.

    page_size=2; cached prompts [1,2,3,4,5] and [1,2,7,8]:
        root -> (1,2) p4 -> (3,4) p9        ([5] was a partial page: never cached)
                         -> (7,8) p2

- `match(ids)` returns the pages of the longest cached prefix, at most `(len(ids)-1)//page_size`
  pages (the last prompt token is always computed: its logits give the first output token) and
  pins the path (`refs`) so eviction cannot take pages a running request reads.
- `insert(ids, pages)` hands a finished request's full pages to the tree; pages another request
  cached meanwhile are duplicates and come back to the caller to free.
- `evict(n)` frees the least recently used unpinned leaves. `alloc(n)` evicts when the pool is short.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Sequence

from deepseek_pd.model.kv.pool import KVPool, KVPoolExhausted


class _Node:
    __slots__ = ("key", "page", "parent", "children", "refs", "last_used")

    def __init__(self, key: tuple[int, ...], page: int, parent: "_Node | None", now: int) -> None:
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.refs = 0
        self.last_used = now


@dataclass
class CacheHit:
    """A pinned cached prefix: `pages` hold the KV of the first `num_tokens` prompt tokens."""

    pages: list[int]
    nodes: list[_Node] = field(repr=False)
    page_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.pages) * self.page_size


class RadixCache:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._clock = itertools.count(1)
        self.root = _Node((), -1, None, 0)
        self.num_pages = 0  # pages owned by the tree

    def _page_keys(self, token_ids: Sequence[int], num_pages: int) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(token_ids[i * ps:(i + 1) * ps]) for i in range(num_pages)]

    def match(self, token_ids: Sequence[int]) -> CacheHit:
        now = next(self._clock)
        node, nodes = self.root, []
        for key in self._page_keys(token_ids, (len(token_ids) - 1) // self.page_size):
            child = node.children.get(key)
            if child is None:
                break
            nodes.append(child)
            node = child
        for hit in nodes:
            hit.refs += 1
            hit.last_used = now
        return CacheHit([n.page for n in nodes], nodes, self.page_size)

    def release(self, hit: CacheHit) -> None:
        """Unpins a hit; its pages stay cached (evictable once no one else pins them)."""
        for node in hit.nodes:
            if node.refs <= 0:
                raise RuntimeError("radix cache: release of a prefix that is not pinned")
            node.refs -= 1
        hit.nodes = []

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> list[int]:
        """Caches the full pages of a finished prompt; returns the caller's pages it must free.

        `pages` is the request's whole page table (cached prefix first). The tree adopts each full
        page it did not have; for a page it already had (the request's own prefix hit, or a copy
        another request inserted first) the request's page is returned unless it is that same page.
        The partial last page, if any, is always returned.
        """
        now = next(self._clock)
        num_full = len(token_ids) // self.page_size
        node, to_free = self.root, []
        for index, key in enumerate(self._page_keys(token_ids, num_full)):
            page = pages[index]
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(key, page, node, now)
                self.num_pages += 1
            elif child.page != page:
                to_free.append(page)
            child.last_used = now
            node = child
        to_free += list(pages[num_full:])
        return to_free

    def evict(self, num_pages: int) -> int:
        """Frees up to `num_pages` unpinned leaf pages, least recently used first."""
        heap = [(n.last_used, id(n), n) for n in self._nodes() if not n.children and n.refs == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            freed.append(node.page)
            if parent is not self.root and not parent.children and parent.refs == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        self.pool.free(freed)
        self.num_pages -= len(freed)
        return len(freed)

    def alloc(self, num_pages: int) -> list[int]:
        """`pool.alloc`, evicting cached pages first if the pool is short."""
        short = num_pages - self.pool.num_free_pages
        if short > 0:
            self.evict(short)
        if num_pages > self.pool.num_free_pages:
            raise KVPoolExhausted(f"KV pool exhausted: need {num_pages} pages, {self.pool.num_free_pages} "
                                  f"free and {self.num_pages} cached (pinned by running requests)")
        return self.pool.alloc(num_pages)

    @property
    def num_pinned_nodes(self) -> int:
        return sum(1 for n in self._nodes() if n.refs > 0)

    def clear(self) -> None:
        """Frees every unpinned page (all of them when nothing runs)."""
        self.evict(self.num_pages)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
