"""Where one page lives in an SGLang host pool: its segments (address, bytes) in kvcr's
canonical order, and the pool's geometry.

Canonical order = the order of SGLang's flat data page (`get_data_page(flat=True)`), so a
page written through the generic interface reads back byte-exactly through zero-copy v1 and
the other way round. For MHA `layer_first` SGLang's zero-copy pointers come as (K, V) per
layer; they are reordered to all K layers, then all V layers. Other layouts already match.
Addresses come from `get_page_buffer_meta`, SGLang's own zero-copy API. Pure; thread-safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcr_sglang.pagestore import Segments
from kvcr_sglang.settings import PageGeometry

if TYPE_CHECKING:
    import torch


def geometry_of(pool: Any, *, mla: bool) -> PageGeometry:
    import torch

    page = int(pool.page_size)
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page, dtype=torch.int64))
    if len(ptrs) != len(sizes) or not sizes:
        raise ValueError(f"{type(pool).__name__}.get_page_buffer_meta gave {len(ptrs)} "
                         f"addresses and {len(sizes)} sizes for one page")
    layers = int(getattr(pool, "layer_num", 1))
    if mla:
        heads = 1
        dim = int(getattr(pool, "kv_lora_rank", 0)) + int(getattr(pool, "qk_rope_head_dim", 0))
    else:
        heads, dim = int(getattr(pool, "head_num", 1)), int(getattr(pool, "head_dim", 1))
    return PageGeometry(layout=str(pool.layout), dtype=str(pool.dtype).removeprefix("torch."),
                        page_tokens=page, num_layers=layers, num_heads=max(heads, 1),
                        head_dim=max(dim, 1), page_bytes=int(sum(sizes)),
                        pool_kind=type(pool).__name__)


class HostPages:
    """Segments of pages of one host pool (zero-copy) or of flat page tensors (generic)."""

    def __init__(self, pool: Any, *, mla: bool) -> None:
        self.pool = pool
        self.page_tokens = int(pool.page_size)
        self.geometry = geometry_of(pool, mla=mla)
        self._kv_split = (not mla and self.geometry.layout == "layer_first")

    def segments(self, host_indices: torch.Tensor, n_pages: int) -> list[Segments]:
        """One entry per page of `host_indices` (token indices, `page_tokens` per page)."""
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices[:n_pages * self.page_tokens])
        per_page = len(ptrs) // n_pages if n_pages else 0
        pages: list[Segments] = []
        for i in range(n_pages):
            lo = i * per_page
            pieces = list(zip(ptrs[lo:lo + per_page], sizes[lo:lo + per_page], strict=True))
            if self._kv_split:
                pieces = pieces[0::2] + pieces[1::2]
            pages.append(pieces)
        return pages

    @staticmethod
    def tensor_segments(pages: list[Any]) -> list[Segments]:
        """Segments of flat page tensors (generic interface); each must be contiguous."""
        out: list[Segments] = []
        for page in pages:
            if not page.is_contiguous():
                raise ValueError("a generic page tensor must be contiguous")
            out.append([(int(page.data_ptr()), int(page.numel() * page.element_size()))])
        return out
