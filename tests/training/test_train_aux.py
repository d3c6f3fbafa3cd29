"""The authors' aux loss (``das_aux_loss``): L(real) + w * L(real + produced), in one process,
across two gloo ranks (DAS on the gathered batch), and in the training loop's log / NaN guard."""
from __future__ import annotations

import csv
import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
NUM_CLASSES = 6


def _cfg(**kw):
    from training.config import TrainConfig

    base = dict(backbone="small_cnn", pretrained=False, dim=16, loss="multisimilarity",
                miner="none", das=True, das_aux_loss=True, das_aux_weight=0.7,
                das_scale_bounds=[0.5, 2.0], das_shift_scale=0.1, seed=11)
    base.update(kw)
    return TrainConfig(**base).validate()


def _build(cfg):
    """Model, criterion and DAS exactly as the trainer builds them; BatchNorm on running
    statistics so that per-rank and whole-batch forward passes agree."""
    from training.run_state import build_components

    torch.manual_seed(0)
    model, criterion, das = build_components(cfg, NUM_CLASSES)
    model.eval()
    das.train()
    return model, criterion, das


def _batch():
    """A fixed global batch: 6 classes x 2 glyph-sized images, classes interleaved so each rank
    holds pieces of every class."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 * NUM_CLASSES, 1, 28, 28, generator=g)
    y = torch.arange(NUM_CLASSES).repeat(2)
    return x, y


def test_aux_loss_equals_real_plus_weighted_all_computed_directly():
    from training import distributed as D
    from training.step import aux_weight, compute_loss

    torch.set_num_threads(2)
    cfg = _cfg()
    assert aux_weight(cfg) == 0.7
    assert aux_weight(dataclasses.replace(cfg, das=False)) is None  # no copies, no aux term
    assert aux_weight(dataclasses.replace(cfg, das_aux_loss=False)) is None
    x, y = _batch()

    model, criterion, das = _build(cfg)
    parts: dict[str, torch.Tensor] = {}
    loss = compute_loss(model, criterion, das, x, y, info=D.DistInfo(), seed=5,
                        aux_weight=aux_weight(cfg), parts=parts)
    loss.backward()
    got_grads = [p.grad.clone() for p in model.parameters()]

    # the same step by hand: DAS on the real embeddings, then the two loss terms
    model2, criterion2, das2 = _build(cfg)
    emb = model2(x)
    all_emb, all_lab = das2(emb, y)
    assert torch.equal(all_emb[:len(y)], emb) and torch.equal(all_lab[:len(y)], y)
    real = criterion2(emb, y)
    everything = criterion2(all_emb, all_lab)
    expected = real + 0.7 * everything
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(parts["real"], real.detach())
    torch.testing.assert_close(parts["all"], everything.detach())
    # the two terms really differ (the produced copies matter), so the test can tell them apart
    assert abs(real.item() - everything.item()) > 1e-4
    expected.backward()
    for g, p in zip(got_grads, model2.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(das.frm, das2.frm, rtol=0, atol=0)  # DAS state updated once

    # without the aux loss the step is the plain loss on everything (unchanged behaviour)
    model3, criterion3, das3 = _build(cfg)
    plain = compute_loss(model3, criterion3, das3, x, y, info=D.DistInfo(), seed=5)
    torch.testing.assert_close(plain, everything, rtol=1e-6, atol=1e-7)


def _worker(rank: int, port: int, x: torch.Tensor, y: torch.Tensor, out: str):
    from training import distributed as D
    from training.step import aux_weight, compute_loss

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        cfg = _cfg()
        model, criterion, das = _build(cfg)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        n = len(x) // WORLD
        parts: dict[str, torch.Tensor] = {}
        loss = compute_loss(ddp, criterion, das, x[rank * n:(rank + 1) * n],
                            y[rank * n:(rank + 1) * n], info=D.DistInfo(rank, WORLD, rank), seed=9,
                            aux_weight=aux_weight(cfg), parts=parts)
        loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        torch.save({"loss": loss.detach(), "parts": parts, "grads": grads},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()



def test_aux_loss_on_two_gloo_ranks_uses_the_gathered_real_rows(tmp_path, free_port):
    """DAS runs on the gathered global batch, so the real part is its first B_global rows on
    every rank: the 2-rank loss, its terms and the gradients match one process."""
    from training import distributed as D
    from training.step import aux_weight, compute_loss

    x, y = _batch()
    mp.spawn(_worker, args=(free_port(), x, y, str(tmp_path)), nprocs=WORLD, join=True)

    cfg = _cfg()
    model, criterion, das = _build(cfg)
    parts: dict[str, torch.Tensor] = {}
    loss = compute_loss(model, criterion, das, x, y, info=D.DistInfo(), seed=9,
                        aux_weight=aux_weight(cfg), parts=parts)
    loss.backward()
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(got["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
        for k in ("real", "all"):
            torch.testing.assert_close(got["parts"][k], parts[k], rtol=1e-5, atol=1e-6)
        for k, p in model.named_parameters():
            g = p.grad
            torch.testing.assert_close(got["grads"][k], g, rtol=1e-4,
                                       atol=1e-4 * float(g.abs().max()), msg=lambda m, k=k: f"{k}: {m}")


def _tiny_train_cfg(root, out, **kw):
    from training.config import TrainConfig

    base = dict(dataset="omniglot", root=str(root), max_classes=8, cache_images=True,
                backbone="small_cnn", pretrained=False, dim=16, loss="multisimilarity",
                miner="none", das=True, das_aux_loss=True, das_aux_weight=0.5, epochs=1,
                lr=1e-3, batch_size=32, per_class=4, steps_per_epoch=2, eval_every=1,
                eval_clustering=False, eval_initial=False, export_onnx=False, tensorboard=False,
                progress=False, seed=3, device="cpu", amp="off", threads=2, out=str(out))
    base.update(kw)
    return TrainConfig(**base)


def test_training_logs_both_terms_and_nan_guard_names_them(tmp_path, omniglot_root):
    from training import train
    from training.data import load_splits
    from training.report import write_csv
    from training.trainer import NonFiniteLossError

    splits = dict(zip(("train_split", "test_split"),
                      load_splits("omniglot", omniglot_root, max_classes=8)))
    result = train(_tiny_train_cfg(omniglot_root, tmp_path / "run"), **splits)
    row = result.history[-1]
    # the epoch's mean loss is the mean real term plus w times the mean term on everything
    assert row["loss"] == pytest.approx(row["loss_real"] + 0.5 * row["loss_all"], rel=1e-6)
    assert row["loss_real"] != pytest.approx(row["loss_all"], rel=1e-4)
    with open(tmp_path / "run" / "log.csv") as fh:
        logged = list(csv.DictReader(fh))
    assert list(logged[0])[:5] == ["epoch", "steps", "loss", "loss_real", "loss_all"]
    assert float(logged[-1]["loss_real"]) == pytest.approx(row["loss_real"])
    assert float(logged[-1]["loss_all"]) == pytest.approx(row["loss_all"])
    # without the aux loss the log keeps its usual columns
    write_csv(tmp_path / "plain.csv", result.history,
              _tiny_train_cfg(omniglot_root, tmp_path / "run", das_aux_loss=False))
    assert (tmp_path / "plain.csv").read_text().split("\n")[0].startswith("epoch,steps,loss,lr,")

    # the NaN guard says which term broke (the step after a 1e30 learning-rate update)
    bad = _tiny_train_cfg(omniglot_root, tmp_path / "nan", lr=1e30, loss="contrastive",
                          miner="distance")
    with pytest.raises(NonFiniteLossError, match=r"loss is (nan|inf).*L\(real\) = .*"
                                                 r"L\(real \+ produced\) = .*aux weight 0\.5"):
        train(bad, **splits)
