"""Baseline vs DAS on Omniglot with held-out classes, on CPU: same config and seeds, three losses.

    python benchmarks/omniglot_das.py --root ../shared/data/omniglot

For triplet [distance-weighted], margin [distance-weighted] and multi-similarity, trains the
small_cnn embedder with and without DAS for each seed, evaluates the *last* epoch on the
held-out classes (no test-set model selection), and prints / writes R@1/2/4/8, NMI and F1 as
mean +- standard deviation over seeds, plus DAS's time overhead per step as a ratio to the
baseline measured in the same run. `--root` is any Omniglot folder with images_background/
(and optionally images_evaluation/, then used as the test split).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

METRICS = ("R@1", "R@2", "R@4", "R@8", "NMI", "F1")


def parse_args(argv=None) -> argparse.Namespace:
    default_root = os.environ.get("DAS_OMNIGLOT", str(REPO.parent / "shared" / "data" / "omniglot"))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--root", default=default_root, help="Omniglot root (images_background/ inside)")
    p.add_argument("--methods", nargs="+", default=["triplet:distance", "margin:distance",
                                                     "multisimilarity:none"],
                   help="loss:miner pairs")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--classes", type=int, default=80,
                   help="first N classes of each split (train and held-out test)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=112)
    p.add_argument("--per-class", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--input-size", type=int, default=28)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--exclude-own-copies", action="store_true",
                   help="DAS runs: samplers never draw an anchor's own copies as positives "
                        "(TrainConfig.das_exclude_own_copies; not in the paper)")
    p.add_argument("--out", default=str(REPO / "bench_out" / "omniglot_das"), help="run directories")
    p.add_argument("--results", default=str(REPO / "benchmarks" / "RESULTS-training.md"),
                   help="Markdown file the results table is written to")
    return p.parse_args(argv)


def _mean_std(values: list[float]) -> tuple[float, float]:
    import numpy as np

    a = np.asarray(values, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def render(results: dict, args: argparse.Namespace, command: str, done: bool) -> str:
    lines = ["## Omniglot: baseline vs DAS (benchmarks/omniglot_das.py)", "",
             f"Command (from the repository root): `{command}`", "",
             f"Setup: small_cnn, {args.input_size} px, d = {args.dim}, first {args.classes} training "
             f"classes and first {args.classes} held-out classes (last 10 alphabets of "
             f"images_background/ unless images_evaluation/ exists), {args.epochs} epochs, Adam lr "
             f"{args.lr:g}, batch {args.batch_size} with {args.per_class} per class, DAS defaults "
             f"(T = 3, K = 4, Z = 10, r_s = r_b = 0.01{', own copies excluded from positives' if args.exclude_own_copies else ''}), seeds {', '.join(map(str, args.seeds))}; "
             f"metrics of the last epoch on the held-out classes, in %, mean +- std over seeds. "
             f"CPU: {platform.processor() or platform.machine()}, torch threads {args.threads}, "
             "machine shared with other jobs (timings are ratios within this run).", ""]
    if not done:
        lines += ["**Partial results: the run was still going when this was written.**", ""]
    lines += ["| loss [sampler] | DAS | " + " | ".join(METRICS) + " | s/step | DAS time ratio |",
              "|---|---|" + "---|" * (len(METRICS) + 2)]
    for method, by_das in results.items():
        base_step = None
        for das in ("off", "on"):
            runs = by_das.get(das, [])
            if not runs:
                continue
            cells = []
            for m in METRICS:
                mu, sd = _mean_std([100 * r["metrics"][m] for r in runs])
                cells.append(f"{mu:.2f} +- {sd:.2f}")
            step, _ = _mean_std([r["sec_per_step"] for r in runs])
            if das == "off":
                base_step = step
            ratio = f"{step / base_step:.2f}" if base_step else ""
            lines.append(f"| {method} | {'yes' if das == 'on' else 'no'} | " + " | ".join(cells)
                         + f" | {step:.3f} | {ratio} |")
    lines.append("")
    deltas = []
    for method, by_das in results.items():
        if by_das.get("off") and by_das.get("on") and len(by_das["on"]) == len(by_das["off"]):
            d = [100 * (a["metrics"]["R@1"] - b["metrics"]["R@1"])
                 for a, b in zip(by_das["on"], by_das["off"])]
            mu, sd = _mean_std(d)
            wins = sum(x > 0 for x in d)
            deltas.append(f"- {method}: R@1 DAS - baseline = {mu:+.2f} +- {sd:.2f} points "
                          f"(DAS better in {wins}/{len(d)} seeds)")
    if deltas:
        lines += ["Paired by seed:", ""] + deltas + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm.auto import tqdm

    from training.config import TrainConfig
    from training.data import DatasetLayoutError, load_splits
    from training.trainer import train

    torch.set_num_threads(args.threads)
    try:
        train_split, test_split = load_splits("omniglot", args.root, max_classes=args.classes)
    except DatasetLayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = ("python benchmarks/omniglot_das.py " + shlex.join(argv if argv is not None else sys.argv[1:])).rstrip()
    out = Path(args.out)
    results: dict[str, dict[str, list]] = {}
    jobs = [(m, das, s) for m in args.methods for das in (False, True) for s in args.seeds]
    t_start = time.time()
    for method, das, seed in tqdm(jobs, desc="benchmark runs"):
        loss, _, miner = method.partition(":")
        name = f"{loss}_{miner or 'none'}_{'das' if das else 'base'}_s{seed}"
        cfg = TrainConfig(dataset="omniglot", root=str(args.root), max_classes=args.classes,
                          cache_images=True, backbone="small_cnn", pretrained=False, dim=args.dim,
                          input_size=args.input_size, loss=loss, miner=miner or "none", das=das,
                          das_exclude_own_copies=args.exclude_own_copies,
                          epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                          per_class=args.per_class, eval_every=args.epochs, eval_initial=False,
                          export_onnx=False, tensorboard=False, progress=False, seed=seed,
                          device="cpu", amp="off", out=str(out / name))
        r = train(cfg, train_split=train_split, test_split=test_split)
        last = r.history[-1]
        secs = sum(h["seconds"] for h in r.history if h.get("loss") != "")
        entry = {"seed": seed, "metrics": r.last_metrics, "sec_per_step": secs / max(last["steps"], 1)}
        label = f"{loss} [{miner or 'none'}]"
        results.setdefault(label, {}).setdefault("on" if das else "off", []).append(entry)
        tqdm.write(f"{name}: R@1 {100 * r.last_metrics['R@1']:.2f} "
                   f"({entry['sec_per_step']:.3f} s/step)")
        Path(args.results).write_text(render(results, args, command, done=False))
        (out / "results.json").write_text(json.dumps(results, indent=2))
    text = render(results, args, command, done=True)
    text += f"Wall time: {(time.time() - t_start) / 60:.1f} min.\n"
    Path(args.results).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
