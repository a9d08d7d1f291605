"""Rendered Kubernetes pods run as local processes, to prove that the manifests' commands,
flags, mounts, users and peer names work together (tests and demos of `deploy/kubernetes`).

Each pod gets its own network namespace on one bridge (its "node", reachable from the host at
its address) and an /etc/hosts that names the pods by their Service DNS names. Each container
runs in its own mount, user and PID namespaces: the pod's volumes (emptyDir, Secret, ConfigMap,
a PersistentVolumeClaim) are host folders bound at the container's mount paths, read-only
where the manifest says so, the root filesystem is read-only under `readOnlyRootFilesystem`,
and the process runs as the pod's `runAsUser`/`runAsGroup` (mapped to the host user running
this, who owns the Python environment that stands in for every image; the images add that user
to /etc/passwd, so the harness does too). Sidecars (`initContainers` with `restartPolicy:
Always`) start first, each waiting for its startup probe; exited containers are restarted as
the restart policy says; exec and httpGet probes run as the manifest writes them.

This is not a cluster: no scheduler, no kubelet, no images, no resource limits, no liveness
kills, no Service load balancing (a Service name resolves to its pods' addresses). Root only
(iproute2, util-linux `unshare` and `nsenter`); it creates mount points that are missing on
the host (such as /models) and removes them when the pod closes."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

Doc = dict[str, Any]
CRASH_LOOP = 3  # restarts while waiting for a probe that mean the container cannot start
Adapt = Callable[[str, list[str], dict[str, str]], tuple[list[str], dict[str, str]]]


class PodNetwork:
    """A bridge `kvcr<tag>br` at 10.203.<subnet>.1/24 on the host and one network namespace
    per pod, joined to it by a veth pair. Removed on close (and before creation, in case a
    crashed run left them)."""

    def __init__(self, tag: str, subnet: int) -> None:
        self.tag, self.subnet = tag, subnet
        self.bridge = f"kvcr{tag}br"
        self.host = f"10.203.{subnet}.1"
        self.namespaces: list[str] = []

    def __enter__(self) -> PodNetwork:
        self._remove(leftovers=True)
        for step in (("link", "add", self.bridge, "type", "bridge"),
                     ("addr", "add", f"{self.host}/24", "dev", self.bridge),
                     ("link", "set", self.bridge, "up")):
            _ip(*step)
        return self

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def add(self) -> tuple[str, str]:
        """A new namespace on the bridge: (its name, its address)."""
        index = len(self.namespaces)
        ns, host_end, pod_end = (f"kvcr{self.tag}{index}", f"kvcr{self.tag}{index}h",
                                 f"kvcr{self.tag}{index}p")
        address = f"10.203.{self.subnet}.{10 + index}"
        self.namespaces.append(ns)
        for step in (("netns", "add", ns),
                     ("link", "add", host_end, "type", "veth", "peer", "name", pod_end),
                     ("link", "set", pod_end, "netns", ns),
                     ("link", "set", host_end, "master", self.bridge),
                     ("link", "set", host_end, "up"),
                     ("-n", ns, "addr", "add", f"{address}/24", "dev", pod_end),
                     ("-n", ns, "link", "set", pod_end, "up"),
                     ("-n", ns, "link", "set", "lo", "up")):
            _ip(*step)
        return ns, address

    def _remove(self, leftovers: bool = False) -> None:
        names = [f"kvcr{self.tag}{i}" for i in range(16)] if leftovers else self.namespaces
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30,
                           check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30,
                       check=False)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass(frozen=True)
class Sources:
    """What the cluster would provide: PersistentVolumeClaims (claim name -> host folder),
    Secrets and ConfigMaps (name -> key -> content)."""

    claims: Mapping[str, Path] = field(default_factory=dict)
    secrets: Mapping[str, Mapping[str, bytes]] = field(default_factory=dict)
    config_maps: Mapping[str, Mapping[str, str]] = field(default_factory=dict)


@dataclass
class Container:
    """One container of a pod, as the manifest writes it (after `adapt`)."""

    name: str
    spec: Doc
    argv: list[str]
    env: dict[str, str]
    always: bool  # restarted whenever it exits
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0


class Pod:
    """A pod spec run as processes in its own network namespace (see the module header).
    `adapt(container, argv, env)` may change a container's command line and environment for
    this machine; whatever it changes is the caller's to say."""

    def __init__(self, name: str, spec: Doc, network: PodNetwork, workdir: Path,
                 sources: Sources, path: str, adapt: Adapt | None = None,
                 keep: Path | None = None) -> None:
        self.name, self.spec, self.sources = name, spec, sources
        self.keep = keep  # a host folder containers need at its own path (the environment)
        self.labels: dict[str, str] = {}  # the template's, for Service selectors
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True)
        self.netns, self.address = network.add()
        self.path = path
        security = spec.get("securityContext", {})
        self.uid = int(security.get("runAsUser", 0))
        self.gid = int(security.get("runAsGroup", self.uid))
        self.volumes = {v["name"]: self._volume(v) for v in spec.get("volumes", [])}
        self.sidecars = [self._container(c, True, adapt) for c in spec.get("initContainers", [])
                         if c.get("restartPolicy") == "Always"]
        policy = spec.get("restartPolicy", "Always")
        self.main = [self._container(c, policy == "Always", adapt) for c in spec["containers"]]
        self._mounts_lock = _MountPoints.share()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._supervisor = threading.Thread(target=self._supervise, daemon=True)

    # -- set-up ---------------------------------------------------------------------------

    def _volume(self, volume: Doc) -> Path:
        if "persistentVolumeClaim" in volume:
            return Path(self.sources.claims[volume["persistentVolumeClaim"]["claimName"]])
        folder: Path = self.workdir / "volumes" / str(volume["name"])
        folder.mkdir(parents=True)
        if "secret" in volume:
            source = volume["secret"]
            mode = int(source.get("defaultMode", 0o644))
            for key, value in self.sources.secrets[source["secretName"]].items():
                (folder / key).write_bytes(value)
                (folder / key).chmod(mode)
        elif "configMap" in volume:
            for key, text in self.sources.config_maps[volume["configMap"]["name"]].items():
                (folder / key).write_text(text)
        return folder

    def _container(self, spec: Doc, always: bool, adapt: Adapt | None) -> Container:
        if any("value" not in e for e in spec.get("env", [])):
            raise ValueError(f"{spec['name']}: only literal env values are supported here")
        env = {"PATH": self.path, **{e["name"]: e["value"] for e in spec.get("env", [])}}
        expand = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")  # as the kubelet does
        argv = [expand.sub(lambda m: env.get(m.group(1), m.group(0)), a)
                for a in (*spec.get("command", []), *spec.get("args", []))]
        if adapt is not None:
            argv, env = adapt(spec["name"], argv, env)
        return Container(spec["name"], spec, argv, env, always)

    def hosts(self, names: Mapping[str, str]) -> None:
        """Writes the pod's /etc/hosts: localhost, its own name, then `names` (DNS -> address)."""
        lines = ["127.0.0.1 localhost", f"{self.address} {self.name}",
                 *(f"{address} {dns}" for dns, address in names.items())]
        (self.workdir / "hosts").write_text("\n".join(lines) + "\n")
        user = f"kvcr:x:{self.uid}:{self.gid}::/tmp:/usr/sbin/nologin\n"
        (self.workdir / "passwd").write_text(Path("/etc/passwd").read_text() + user)
        (self.workdir / "group").write_text(Path("/etc/group").read_text()
                                            + f"kvcr:x:{self.gid}:\n")

    def _script(self, container: Container) -> str:
        """The shell lines that set up a container's mount namespace, then become it."""
        lines = ["set -e"]
        for name in ("hosts", "passwd", "group"):
            lines.append(f"mount --bind {self.workdir / name} /etc/{name}")
        mounts = container.spec.get("volumeMounts", [])
        keep = self.keep
        hidden = keep is not None and any(
            Path(m["mountPath"]) in (keep, *keep.parents) for m in mounts)
        stage = Path("/run") / f"kvcr-pods-keep-{os.getpid()}"
        if hidden:  # a volume mounts over the environment (a clone under /tmp): set it aside
            self._mount_point(stage)
            lines.append(f"mount --bind {shlex.quote(str(keep))} {stage}")
        for mount in mounts:
            target = mount["mountPath"]
            self._mount_point(Path(target))
            lines.append(f"mount --bind {shlex.quote(str(self.volumes[mount['name']]))} "
                         f"{shlex.quote(target)}")
            if mount.get("readOnly"):
                lines.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
        if hidden:  # and put it back where it was, inside the volume
            lines.append(f"mkdir -p {shlex.quote(str(keep))}")
            lines.append(f"mount --bind {stage} {shlex.quote(str(keep))}")
        if container.spec.get("securityContext", {}).get("readOnlyRootFilesystem"):
            lines.append("mount -o remount,bind,ro /")
        lines.append(f"cd {shlex.quote(container.spec.get('workingDir', '/'))}")
        env = " ".join(shlex.quote(f"{k}={v}") for k, v in container.env.items())
        lines.append(f"exec unshare --user --map-user={self.uid} --map-group={self.gid} "
                     f"--pid --fork --kill-child=SIGTERM -- env -i {env} "
                     + " ".join(shlex.quote(a) for a in container.argv))
        return "\n".join(lines)

    def _mount_point(self, target: Path) -> None:
        missing = [p for p in (target, *target.parents) if not p.exists()]
        for folder in reversed(missing):
            folder.mkdir()
            _MountPoints.record(folder)

    # -- running --------------------------------------------------------------------------

    def start(self, startup_timeout_s: float = 600) -> Pod:
        """Starts the sidecars one by one (each passing its startup probe), then the
        containers, then the restart supervisor. Returns at once after the last start."""
        if not (self.workdir / "hosts").exists():
            self.hosts({})
        for sidecar in self.sidecars:
            self._launch(sidecar)
            self.wait_probe(sidecar, "startupProbe", startup_timeout_s)
        for container in self.main:
            self._launch(container)
        self._supervisor.start()
        return self

    def _launch(self, container: Container) -> None:
        log = open(self.workdir / f"{container.name}.log", "ab")  # noqa: SIM115 (kept by Popen)
        with log:
            container.proc = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.netns}", "--", "unshare", "--mount",
                 "--propagation", "private", "--", "sh", "-c", self._script(container)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _supervise(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                for container in (*self.sidecars, *self.main):
                    proc = container.proc
                    if proc is not None and proc.poll() is not None and container.always:
                        container.restarts += 1
                        self._launch(container)

    def container(self, name: str) -> Container:
        (found,) = [c for c in (*self.sidecars, *self.main) if c.name == name]
        return found

    def kill(self, name: str) -> int:
        """SIGKILLs a container's PID 1 (a crash: its PID namespace dies with it); returns the
        old process id. The supervisor restarts it if its policy says so."""
        container = self.container(name)
        assert container.proc is not None
        with self._lock:
            pid = self._container_pid(container)
            assert pid is not None, f"{self.name}/{name} is not running"
            os.kill(pid, signal.SIGKILL)
            container.proc.wait(timeout=30)
        return pid

    def logs(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    # -- probes ---------------------------------------------------------------------------

    def probe(self, container: Container, kind: str) -> bool:
        """One try of a container's probe of `kind` (readinessProbe, startupProbe, ...); a
        container without one counts as passing while it runs."""
        if container.proc is None or container.proc.poll() is not None:
            return False
        probe = container.spec.get(kind)
        if probe is None:
            return True
        if "exec" in probe:
            return self._exec_probe(container, probe)
        get = probe["httpGet"]
        url = f"http://{self.address}:{self.port(container, get['port'])}{get.get('path', '/')}"
        with contextlib.suppress(httpx.HTTPError):
            return 200 <= httpx.get(url, timeout=probe.get("timeoutSeconds", 1)).status_code < 400
        return False

    def _exec_probe(self, container: Container, probe: Doc) -> bool:
        pid = self._container_pid(container)
        if pid is None:
            return False
        env = [f"{k}={v}" for k, v in container.env.items()]
        try:
            done = subprocess.run(
                ["nsenter", "-t", str(pid), "-a", "-S", str(self.uid), "-G", str(self.gid),
                 "--", "env", "-i", *env, *probe["exec"]["command"]],
                capture_output=True, timeout=probe.get("timeoutSeconds", 1), check=False)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    @staticmethod
    def _container_pid(container: Container) -> int | None:
        """The container's PID 1 (the child of its `unshare --fork`), as the host sees it."""
        assert container.proc is not None
        with contextlib.suppress(OSError, ValueError, IndexError):  # not forked yet, or gone
            path = Path(f"/proc/{container.proc.pid}/task/{container.proc.pid}/children")
            return int(path.read_text().split()[0])
        return None

    @staticmethod
    def port(container: Container, port: int | str) -> int:
        if isinstance(port, int):
            return port
        (number,) = [p["containerPort"] for p in container.spec.get("ports", [])
                     if p.get("name") == port]
        return int(number)

    def wait_probe(self, container: Container, kind: str, timeout_s: float) -> None:
        """Waits for a pass of the probe; a startup probe gets no more than the manifest's
        budget (initialDelaySeconds + failureThreshold x periodSeconds), after which the
        kubelet would kill the container."""
        probe = container.spec.get(kind)
        if kind == "startupProbe" and probe is not None:
            timeout_s = min(timeout_s, probe.get("initialDelaySeconds", 0)
                            + probe.get("failureThreshold", 3) * probe.get("periodSeconds", 10))
        deadline = time.monotonic() + timeout_s
        while not self.probe(container, kind):
            if container.proc is not None and container.proc.poll() is not None \
                    and not container.always:
                raise AssertionError(f"{self.name}/{container.name} exited: "
                                     f"{self.logs(container.name)}")
            if container.restarts > CRASH_LOOP:
                raise AssertionError(f"{self.name}/{container.name} restarted "
                                     f"{container.restarts} times: {self.logs(container.name)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}/{container.name}: no {kind} pass in "
                                     f"{timeout_s:.0f} s: {self.logs(container.name)}")
            time.sleep(0.5)

    def wait_ready(self, timeout_s: float = 600) -> None:
        """Every container passes its startup probe, then its readiness probe."""
        for container in (*self.sidecars, *self.main):
            self.wait_probe(container, "startupProbe", timeout_s)
            self.wait_probe(container, "readinessProbe", timeout_s)

    # -- teardown -------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the containers (sidecars last, as the kubelet does) and removes the mount
        points it made."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._supervisor.is_alive():
            self._supervisor.join(timeout=10)
        _stop_all(self.main)
        for sidecar in reversed(self.sidecars):
            _stop_all([sidecar])
        _MountPoints.release(self._mounts_lock)


class _MountPoints:
    """Mount points made on the host for containers (such as /models), shared by every pod
    of every process on this machine: each pod holds a shared lock on a host-wide file while
    it lives, and the last one to close (the one that gets the lock exclusively) removes the
    folders recorded as made, so a pod never loses a mount point another one still uses."""

    LOCK = Path("/tmp/kvcr-pods.lock")
    MADE = Path("/tmp/kvcr-pods.made")

    @classmethod
    def share(cls) -> int:
        fd = os.open(cls.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    @classmethod
    def record(cls, folder: Path) -> None:
        with open(cls.MADE, "a") as made:
            made.write(f"{folder}\n")

    @classmethod
    def release(cls, fd: int) -> None:
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another pod still runs; the last one cleans up
            if cls.MADE.exists():
                for line in reversed(cls.MADE.read_text().splitlines()):
                    with contextlib.suppress(OSError):
                        Path(line).rmdir()
                cls.MADE.unlink()
        finally:
            os.close(fd)


def _stop_all(containers: Sequence[Container], grace_s: float = 20) -> None:
    """SIGTERM to each container's PID 1, then SIGKILL to what is left after `grace_s`."""
    running = [c for c in containers if c.proc is not None and c.proc.poll() is None]
    for container in running:
        _signal(container, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for container in running:
        assert container.proc is not None
        try:
            container.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(container, signal.SIGKILL)
            container.proc.kill()
            container.proc.wait(timeout=30)


def _signal(container: Container, signum: int) -> None:
    pid = Pod._container_pid(container)
    with contextlib.suppress(ProcessLookupError):
        if pid is not None:
            os.kill(pid, signum)
        elif container.proc is not None:
            container.proc.send_signal(signum)


def workload_pods(workload: Doc) -> list[tuple[str, Doc]]:
    """(pod name, pod spec) of a Deployment or StatefulSet: StatefulSet pods are named
    `<name>-<ordinal>`; a Deployment's pods get `<name>-<index>` here (the real ones get a
    random suffix)."""
    name, spec = workload["metadata"]["name"], workload["spec"]
    replicas = int(spec.get("replicas", 1))
    return [(f"{name}-{i}", spec["template"]["spec"]) for i in range(replicas)]


def environment_path(bin_dir: Path) -> str:
    """PATH for the containers: this Python environment's commands stand in for the image's."""
    return f"{bin_dir}:/usr/local/bin:/usr/bin:/bin"


__all__ = ["Container", "Pod", "PodNetwork", "Sources", "environment_path", "workload_pods"]
