"""Indexer fixtures: small real galleries (Omniglot copies, scikit-image photos) and a CLI runner.

Galleries are copied into tmp dirs (never into the repo) because tests add bad files to them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# test_ray.py starts Ray, which listens beyond loopback: the main run leaves it out and
# test_ray_netns.py runs it inside a private network namespace (run by hand, it runs there too).
collect_ignore = ["test_ray.py"]


def run_cli(*args: object, check: bool = True, timeout: float = 300,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m indexer ...`` in a real subprocess (the way users run it); ``env`` adds to ours."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2", **(env or {})}
    p = subprocess.run([sys.executable, "-m", "indexer", *map(str, args)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"indexer {args} exited {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}")
    return p


def copy_characters(omniglot_root: Path, dst: Path, n_chars: int, per_char: int = 20,
                    skip_chars: int = 0) -> list[Path]:
    """Copy ``n_chars`` Omniglot characters (Alphabet/characterNN/*.png) into ``dst``."""
    base = omniglot_root / "images_background"
    chars = [c for a in sorted(base.iterdir()) for c in sorted(a.iterdir())][skip_chars:skip_chars + n_chars]
    out = []
    for c in chars:
        d = dst / c.parent.name / c.name
        d.mkdir(parents=True, exist_ok=True)
        for f in sorted(c.glob("*.png"))[:per_char]:
            shutil.copy2(f, d / f.name)
            out.append(d / f.name)
    return out


@pytest.fixture(scope="session")
def omniglot_gallery(tmp_path_factory: pytest.TempPathFactory, omniglot_root: Path) -> Path:
    """12 characters x 20 drawings = 240 real Omniglot images, labelled Alphabet/characterNN."""
    root = tmp_path_factory.mktemp("omniglot-gallery")
    copy_characters(omniglot_root, root, 12)
    return root


@pytest.fixture(scope="session")
def built_index(tmp_path_factory: pytest.TempPathFactory, omniglot_gallery: Path, small_onnx: Path) -> Path:
    """A Flat index of ``omniglot_gallery`` built through the CLI; tests must not modify it."""
    out = tmp_path_factory.mktemp("built") / "idx"
    run_cli("build", omniglot_gallery, "--model", small_onnx, "--out", out, "--quiet")
    return out
