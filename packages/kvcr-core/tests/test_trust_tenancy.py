"""Trust boundary, daemon side: tenants are isolated by default, no uid captures the pool, a
connect flood by a foreign uid does not keep engines out, the status shows a uid only its
own. Attackers are real processes of another uid (65534, through setpriv) against a real
kvcr-guard; the victim is an engine of the daemon's uid. Integration layer.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from kvcr_core.attach import AttachClient, RunnerError
from kvcr_core.checksums import block_checksum
from kvcr_core.config import KVCRConfig, verifies_loads
from kvcr_core.testing import pattern_block
from kvcr_core.testing.uids import OTHER_UID, THIRD_UID, as_other_uid, other_uid_unavailable

sys.path.insert(0, os.path.dirname(__file__))
from attach_worker import BLOCK, SPEC, keys_for
from trust_attacker import Attacker, hint

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(other_uid_unavailable() is not None,
                                 reason=str(other_uid_unavailable()))]


@pytest.fixture
def shared_guard(short_tmp: str, harness) -> Iterator[object]:
    """kvcr-guard (this uid) that uid 65534 may attach to, with no tenant configured."""
    yield _guard(short_tmp, harness)


def _guard(short_tmp: str, harness, *flags: str) -> object:
    os.chmod(short_tmp, 0o755)
    g = harness.Guard(short_tmp, "--allowed-uid", str(os.getuid()), "--allowed-uid",
                      str(OTHER_UID), *flags).start()
    os.chmod(g.socket, 0o666)  # the kernel lets 65534 connect; the daemon decides
    return g


def _victim(path: str, tenant: str = "", prompt: int = 1) -> tuple[AttachClient, list[bytes]]:
    client = AttachClient(path, dataclasses.replace(SPEC, tenant=tenant), BLOCK,
                          identity="victim-engine")
    keys = keys_for(prompt, 8)
    assert client.store(keys, [pattern_block(k, BLOCK) for k in keys]) == 8
    return client, keys


def _exact(client: AttachClient, keys: list[bytes]) -> int:
    lease = client.acquire(keys)
    pool = client.pool()
    exact = sum(1 for k, s in zip(keys, lease.slots, strict=True)
                if s is not None and bytes(pool.view(s)) == pattern_block(k, BLOCK))
    client.release(lease.op)
    return exact


def test_without_tenants_another_uid_can_neither_read_nor_write_an_engines_kv(
        shared_guard) -> None:
    """Risk: with no --tenant, another uid opens the victim's namespace, maps it read-write,
    reads its prompt's KV and overwrites it; the victim loads the overwritten blocks."""
    victim, keys = _victim(shared_guard.socket)
    reader = Attacker("client", shared_guard.socket, "read", "1", "8")
    assert reader.ready == {"ready": True, "attached": True, "read": 0}
    reader.finish()
    scribbler = Attacker("client", shared_guard.socket, "overwrite", "1", "8")
    assert scribbler.ready["attached"] is True
    scribbler.finish()
    assert _exact(victim, keys) == 8  # it scribbled over its own namespace only
    victim.close()


def test_a_named_tenant_is_shared_with_its_uids_and_only_they_clear_nothing(
        short_tmp: str, harness) -> None:
    """Risk: sharing between uids is all or nothing (or the empty tenant is shared by
    accident), and any member of a shared namespace clears it for everyone."""
    g = _guard(short_tmp, harness, "--tenant", f"team=0,{OTHER_UID}")
    victim, _ = _victim(g.socket, tenant="team")
    member = Attacker("client", g.socket, "read-tenant", "team", "1", "8")
    assert member.ready["read"] == 8  # opted in: the tenant's uids share its KV
    member.finish()
    clear = Attacker("client", g.socket, "clear-tenant", "team")
    assert "not_allowed" in str(clear.ready["refused"])
    clear.finish()
    assert victim.lookup(keys_for(1, 8)) == 8
    own = Attacker("client", g.socket, "clear")  # its private namespace: its own to clear
    assert own.ready["cleared"] == 0
    own.finish()
    victim.close()


def test_one_uid_cannot_take_the_pool_from_another(shared_guard) -> None:
    """Risk: Hellos for junk namespaces take every byte of the pool ("no pool room") and the
    victim's engine cannot store anything, even after the attacker left."""
    junk = Attacker("client", shared_guard.socket, "fill", "8")
    assert 1 <= junk.ready["opened"] < 4  # its share (half of the pool), not all of it
    victim, keys = _victim(shared_guard.socket)
    assert _exact(victim, keys) == 8
    junk.finish()
    victim.close()


def test_another_uid_cannot_squat_a_namespace_with_another_block_size(shared_guard) -> None:
    """Risk: another uid opens the victim's namespace first with another block size, and
    the real engine's attach fails ("holds blocks of N bytes")."""
    squatter = Attacker("client", shared_guard.socket, "squat-size")
    assert squatter.ready["attached"] is True
    victim, keys = _victim(shared_guard.socket)
    assert _exact(victim, keys) == 8
    squatter.finish()
    victim.close()


def test_a_uids_connections_together_hold_at_most_one_share_of_a_shared_tenant(
        short_tmp: str, harness) -> None:
    """Risk: in a shared tenant, two connections of one uid reserve half of the slots each
    and never commit: the other uids store nothing."""
    g = _guard(short_tmp, harness, "--tenant", f"team=0,{OTHER_UID}")
    hog = Attacker("client", g.socket, "hog", "team")
    assert hog.ready["granted"] <= hog.ready["capacity"] // 2
    victim, keys = _victim(g.socket, tenant="team")
    assert victim.lookup(keys) == 8
    hog.finish()
    victim.close()


def test_junk_hints_of_another_uid_cannot_crowd_a_real_source_off_the_board(
        shared_guard) -> None:
    """Risk: one client posts hints naming 512 junk endpoints; the hint board's endpoint
    table fills (daemon memory 29 -> 229 MiB) and a real source then gets 0 hashes."""
    flood = Attacker("client", shared_guard.socket, "hint-flood")
    assert flood.ready["taken"] > 0
    engine = AttachClient(shared_guard.socket, SPEC, BLOCK, identity="engine")
    real = list(range(10_000_000, 10_000_064))
    assert engine.post_hint(hint("tcp://10.0.0.7:7500", real)) == 64
    assert engine.hint_sources(real) == ["tcp://10.0.0.7:7500"] * 64
    flood.finish()
    engine.close()


def test_the_status_shows_a_uid_only_its_own_namespaces_and_clients(shared_guard) -> None:
    """Risk: the status probe tells any uid which engines (identities) run on the node and
    which namespaces they use."""
    victim, _ = _victim(shared_guard.socket)
    spy = Attacker("client", shared_guard.socket, "status")
    status = spy.ready["status"]
    spy.finish()
    assert "victim-engine" not in status["identities"]
    assert status["identities"] == ["attacker"]
    assert len(status["namespaces"]) == 1  # its own private one
    assert SPEC.digest().hex() not in {n["namespace"] for n in status["namespaces"]}
    victim.close()


def test_a_connect_flood_by_a_foreign_uid_does_not_keep_engines_out(guard) -> None:
    """Risk: a uid that may not even attach floods the socket with connections; the backlog
    fills and legitimate workers' attaches fail with EAGAIN."""
    os.chmod(guard.dir, 0o755)
    os.chmod(guard.socket, 0o666)
    flood = Attacker("flood", guard.socket, "400")
    assert flood.ready["connected"] > 100
    results: list[bool | str] = []

    def attach(n: int) -> None:
        client = AttachClient(guard.socket, SPEC, BLOCK, identity=f"worker-{n}")
        keys = keys_for(100 + n, 1)
        try:
            results.append(client.store(keys, [pattern_block(keys[0], BLOCK)]) == 1)
        except RunnerError as exc:
            results.append(str(exc))
        finally:
            client.close()

    threads = [threading.Thread(target=attach, args=(n,)) for n in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flood.finish()
    assert results == [True] * 20


def test_pages_punched_out_of_the_pool_are_never_loaded_as_kv(guard) -> None:
    """Risk: a process that maps the namespace (same uid) punches holes in the pool memfd
    (madvise(MADV_REMOVE) / fallocate(PUNCH_HOLE)); the victim's engine then loads zeroed
    blocks without error while verify_loads is off."""
    victim, keys = _victim(guard.socket)
    vandal = Attacker("client", guard.socket, "punch", same_uid=True)
    assert vandal.ready["punched"] is True
    vandal.finish()
    assert _exact(victim, keys) == 0  # dropped: a miss, never zeros
    assert victim.lookup(keys) == 0
    assert guard.metric("kvcr_holed_blocks_total") == 8
    victim.close()


def test_pages_punched_while_an_engine_copies_fail_its_check_where_uids_share(
        short_tmp: str, harness) -> None:
    """Risk: holes punched after the lease's hole check, while the engine copies (a race
    that check cannot see), are loaded as zeros. Where other uids map the namespace (a
    named tenant's), the default `verify_loads: auto` makes the engine hash what it read;
    private namespaces are not told to (no other uid maps them)."""
    g = _guard(short_tmp, harness, "--tenant", f"team=0,{OTHER_UID}")
    victim, keys = _victim(g.socket, "team")
    assert victim.shared is True
    verify = verifies_loads(KVCRConfig().verify_loads, victim.shared)
    assert verify is True
    lease = victim.acquire(keys, checksums=verify)
    assert lease.granted == 8
    vandal = Attacker("client", g.socket, "punch-tenant", "team")
    assert vandal.ready["punched"] is True
    vandal.finish()
    pool = victim.pool()
    intact = sum(1 for s, c in zip(lease.slots, lease.checksums, strict=True)
                 if s is not None and block_checksum(pool.view(s)) == c)
    assert intact == 0  # every block fails the engine's check: recomputed, never zeros
    victim.release(lease.op)
    private, _ = _victim(g.socket, prompt=2)
    assert private.shared is False
    assert verifies_loads(KVCRConfig().verify_loads, private.shared) is False
    victim.close()
    private.close()


_CONNECT = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n"
            "    s.connect(sys.argv[1])\n    print('connected')\n"
            "except OSError as e:\n    print(e.strerror)\n")


def test_the_kernel_lets_only_allowed_uids_reach_the_guards_socket(
        short_tmp: str, harness) -> None:
    """Risk: every uid's connections reach the daemon, whose accept loop pays for each (a
    connect flood by a uid that may not attach slows every engine's round trip), or an
    allowed uid cannot connect without the operator opening the socket to every uid."""
    os.chmod(short_tmp, 0o755)
    g = harness.Guard(short_tmp, "--allowed-uid", str(os.getuid()), "--allowed-uid",
                      str(OTHER_UID)).start()  # the socket as kvcr-guard makes it
    assert stat.S_IMODE(os.stat(g.socket).st_mode) & 0o007 == 0  # nothing for "other"
    allowed = Attacker("client", g.socket, "read", "1", "8")
    assert allowed.ready["attached"] is True  # its ACL entry lets 65534 in
    allowed.finish()
    for uid, expected in ((THIRD_UID, "Permission denied"), (OTHER_UID, "connected")):
        probe = as_other_uid([sys.executable, "-c", _CONNECT, g.socket], uid=uid,
                             stdout=subprocess.PIPE)
        out, _ = probe.communicate(timeout=60)
        assert out.decode().strip() == expected, uid
    # the kernel turned uid 65533 away: the daemon never saw (nor closed) its connection
    assert g.metric("kvcr_guard_connections_closed_total", reason="not_allowed") == 0
