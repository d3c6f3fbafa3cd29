"""Where the test suite spends its CPU: a pytest plugin that records, per test, the CPU seconds of
its worker (user + system) and of the child processes it waited for, and a report by module.

pytest's ``--durations`` shows wall time, which on 2 shared cores is mostly contention; the
suite's goal (12 min on 2 cores) is bound by CPU seconds, so cuts are chosen on these:

    DAS_SUITE_CPU=/tmp/cpu python -m pytest -q -n auto -p benchmarks.suite_cpu
    python -m benchmarks.suite_cpu /tmp/cpu --top 30

Children are counted when they are reaped: a pool worker that a test leaves to the garbage
collector is counted in the test that next starts a process (the report lists such tests, whose
child seconds exceed their wall time, apart).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

from embedder.cli import run_main

ENV = "DAS_SUITE_CPU"
_out = None


def _cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """One JSON line a test (setup + call + teardown) in ``$DAS_SUITE_CPU/cpu-<worker>.jsonl``."""
    global _out
    folder = os.environ.get(ENV)
    if folder and _out is None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _out = open(Path(folder) / f"cpu-{worker}-{os.getpid()}.jsonl", "a")
    (s0, c0), t0 = _cpu(), time.monotonic()
    yield
    if _out is not None:
        (s1, c1), wall = _cpu(), time.monotonic() - t0
        _out.write(json.dumps({"id": item.nodeid, "self": s1 - s0, "child": c1 - c0, "wall": wall}) + "\n")
        _out.flush()


def report(folder: Path, top: int) -> str:
    rows = [json.loads(line) for f in sorted(folder.glob("cpu-*.jsonl")) for line in f.open()]
    if not rows:
        raise FileNotFoundError(f"{folder}: no cpu-*.jsonl here (run pytest with {ENV}={folder} -p benchmarks.suite_cpu)")
    by_module: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for r in rows:
        m = by_module[r["id"].split("::")[0]]
        m[0] += r["self"]
        m[1] += r["child"]
        m[2] += r["wall"]
        m[3] += 1
    total = sum(r["self"] + r["child"] for r in rows)
    lines = [f"{len(rows)} tests, {total:.0f} CPU-s (self {sum(r['self'] for r in rows):.0f}, "
             f"children {sum(r['child'] for r in rows):.0f})", "",
             "| module | CPU-s | self | children | wall s | tests |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, (me, kids, wall, n) in sorted(by_module.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]:
        lines.append(f"| `{name}` | {me + kids:.1f} | {me:.1f} | {kids:.1f} | {wall:.1f} | {n} |")
    late = [r for r in rows if r["child"] > r["wall"] + 5]
    if late:
        lines += ["", "Reaped others' children (child CPU-s > their wall time): "
                  + ", ".join(f"{r['id']} {r['child']:.0f}" for r in late)]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help=f"the folder {ENV} pointed at during the pytest run")
    p.add_argument("--top", type=int, default=30, help="modules listed, most CPU first")
    return p


def main(argv=None) -> int:
    return run_main("python -m benchmarks.suite_cpu", build_parser(), argv,
                    handler=lambda args: print(report(args.folder, args.top)))


if __name__ == "__main__":
    sys.exit(main())
