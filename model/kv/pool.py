"""The paged latent KV pool: one tensor per layer, pages handed out by a free-list allocator.

Layout (ARCHITECTURE §3): `buffers[layer]` is `[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`
in the model dtype; the first `kv_lora_rank` values of a slot are the normalised latent `c_kv`, the
rest the roped `k_pe`. A request owns an ordered list of pages; its token at position `p` lives at
`pages[p // page_size]`, offset `p % page_size`. Prefill and decode use the same request-local
layout, so PD transfer copies "page i of the request" for every layer.

Example with page_size=4 and pages=[7, 2]: position 5 is slot 2*4 + 1 = 9 of the flattened pool.
"""
from __future__ import annotations

from typing import Sequence

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.config import latent_kv_bytes
from deepseek_pd.units import gib


def copy_pages_(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """`dst[index] = src` along the page dimension, copied as bytes: CUDA's `index_copy_` has no
    float8 kernels (torch 2.11: "index_copy_cuda not implemented for Float8_e4m3fn", an FP8 KV cache),
    and a byte copy moves the same bits for every dtype. Both tensors' last dimension is contiguous."""
    dst.view(torch.uint8).index_copy_(0, index, src.view(torch.uint8))


class KVPoolExhausted(UserError):
    """Not enough free pages: the caller must queue, evict, or reject the request."""


def bytes_per_pool_page(num_layers: int, page_size: int, kv_dim: int, dtype: torch.dtype) -> int:
    """Bytes one page takes over all layers: what a memory budget is divided by (kv_pool_sizing.py)."""
    return latent_kv_bytes(num_layers, kv_dim, dtype.itemsize, tokens=page_size)


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, kv_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if num_pages < 1 or page_size < 1:
            raise UserError(f"KV pool needs num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_dim = kv_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.buffers: list[torch.Tensor] = [
            torch.zeros(num_pages, page_size, kv_dim, dtype=dtype, device=self.device)
            for _ in range(num_layers)
        ]
        # LIFO free list: recently freed pages are reused first, which keeps them warm in cache.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._in_use = bytearray(num_pages)

    # ---- allocator -------------------------------------------------------------------------
    def pages_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, num_pages: int) -> list[int]:
        """Hands out `num_pages` distinct free pages, or raises KVPoolExhausted and changes nothing."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if num_pages > len(self._free):
            raise KVPoolExhausted(
                f"KV pool exhausted: need {num_pages} pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(num_pages)]
        for page in pages:
            self._in_use[page] = 1
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Returns pages to the pool. A page that is not in use is a bug: raise before changing anything."""
        seen: set[int] = set()
        for page in pages:
            if not 0 <= page < self.num_pages or not self._in_use[page] or page in seen:
                raise RuntimeError(f"KV pool: free of page {page} that is not allocated (double free?)")
            seen.add(page)
        for page in pages:
            self._in_use[page] = 0
            self._free.append(page)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_pages / self.num_pages

    # ---- addressing ------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """Latent KV bytes of one token over all layers (config.latent_kv_bytes)."""
        return latent_kv_bytes(self.num_layers, self.kv_dim, self.buffers[0].element_size())

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page of one layer, the unit of PD transfer."""
        return latent_kv_bytes(1, self.kv_dim, self.buffers[0].element_size(), tokens=self.page_size)

    @property
    def total_bytes(self) -> int:
        """The whole pool: every page of every layer."""
        return self.num_pages * self.num_layers * self.bytes_per_page

    def describe(self) -> str:
        """The capacity, as logged at start: "N pages x P tokens = T tokens (G GiB)"."""
        return (f"{self.num_pages} pages x {self.page_size} tokens = {self.num_pages * self.page_size} tokens "
                f"({gib(self.total_bytes)})")

    def slots(self, pages: Sequence[int] | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot indices (into `buffer.view(-1, kv_dim)`) of `positions` in a request owning `pages`."""
        page_table = torch.as_tensor(pages, dtype=torch.long, device=positions.device)
        return page_table[positions // self.page_size] * self.page_size + positions % self.page_size

    def flat(self, layer: int) -> torch.Tensor:
        """Layer `layer` as `[num_pages * page_size, kv_dim]` (a view, writes go to the pool)."""
        return self.buffers[layer].view(-1, self.kv_dim)
