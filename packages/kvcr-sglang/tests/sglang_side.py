"""One SGLang-side process for the sharing tests: builds a real host pool and a real
HiCacheController attached to kvcr-guard, then writes, reads or clears 8 pages of a fixed
prompt. `python sglang_side.py SOCKET write|read|clear [EXTRA_JSON]` (EXTRA_JSON: more backend
extra config, e.g. peers). Prints one JSON line: pages stored / hit / filled, a digest of the
page bytes, and the backend's kvcr_stats()."""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from kvcr_bench import sglang_rig as cpu_rig
from kvcr_bench.sglang_rig import KVCR_EXTRA, PoolShape


def main(socket_path: str, role: str, more: dict[str, object]) -> int:
    shape = PoolShape()
    alloc, dev = cpu_rig.device_pool(shape)
    host = cpu_rig.host_pool(dev, shape, "page_first")
    ctrl = cpu_rig.controller(alloc, host, shape, extra={
        **KVCR_EXTRA, "interface_v1": 1, "mode": "guarded", "socket": socket_path, **more})
    n, page = 8, shape.page_tokens
    gen = torch.Generator().manual_seed(42)
    tokens = torch.randint(10, 30000, (n * page,), generator=gen).tolist()
    keys = cpu_rig.page_keys(tokens, page)
    out: dict[str, object] = {"keys": keys}
    if role == "clear":
        ctrl.storage_backend.clear()
        data = []
    elif role == "write":
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
    out["stats"] = ctrl.storage_backend.kvcr_stats()
    ctrl.detach_storage_backend()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}))
