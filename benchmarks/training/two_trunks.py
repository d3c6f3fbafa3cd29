"""Fine-tuning both trunks of the two-backbone default (issue 41, item 3): trained apart (the
README's two recipe runs) or jointly, one loss on their concatenated embedding.

    python -m benchmarks.training.two_trunks [--mode apart|joint|both] [--epochs 3] [--lr 1e-5]
        [--root ../shared/data/cub-dev/images] [--validation-classes 12] [--set KEY=VALUE ...]

Lite0 and Lite1 (configs/photos_finetune_cpu.toml, ``last:2`` trainable, trunk cache) share the
batch sampler, and each image's stored view is the same crop in both caches (seeded per image), so
``joint`` sees exactly the batches ``apart`` does. Prints R@1 / MAP@R of each trunk and of the
concatenation on the validation classes after every epoch. ``apart`` reproduces the two CLI runs
to the digit; ``--set das=true das_preset=robust`` adds DAS to each trunk's loss (``apart``), ``--xbm N``
a cross-batch memory.
Why not in the trainer: on the 12 validation species joint training gave what training apart
gives (docs/benchmarks/training-das.md, round 5).
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from embedder.cli import run_main

PROG = "python -m benchmarks.training.two_trunks"
BACKBONES = ("efficientnet_lite0", "efficientnet_lite1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("apart", "joint", "both"), default="joint",
                    help="apart: each trunk its own loss; joint: one loss on the concatenation; "
                         "both: the sum of the two")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5, help="backbone lr of both trunks")
    ap.add_argument("--root", default="../shared/data/cub-dev/images")
    ap.add_argument("--validation-classes", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--xbm", type=int, default=0, metavar="N",
                    help="apart: add a cross-batch memory of N embeddings per trunk (PML's CrossBatchMemory, MS "
                         "loss and miner; XBM, Wang et al. 2020): the batch's MS loss against the memory")
    ap.add_argument("--xbm-from", type=int, default=0, metavar="STEP",
                    help="the memory's loss counts from this step on (the memory fills from step 0)")
    ap.add_argument("--xbm-only", action="store_true", help="from --xbm-from on, the memory's loss alone")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more overrides of the recipe, for both trunks")
    return run_main(PROG, ap, argv, handler=_run)


def _run(a: argparse.Namespace) -> int:
    from embedder import keep_freed_memory
    from embedder.metrics import evaluate
    from training.config import load_config
    from training.distributed import DistInfo
    from training.finetune import carve_validation, prepare_inputs
    from training.run_state import RunState, build_datasets
    from training.step import aux_weight, compute_loss, step_seed

    keep_freed_memory()          # what `python -m training` does: 10x faster steps here
    torch.set_num_threads(2)
    sides = []
    for backbone in BACKBONES:
        cfg = load_config("configs/photos_finetune_cpu.toml", [
            f"backbone={backbone}", 'concat=""', f"backbone_lr={a.lr}", f"root={a.root}", f"seed={a.seed}",
            f"validation_classes={a.validation_classes}", "progress=false", *a.set])
        train_full, test_full = build_datasets(cfg)
        train, _, _, _ = carve_validation(train_full, test_full, cfg.validation_classes)
        state = RunState.build(cfg, train.labels, train.split.num_classes, torch.device("cpu"), None)
        sides.append((cfg, state, prepare_inputs(cfg, state, train_full, test_full, fresh=True)))
    labels = sides[0][2].train.labels
    if a.xbm and (a.mode != "apart" or any(cfg.das for cfg, _, _ in sides)):
        raise ValueError("--xbm: with --mode apart and without DAS")
    memories: list = [None, None]
    if a.xbm:
        from pytorch_metric_learning import losses, miners

        memories = [losses.CrossBatchMemory(losses.MultiSimilarityLoss(2.0, 40.0, 0.5), 1280, memory_size=a.xbm,
                                            miner=miners.MultiSimilarityMiner(0.1)) for _ in sides]
    sampler = sides[0][1].sampler

    @torch.no_grad()
    def report(epoch: int) -> None:
        outs = []
        for _, _, inp in sides:
            inp.net.eval()
            ds = inp.evaluate
            outs.append(torch.cat([inp.net(torch.stack([ds[j][0] for j in range(s, min(s + 128, len(ds)))]))
                                   for s in range(0, len(ds), 128)]).numpy())
            inp.net.train()
        cells = []
        for name, x in (("lite0", outs[0]), ("lite1", outs[1]), ("both", np.hstack(outs) / math.sqrt(2))):
            m = evaluate(x, sides[0][2].evaluate.labels, clustering=False)
            cells.append(f"{name} {100 * m['R@1']:.2f} / {100 * m['MAP@R']:.2f}")
        print(f"epoch {epoch}: " + "   ".join(cells), flush=True)

    report(0)
    step = 0
    for epoch in range(a.epochs):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        for _, _, inp in sides:
            inp.train.set_epoch(epoch)      # the same view index per image on both sides
        for idx in sampler:
            y = torch.as_tensor(labels[idx])
            xs = [torch.stack([inp.train[j][0] for j in idx]) for _, _, inp in sides]
            loss = torch.zeros(())
            if a.xbm:           # the trunk's MS loss on the batch (DAS off: compute_loss's), plus the memory's
                for (_, st, inp), x, memory in zip(sides, xs, memories):
                    emb = inp.net(x)
                    held = memory(emb, y)                               # enqueues the batch every step
                    part = st.criterion(emb, y)
                    loss = loss + (part if step < a.xbm_from else (0 if a.xbm_only else part) + held)
            elif a.mode in ("apart", "both"):
                loss = loss + sum(compute_loss(inp.net, st.criterion, st.das, x, y, info=DistInfo(),
                                               seed=step_seed(cfg, step), aux_weight=aux_weight(cfg))
                                  for (cfg, st, inp), x in zip(sides, xs))
            if a.mode in ("joint", "both"):
                cat = torch.cat([inp.net(x) for (_, _, inp), x in zip(sides, xs)], 1) / math.sqrt(2)
                loss = loss + sides[1][1].criterion(cat, y)
            for _, st, _ in sides:
                st.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for _, st, _ in sides:
                st.optimizer.step()
            step += 1
        print(f"  epoch {epoch + 1}: {time.perf_counter() - t0:.1f} s", flush=True)
        report(epoch + 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
