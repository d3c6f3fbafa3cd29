"""``python -m training.das_check SPEC_JSON``: the fused DAS kernels' self-check for one kernel
variant, in a process of its own (training/das_fused.py starts it on CUDA, so that a sticky
CUDA fault in a kernel cannot poison the trainer's context). Prints ``{"ok": ..., "reason": ...}``
on its last line; the parent reads that line, or the exit status when the child died.

Errors follow the CLI kit (embedder/cli.py): a missing SPEC or one that is not JSON is a usage
error (exit 2); a check that fails is not an error (``ok: false``, exit 0).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from embedder.cli import run_main

from .das import DAS
from .das_fused import CRASH_ENV, run_spec

PROG = "python -m training.das_check"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Run the fused DAS kernels' self-check for "
                                "one variant and print {\"ok\": ..., \"reason\": ...}.")
    p.add_argument("spec", metavar="SPEC_JSON", type=json.loads,
                   help="the module's settings and the batch's layout (das_fused.spec_of)")
    return p


def check(args: argparse.Namespace) -> int:
    """Run the check; a kernel that fails to compile or run is a verdict, not a crash."""
    if os.environ.get(CRASH_ENV):
        os.abort()
    spec = args.spec
    try:
        ok, reason = run_spec(spec, DAS)
    except Exception as e:  # noqa: BLE001 - the verdict names it; the parent falls back to eager
        ok, reason = False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    if spec["device"].startswith("cuda"):
        torch.cuda.synchronize()       # a late fault shows here, as a non-zero exit
    print(json.dumps({"ok": ok, "reason": reason}))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(PROG, build_parser(), argv, handler=check)


if __name__ == "__main__":
    sys.exit(main())
