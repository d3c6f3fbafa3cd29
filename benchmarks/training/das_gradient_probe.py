"""How DAS changes the training step: the head's gradient with and without DAS on the same batches.

    python -m benchmarks.training.das_gradient_probe --root ../shared/data/omniglot --method triplet:distance

The PCA-initialised head on frozen features of the first half of the training classes (the
frozen benchmark's --validation setting); for each DAS setting, the gradient of
`step.compute_loss` w.r.t. the head on the same class-balanced batches is compared with the
baseline's: its norm relative to the baseline's and its cosine to it, averaged over batches.
"base (other draw)" repeats the baseline with other miner seeds: the noise floor of the cosine.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from embedder.cli import run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.training.das_gradient_probe"

SETTINGS = {
    "paper": {},
    "own": {"das_exclude_own_copies": True},
    "big": {"das_scale_bounds": [0.5, 2.0], "das_shift_scale": 1.0},
    "no detach": {"das_detach": False},
    "no detach + own": {"das_detach": False, "das_exclude_own_copies": True},
    "T = 1": {"das_num_produce": 1},
    "aux": {"das_aux_loss": True},
    "robust": {"das_preset": "robust"},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="class-folder dataset or Omniglot root")
    p.add_argument("--method", default="triplet:distance", help="loss:sampler")
    p.add_argument("--batches", type=int, default=30)
    return run_main(PROG, p, argv, handler=run)


def run(args: argparse.Namespace) -> int | None:

    import numpy as np
    import torch
    import torch.nn.functional as F

    from training import ClassBalancedBatchSampler, load_config
    from training.distributed import DistInfo
    from benchmarks.training.frozen_features import frozen_splits, pca_head
    from training.step import aux_weight, build_criterion, build_das, compute_loss

    torch.set_num_threads(1)
    train, _ = frozen_splits(args.root, progress=False)
    half = train.num_classes // 2
    train = train.subset_classes(list(range(half)))
    x_all, y_all = torch.from_numpy(train.features), torch.from_numpy(train.labels)
    loss, _, miner = args.method.partition(":")
    base = {"loss": loss, "miner": miner or "none", "dim": 128, "seed": 0}
    head = pca_head(train, 128)
    sampler = ClassBalancedBatchSampler(train.labels, batch_size=2 * min(56, half), per_class=2)
    batches = [torch.as_tensor(b) for b in sampler][:args.batches]

    def grads(cfg, offset: int) -> list[torch.Tensor]:
        das = build_das(cfg, half, True) if cfg.das else None
        crit = build_criterion(cfg, half)
        out = []
        for i, idx in enumerate(batches):
            head.zero_grad()
            compute_loss(head, crit, das, x_all[idx], y_all[idx], info=DistInfo(), seed=i + offset,
                         aux_weight=aux_weight(cfg),
                         exclude_own_copies=cfg.das_exclude_own_copies).backward()
            out.append(torch.cat([q.grad.flatten() for q in head.parameters()]).clone())
        return out

    g_base = grads(load_config(None, {**base, "das": False}), 0)
    rows = [("base (other draw)", grads(load_config(None, {**base, "das": False}), 1000))]
    rows += [(name, grads(load_config(None, {**base, "das": True, **opts}), 0))
             for name, opts in SETTINGS.items()]
    print(f"{args.method} on {args.root}, {len(batches)} batches, PCA-initialised head:\n")
    print("| DAS setting | gradient norm / baseline's | cosine to the baseline gradient |")
    print("|---|---:|---:|")
    for name, gs in rows:
        ratio = np.mean([float(g.norm() / b.norm()) for g, b in zip(gs, g_base)])
        cos = np.mean([float(F.cosine_similarity(g, b, dim=0)) for g, b in zip(gs, g_base)])
        print(f"| {name} | {ratio:.3f} | {cos:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
