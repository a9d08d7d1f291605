"""Another uid for trust tests: `as_other_uid(argv)` runs a real process as uid/gid 65534
(`nobody`, through `setpriv`), so an attack on a shared node is tried by a real second uid,
not by a client that only claims one. `other_uid_unavailable()` says why a test cannot (not
root, no setpriv, or uid 65534 cannot run this Python): skip with that reason.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

OTHER_UID = 65534
THIRD_UID = 65533  # a uid no daemon in the tests allows


@functools.cache
def other_uid_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "switching to another uid needs root (run the trust tests as root)"
    if shutil.which("setpriv") is None:
        return "setpriv (util-linux) is not installed"
    probe = subprocess.run([*_prefix(), sys.executable, "-c", "import kvcr_core"],
                           capture_output=True, timeout=60, check=False, env=_env())
    if probe.returncode != 0:
        return (f"uid {OTHER_UID} cannot import kvcr_core with {sys.executable}: "
                f"{probe.stderr.decode(errors='replace')[-200:]}")
    return None


def _prefix(uid: int = OTHER_UID) -> list[str]:
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.pop("PYTHONHOME", None)
    return env


def as_other_uid(argv: Sequence[str], *, uid: int = OTHER_UID,
                 **popen: object) -> subprocess.Popen[bytes]:
    """Starts `argv` (e.g. [sys.executable, "-m", ...]) as `uid` (and that gid; default
    65534), with this process's import path."""
    return subprocess.Popen([*_prefix(uid), *argv], env=_env(), **popen)  # type: ignore[call-overload, no-any-return]
