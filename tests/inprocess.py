"""A command line's ``main(argv)`` run in the test's process, as ``python -m PKG`` would run it:
stdout and stderr captured, the exit code as ``returncode``. ~0.7-3 CPU-s of imports cheaper than
a subprocess a call (torch, faiss, onnxruntime are loaded once per worker); the code run is the
same ``main`` that ``__main__`` calls. Each CLI keeps at least one test through a real subprocess
(its entry point, its exit code)."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import traceback
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Callable, Mapping, Sequence

REPO = Path(__file__).resolve().parents[1]


def run_main(main: Callable[[list[str]], int | None], prog: str, argv: Sequence[object]) -> subprocess.CompletedProcess:
    argv = [str(a) for a in argv]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(argv) or 0
        except SystemExit as e:                       # argparse: usage errors (2) and --help (0)
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception:                             # what `python -m` would print, exit 1
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess([prog, *argv], code, out.getvalue(), err.getvalue())


def run_module(package: str, argv: Sequence[object], *, timeout: float = 300,
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m PACKAGE ARGV`` as a real subprocess (the entry point itself, or where the
    process is the point), from the repository, 2 threads, ``env`` on top of this environment."""
    full = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2", **(env or {})}
    return subprocess.run([sys.executable, "-m", package, *map(str, argv)], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=timeout)
