"""Real SGLang cache objects on CPU tensors, for the tests and `kvcr bench sglang`.

SGLang cannot serve a model on a CPU-only machine, but its device pool, host pools and
`HiCacheController` (with its own backup, prefetch and I/O threads) run on CPU tensors. This
module builds them the way SGLang's scheduler does, for one rank (a single-process gloo group).
Imports SGLang; not used by the backend itself.
"""

from __future__ import annotations

import dataclasses
import tempfile
import threading
import time
from typing import Any

import torch

KVCR_EXTRA = {"backend_name": "kvcr", "module_path": "kvcr_sglang.hicache",
              "class_name": "KVCRHiCacheStorage"}


@dataclasses.dataclass(frozen=True)
class PoolShape:
    layers: int = 4
    heads: int = 2
    head_dim: int = 64
    page_tokens: int = 16
    device_tokens: int = 512
    dtype: torch.dtype = torch.bfloat16


def single_rank() -> None:
    """A one-process gloo group and SGLang's parallel context for rank 0 (idempotent)."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    if not dist.is_initialized():
        store = tempfile.mktemp(prefix="kvcr-gloo-")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0, attn_cp_size=1,
                                        attn_cp_rank=0)


def device_pool(shape: PoolShape) -> tuple[Any, Any]:
    """(allocator, MHATokenToKVPool) on CPU."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    dev = MHATokenToKVPool(size=shape.device_tokens, page_size=shape.page_tokens,
                           dtype=shape.dtype, head_num=shape.heads, head_dim=shape.head_dim,
                           layer_num=shape.layers, device="cpu", enable_memory_saver=False)
    alloc = PagedTokenToKVPoolAllocator(shape.device_tokens, shape.page_tokens, shape.dtype,
                                        "cpu", dev, False)
    return alloc, dev


def host_pool(dev: Any, shape: PoolShape, layout: str, ratio: float = 2.0) -> Any:
    """A real `MHATokenToKVPoolHost` (unpinned: no GPU) over the device pool's geometry."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    return MHATokenToKVPoolHost(dev._mha_buffer_info(), ratio, 0, shape.page_tokens, layout,
                                pin_memory=False, device="cpu",
                                device_capacity_tokens=shape.device_tokens, start_layer=0,
                                end_layer=shape.layers - 1)


def controller(alloc: Any, host: Any, shape: PoolShape, *, backend: str | None = "dynamic",
               extra: dict[str, Any] | None = None, model_name: str = "kvcr-tiny") -> Any:
    """A real `HiCacheController` with a storage backend attached (its threads running)."""
    import torch.distributed as dist
    from sglang.srt.managers.cache_controller import HiCacheController

    single_rank()
    return HiCacheController(alloc, host, shape.page_tokens, dist.group.WORLD,
                             threading.Event(), write_policy="write_through",
                             io_backend="direct", storage_backend=backend,
                             model_name=model_name,
                             storage_backend_extra_config=dict(extra or {}))


def fill_pages(host: Any, first_page: int, n_pages: int, seed: int) -> None:
    """Random bytes into pages [first, first + n) of every layout (via the flat page API)."""
    gen = torch.Generator().manual_seed(seed)
    page = host.page_size
    for i in range(first_page, first_page + n_pages):
        flat = host.get_dummy_flat_data_page()
        raw = torch.randint(0, 256, (flat.numel() * flat.element_size(),), generator=gen,
                            dtype=torch.uint8)
        host.set_from_flat_data_page(i * page, raw.view(flat.dtype))


def page_bytes(host: Any, first_page: int, n_pages: int) -> list[bytes]:
    page = host.page_size
    return [host.get_data_page(i * page, flat=True).contiguous().view(torch.uint8)
            .numpy().tobytes() for i in range(first_page, first_page + n_pages)]


def zero_pages(host: Any, first_page: int, n_pages: int) -> None:
    page = host.page_size
    for i in range(first_page, first_page + n_pages):
        host.set_from_flat_data_page(i * page, host.get_dummy_flat_data_page())


def page_keys(tokens: list[int], page_tokens: int, prior: str | None = None) -> list[str]:
    """SGLang's own storage keys (native SHA-256 page-hash chain)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return list(get_storage_hash_str(tokens, prior, page_size=page_tokens))


def drain(queue: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.05)
        except Exception:  # queue.Empty
            continue
    raise TimeoutError(f"nothing arrived in {timeout_s} s")


