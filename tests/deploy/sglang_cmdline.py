"""Parses one SGLang server command line the way SGLang 0.5.23 does, then the kvcr backend
config it carries the way kvcr-sglang does; prints what kvcr would use as JSON.

Run as a script in .venv-sglang (SGLang and vLLM need different torch builds):
    python sglang_cmdline.py ARG...    (the arguments after `python3 -m sglang.launch_server`)
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str]) -> dict[str, object]:
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.unified_cache.linker_config import UnifiedCacheLinkerConfig
    from sglang.srt.server_args import ServerArgs

    from kvcr_sglang.linker import FIELD as LINKER_FIELD
    from kvcr_sglang.settings import BackendSettings

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    server = ServerArgs.from_cli_args(args)  # SGLang's own checks of the combination
    if server.enable_unified_cache_external_linker:
        linker = UnifiedCacheLinkerConfig.from_dict(server.unified_cache_external_linker_config)
        way = {"linker": linker.linker, "module": linker.linker_module_path}
        settings = BackendSettings.from_extra_config(linker.linker_extra_config,
                                                     field=LINKER_FIELD)
    else:
        extra = HybridCacheController.parse_storage_backend_extra_config(
            server.hicache_storage_backend_extra_config)[0]
        way = {"backend": server.hicache_storage_backend, "module": extra.get("module_path"),
               "class": extra.get("class_name")}
        settings = BackendSettings.from_extra_config(extra)
    return {**way, "mode": settings.mode.value, "socket": settings.socket,
            "port": server.port, "page_size": server.page_size, "model": server.model_path}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
