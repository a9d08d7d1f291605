"""A Runner node in its own process for the peer tests (run as a script).

serve SECRET HOST N BLOCK_BYTES [tcp|nixl]: stores N pattern blocks, serves them, prints
  {"endpoint": ...}, then waits to be killed.
fetch SECRET ENDPOINT N BLOCK_BYTES [tcp|nixl]: fetches the N keys and checks every byte;
  prints counts and the transport the fetches used.
With "nixl", the node waits for its NIXL agent before serving or fetching.
"""

from __future__ import annotations

import json
import sys
import time

from prometheus_client import CollectorRegistry

from kvcr_core.config import KVCRConfig
from kvcr_core.peers import PeerClient, PeerMetrics, PeerSecret, PeerServer
from kvcr_core.peers.nixl_engine import NixlEngine
from kvcr_core.runner import Runner
from kvcr_core.testing import pattern_block, random_keys
from kvcr_core.types import NamespaceDigest

DIGEST = NamespaceDigest(b"peer-test-ns-v1!")


def main() -> None:
    mode, secret, where = sys.argv[1:4]
    n, block = int(sys.argv[4]), int(sys.argv[5])
    nixl = len(sys.argv) > 6 and sys.argv[6] == "nixl"
    if nixl and not NixlEngine.shared().wait_ready(120):
        raise SystemExit(f"NIXL did not start: {NixlEngine.shared().failure}")
    registry = CollectorRegistry()
    runner = Runner(KVCRConfig(pool_bytes=(n + 8) * max(block, 4096)), registry=registry)
    store = runner.open_namespace(DIGEST, block)
    keys = random_keys(n, seed=99)
    metrics = PeerMetrics(registry)
    if mode == "serve":
        for i in range(0, n, 256):
            batch = keys[i:i + 256]
            store.store(batch, [pattern_block(k, block) for k in batch])
        server = PeerServer(runner, PeerSecret(secret.encode()), metrics, host=where, nixl=nixl)
        print(json.dumps({"endpoint": server.endpoint}), flush=True)
        time.sleep(3600)
    client = PeerClient(store, PeerSecret(secret.encode()), metrics, nixl=nixl)
    ok = bad = 0
    transports = set()
    start = time.perf_counter()
    for i in range(0, n, 256):
        result = client.fetch(where, keys[i:i + 256], deadline_s=60)
        ok += result.fetched
        transports.add(result.transport.value if result.transport else None)
    seconds = time.perf_counter() - start
    for key, data in zip(keys, store.load(keys), strict=False):
        bad += data != pattern_block(key, block)
    print(json.dumps({"fetched": ok, "ready": store.lookup(keys), "corrupt": bad,
                      "seconds": seconds, "transports": sorted(map(str, transports))}),
          flush=True)
    client.close()


if __name__ == "__main__":
    main()
