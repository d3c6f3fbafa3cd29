"""Two gloo processes on CPU == one process on the same global batch (loss, gradients, DAS)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def _cfg():
    from training.config import TrainConfig

    return TrainConfig(backbone="small_cnn", pretrained=False, dim=32, loss="margin",
                       miner="distance", das=True, seed=5)


def _build(num_classes: int):
    from training.run_state import build_components

    torch.manual_seed(0)
    model, criterion, das = build_components(_cfg(), num_classes)
    # BatchNorm on running statistics: per-rank batch statistics are not the global batch's
    # (that is what SyncBatchNorm is for); everything else runs in training mode.
    model.eval()
    das.train()
    return model, criterion, das


def _grads(model, criterion) -> dict[str, torch.Tensor]:
    named = list(model.named_parameters()) + [(f"criterion.{n}", p) for n, p in criterion.named_parameters()]
    return {n: p.grad.detach().clone() for n, p in named if p.grad is not None}


def _worker(rank: int, ports: tuple[int, int], x: torch.Tensor, y: torch.Tensor, num_classes: int, out: str):
    from training import distributed as D
    from training.step import compute_loss

    torch.set_num_threads(1)
    # twice, each time in a new process group, as the two runs of a config with `concat` do
    for port, name in zip(ports, (f"rank{rank}.pt", f"rank{rank}-again.pt")):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        try:
            model, criterion, das = _build(num_classes)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            n = len(x) // WORLD
            loss = compute_loss(ddp, criterion, das, x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n],
                                info=D.DistInfo(rank, WORLD, rank), seed=1234)
            loss.backward()
            torch.save({"loss": loss.detach(), "grads": _grads(model, criterion),
                        "das": das.state_dict()}, Path(out) / name)
        finally:
            dist.destroy_process_group()



def test_two_rank_gloo_matches_single_process(tmp_path, omniglot_root, free_port):
    from embedder.preprocess import preprocessing_for
    from training import distributed as D
    from training.data import ImageDataset, load_splits
    from training.step import compute_loss

    train, _ = load_splits("omniglot", omniglot_root, max_classes=6)
    pre = preprocessing_for("small_cnn")
    ds = ImageDataset(train, pre.eval_transform(), pre.mode)
    # global batch: 6 classes x 2 images, interleaved so each rank holds pieces of every class
    idx = [int(np.flatnonzero(train.labels == c)[j]) for j in range(2) for c in range(6)]
    x = torch.stack([ds[i][0] for i in idx])
    y = torch.tensor([int(train.labels[i]) for i in idx])

    mp.spawn(_worker, args=((free_port(), free_port()), x, y, train.num_classes, str(tmp_path)), nprocs=WORLD,
             join=True)

    model, criterion, das = _build(train.num_classes)
    loss = compute_loss(model, criterion, das, x, y, info=D.DistInfo(), seed=1234)
    loss.backward()
    ref = _grads(model, criterion)
    assert any(k.startswith("criterion.") for k in ref)  # margin betas get gradients too
    for rank, again in [(r, a) for r in range(WORLD) for a in ("", "-again")]:
        got = torch.load(tmp_path / f"rank{rank}{again}.pt", weights_only=True)
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
        assert got["grads"].keys() == ref.keys()
        for k, g in ref.items():
            # not scaled by the world size, and every rank's slice receives its gradient
            # (atol relative to the tensor's scale: summation order differs between the runs)
            torch.testing.assert_close(got["grads"][k], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()),
                                       msg=lambda m, k=k: f"{k}: {m}")
        for k, v in das.state_dict().items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(got["das"][k], v, rtol=0, atol=1e-6, msg=f"das.{k}")
    assert das.frm.sum() == 12 * das.topk  # the FRM saw the whole global batch, once
