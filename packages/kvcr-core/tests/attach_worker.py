"""A kvcr-guard client process for the guard tests (run as a script, one mode per process).

Every block's bytes are derived from its key (`pattern_block`), and every read is checked, so
any corruption shows as exit code 3. Lines on stdout tell the test where the worker is.
"""

from __future__ import annotations

import json
import random
import sys
import time

from kvcr_core.attach import AttachClient, RunnerUnavailable
from kvcr_core.checksums import block_checksum
from kvcr_core.keys import NamespaceSpec, sequence_keys
from kvcr_core.testing import pattern_block

BLOCK = 16384
SPEC = NamespaceSpec(model_id="tiny", dtype="float32", kv_dtype="float32", block_size_tokens=16,
                     num_layers=2, num_kv_heads=2, head_dim=64, layout="test/guard")


def keys_for(prompt: int, blocks: int) -> list[bytes]:
    return sequence_keys(SPEC, [prompt * 100_000 + t for t in range(16 * blocks)])


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def check(client: AttachClient, keys: list[bytes], lease_slots: tuple[int | None, ...]) -> int:
    pool = client.pool()
    for key, slot in zip(keys, lease_slots, strict=False):
        if slot is not None and bytes(pool.view(slot)) != pattern_block(key, BLOCK):
            print(f"CORRUPT key {key.hex()} slot {slot}", file=sys.stderr, flush=True)
            sys.exit(3)
    return sum(s is not None for s in lease_slots)


def main() -> None:
    socket_path, mode = sys.argv[1], sys.argv[2]
    args = [int(a) for a in sys.argv[3:]]
    client = AttachClient(socket_path, SPEC, BLOCK, identity=f"worker-{mode}")
    client.attach()
    if mode in ("store", "store-hang"):  # prompt, blocks (store-hang: then wait to be killed)
        keys = keys_for(args[0], args[1])
        say(stored=client.store(keys, [pattern_block(k, BLOCK) for k in keys]))
        if mode == "store-hang":
            time.sleep(3600)
    elif mode == "read":  # prompt, blocks: prints how many READY blocks were read exactly
        keys = keys_for(args[0], args[1])
        lease = client.acquire(keys)
        say(read=check(client, keys, lease.slots), lookup=client.lookup(keys))
        client.release(lease.op)
    elif mode == "hang-writing":  # reserve, write half of every block, then wait to be killed
        keys = keys_for(args[0], args[1])
        res = client.reserve(keys)
        for key, slot in zip(keys, res.slots, strict=True):
            if slot is not None:
                client.pool().view(slot)[: BLOCK // 2] = pattern_block(key, BLOCK)[: BLOCK // 2]
        say(reserved=res.granted)
        time.sleep(3600)
    elif mode == "hold-lease":  # lease the prompt's blocks, then wait to be killed
        keys = keys_for(args[0], args[1])
        lease = client.acquire(keys)
        say(leased=lease.granted)
        time.sleep(3600)
    elif mode == "soak":  # seed, seconds: random stores and verified reads on shared prompts
        with open(f"{socket_path}.attached.{args[0]}", "w"):
            pass  # the test kills only workers the daemon has seen attach
        soak(client, random.Random(args[0]), args[1])
    client.close()


def soak(client: AttachClient, rng: random.Random, seconds: int) -> None:
    deadline = time.monotonic() + seconds
    reads = stores = unavailable = 0
    while time.monotonic() < deadline:
        keys = keys_for(rng.randrange(40), rng.randrange(1, 12))
        try:
            if rng.random() < 0.5:
                res = client.reserve(keys)
                sums = []
                for key, slot in zip(keys, res.slots, strict=True):
                    if slot is not None:
                        client.pool().write(slot, pattern_block(key, BLOCK))
                        sums.append(block_checksum(client.pool().view(slot)))
                if rng.random() < 0.1:
                    client.abort(res.op)
                else:
                    stores += client.commit(res.op, checksums=sums)
            else:
                lease = client.acquire(keys, prefix_only=rng.random() < 0.5)
                reads += check(client, keys, lease.slots)
                client.release(lease.op)
        except RunnerUnavailable:
            unavailable += 1
            time.sleep(0.01)
    say(reads=reads, stores=stores, unavailable=unavailable)


if __name__ == "__main__":
    main()
