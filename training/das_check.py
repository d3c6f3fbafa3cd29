"""``python -m training.das_check SPEC_JSON``: the fused DAS kernels' self-check for one variant,
in its own process (a sticky CUDA fault cannot poison the trainer). Prints ``{"ok": ...,
"reason": ...}`` on its last line; a bad SPEC is a usage error (exit 2), a failed check is not.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from embedder.cli import run_main

from .das import DAS
from .das_fused import run_spec

PROG = "python -m training.das_check"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Run the fused DAS kernels' self-check for "
                                "one variant and print {\"ok\": ..., \"reason\": ...}.")
    p.add_argument("spec", metavar="SPEC_JSON", type=json.loads,
                   help="the module's settings and the batch's layout (das_fused.spec_of)")
    return p


def check(args: argparse.Namespace) -> int:
    """Run the check; a kernel that fails to compile or run is a verdict, not a crash."""
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
