"""What `python -m training`'s malloc policy (``embedder.keep_freed_memory``) buys on a CPU.

    python -m benchmarks.training.malloc_policy [--rounds 2] [--steps 3] [--batch 32]

The CPU photo recipe's network (EfficientNet-Lite1, GeM p = 4, 224 px, ImageNet weights): forward
passes without gradients (what the trunk cache computes for every photo and view) and training
steps (forward + backward of the whole network), each in a fresh process, glibc's default policy
and the kept one alternating round by round; seconds per step, CPU seconds in the kernel, page
faults. Why: glibc maps every block above its 32 MB ceiling anew and the kernel faults in and
zeroes each page of it; a batch's activations are such blocks, every step.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from embedder.cli import run_main

PROG = "python -m benchmarks.training.malloc_policy"
POLICIES = ("glibc default", "kept (python -m training)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="processes per policy, alternating")
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each kind (after one warm-up)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
    return run_main(PROG, ap, argv, handler=run)


def _steps(fn, n: int) -> dict[str, float]:
    fn()                                                # warm-up: weights, first allocations
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(n):
        fn()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"s": (time.perf_counter() - t0) / n, "sys": (r1.ru_stime - r0.ru_stime) / n,
            "faults": (r1.ru_minflt - r0.ru_minflt) / n}


def child(a: argparse.Namespace) -> dict:
    import torch

    from embedder import Embedder, EmbedderConfig, keep_freed_memory

    if a.child == POLICIES[1]:
        keep_freed_memory()
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    net = Embedder(EmbedderConfig(backbone="efficientnet_lite1", pretrained=True, pooling="gem",
                                  gem_p=4.0, dim=0))
    x = torch.randn(a.batch, 3, 224, 224)

    def forward():
        with torch.no_grad():
            net.eval()(x)

    def train_step():
        net.train()(x).sum().backward()

    return {"forward": _steps(forward, a.steps), "training step": _steps(train_step, a.steps)}


def run(a: argparse.Namespace) -> int:
    if a.child:
        print(json.dumps(child(a)))
        return 0
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for _ in range(a.rounds):
        for p in POLICIES:
            out = subprocess.run([sys.executable, "-m", "benchmarks.training.malloc_policy", "--child", p,
                                  "--steps", str(a.steps), "--batch", str(a.batch),
                                  "--threads", str(a.threads)], check=True, capture_output=True, text=True)
            runs[p].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"Lite1 GeM4 at batch {a.batch}, {a.threads} threads, {a.rounds} processes per policy "
          f"x {a.steps} steps (mean)\n")
    print("| step | policy | s / step | kernel CPU-s / step | page faults / step | speed vs default |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for kind in ("forward", "training step"):
        mean = {p: {k: sum(r[kind][k] for r in runs[p]) / len(runs[p]) for k in ("s", "sys", "faults")}
                for p in POLICIES}
        for p in POLICIES:
            m = mean[p]
            print(f"| {kind} | {p} | {m['s']:.2f} | {m['sys']:.2f} | {m['faults']:,.0f} | "
                  f"{mean[POLICIES[0]]['s'] / m['s']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
