"""Test doubles and helpers shipped with the product (the `trio.testing` pattern), for kvcr's
own tests and for anyone testing code built on it.

- `pattern_block(key, nbytes)`: deterministic bytes derived from a block key, so any reader
  can check that a slot holds exactly the bytes written for that key.
- `random_keys(n, seed)`: distinct 16-byte keys without hashing token ids.
- `secret_for(label)`: a strong peer secret derived from a label (tests, benchmarks).
- `RaisingPolicy`: an eviction policy whose every hook raises, to prove the index survives.
- `peer_node(namespace, block_bytes, blocks)`: a runner with one namespace open and peer
  metrics in its registry, the node of peer tests; `stocked_source(...)`: one holding pattern
  blocks, served to peers.
- `network_namespaces`: two throwaway network namespaces joined by a veth pair (root only),
  the "two hosts" of peer tests and benchmarks.
- `LoopbackTransport`: a peer transport between pools of one process (memmove reads).
- `FakePeerSource`: a peer source that authenticates correctly, then misbehaves as told
  (wrong bytes, silence, death, addresses it never exposed), over TCP or a read transport.
- `in_process(runner, specs, block_bytes, peers=LoopbackPeers(...))`: the real
  `RunnerService` over an in-process Runner, whose peers are other in-process Runners;
  `ObservedRunner` counts a client's calls and can take its Runner down; `ManualClock`: time
  that moves when the test says. For unit tests of engine adapters.
- `mapped_kib(address)`: how much of a mapping this process's page tables hold (smaps Rss);
  `resident_kib(address, length)`: how much of it exists in memory, whoever backed it.
- `free_port()`: a TCP port on 127.0.0.1 free a moment ago (test and benchmark servers).
- `as_other_uid(argv)`: a real process of another uid (65534, through setpriv) for trust
  tests; `other_uid_unavailable()` says why none can run here (skip with it).
- `setup.missing_setup(message)`: fail in CI, skip elsewhere, when a set-up script's
  product (a side venv, a tool) is absent.
- `ThreadedCopyEngine`: a copy engine whose CPU copies complete later on a helper thread (held,
  released or failed by the test), so CPU tests check the ordering rules a GPU imposes.
"""

from kvcr_core.testing.attach import LoopbackPeers, ManualClock, ObservedRunner, in_process
from kvcr_core.testing.blocks import RaisingPolicy, pattern_block, random_keys, secret_for
from kvcr_core.testing.copies import ThreadedCopyEngine
from kvcr_core.testing.fake_peer import FakePeerSource, LoopbackEngine, LoopbackTransport
from kvcr_core.testing.netns import network_namespaces
from kvcr_core.testing.nodes import peer_node, stocked_source
from kvcr_core.testing.pages import mapped_kib, resident_kib
from kvcr_core.testing.ports import free_port

__all__ = [
           "FakePeerSource",
           "LoopbackEngine",
           "LoopbackPeers",
           "LoopbackTransport",
           "ManualClock",
           "ObservedRunner",
           "RaisingPolicy",
           "ThreadedCopyEngine",
           "free_port",
           "in_process",
           "mapped_kib",
           "network_namespaces",
           "pattern_block",
           "peer_node",
           "random_keys",
           "resident_kib",
           "secret_for",
           "stocked_source",
]
