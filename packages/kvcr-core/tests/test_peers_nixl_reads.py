"""NIXL fetches of many READs (one block each, or of shrinking sizes, on one or two read
lanes): every block checked where it lands, cancels and deadlines mid-fetch publish only
checked blocks, checksums that come late or out of order, and the FetchDone that tells a
source whether to drive NIXL's progress for its reader."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

import msgspec
import pytest

from kvcr_core import testing
from kvcr_core.framing import frame, recv_frame
from kvcr_core.peers import FetchStatus, NixlTransport, PeerClient, PeerSecret, TransportKind
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.connection import SourceConnection, authenticate
from kvcr_core.peers.nixl_engine import NixlEngine, NixlRead, nixl_installed
from kvcr_core.peers.reads import read_plan
from kvcr_core.runner import NamespaceStore
from kvcr_core.testing import FakePeerSource, pattern_block, peer_node, random_keys, secret_for
from kvcr_core.types import BlockKey, NamespaceDigest

pytestmark = pytest.mark.integration

if not nixl_installed():
    pytest.skip("nixl is not installed (pip install 'kvcr-core[nixl]')", allow_module_level=True)

SECRET = PeerSecret(secret_for("correct horse battery staple, 2026 edition").encode())
NS = NamespaceDigest(b"peer-test-ns-v1!")
BLOCK = 16384

node = partial(peer_node, NS, BLOCK)
stocked_source = partial(testing.stocked_source, NS, BLOCK, SECRET)


@pytest.fixture(scope="module", autouse=True)
def engine() -> NixlEngine:
    shared = NixlEngine.shared()
    assert shared.wait_ready(120), f"nixl is installed but did not start: {shared.failure}"
    return shared


@pytest.fixture
def one_block_reads(engine: NixlEngine) -> Callable[..., NixlTransport]:
    """NIXL transports whose READs move one block each, so a fetch of a few blocks is many
    READs, which the two read lanes take in turn."""
    return lambda **options: NixlTransport(engine, largest_read_bytes=BLOCK, **options)


@contextlib.contextmanager
def on_third_start(monkeypatch: pytest.MonkeyPatch, action: Callable[[float], object], *,
                   every: bool = False) -> Iterator[None]:
    """Runs `action(deadline)` as the third NIXL READ of a fetch starts (mid-fetch), or as
    each one does (`every`)."""
    started = 0
    start = NixlRead.start

    def hooked(read: NixlRead, deadline: float) -> None:
        nonlocal started
        started += 1
        if started == 3 or every:
            action(deadline)
        start(read, deadline)

    with monkeypatch.context() as patch:
        patch.setattr(NixlRead, "start", hooked)
        yield


def test_a_fetch_of_many_reads_checks_every_block(one_block_reads) -> None:
    """Risk: a lane publishes a block without checking it, or checks the wrong one: block
    1's bytes are wrong, and only it is refused."""
    source = FakePeerSource(SECRET, BLOCK, "wrong_bytes", NixlTransport())
    _, store, metrics = node()
    keys = random_keys(3, seed=23)
    client = PeerClient(store, SECRET, metrics, transport=one_block_reads())
    result = client.fetch(source.endpoint, keys, deadline_s=10)
    assert result.transport is TransportKind.NIXL
    assert result.statuses == (FetchStatus.OK, FetchStatus.CHECKSUM, FetchStatus.OK)
    assert store.contains(keys) == [True, False, True]
    assert metrics.fetched["checksum"] == 1 and store.index.filling_blocks == 0
    client.close()
    source.close()


def published_as_reported(store: NamespaceStore, keys: list[BlockKey],
                          statuses: tuple[FetchStatus, ...]) -> None:
    """Every key reported OK is READY with its own bytes; no other is there, none FILLING."""
    ok = [k for k, status in zip(keys, statuses, strict=True) if status is FetchStatus.OK]
    assert store.contains(keys) == [status is FetchStatus.OK for status in statuses]
    assert store.load(ok) == [pattern_block(k, BLOCK) for k in ok]
    assert store.index.filling_blocks == 0


@pytest.mark.parametrize("parallel", [False, True], ids=["alone", "lanes"])
def test_a_fetch_of_many_reads_is_byte_exact_and_cancellable(
        one_block_reads, parallel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: with READs in flight and checks pending, a cancel publishes unchecked blocks or
    leaves slots FILLING; without one, bytes land in the wrong slots. A fetching thread that
    READs alone stops right after the READ it was in when the caller cancelled; with the two
    lanes, the other lane may finish the READ it had begun as well."""
    source_runner, server, keys, _ = stocked_source(40, 24, nixl=True)
    _, store, metrics = node()
    client = PeerClient(store, SECRET, metrics,
                        transport=one_block_reads(parallel_reads=parallel))
    readers: set[str] = set()

    def slow_read(deadline: float) -> None:  # lets a lane join even on a busy machine
        readers.add(threading.current_thread().name)
        time.sleep(0.003)

    with on_third_start(monkeypatch, slow_read, every=True):
        whole = client.fetch(server.endpoint, keys[:20], deadline_s=10)
    assert whole.fetched == 20 and whole.transport is TransportKind.NIXL
    assert readers == ({"kvcr-lane-0", "kvcr-lane-1"} if parallel  # both lanes READ
                       else {threading.current_thread().name})
    assert store.load(keys[:20]) == [pattern_block(k, BLOCK) for k in keys[:20]]

    cancel = threading.Event()
    with on_third_start(monkeypatch, lambda deadline: cancel.set()):  # the caller cancels
        result = client.fetch(server.endpoint, keys[20:], deadline_s=10, cancel=cancel)
    if not parallel:
        assert result.statuses == (FetchStatus.OK,) * 3 + (FetchStatus.CANCELLED,) * 17
    else:
        assert set(result.statuses) == {FetchStatus.OK, FetchStatus.CANCELLED}
        assert 3 <= result.fetched <= 4 and FetchStatus.OK not in result.statuses[5:]
    published_as_reported(store, keys[20:], result.statuses)
    assert client.fetch(server.endpoint, keys[20:], deadline_s=10).ready_prefix() == 20
    client.close()
    server.close()
    source_runner.close()


def test_reads_of_shrinking_size_check_every_block_where_it_lands(engine: NixlEngine) -> None:
    """Risk: with READs of different sizes (read_plan: 7, 8, 8, 4, 2, 1 blocks here), taken
    by two lanes, a chunk is checked against another chunk's checksums, a block is skipped,
    or a chunk is published unchecked. Source blocks in the first, a middle and the last
    chunk are overwritten after their checksums were taken."""
    assert read_plan(30, BLOCK, 8 * BLOCK, BLOCK) == [7, 8, 8, 4, 2, 1]
    source_runner, server, keys, _ = stocked_source(30, 26, nixl=True)
    _, warm, warm_metrics = node()
    first = PeerClient(warm, SECRET, warm_metrics, nixl=True)
    assert first.fetch(server.endpoint, keys, deadline_s=10).fetched == 30  # checksums taken
    source = source_runner.namespace(NS)
    bad = (0, 20, 29)
    for i in bad:
        slot = source.index.slot_of(keys[i])
        assert slot is not None
        source.pool.view(slot)[:] = bytes(BLOCK)
    _, store, metrics = node()
    client = PeerClient(store, SECRET, metrics, transport=NixlTransport(
        engine, largest_read_bytes=8 * BLOCK, last_read_bytes=BLOCK))
    result = client.fetch(server.endpoint, keys, deadline_s=10)
    assert result.transport is TransportKind.NIXL
    assert result.statuses == tuple(FetchStatus.CHECKSUM if i in bad else FetchStatus.OK
                                    for i in range(30))
    good = [k for i, k in enumerate(keys) if i not in bad]
    assert store.load(good) == [pattern_block(k, BLOCK) for k in good]
    assert store.contains(keys) == [i not in bad for i in range(30)]
    assert metrics.fetched["checksum"] == 3 and store.index.filling_blocks == 0
    for peer in (first, client):
        peer.close()
    server.close()
    source_runner.close()


@pytest.mark.parametrize("parallel", [False, True], ids=["alone", "lanes"])
def test_a_deadline_mid_fetch_keeps_the_blocks_already_checked(
        one_block_reads, parallel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a deadline that passes between READs throws away blocks that were read and
    checked before it, publishes the block whose READ it stopped, or the fetch outlives it.
    The source has served these blocks before, so their checksums come with the addresses.
    On the two lanes, the other one reads on while one stalls, until the deadline."""
    source_runner, server, keys, _ = stocked_source(6, 25, nixl=True)
    _, warm_store, warm_metrics = node()
    warm = PeerClient(warm_store, SECRET, warm_metrics, nixl=True)
    assert warm.fetch(server.endpoint, keys, deadline_s=10).fetched == 6  # checksums known
    warm.close()
    _, store, metrics = node()
    client = PeerClient(store, SECRET, metrics,
                        transport=one_block_reads(parallel_reads=parallel))

    def stall(deadline: float) -> None:  # the source stalls past the deadline
        time.sleep(max(0.0, deadline - time.monotonic()) + 0.01)

    started = time.monotonic()
    with on_third_start(monkeypatch, stall):
        result = client.fetch(server.endpoint, keys, deadline_s=1.0)
    assert time.monotonic() - started < 5.0 and result.detail == "deadline passed"
    if not parallel:
        assert result.statuses == (FetchStatus.OK,) * 2 + (FetchStatus.TIMEOUT,) * 4
    else:
        assert set(result.statuses) == {FetchStatus.OK, FetchStatus.TIMEOUT}
        assert result.fetched >= 2  # two READs started before the stalled one, and finished
    published_as_reported(store, keys, result.statuses)
    client.close()
    server.close()
    source_runner.close()


@pytest.mark.parametrize("late", [True, False], ids=["late-checksums", "older-client"])
def test_checksums_late_or_with_the_addresses_check_every_block(
        one_block_reads, late: bool) -> None:
    """Risk: checksums that follow NixlBlocks (late_checksums) are applied to the wrong
    blocks, or a client that did not offer the feature is sent them anyway."""
    features = (pp.LATE_CHECKSUMS,) if late else ()  # () as a client that predates it
    source = FakePeerSource(SECRET, BLOCK, "wrong_bytes", NixlTransport())
    _, store, metrics = node()
    client = PeerClient(store, SECRET, metrics, transport=one_block_reads(features=features))
    keys = random_keys(3, seed=26)
    result = client.fetch(source.endpoint, keys, deadline_s=10)
    assert source.late is late
    assert result.statuses == (FetchStatus.OK, FetchStatus.CHECKSUM, FetchStatus.OK)
    assert store.contains(keys) == [True, False, True] and store.index.filling_blocks == 0
    client.close()
    source.close()


def test_late_checksums_out_of_order_are_refused() -> None:
    """Risk: a source that skips a checksum shifts the others onto the wrong blocks."""
    source = FakePeerSource(SECRET, BLOCK, "sums_out_of_order", NixlTransport())
    _, store, metrics = node()
    client = PeerClient(store, SECRET, metrics, nixl=True)
    keys = random_keys(3, seed=27)
    result = client.fetch(source.endpoint, keys, deadline_s=10)
    assert source.late
    assert set(result.statuses) == {FetchStatus.PROTOCOL} and "NixlChecksums" in result.detail
    assert store.lookup(keys) == 0 and store.index.filling_blocks == 0
    client.close()
    source.close()


@pytest.mark.parametrize("late", [True, False], ids=["late-checksums", "older-client"])
def test_first_serves_in_a_row_keep_the_connection_in_step(late: bool) -> None:
    """Risk: checksums a source sends after NixlBlocks are left on the connection and read
    as the answer to the next fetch (or sent to a client that did not ask for them). Each
    fetch here is a first serve: the source stores its blocks again before it."""
    features = (pp.LATE_CHECKSUMS,) if late else ()
    source_runner, server, keys, source_metrics = stocked_source(40, 28, nixl=True)
    source_store = source_runner.namespace(NS)
    _, store, metrics = node()
    client = PeerClient(store, SECRET, metrics, transport=NixlTransport(features=features))
    for _ in range(3):
        with source_store.lock:
            source_store.index.discard(keys)
        source_store.store(keys, [pattern_block(k, BLOCK) for k in keys])
        with store.lock:
            store.index.discard(keys)
        result = client.fetch(server.endpoint, keys, deadline_s=10)
        assert result.statuses == (FetchStatus.OK,) * 40
        assert store.load(keys) == [pattern_block(k, BLOCK) for k in keys]
    assert source_metrics.connections == {"tcp": 0, "nixl": 1}  # one pooled connection
    client.close()
    server.close()
    source_runner.close()


@pytest.mark.parametrize("copied_when_posted", [True, False], ids=["cma-like", "network-like"])
def test_fetch_done_says_whether_every_read_copied_when_posted(
        copied_when_posted: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a client tells its source that its READs need no progress from it when one of
    them did (over UCX's TCP transport they would then crawl), or never tells it (the source
    polls NIXL every 0.1 ms and takes the CPU the copies need)."""
    start = NixlRead.start

    def start_as_transport(read: NixlRead, deadline: float) -> None:
        start(read, deadline)
        if copied_when_posted and read.state == "PROC":
            read.wait(deadline)  # done by the time start returns, as over cma
        elif not copied_when_posted and read.state == "DONE":
            read.state = "PROC"  # still moving after start, as over a network

    monkeypatch.setattr(NixlRead, "start", start_as_transport)
    source = FakePeerSource(SECRET, BLOCK, "good", NixlTransport())
    _, store, metrics = node()
    client = PeerClient(store, SECRET, metrics, nixl=True)
    keys = random_keys(3, seed=32)
    assert client.fetch(source.endpoint, keys, deadline_s=10).fetched == 3
    until = time.monotonic() + 5  # the source reads the FetchDone after the fetch returns
    while source.done is None and time.monotonic() < until:
        time.sleep(0.01)
    assert isinstance(source.done, pp.FetchDone) and source.done.inline is copied_when_posted
    client.close()
    source.close()


def test_a_source_drives_progress_for_a_reader_unless_its_reads_copy_inline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Risk: a source polls NIXL every 0.1 ms for a peer whose READs copy within their own
    call (cma: it only steals the CPU those copies need), or stops polling for one whose READs
    need it. It follows each FetchDone: polling often until one says `inline`, and again once
    one does not. A FetchDone from an older client (no `inline`) means polling."""
    source_runner, server, keys, _ = stocked_source(4, 31, nixl=True)
    reading: list[bool] = []
    next_frame = NixlTransport.next_frame

    def spy(self: NixlTransport, conn: SourceConnection, **kw: bool) -> bytearray:
        if "reading" in kw:  # the wait for a FetchDone (the wait for a request names none)
            reading.append(kw["reading"])
        return next_frame(self, conn, **kw)

    monkeypatch.setattr(NixlTransport, "next_frame", spy)
    host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    ready = authenticate(sock, SECRET, NS, BLOCK, server.endpoint, (TransportKind.NIXL.value,))
    assert ready.transport is TransportKind.NIXL
    older = msgspec.msgpack.encode(["fetch_done", 4])  # FetchDone as sent before `inline`
    for seq, inline in enumerate([True, False, True, None], start=1):
        sock.sendall(pp.encode(pp.Fetch(seq, keys)))
        answer = pp.decode_to_client(recv_frame(sock)[0])
        assert isinstance(answer, pp.NixlBlocks) and all(answer.found)
        sock.sendall(frame(older) if inline is None else pp.encode(pp.FetchDone(seq, inline)))
    sock.sendall(pp.encode(pp.Fetch(5, keys)))  # its answer comes after the fourth FetchDone
    assert isinstance(pp.decode_to_client(recv_frame(sock)[0]), pp.NixlBlocks)
    assert reading[:4] == [True, False, True, False]  # the fifth: as the older client's said
    until = time.monotonic() + 5
    while len(reading) < 5 and time.monotonic() < until:
        time.sleep(0.01)
    assert reading[4] is True
    assert pp.decode_to_server(older) == pp.FetchDone(4, False)
    sock.close()
    server.close()
    source_runner.close()
