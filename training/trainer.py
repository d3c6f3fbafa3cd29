"""The training loop: paper recipe, DAS in the step, evaluation, exact resume, DDP, export.

The project's only training loop (benchmarks/training/frozen_table2.py runs it too). One step is
`step.compute_loss`; what a resumed run needs to continue bit-exactly is a `run_state.RunState`,
saved as ``last.pt`` after every epoch.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from . import distributed
from .config import TrainConfig
from .data import ImageDataset, Split
from .device import amp_dtype, resolve_device
from .device_batches import DeviceBatches, DeviceEvalSet
from .finetune import carve_validation, prepare_inputs
from .report import AUX_COLUMNS, EpochLogger
from .run_state import RunState, build_datasets
from .skips import Readable, SkipLog, UnreadableDataError, drain, filter_collate
from .step import aux_weight, compute_loss, step_seed


class NonFiniteLossError(FloatingPointError):
    """The loss became NaN or infinite; continuing would only corrupt the weights."""


@dataclass(frozen=True)
class PairResult:
    """Two backbones' runs joined (config ``concat``: training/runs.py)."""

    backbones: tuple[str, str]          # in the embedding's order: the front (cfg.concat) first
    metrics: dict[str, float]           # the joined embedder on the run's evaluation split
    initial: dict[str, float]           # the same before training ({} with eval_initial = false)
    front: "TrainResult"                # the second backbone's own run
    onnx_path: Path | None              # <out>/two.onnx (None with export_onnx = false)


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
    skipped: dict[str, str] = field(default_factory=dict)   # unreadable image -> reason
    skipped_file: Path | None = None                        # <run_dir>/skipped.jsonl
    pair: PairResult | None = None                          # with cfg.concat: both backbones joined


EVAL_EMBEDDINGS = "eval_embeddings.npz"   # train_run(keep_embeddings=True): "initial", "best", "labels"


@torch.no_grad()
def embed_split(model: nn.Module, dataset: ImageDataset, cfg: TrainConfig, device: torch.device,
                autocast_dtype: torch.dtype | None, skips: SkipLog) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings, labels) of the evaluation split, without touching the training RNG streams (how
    often one evaluates never changes the trajectory); unreadable images go to `skips`."""
    was_training = model.training
    model.eval()
    out, labels = [], []
    with distributed.seeded_rng(cfg.seed + 99_991, device):
        for x, y in _eval_batches(dataset, cfg, skips):
            labels.append(y)
            with torch.autocast(device_type=device.type, dtype=autocast_dtype,
                                enabled=autocast_dtype is not None):
                e = model(_on_device(x, device, cfg))
            out.append(e.float().cpu().numpy())
    model.train(was_training)
    y_all = np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64)
    if len(np.unique(y_all)) < 2:
        raise UnreadableDataError(
            f"evaluation: {len(y_all)} readable image(s) in {len(np.unique(y_all))} class(es) "
            f"of {len(dataset)} ({len(skips)} unreadable skipped so far); expected images "
            f"of at least 2 classes")
    return np.concatenate(out, axis=0), y_all


def split_metrics(x: np.ndarray, y: np.ndarray, cfg: TrainConfig) -> dict[str, float]:
    """R@k, NMI, F1, MAP@R of the evaluation split's embeddings (`embedder.metrics.evaluate`)."""
    from embedder.metrics import evaluate

    metrics = evaluate(x, y, ks=tuple(cfg.eval_ks), clustering=cfg.eval_clustering, seed=cfg.seed)
    return {k: float(v) for k, v in metrics.items()}


def store_embeddings(path: Path, name: str, x: np.ndarray, y: np.ndarray) -> None:
    """Store ``x`` as ``name`` (with ``labels``) in the npz at ``path``, beside what it holds
    already (a resumed run's earlier evaluations); replaced whole, never half-written."""
    held = dict(np.load(path)) if path.is_file() else {}
    held.update({name: x, "labels": y})
    tmp = path.with_name(path.stem + ".partial.npz")
    np.savez(tmp, **held)
    tmp.replace(path)


def _eval_batches(dataset: ImageDataset | DeviceEvalSet, cfg: TrainConfig, skips: SkipLog):
    """(inputs, labels as numpy) of the evaluation set: from device memory, or decoded by a
    DataLoader (unreadable images into `skips`)."""
    if isinstance(dataset, DeviceEvalSet):
        yield from dataset.batches(cfg.eval_batch_size)
        return
    loader = DataLoader(Readable(dataset), batch_size=cfg.eval_batch_size, shuffle=False,
                        num_workers=cfg.workers, collate_fn=filter_collate)
    for x, y, _ in drain(loader, skips):
        if x is not None:
            yield x, y.numpy()


def train_one_epoch(state: RunState, net: nn.Module, loader: DataLoader, cfg: TrainConfig,
                    epoch: int, info: distributed.DistInfo, autocast_dtype: torch.dtype | None) -> dict[str, Any]:
    """One epoch of steps (at most ``cfg.steps_per_epoch``); returns its log row (no metrics).
    ``net``: ``state.model`` or its DDP wrapper."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    device, opt, scaler = state.device, state.optimizer, state.scaler
    aux_w = aux_weight(cfg)
    loader.batch_sampler.set_epoch(epoch)
    if hasattr(loader.dataset, "set_epoch"):   # cached trunk: which stored view of each image
        loader.dataset.set_epoch(epoch)
    n_batches = len(loader.batch_sampler)
    if cfg.steps_per_epoch > 0:
        n_batches = min(n_batches, cfg.steps_per_epoch)
    bar = tqdm(total=n_batches, desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False,
               disable=not (cfg.progress and info.is_main))
    loss_sum, n_steps, n_seen, n_thin = 0.0, 0, 0, 0
    part_sums = {k: 0.0 for k in AUX_COLUMNS}
    for x, y, dropped in drain(loader, state.skips):
        if n_seen >= n_batches:
            break
        n_seen += 1
        if dropped and _too_thin(x, y, info, state.skips):
            n_thin += 1          # nothing to learn from: no step, the sampler moves on
            bar.update(1)
            continue
        x, y = _on_device(x, device, cfg), y.to(device, non_blocking=True)
        parts: dict[str, torch.Tensor] = {}
        loss = compute_loss(net, state.criterion, state.das, x, y, info=info,
                            seed=step_seed(cfg, state.global_step), autocast_dtype=autocast_dtype,
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
            nn.utils.clip_grad_norm_(state.model.parameters(), cfg.grad_clip)
        scaler.step(opt)
        scaler.update()
        loss_sum += float(loss.detach())
        if aux_w is not None:
            part_sums["loss_real"] += float(parts["real"])
            part_sums["loss_all"] += float(parts["all"])
        n_steps += 1
        state.global_step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_sum / n_steps:.4f}")
    bar.close()
    if n_steps == 0 and n_thin:
        raise UnreadableDataError(
            f"epoch {epoch + 1}: none of its {n_thin} batches had readable images of at least 2 "
            f"classes ({len(state.skips)} unreadable image(s) skipped, first: "
            f"{next(iter(state.skips.reasons))}); expected at least 2 readable classes")
    lr_used = opt.param_groups[0]["lr"]
    state.scheduler.step()
    row: dict[str, Any] = {"epoch": epoch + 1, "steps": state.global_step,
                           "loss": loss_sum / max(n_steps, 1), "lr": lr_used,
                           "seconds": time.perf_counter() - t0}
    if aux_w is not None:
        row.update({k: v / max(n_steps, 1) for k, v in part_sums.items()})
    return row


def _on_device(x: torch.Tensor, device: torch.device, cfg: TrainConfig) -> torch.Tensor:
    """A batch of inputs on the run's device (channels-last images on CUDA when configured)."""
    x = x.to(device, non_blocking=True)
    if cfg.channels_last and device.type == "cuda" and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x


def _too_thin(x: torch.Tensor | None, y: torch.Tensor | None, info: distributed.DistInfo,
              skips: SkipLog) -> bool:
    """A batch that lost unreadable images: True when the rest cannot make a step (no image, or
    one class); in DDP, where ranks must gather equal batches, an error naming the file."""
    if info.enabled:
        path, why = next(reversed(skips.reasons.items()))
        raise UnreadableDataError(
            f"{path}: {why}; a multi-process run cannot leave images out of its batches "
            f"(fix or remove the file, or use trunk_cache = true, which leaves it out up front)")
    return x is None or len(torch.unique(y)) < 2


def _distribute(state: RunState, net: nn.Module, cfg: TrainConfig, info: distributed.DistInfo) -> nn.Module:
    """`net` (``state.model`` or its trainable part), or its DDP wrapper in a multi-process run."""
    if not info.enabled:
        return net
    # SyncBN for the whole model only (frozen stages' BN is in eval mode anyway)
    if net is state.model and cfg.sync_bn and state.device.type == "cuda" and not cfg.frozen_bn:
        # in place, reusing the same Parameters (the optimiser keeps them) and buffers, so
        # checkpoints still load into a plain Embedder
        net = state.model = nn.SyncBatchNorm.convert_sync_batchnorm(state.model)
    return nn.parallel.DistributedDataParallel(
        net, device_ids=[state.device.index] if state.device.type == "cuda" else None)


def train_run(cfg: TrainConfig, *, train_split: Split | None = None,
              test_split: Split | None = None, keep_embeddings: bool = False) -> TrainResult:
    """Run (or resume) one backbone's run described by `cfg` (``cfg.concat`` is
    `training.runs.train`'s); returns where everything went. `train_split`/`test_split` replace
    the config's dataset (a benchmark shares one parse). `keep_embeddings`: the evaluation split's
    embeddings before training and of best.pt go to ``EVAL_EMBEDDINGS`` (a pair joins them)."""
    from embedder import save_checkpoint

    cfg.validate()
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    info = distributed.init_from_env("cuda" if (cfg.device.startswith("cuda") or (
        cfg.device == "auto" and torch.cuda.is_available())) else "cpu")
    device = resolve_device(cfg.device, info)
    if cfg.device_batches and info.enabled:    # before any image is decoded
        raise ValueError("device_batches=true runs in one process (it holds every image in one "
                         "device's memory); unset it for a multi-process run")
    if cfg.batch_size % info.world_size:
        raise ValueError(f"batch_size={cfg.batch_size} does not split over {info.world_size} ranks")
    ac_dtype = amp_dtype(cfg.amp, device)
    distributed.seed_everything(cfg.seed)
    run_dir = Path(cfg.out)
    last_path, best_path = run_dir / "last.pt", run_dir / "best.pt"
    train_full, test_full = build_datasets(cfg, train_split, test_split)   # a bad root: nothing written
    train_ds, test_ds, _, _ = carve_validation(train_full, test_full, cfg.validation_classes)
    counts = np.bincount(train_ds.labels, minlength=train_ds.split.num_classes)
    if (counts < cfg.per_class).any() and info.is_main:   # a batch takes per_class images of a class
        small = [f"{train_ds.split.classes[c]!r} ({n})" for c, n in enumerate(counts) if n < cfg.per_class]
        print(f"{len(small)} training class(es) with fewer than per_class={cfg.per_class} images: "
              f"{', '.join(small[:5])}{' ...' if len(small) > 5 else ''}; their images repeat in their "
              "batches, augmented afresh")
    if train_ds.split.num_classes < 2:            # a metric loss needs a negative: another class
        raise ValueError(f"{train_ds.split.num_classes} training class ({', '.join(train_ds.split.classes)}): metric "
                         f"learning needs two or more (negatives come from other classes); the split gives "
                         f"{test_ds.split.num_classes} to testing: add class folders")
    if (np.bincount(test_ds.labels) < 2).all():   # each query needs another image of its class
        raise ValueError(f"no test class holds two images or more ({len(test_ds.split.classes)} classes, e.g. "
                         f"{test_ds.split.classes[0]!r}): R@k needs another image of a query's class; add photos "
                         "to the test half's folders")
    # a loss or option that cannot be built: refused before anything is written
    state = RunState.build(cfg, train_ds.labels, train_ds.split.num_classes, device, ac_dtype)
    if info.is_main:   # eval_classes.txt: the split's own order (natural, case-insensitive), for galleries of it
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        (run_dir / "eval_classes.txt").write_text("".join(f"{c}\n" for c in test_ds.split.classes))
    if state.sampler.batch_size != cfg.batch_size and info.is_main:     # fit_batch's
        print(f"batch_size {cfg.batch_size} -> {state.sampler.batch_size}: {state.sampler.classes_per_batch} "
              f"training classes x per_class {cfg.per_class} (fit_batch)")
    if state.sampler.batch_size % info.world_size:
        raise ValueError(f"batch_size={state.sampler.batch_size} does not split over {info.world_size} ranks")
    resuming = cfg.resume and last_path.is_file()
    kept = run_dir / EVAL_EMBEDDINGS if keep_embeddings and info.is_main else None
    if kept is not None and not resuming:
        kept.unlink(missing_ok=True)              # an earlier run's, in the same directory
    inputs = prepare_inputs(cfg, state, train_full, test_full, fresh=not resuming)
    batches = distributed.RankSlice(state.sampler, info) if info.enabled else state.sampler
    # Not persistent: fresh workers each epoch take their seeds from the global torch RNG, which
    # the checkpoint restores, so a resumed run augments exactly like an uninterrupted one.
    # Unreadable images leave their batch (filter_collate) and are reported at the end.
    if isinstance(inputs.train, DeviceBatches):
        loader = inputs.train
    else:
        loader = DataLoader(Readable(inputs.train), batch_sampler=batches,
                            num_workers=cfg.workers, pin_memory=device.type == "cuda",
                            collate_fn=filter_collate)
    net = _distribute(state, inputs.net, cfg, info)
    if resuming:
        state.load_state_dict(torch.load(last_path, map_location=device, weights_only=True))
        if info.is_main:
            print(f"resumed from {last_path} at epoch {state.epoch}")
    logger = EpochLogger(run_dir, cfg, aux=aux_weight(cfg) is not None) if info.is_main else None
    if state.epoch == 0 and info.is_main and cfg.eval_initial and not state.history:
        x, y = embed_split(inputs.net, inputs.evaluate, cfg, device, ac_dtype, state.skips)
        state.initial_metrics = split_metrics(x, y, cfg)
        if kept is not None:
            store_embeddings(kept, "initial", x, y)
        state.history.append({"epoch": 0, "steps": 0, "loss": "", "lr": cfg.lr, "seconds": 0.0,
                              **state.initial_metrics})
    distributed.barrier(info)

    net.train()
    for epoch in range(state.epoch, cfg.epochs):
        row = train_one_epoch(state, net, loader, cfg, epoch, info, ac_dtype)
        if info.is_main and ((epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs):
            x, y = embed_split(inputs.net, inputs.evaluate, cfg, device, ac_dtype, state.skips)
            metrics = split_metrics(x, y, cfg)
            row.update(metrics)
            if state.record_best(epoch + 1, metrics):
                save_checkpoint(best_path, state.model, epoch=epoch + 1, metrics=metrics,
                                train_config=cfg.to_dict(), classes=train_ds.split.classes)
                if kept is not None:
                    store_embeddings(kept, "best", x, y)
        state.history.append(row)
        state.epoch = epoch + 1
        if info.is_main:
            save_checkpoint(last_path, state.model, train_config=cfg.to_dict(), **state.state_dict())
            logger.log(state.history)
        distributed.barrier(info)
    if logger is not None:
        logger.close()
    return _finish(cfg, state, run_dir, train_ds, test_ds, info)


def _parity_images(test_ds: ImageDataset, picks, skips: SkipLog) -> list:
    """The ONNX parity check's images: the picked test images that decode."""
    from embedder import ImageLoadError

    images = []
    for i in picks:
        try:
            images.append(test_ds.image(int(i)))
        except ImageLoadError as e:
            skips.add(e.path, e.reason)
    return images


def _finish(cfg: TrainConfig, state: RunState, run_dir: Path, train_ds: ImageDataset,
            test_ds: ImageDataset, info: distributed.DistInfo) -> TrainResult:
    """best.pt (always there), the ONNX export with its parity check, the report; then leave
    the process group."""
    from embedder import export_onnx, file_sha256, load_checkpoint, save_checkpoint

    from .report import write_report

    history = state.history
    result = TrainResult(run_dir=run_dir, best_epoch=state.best_epoch,
                         best_metrics=state.best_metrics,
                         last_metrics=next((r for r in reversed(history) if "R@1" in r), {}),
                         initial_metrics=state.initial_metrics, history=history,
                         best_checkpoint=run_dir / "best.pt", last_checkpoint=run_dir / "last.pt",
                         device=str(state.device), skipped=dict(state.skips.reasons))
    if info.is_main:
        best_path = result.best_checkpoint
        if not best_path.is_file():  # resumed a finished run whose best.pt was removed
            save_checkpoint(best_path, state.model, epoch=cfg.epochs, metrics={},
                            train_config=cfg.to_dict())
        if cfg.export_onnx:
            best_model, _ = load_checkpoint(best_path)
            n = min(cfg.parity_images, len(test_ds))
            picks = np.linspace(0, len(test_ds) - 1, n).round().astype(int) if n else []
            images = _parity_images(test_ds, picks, state.skips)
            result.onnx_path = export_onnx(best_model, run_dir / "model.onnx",
                                           source_hash=file_sha256(best_path),
                                           parity_images=images)
        frm = state.das.frm.detach().cpu().numpy() if hasattr(state.das, "frm") else None
        skips = state.skips
        skips.note_dead_classes(train_ds.split, "train")
        skips.note_dead_classes(test_ds.split, "validation" if cfg.validation_classes else "test")
        for line in skips.lines():
            print(line)
        result.skipped = dict(skips.reasons)
        result.skipped_file = skips.write(run_dir)
        result.report = write_report(run_dir, cfg, history, state.best_epoch, state.best_metrics,
                                     state.initial_metrics, frm, train_ds.split.classes,
                                     skipped=len(skips))
    distributed.barrier(info)
    distributed.cleanup(info)
    return result
