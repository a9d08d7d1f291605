"""One SGLang-side process for the sharing test: builds a real host pool and a real
HiCacheController attached to kvcr-guard, then writes or reads 8 pages of a fixed prompt.
Prints one JSON line: pages stored / hit / filled and a digest of the page bytes."""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from kvcr_bench import sglang_rig as cpu_rig
from kvcr_bench.sglang_rig import KVCR_EXTRA, PoolShape


def main(socket_path: str, role: str) -> int:
    shape = PoolShape()
    alloc, dev = cpu_rig.device_pool(shape)
    host = cpu_rig.host_pool(dev, shape, "page_first")
    ctrl = cpu_rig.controller(alloc, host, shape, extra={
        **KVCR_EXTRA, "interface_v1": 1, "mode": "guarded", "socket": socket_path})
    n, page = 8, shape.page_tokens
    gen = torch.Generator().manual_seed(42)
    tokens = torch.randint(10, 30000, (n * page,), generator=gen).tolist()
    keys = cpu_rig.page_keys(tokens, page)
    out: dict[str, object] = {"keys": keys}
    if role == "write":
        cpu_rig.fill_pages(host, 1, n, seed=77)
        ok = ctrl.storage_backend.batch_set_v1(keys, torch.arange(page, (n + 1) * page))
        out["stored"] = sum(ok)
        data = cpu_rig.page_bytes(host, 1, n)
    else:
        out["hits"] = ctrl.storage_backend.batch_exists(keys)
        filled = ctrl.storage_backend.batch_get_v1(keys, torch.arange(3 * page,
                                                                       (n + 3) * page))
        out["filled"] = sum(filled)
        data = cpu_rig.page_bytes(host, 3, n)
    out["digest"] = hashlib.sha256(b"".join(data)).hexdigest()
    ctrl.detach_storage_backend()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
