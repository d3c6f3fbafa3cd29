"""A command line's ``main(argv)`` run in the test's process, as ``python -m PKG`` would run it:
stdout and stderr captured, the exit code as ``returncode``. ~0.7-3 CPU-s of imports cheaper than
a subprocess a call (torch, faiss, onnxruntime are loaded once per worker); the code run is the
same ``main`` that ``__main__`` calls. Each CLI keeps at least one test through a real subprocess
(its entry point, its exit code)."""
from __future__ import annotations

import io
import subprocess
import traceback
from contextlib import redirect_stderr, redirect_stdout
from typing import Callable, Sequence


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
