"""Fixtures of the deploy checks: the deploy tools (scripts/setup_deploy.sh installs them) and
the kustomizations rendered once by `kubectl kustomize` (conftest is not importable as a
module, so tests get helpers from these fixtures)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvcr_core.testing.setup import missing_setup

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
KUSTOMIZATIONS = {
    "vllm-embedded-peers": KUBERNETES / "overlays" / "vllm-embedded-peers",
    "vllm-guard": KUBERNETES / "overlays" / "vllm-guard",
    "sglang-hicache": KUBERNETES / "overlays" / "sglang-hicache",
    "sglang-linker": KUBERNETES / "overlays" / "sglang-linker",
    "monitoring": KUBERNETES / "monitoring",
}
OVERLAYS = tuple(name for name in KUSTOMIZATIONS if name != "monitoring")
GUARDED = ("vllm-guard", "sglang-hicache", "sglang-linker")
Doc = dict[str, Any]


class Tools:
    """Where the deploy tools are. One that scripts/setup_deploy.sh installs but is absent
    fails the test in CI (CI=true) and skips it elsewhere, naming the script."""

    repo = REPO

    @staticmethod
    def missing(what: str) -> None:
        missing_setup(f"{what} is missing: run bash scripts/setup_deploy.sh")

    def venv(self, name: str) -> str:
        """A command of .venv-deploy (hadolint, kubernetes-validate, checkov, python)."""
        path = REPO / ".venv-deploy" / "bin" / name
        if not path.exists():
            self.missing(f".venv-deploy/bin/{name}")
        return str(path)

    def system(self, name: str) -> str:
        """A Debian command (kubectl, prometheus, promtool)."""
        path = shutil.which(name)
        if path is None:
            self.missing(name)
        return str(path)


class Manifests:
    """The rendered kustomizations: files and parsed objects."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.docs = {name: [d for d in yaml.safe_load_all(path.read_text()) if d]
                     for name, path in files.items()}

    def find(self, name: str, kind: str) -> list[Doc]:
        return [d for d in self.docs[name] if d["kind"] == kind]

    def workloads(self, name: str) -> list[Doc]:
        return [d for d in self.docs[name] if d["kind"] in ("Deployment", "StatefulSet")]

    def one(self, name: str, kind: str, object_name: str) -> Doc:
        (found,) = [d for d in self.find(name, kind) if d["metadata"]["name"] == object_name]
        return found

    @staticmethod
    def pod(workload: Doc) -> Doc:
        spec: Doc = workload["spec"]["template"]["spec"]
        return spec

    @classmethod
    def containers(cls, workload: Doc) -> list[Doc]:
        spec = cls.pod(workload)
        return [*spec.get("initContainers", []), *spec["containers"]]

    @classmethod
    def container(cls, workload: Doc, name: str) -> Doc:
        (found,) = [c for c in cls.containers(workload) if c["name"] == name]
        return found


@pytest.fixture(scope="session")
def tools() -> Tools:
    return Tools()


@pytest.fixture(scope="session")
def manifests(tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> Manifests:
    """Every kustomization rendered by `kubectl kustomize` (offline)."""
    out = tmp_path_factory.mktemp("rendered")
    files = {}
    for name, directory in KUSTOMIZATIONS.items():
        run = subprocess.run([tools.system("kubectl"), "kustomize", str(directory)],
                             capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 0, f"kubectl kustomize {directory} failed:\n{run.stderr}"
        files[name] = out / f"{name}.yaml"
        files[name].write_text(run.stdout)
    return Manifests(files)
