"""Class-balanced batches: `per_class` images from each of `batch_size / per_class` classes.

SPC-n sampling (Roth et al., the paper's supplementary C): an epoch has ``N // batch_size`` batches
(``ceil`` without ``drop_last``); classes come in a fresh random order, restarted when all were used
(never repeated within a batch); each class hands out its own shuffled queue, reshuffled when empty.
A class with fewer than `per_class` images repeats some in its batch (as pytorch-metric-learning's
MPerClassSampler draws with replacement): a team's folder of two photos trains beside folders of
fifty instead of stopping the run; its images are augmented afresh each time. All is drawn from a
generator seeded with ``(seed, epoch)``; `state_dict()` adds the batches already handed out, so
`load_state_dict` resumes right there.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = ["ClassBalancedBatchSampler"]


class ClassBalancedBatchSampler(Sampler[list[int]]):
    """Batch sampler (for ``DataLoader(batch_sampler=...)``) with `per_class` images per class."""

    def __init__(self, labels: Sequence[int] | np.ndarray | torch.Tensor, batch_size: int = 112,
                 per_class: int = 2, seed: int = 0, drop_last: bool = True) -> None:
        labels = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
        if labels.ndim != 1 or len(labels) == 0:
            raise ValueError(f"labels: expected a non-empty 1-D sequence, got shape {labels.shape}")
        if per_class < 1:
            raise ValueError(f"per_class={per_class}: expected >= 1")
        if batch_size < per_class or batch_size % per_class:
            raise ValueError(f"batch_size={batch_size}: expected a positive multiple of "
                             f"per_class={per_class}")
        groups: dict[object, list[int]] = defaultdict(list)
        for i, y in enumerate(labels.tolist()):
            groups[y].append(i)
        #: classes with fewer than per_class images ({label: count}): repeated within their batch
        self.repeated = {y: len(ix) for y, ix in groups.items() if len(ix) < per_class}
        self.classes_per_batch = batch_size // per_class
        if self.classes_per_batch > len(groups):
            raise ValueError(f"batch_size={batch_size} with per_class={per_class} needs "
                             f"{self.classes_per_batch} classes per batch, but labels have only "
                             f"{len(groups)} (a batch_size of at most {len(groups) * per_class}, "
                             f"more training classes, or the trainer's fit_batch = true)")
        self.batch_size, self.per_class = int(batch_size), int(per_class)
        self.seed, self.drop_last = int(seed), bool(drop_last)
        self._groups = [np.asarray(ix) for _, ix in sorted(groups.items(), key=lambda kv: kv[1][0])]
        self.num_samples = len(labels)
        self.epoch = 0
        self._resume = 0        # batches of `epoch` to skip on the next iteration
        self._done = 0          # batches handed out so far in `epoch`

    def __len__(self) -> int:
        n, rest = divmod(self.num_samples, self.batch_size)
        return max(n + int(bool(rest) and not self.drop_last), 1)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch (its batches depend only on seed and epoch); resets resume."""
        if epoch != self.epoch:
            self._resume = 0
        self.epoch = int(epoch)

    def state_dict(self) -> dict:
        """Exact resume point. With a prefetching DataLoader, set "batches_done" to the number
        of batches the trainer actually consumed before saving."""
        return {"seed": self.seed, "epoch": self.epoch, "batches_done": self._done,
                "batch_size": self.batch_size, "per_class": self.per_class}

    def load_state_dict(self, state: dict) -> None:
        for key in ("batch_size", "per_class"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(f"state_dict {key}={state[key]} does not match this sampler's "
                                 f"{getattr(self, key)}")
        self.seed, self.epoch = int(state["seed"]), int(state["epoch"])
        self._resume = self._done = int(state["batches_done"])

    def batches(self, epoch: int) -> list[list[int]]:
        """All batches of `epoch` (deterministic in (seed, epoch))."""
        rng = np.random.default_rng([self.seed, epoch])
        n_batches = len(self)
        last_size = self.batch_size
        if not self.drop_last and self.num_samples % self.batch_size and \
                self.num_samples >= self.batch_size:
            last_size = (self.num_samples % self.batch_size) // self.per_class * self.per_class
        class_queue: list[int] = []
        image_queues: list[list[int]] = [[] for _ in self._groups]
        out = []
        for b in range(n_batches):
            size = last_size if b == n_batches - 1 else self.batch_size
            need = max(size // self.per_class, 1)
            chosen: list[int] = []
            while len(chosen) < need:
                if not class_queue:
                    fresh = rng.permutation(len(self._groups)).tolist()
                    # a new round must not hand out a class this batch already has
                    class_queue = [c for c in fresh if c not in chosen] + \
                                  [c for c in fresh if c in chosen]
                c = class_queue.pop(0)
                if c in chosen:          # only possible right after a round boundary
                    class_queue.append(c)
                    continue
                chosen.append(c)
            batch = []
            for c in chosen:
                q = image_queues[c]
                if len(q) < self.per_class:
                    q.extend([i for i in rng.permutation(self._groups[c]).tolist() if i not in q])
                    while len(q) < self.per_class:      # a class smaller than per_class repeats
                        q.extend(rng.permutation(self._groups[c]).tolist())
                batch.extend(q[:self.per_class])
                del q[:self.per_class]
            out.append(batch)
        return out

    def __iter__(self) -> Iterator[list[int]]:
        start, self._resume = self._resume, 0
        self._done = start
        for batch in self.batches(self.epoch)[start:]:
            self._done += 1
            yield batch
