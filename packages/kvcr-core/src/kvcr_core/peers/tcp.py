"""`TcpTransport`: block bytes streamed on the peer connection itself (plain TCP or TLS).

Source: leases the found blocks, answers Blocks(seq, found) (after their Origins on a fleet
connection), then sends each found block's
bytes straight from pool memory followed by its 8-byte xxh3-64, gathered about 1 MiB per
send (few system calls, few wake-ups of the destination); the lease ends after the last send.
Destination: receives each block straight into its reserved slot (`recv_into`, no copy),
hashes it while the kernel receives what follows, and keeps it only if the checksum matches.
A block whose slot went away meanwhile (stored here, or no room) is received into a scratch
buffer and dropped, so the stream stays in step. Always available: a source answers TCP
whenever the destination offered nothing else, or nothing it can serve.
"""

from __future__ import annotations

from typing import Final

from kvcr_core.checksums import block_checksum
from kvcr_core.framing import FrameError, recv_exact_into, send_all
from kvcr_core.peers import protocol as pp
from kvcr_core.peers.connection import DestConnection, FetchJob, SourceConnection
from kvcr_core.peers.transport import PeerTransport
from kvcr_core.types import FetchStatus

SEND_GROUP_BYTES: Final = 1 << 20  # block bytes per gather send (and per checksum group)


class TcpTransport(PeerTransport):
    kind = pp.TransportKind.TCP

    def send(self, conn: SourceConnection, fetch: pp.Fetch) -> None:
        store = conn.store
        lease = store.acquire(fetch.keys, conn.owner, prefix_only=False)  # type: ignore[arg-type]
        try:
            view, sums, pack = store.pool.view, conn.checksums.of, pp.CHECKSUM.pack
            slots = [s for s in lease.slots if s is not None]
            out: list[bytes | memoryview] = [
                *conn.origins_frame(fetch.seq, fetch.keys, lease.slots),
                pp.encode(pp.Blocks(fetch.seq, [s is not None for s in lease.slots]))]
            per_send = max(1, SEND_GROUP_BYTES // store.block_bytes)
            for start in range(0, len(slots), per_send):
                for slot in slots[start:start + per_send]:
                    out += (view(slot), pack(sums(slot)))
                send_all(conn.sock, out)
                out = []
            if out:
                send_all(conn.sock, out)
            conn.metrics.on_served(len(slots), len(slots) * store.block_bytes)
        finally:
            store.release(lease.op)

    def receive(self, conn: DestConnection, reply: pp.ToClient, job: FetchJob) -> bool:
        """Receives the found blocks; False when cancelled midway (the stream is out of step)."""
        if not isinstance(reply, pp.Blocks):
            raise FrameError(f"a {type(reply).__name__} reply on a TCP connection")
        if reply.seq != conn.seq or len(reply.found) != len(job.wanted):
            raise FrameError("a Blocks reply that does not match the Fetch")
        pool = conn.store.pool
        view, checksum, unpack = pool.view, block_checksum, pp.CHECKSUM.unpack
        trailer = bytearray(pp.CHECKSUM.size)
        skipped: memoryview | None = None
        for i, found in zip(job.wanted, reply.found, strict=True):
            slot = job.slots[i]
            if not found:
                if slot is not None:
                    job.statuses[i] = FetchStatus.MISSING
                continue
            if job.cancelled():
                return False
            conn.time_left(job.deadline)
            if slot is None:  # stored here meanwhile, or no room: its bytes go nowhere
                skipped = skipped or memoryview(bytearray(pool.slot_bytes))
                recv_exact_into(conn.sock, skipped)
                recv_exact_into(conn.sock, memoryview(trailer))
                continue
            target = view(slot)
            recv_exact_into(conn.sock, target)
            got = checksum(target)  # while the kernel receives what follows
            recv_exact_into(conn.sock, memoryview(trailer))
            job.received += len(target)
            if got == unpack(trailer)[0]:
                job.statuses[i] = FetchStatus.OK
                job.keep[job.keys[i]] = got
            else:
                job.statuses[i] = FetchStatus.CHECKSUM
        return True
