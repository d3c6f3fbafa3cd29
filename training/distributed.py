"""DistributedDataParallel plumbing for ``torchrun --nproc_per_node=N -m training``.

Each rank embeds its slice of the global class-balanced batch; embeddings and labels are
gathered so DAS, miner and loss see the whole batch identically on every rank.
`torch.distributed.nn.functional.all_gather` sums each slice's gradient over the W ranks
(W * dL/dv_r) and DDP averages over W: exactly dL/dtheta, no loss scaling. The RNG helpers
(per-step seeding, checkpointable states) live here: identical draws per rank is their purpose.
"""
from __future__ import annotations

import contextlib
import os
import random
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Sampler


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_from_env(device_type: str) -> DistInfo:
    """Join the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK); single
    process otherwise. gloo on CPU, nccl on CUDA."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def gather_batch(emb: torch.Tensor, labels: torch.Tensor, info: DistInfo
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch in rank order: embeddings keep their autograd path, labels are plain."""
    if not info.enabled:
        return emb, labels
    from torch.distributed.nn.functional import all_gather

    with warnings.catch_warnings():
        # deprecated in favour of a private module (_functional_collectives); still the public
        # autograd-aware gather, and its backward sums each slice's gradient from every rank
        warnings.simplefilter("ignore", FutureWarning)
        # the group named at call time: all_gather's default is the group of its first import,
        # stale once a run's group is destroyed and the next run (config `concat`) makes another
        all_emb = torch.cat(all_gather(emb, group=dist.group.WORLD), dim=0)
    all_lab = [torch.empty_like(labels) for _ in range(info.world_size)]
    dist.all_gather(all_lab, labels)
    return all_emb, torch.cat(all_lab, dim=0)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def cleanup(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()


class RankSlice(Sampler[list[int]]):
    """This rank's contiguous slice of each global batch from an inner batch sampler, seeded
    identically on every rank (so all agree on the global batch)."""

    def __init__(self, inner, info: DistInfo):
        self.inner, self.info = inner, info

    def __iter__(self) -> Iterator[list[int]]:
        w, r = self.info.world_size, self.info.rank
        for batch in self.inner:
            if len(batch) % w:
                raise ValueError(f"global batch of {len(batch)} does not split over {w} ranks")
            n = len(batch) // w
            yield list(batch[r * n:(r + 1) * n])

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)


@contextlib.contextmanager
def seeded_rng(seed: int, device: torch.device | None = None):
    """Run a block on freshly seeded torch/numpy/python RNGs and restore the outer states after:
    miner and loss draws stay identical on every rank and independent of what else drew."""
    devices = [device] if device is not None and device.type == "cuda" else []
    np_state, py_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=devices):
        seed_everything(seed)
        try:
            yield
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every global RNG's state as checkpoint-safe values (tensors and plain lists, which
    ``torch.load(weights_only=True)`` reads)."""
    np_state, py_state = np.random.get_state(), random.getstate()
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
