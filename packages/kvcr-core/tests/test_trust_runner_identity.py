"""Trust boundary, engine side: an engine attaches only to a Runner served by a uid it trusts.
Attackers are real processes of another uid (65534, through setpriv); integration layer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from kvcr_core.attach import AttachClient, EmbeddedRunner, EngineSettings, RunnerUnavailable
from kvcr_core.config import KVCRConfig
from kvcr_core.testing import pattern_block, random_keys
from kvcr_core.testing.uids import other_uid_unavailable

sys.path.insert(0, os.path.dirname(__file__))
from attach_worker import BLOCK, SPEC
from trust_attacker import Attacker

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(other_uid_unavailable() is not None,
                                 reason=str(other_uid_unavailable()))]


@pytest.fixture
def open_dir() -> Iterator[str]:
    """A short directory every uid may write (like a careless /tmp/kvcr)."""
    path = tempfile.mkdtemp(prefix="kt", dir="/tmp")
    os.chmod(path, 0o777)
    yield path
    subprocess.run(["rm", "-rf", path], check=False)


@pytest.mark.parametrize("where", ["file", "abstract"])
def test_an_engine_never_talks_to_a_runner_served_by_another_uid(open_dir: str,
                                                                  where: str) -> None:
    """Risk: another uid binds the socket an engine uses (first, in a shared directory, or an
    abstract name) and receives the engine's KV, answers its lookups and serves it poisoned
    blocks."""
    path = os.path.join(open_dir, "g.sock") if where == "file" else \
        f"@kvcr-embedded-trust-{os.getpid()}"
    fake = Attacker("fake-server", path)
    engine = AttachClient(path.replace("@", "\0", 1), SPEC, BLOCK, identity="victim")
    keys = random_keys(4, seed=1)
    with pytest.raises(RunnerUnavailable) as refused:
        engine.store(keys, [pattern_block(k, BLOCK) for k in keys])
    assert refused.value.reason == "untrusted_runner"
    assert "uid 65534" in refused.value.detail and "runner_uids" in refused.value.detail
    with pytest.raises(RunnerUnavailable):  # backed off: no second connection either
        engine.lookup(keys)
    engine.close()
    assert fake.finish() == {"received": 0}  # not even the Hello (identity, pid) was sent


def test_a_squatted_embedded_name_never_stops_an_engine_from_starting() -> None:
    """Risk: another uid binds the embedded Runner's likely names first and the engine's
    cache fails to start (or its workers attach to the squatter)."""
    base = f"kvcr-embedded-squat-{os.getpid()}"
    squatter = Attacker("squat", base, *(f"{base}-{i:016x}" for i in range(200)))
    assert squatter.ready["squatted"] == 201
    runner = EmbeddedRunner(EngineSettings(socket="\0" + base,
                                           runner=KVCRConfig(pool_bytes=64 * BLOCK)))
    try:
        assert runner.socket_path.startswith("\0" + base + "-")
        engine = AttachClient(runner.socket_path, SPEC, BLOCK, identity="engine")
        keys = random_keys(4, seed=2)
        assert engine.store(keys, [pattern_block(k, BLOCK) for k in keys]) == 4
        assert engine.lookup(keys) == 4
        engine.close()
    finally:
        runner.stop()
        squatter.finish()


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775])
def test_kvcr_guard_refuses_a_socket_directory_another_uid_can_write(open_dir: str,
                                                                     mode: int) -> None:
    """Risk: kvcr-guard serves from a directory where another uid can bind its path first
    (then the real daemon cannot start and engines attach to the impostor)."""
    os.chmod(open_dir, mode)
    out = subprocess.run([sys.executable, "-m", "kvcr_guard", "--socket",
                          os.path.join(open_dir, "g.sock"), "--pool-bytes", "32MiB"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0
    assert "writable by other uids" in out.stderr and "mkdir -m 0755" in out.stderr, out.stderr
    assert not os.path.exists(os.path.join(open_dir, "g.sock"))
