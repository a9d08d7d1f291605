"""The user guide builds: `mkdocs build --strict` over docs/ (MkDocs with the Material theme,
from .venv-docs, which scripts/setup_docs.sh makes). Strict mode fails on a link to a missing
page or anchor and on a page left out of the navigation."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from kvcr_core.testing.setup import missing_setup

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
MKDOCS = REPO / ".venv-docs" / "bin" / "mkdocs"


def test_site_builds_strict(tmp_path: Path) -> None:
    """Risk: a broken link or anchor, a page missing from the navigation, or a bad fence
    ships in the user guide."""
    if not MKDOCS.exists():
        missing_setup(".venv-docs/bin/mkdocs is missing: run bash scripts/setup_docs.sh")
    run = subprocess.run([str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path)],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "configure-vllm" / "index.html").exists()


def test_readme_links_resolve_and_point_at_the_guide() -> None:
    """Risk: the README, the first page anyone reads, links to files that moved or to
    places outside the repository."""
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link.split("#")[0] for link in links
             if "://" not in link and not link.startswith("#")]
    missing = [link for link in local
               if not (REPO / link).resolve().is_relative_to(REPO) or not (REPO / link).exists()]
    assert not missing, missing
    assert "docs/index.md" in local
