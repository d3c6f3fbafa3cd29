"""Unreadable images in a training run: found while decoding, left out, reported at the end.
Nothing is decoded up front: the trunk cache records its failed rows and the DataLoaders carry an
item's decode error in its batch (`filter_collate`). `SkipLog` collects them by path (first reason
wins) into ``skipped.jsonl``, the format of the indexer's ``report.jsonl``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from embedder.files import atomic_target
from embedder.images import ImageLoadError

from .data import DatasetLayoutError, Split

__all__ = ["Readable", "SkipLog", "UnreadableDataError", "filter_collate", "drain"]


class UnreadableDataError(DatasetLayoutError):
    """Too few readable images (or classes) are left to train or evaluate on."""


class SkipLog:
    """The images a run could not decode, by path, plus notes on classes left out; saved in
    ``last.pt`` so a resumed run still reports them."""

    def __init__(self) -> None:
        self.reasons: dict[str, str] = {}
        self.notes: list[str] = []

    def add(self, path: str | Path, reason: str) -> None:
        self.reasons.setdefault(str(path), reason)

    def note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)

    def __len__(self) -> int:
        return len(self.reasons)

    def readable(self, paths: Iterable[str | Path]) -> np.ndarray:
        """Boolean mask: which of `paths` are not known to be unreadable."""
        return np.asarray([str(p) not in self.reasons for p in paths], dtype=bool)

    def note_dead_classes(self, split: Split, which: str) -> None:
        """Note the classes of `split` whose every image is unreadable."""
        ok = self.readable(split.paths)
        for i, c in enumerate(split.classes):
            if (split.labels == i).any() and not ok[split.labels == i].any():
                self.note(f"class {c!r} ({which}): all {int((split.labels == i).sum())} images "
                          f"unreadable; dropped")

    def lines(self) -> list[str]:
        """What the run prints at its end: one ``skipped PATH: REASON`` line per file, then the
        notes on dropped classes."""
        return [f"skipped {p}: {r}" for p, r in self.reasons.items()] + self.notes

    def write(self, run_dir: str | Path) -> Path:
        """``skipped.jsonl`` (always written, empty when nothing was skipped, so a rerun in the
        same directory never leaves an earlier run's list behind)."""
        path = Path(run_dir) / "skipped.jsonl"
        with atomic_target(path) as tmp, open(tmp, "w") as f:
            for p, r in self.reasons.items():
                f.write(json.dumps({"path": p, "reason": r}) + "\n")
        return path

    def state_dict(self) -> dict[str, Any]:
        return {"paths": list(self.reasons), "reasons": list(self.reasons.values()),
                "notes": list(self.notes)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Merge a saved log into this one (failures found since are kept)."""
        if not state:
            return
        for p, r in zip(state.get("paths", []), state.get("reasons", [])):
            self.add(p, r)
        for line in state.get("notes", []):
            self.note(line)


class Readable(Dataset):
    """`dataset` (an `ImageDataset` or anything with the same ``__getitem__``) whose items are
    the decode error instead of raising it; `filter_collate` takes them out of the batch."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str):      # labels, split, set_epoch, ... of the wrapped set
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, i: int):
        try:
            return self.dataset[i]
        except ImageLoadError as e:
            return e


def filter_collate(items: list) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                         list[tuple[str, str]]]:
    """(inputs, labels, [(path, reason), ...]): readable items collated as usual, in the
    DataLoader's workers; inputs and labels are None when no item was readable."""
    bad = [(e.path, e.reason) for e in items if isinstance(e, ImageLoadError)]
    good = [t for t in items if not isinstance(t, ImageLoadError)]
    x, y = default_collate(good) if good else (None, None)
    return x, y, bad


def drain(loader: Iterable, log: SkipLog) -> Iterator[tuple[torch.Tensor | None,
                                                            torch.Tensor | None, int]]:
    """(inputs, labels, items dropped) of each batch of a `filter_collate` loader; the dropped
    items go into `log`."""
    for x, y, bad in loader:
        for p, r in bad:
            log.add(p, r)
        yield x, y, len(bad)
