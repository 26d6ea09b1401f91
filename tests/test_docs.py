"""The documentation site builds with warnings as errors, and what it shows comes from the sources.

Runs ``mkdocs build --strict`` (mkdocs.yml at the repository root) into a temporary directory: a broken
link, a page missing from the nav, a docstring griffe cannot parse or a missing snippet fails the test.
Then checks that the API reference really rendered the docstrings and that the changelog page is the root
CHANGELOG.md, included rather than copied.
"""

from __future__ import annotations

import ast
import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # mkdocs-material's banner about MkDocs 2.0
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    assert "WARNING" not in log, log
    return out


def text_of(page: Path) -> str:
    """The page's visible text: tags dropped, entities decoded, whitespace collapsed."""
    raw = page.read_text(encoding="utf-8")
    raw = re.sub(r"<(script|style)\b.*?</\1>", " ", raw, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", raw)))


def docstring_first_line(path: Path, name: str) -> str:
    """First line of a class's docstring, read from the source without importing the package."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    line = ast.get_docstring(node).splitlines()[0].strip()
    line = re.sub(r":\w+:`~?([^`]*)`", r"\1", line)  # a Sphinx role shows as its target's name
    return line.replace("`", "")                     # code spans show without their backticks


def test_api_reference_renders_docstrings(site):
    strategy = text_of(site / "api" / "strategy" / "index.html")
    summary = docstring_first_line(ROOT / "lightning_dpzero" / "strategy.py", "DPDeepSpeedStrategy")
    assert summary in strategy
    for param in ("noise_multiplier", "max_grad_norm", "clipping_fn", "poisson_sampling"):
        assert param in strategy, param
    callback = text_of(site / "api" / "callback" / "index.html")
    assert docstring_first_line(ROOT / "lightning_dpzero" / "callback.py", "PrivacyAccountantCallback") in callback
    assert "target_epsilon" in callback and "ClipFraction" in callback and "MeanGradNorm" in callback
    accounting = text_of(site / "api" / "accounting" / "index.html")
    assert "calibrate_noise_multiplier" in accounting and "PrivacyLedger" in accounting
    per_sample = text_of(site / "api" / "per-sample" / "index.html")
    assert "LayerRule" in per_sample and "norm_sq" in per_sample and "UnsupportedLayerError" in per_sample
    # Sphinx roles in docstrings (:class:`X`) are shown as plain code, not as literal ":class:"
    for page in (site / "api").rglob("index.html"):
        assert ":class:" not in text_of(page) and ":meth:" not in text_of(page), page


def test_changelog_is_included_from_the_root_file(site):
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    headings = [line.lstrip("#").strip() for line in changelog.splitlines() if line.startswith("#")]
    page = text_of(site / "changelog" / "index.html")
    assert headings[0] in page
    assert headings[1] in page  # the first release section, e.g. "[Unreleased]"
    assert "--8<--" not in page  # the snippet was replaced, not left as text


def test_pages_of_the_nav_are_built(site):
    for page in ("index.html", "concepts/zero/index.html", "how-to/resume/index.html", "yaml/index.html",
                 "wandb/index.html", "benchmarks/index.html", "multi-node/index.html"):
        assert (site / page).is_file(), page
    zero = text_of(site / "concepts" / "zero" / "index.html")
    assert "2Ψ + (2Ψ + 12Ψ)/N_d" in zero
    # images that docs/ pages link to in the repository (../benchmarks/...) are published with the site
    for img in re.findall(r"\]\((\.\./[^)\s]+\.png)\)", (ROOT / "docs" / "benchmarks.md").read_text("utf-8")):
        assert (site / "repo" / Path(img).relative_to("..")).is_file(), img
