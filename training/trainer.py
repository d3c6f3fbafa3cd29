"""The training loop: paper recipe, DAS in the step, evaluation, exact resume, DDP, export.

One step is `step.compute_loss` (shared with the frozen-feature benchmark): ``emb = model(x)``;
in DDP the global batch is gathered; ``emb, lab = das(emb, y)`` when DAS is on; ``loss =
criterion(emb, lab)`` (with the authors' aux loss, ``criterion(real rows) + w * criterion(emb,
lab)``). Everything that a resumed run needs to
continue bit-exactly is in ``last.pt`` (model, optimiser, scheduler, criterion, DAS buffers and RNG,
sampler, every RNG state), stored as tensors/plain lists so ``torch.load(weights_only=True)``
reads it.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from . import distributed as D
from .config import TrainConfig
from .data import ImageDataset, Split, load_splits
from .device import amp_dtype, resolve_device
from .step import (BANK_TORCH_DTYPES, aux_weight, build_criterion, build_das,  # noqa: F401
                   compute_loss, step_seed)


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; continuing would only corrupt the weights."""


@dataclass
class TrainResult:
    run_dir: Path
    best_epoch: int
    best_metrics: dict[str, float]
    last_metrics: dict[str, float]
    initial_metrics: dict[str, float]
    history: list[dict[str, Any]]
    best_checkpoint: Path
    last_checkpoint: Path
    onnx_path: Path | None = None
    report: dict[str, Path] = field(default_factory=dict)
    device: str = ""           # the device trained on, e.g. "cuda:0"


# ---------------------------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------------------------
def build_preprocessing(cfg: TrainConfig):
    """The backbone's Preprocessing, with the config's input size / resize when given."""
    from embedder.preprocess import preprocessing_for

    pre = preprocessing_for(cfg.backbone)
    if cfg.input_size or cfg.resize:
        size = cfg.input_size or pre.input_size
        if cfg.resize:
            resize = cfg.resize
        else:  # keep the backbone's resize/crop ratio (256/224 for ImageNet, 32/28 for small_cnn)
            resize = round(size * pre.resize / pre.input_size)
        pre = dataclasses.replace(pre, input_size=size, resize=max(resize, size))
    return pre


def build_model(cfg: TrainConfig, normalize: bool = True) -> nn.Module:
    """The embedder described by the config (preprocessing from `build_preprocessing`)."""
    from embedder import Embedder, EmbedderConfig

    pre = build_preprocessing(cfg)
    return Embedder(EmbedderConfig(backbone=cfg.backbone, dim=cfg.dim, pooling=cfg.pooling,
                                   normalize=normalize, pretrained=cfg.pretrained,
                                   frozen_bn=cfg.frozen_bn), pre)


def build_components(cfg: TrainConfig, num_classes: int):
    """(model, criterion, das or None, batch sampler factory) -- what a config must be able to
    build without any data (the configs test walks every file through this)."""
    criterion = build_criterion(cfg, num_classes)
    normalize = bool(getattr(criterion, "normalize", True))
    model = build_model(cfg, normalize)
    das = build_das(cfg, num_classes, normalize) if cfg.das else None
    return model, criterion, das


def build_optimizer(cfg: TrainConfig, model: nn.Module, criterion: nn.Module):
    """Adam over the model at `lr`, plus the criterion's own groups (betas, proxies) at theirs."""
    groups: list[dict] = [{"params": [p for p in model.parameters() if p.requires_grad],
                           "lr": cfg.lr, "name": "model"}]
    extra = criterion.param_groups() if hasattr(criterion, "param_groups") else []
    for i, g in enumerate(extra):
        g = dict(g)
        g["params"] = list(g["params"])
        g.setdefault("name", f"criterion{i}")
        groups.append(g)
    opt = torch.optim.Adam(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=cfg.milestones(), gamma=cfg.lr_gamma)
    return opt, sched


@torch.no_grad()
def embed_dataset(model: nn.Module, dataset: ImageDataset, device: torch.device, batch_size: int,
                  autocast_dtype: torch.dtype | None = None, workers: int = 0,
                  channels_last: bool = False) -> np.ndarray:
    was_training = model.training
    model.eval()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers)
    out = []
    for x, _ in loader:
        x = x.to(device, non_blocking=True)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if autocast_dtype is not None:
            with torch.autocast(device_type=device.type, dtype=autocast_dtype):
                e = model(x)
        else:
            e = model(x)
        out.append(e.float().cpu().numpy())
    model.train(was_training)
    return np.concatenate(out, axis=0)


def evaluate_model(model: nn.Module, dataset: ImageDataset, cfg: TrainConfig, device: torch.device,
                   autocast_dtype: torch.dtype | None = None) -> dict[str, float]:
    """R@k, NMI, F1, MAP@R on the test split (embedder.metrics), without touching the training
    RNG streams, so evaluating more or less often never changes the trajectory."""
    from embedder.metrics import evaluate

    with D.seeded_rng(cfg.seed + 99_991, device):
        emb = embed_dataset(model, dataset, device, cfg.eval_batch_size, autocast_dtype,
                            cfg.workers, cfg.channels_last and device.type == "cuda")
        metrics = evaluate(emb, dataset.labels, ks=tuple(cfg.eval_ks),
                           clustering=cfg.eval_clustering, seed=cfg.seed)
    return {k: float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------------------------------------
# RNG state as checkpoint-safe values
# ---------------------------------------------------------------------------------------------
def rng_state(device: torch.device) -> dict[str, Any]:
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]),
                  int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    p = state["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# logging
# ---------------------------------------------------------------------------------------------
def _metric_columns(cfg: TrainConfig) -> list[str]:
    cols = [f"R@{k}" for k in cfg.eval_ks]
    if cfg.eval_clustering:
        cols += ["NMI", "F1"]
    return cols + ["MAP@R"]


#: Per-epoch mean loss terms logged next to "loss" when the aux loss is on.
AUX_COLUMNS = ("loss_real", "loss_all")
_TRAIN_KEYS = ("epoch", "steps", "loss", "lr", "seconds") + AUX_COLUMNS


def write_csv(path: Path, history: list[dict[str, Any]], cfg: TrainConfig) -> None:
    aux = list(AUX_COLUMNS) if aux_weight(cfg) is not None else []
    cols = ["epoch", "steps", "loss"] + aux + ["lr", "seconds"] + _metric_columns(cfg)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for row in history:
            w.writerow({k: row.get(k, "") for k in cols})


def _tensorboard(run_dir: Path, enabled: bool):
    if not enabled:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard not installed: CSV only
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def _load_data(cfg: TrainConfig, pre) -> tuple[ImageDataset, ImageDataset]:
    train_split, test_split = load_splits(cfg.dataset, cfg.root, max_classes=cfg.max_classes,
                                          test_classes=cfg.test_classes,
                                          holdout_alphabets=cfg.holdout_alphabets)
    train_ds = ImageDataset(train_split, pre.train_transform(), pre.mode, cfg.cache_images)
    test_ds = ImageDataset(test_split, pre.eval_transform(), pre.mode, cfg.cache_images)
    return train_ds, test_ds


def _batch_sampler(cfg: TrainConfig, labels: np.ndarray):
    from .batching import ClassBalancedBatchSampler

    return ClassBalancedBatchSampler(labels, batch_size=cfg.batch_size, per_class=cfg.per_class,
                                     seed=cfg.seed, drop_last=True)


def train(cfg: TrainConfig, *, train_split: Split | None = None,
          test_split: Split | None = None) -> TrainResult:
    """Run (or resume) a training run described by `cfg`; returns where everything went.

    `train_split`/`test_split` replace the dataset named in the config (used by the benchmark
    to share one parsed split between runs).
    """
    from embedder import export_onnx, file_sha256, load_checkpoint, save_checkpoint
    from tqdm.auto import tqdm

    from .report import write_report

    cfg.validate()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    info = D.init_from_env("cuda" if (cfg.device.startswith("cuda") or (
        cfg.device == "auto" and torch.cuda.is_available())) else "cpu")
    device = resolve_device(cfg.device, info)
    if cfg.batch_size % info.world_size:
        raise ValueError(f"batch_size={cfg.batch_size} does not split over {info.world_size} ranks")
    ac_dtype = amp_dtype(cfg.amp, device)
    seed_everything(cfg.seed)
    run_dir = Path(cfg.out)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    # data
    pre = build_preprocessing(cfg)
    if train_split is not None and test_split is not None:
        train_ds = ImageDataset(train_split, pre.train_transform(), pre.mode, cfg.cache_images)
        test_ds = ImageDataset(test_split, pre.eval_transform(), pre.mode, cfg.cache_images)
    else:
        train_ds, test_ds = _load_data(cfg, pre)
    num_classes = train_ds.split.num_classes

    # model, loss, DAS, optimiser
    seed_everything(cfg.seed)
    model, criterion, das = build_components(cfg, num_classes)
    model.to(device)
    if cfg.channels_last and device.type == "cuda":
        model.to(memory_format=torch.channels_last)
    criterion.to(device)
    if das is not None:
        das.to(device)
    opt, sched = build_optimizer(cfg, model, criterion)
    scaler = torch.amp.GradScaler(device.type, enabled=ac_dtype == torch.float16)
    inner_sampler = _batch_sampler(cfg, train_ds.labels)
    batch_sampler = D.RankSlice(inner_sampler, info) if info.enabled else inner_sampler
    # Not persistent: fresh workers each epoch take their seeds from the global torch RNG, which
    # the checkpoint restores, so a resumed run augments exactly like an uninterrupted one.
    loader = DataLoader(train_ds, batch_sampler=batch_sampler, num_workers=cfg.workers,
                        pin_memory=device.type == "cuda")
    net: nn.Module = model
    if info.enabled:
        if cfg.sync_bn and device.type == "cuda" and not cfg.frozen_bn:
            # in place, reusing the same Parameters (the optimiser keeps them) and buffers, so
            # checkpoints still load into a plain Embedder
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        net = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)

    history: list[dict[str, Any]] = []
    best_epoch, best_metrics, initial_metrics = 0, {}, {}
    start_epoch, global_step = 0, 0
    last_path, best_path = run_dir / "last.pt", run_dir / "best.pt"

    if cfg.resume and last_path.is_file():
        ck = torch.load(last_path, map_location=device, weights_only=True)
        model.load_state_dict(ck["state_dict"])
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        criterion.load_state_dict(ck["criterion"])
        if das is not None and ck.get("das") is not None:
            das.load_state_dict(ck["das"])  # includes its generator state (extra state)
        if hasattr(inner_sampler, "load_state_dict") and ck.get("sampler") is not None:
            inner_sampler.load_state_dict(ck["sampler"])
        if ck.get("scaler"):
            scaler.load_state_dict(ck["scaler"])
        history = list(ck["history"])
        best_epoch, best_metrics = int(ck["best_epoch"]), dict(ck["best_metrics"])
        initial_metrics = dict(ck.get("initial_metrics") or {})
        start_epoch, global_step = int(ck["epoch"]), int(ck["global_step"])
        set_rng_state(ck["rng"], device)
        if info.is_main:
            print(f"resumed from {last_path} at epoch {start_epoch}")

    tb = _tensorboard(run_dir, cfg.tensorboard) if info.is_main else None

    if start_epoch == 0 and info.is_main and cfg.eval_initial and not history:
        initial_metrics = evaluate_model(model, test_ds, cfg, device, ac_dtype)
        history.append({"epoch": 0, "steps": 0, "loss": "", "lr": cfg.lr, "seconds": 0.0,
                        **initial_metrics})
    D.barrier(info)

    aux_w = aux_weight(cfg)
    net.train()
    for epoch in range(start_epoch, cfg.epochs):
        t0 = time.perf_counter()
        batch_sampler.set_epoch(epoch)
        n_batches = len(batch_sampler)
        if cfg.steps_per_epoch > 0:
            n_batches = min(n_batches, cfg.steps_per_epoch)
        bar = tqdm(total=n_batches, desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False,
                   disable=not (cfg.progress and info.is_main))
        loss_sum, n_steps = 0.0, 0
        part_sums = {k: 0.0 for k in AUX_COLUMNS}
        for x, y in loader:
            if n_steps >= n_batches:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if cfg.channels_last and device.type == "cuda":
                x = x.contiguous(memory_format=torch.channels_last)
            parts: dict[str, torch.Tensor] = {}
            loss = compute_loss(net, criterion, das, x, y, info=info,
                                seed=step_seed(cfg, global_step), autocast_dtype=ac_dtype,
                                aux_weight=aux_w, parts=parts,
                                exclude_own_copies=cfg.das_exclude_own_copies)
            if not torch.isfinite(loss):
                terms = ""
                if aux_w is not None:  # say which term broke: real only, or with DAS's copies
                    terms = (f"; L(real) = {parts['real'].item()}, L(real + produced) = "
                             f"{parts['all'].item()}, aux weight {aux_w}")
                raise NonFiniteLossError(
                    f"loss is {loss.item()} at epoch {epoch + 1}, step {n_steps + 1} "
                    f"(loss={cfg.loss}, lr={cfg.lr}, amp={cfg.amp}{terms}); lower the learning "
                    f"rate or disable mixed precision")
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if cfg.grad_clip > 0:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(opt)
            scaler.update()
            loss_sum += float(loss.detach())
            if aux_w is not None:
                part_sums["loss_real"] += float(parts["real"])
                part_sums["loss_all"] += float(parts["all"])
            n_steps += 1
            global_step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss_sum / n_steps:.4f}")
        bar.close()
        lr_used = opt.param_groups[0]["lr"]
        sched.step()
        row: dict[str, Any] = {"epoch": epoch + 1, "steps": global_step,
                               "loss": loss_sum / max(n_steps, 1), "lr": lr_used,
                               "seconds": time.perf_counter() - t0}
        if aux_w is not None:
            row.update({k: v / max(n_steps, 1) for k, v in part_sums.items()})
        last_epoch = epoch + 1 == cfg.epochs
        if info.is_main and ((epoch + 1) % cfg.eval_every == 0 or last_epoch):
            metrics = evaluate_model(model, test_ds, cfg, device, ac_dtype)
            row.update(metrics)
            if not best_metrics or metrics["R@1"] > best_metrics["R@1"]:
                best_epoch, best_metrics = epoch + 1, metrics
                save_checkpoint(best_path, model, epoch=epoch + 1, metrics=metrics,
                                train_config=cfg.to_dict(), classes=train_ds.split.classes)
        history.append(row)
        if info.is_main:
            save_checkpoint(
                last_path, model, epoch=epoch + 1, global_step=global_step,
                train_config=cfg.to_dict(), optimizer=opt.state_dict(),
                scheduler=sched.state_dict(), criterion=criterion.state_dict(),
                das=das.state_dict() if das is not None else None,
                sampler=inner_sampler.state_dict() if hasattr(inner_sampler, "state_dict") else None,
                scaler=scaler.state_dict() if scaler.is_enabled() else None,
                rng=rng_state(device), history=history, best_epoch=best_epoch,
                best_metrics=best_metrics, initial_metrics=initial_metrics)
            write_csv(run_dir / "log.csv", history, cfg)
            if tb is not None:
                tb.add_scalar("train/loss", row["loss"], epoch + 1)
                tb.add_scalar("train/lr", lr_used, epoch + 1)
                for k in AUX_COLUMNS:
                    if k in row:
                        tb.add_scalar(f"train/{k}", row[k], epoch + 1)
                for k, v in row.items():
                    if k not in _TRAIN_KEYS and v != "":
                        tb.add_scalar(f"test/{k}", v, epoch + 1)
            msg = f"epoch {epoch + 1}/{cfg.epochs} loss {row['loss']:.4f}"
            if aux_w is not None:
                msg += f" (real {row['loss_real']:.4f}, with DAS {row['loss_all']:.4f})"
            if "R@1" in row:
                msg += f" R@1 {row['R@1']:.4f}"
            if cfg.progress:
                print(msg, flush=True)
        D.barrier(info)
    if tb is not None:
        tb.close()

    result = TrainResult(run_dir=run_dir, best_epoch=best_epoch, best_metrics=best_metrics,
                         last_metrics=next((r for r in reversed(history) if "R@1" in r), {}),
                         initial_metrics=initial_metrics, history=history,
                         best_checkpoint=best_path, last_checkpoint=last_path,
                         device=str(device))
    if info.is_main:
        if not best_path.is_file():  # resumed a finished run whose best.pt was removed
            save_checkpoint(best_path, model, epoch=cfg.epochs, metrics={},
                            train_config=cfg.to_dict())
        if cfg.export_onnx:
            best_model, _ = load_checkpoint(best_path)
            n = min(cfg.parity_images, len(test_ds))
            picks = np.linspace(0, len(test_ds) - 1, n).round().astype(int) if n else []
            images = [test_ds.image(int(i)) for i in picks]
            result.onnx_path = export_onnx(best_model, run_dir / "model.onnx",
                                           source_hash=file_sha256(best_path),
                                           parity_images=images)
        frm = das.frm.detach().cpu().numpy() if das is not None and hasattr(das, "frm") else None
        result.report = write_report(run_dir, cfg, history, best_epoch, best_metrics,
                                     initial_metrics, frm, train_ds.split.classes)
    D.barrier(info)
    D.cleanup(info)
    return result
