"""Helpers the indexer tests import: the repository root, a CLI runner, Omniglot copies.

A module of its own, not conftest.py: with several test folders in one run, `from conftest
import ...` would find whichever conftest module was imported first."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

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
