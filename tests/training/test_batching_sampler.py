"""Class-balanced batches, on Omniglot's real label structure and on edge cases."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from training.batching import ClassBalancedBatchSampler


@pytest.fixture(scope="module")
def omniglot_labels(omniglot_root):
    """One label per real Omniglot image (964 characters x 20 drawings)."""
    base = omniglot_root / "images_background"
    chars = sorted(c for a in base.iterdir() if a.is_dir() for c in a.iterdir() if c.is_dir())
    labels = [i for i, c in enumerate(chars) for _ in c.glob("*.png")]
    assert len(chars) == 964 and len(labels) == 964 * 20
    return np.asarray(labels)


def test_batches_are_class_balanced_on_omniglot(omniglot_labels):
    s = ClassBalancedBatchSampler(omniglot_labels, batch_size=112, per_class=2, seed=0)
    batches = list(s)
    assert len(batches) == len(s) == len(omniglot_labels) // 112
    seen = Counter()
    for b in batches:
        assert len(b) == 112 and len(set(b)) == 112               # no repeated image
        per_class = Counter(omniglot_labels[b].tolist())
        assert len(per_class) == 56 and set(per_class.values()) == {2}
        seen.update(b)
    # an epoch shows ~every image once: nothing twice, ~all present
    assert max(seen.values()) == 1 and len(seen) == len(batches) * 112
    # classes visited in rounds: counts of classes per epoch differ by at most one round
    class_counts = Counter(omniglot_labels[list(seen)].tolist())
    assert max(class_counts.values()) - min(class_counts.values()) <= 2


def test_deterministic_per_seed_and_epoch(omniglot_labels):
    a = ClassBalancedBatchSampler(omniglot_labels, seed=3)
    b = ClassBalancedBatchSampler(omniglot_labels, seed=3)
    assert list(a) == list(b)
    a.set_epoch(1)
    b.set_epoch(1)
    e1 = list(a)
    assert e1 == list(b)
    a.set_epoch(0)
    assert list(a) != e1                                          # a fresh order per epoch
    assert list(ClassBalancedBatchSampler(omniglot_labels, seed=4)) != list(b)


def test_state_dict_resumes_mid_epoch():
    labels = np.repeat(np.arange(30), 4)
    s = ClassBalancedBatchSampler(labels, batch_size=12, per_class=3, seed=7)
    s.set_epoch(2)
    full = s.batches(2)
    it = iter(s)
    first = [next(it) for _ in range(4)]
    state = s.state_dict()
    assert state["epoch"] == 2 and state["batches_done"] == 4
    r = ClassBalancedBatchSampler(labels, batch_size=12, per_class=3, seed=0)
    r.load_state_dict(state)
    rest = list(r)
    assert first + rest == full
    assert list(r) == full                                        # later passes start at 0
    with pytest.raises(ValueError, match="per_class"):
        ClassBalancedBatchSampler(labels, batch_size=12, per_class=2).load_state_dict(state)


def test_works_as_dataloader_batch_sampler():
    labels = torch.arange(10).repeat_interleave(3)
    data = torch.utils.data.TensorDataset(torch.arange(30), labels)
    loader = torch.utils.data.DataLoader(
        data, batch_sampler=ClassBalancedBatchSampler(labels, batch_size=6, per_class=2))
    for idx, lab in loader:
        assert len(idx) == 6 and sorted(Counter(lab.tolist()).values()) == [2, 2, 2]


def test_small_classes_reuse_images_without_repeating_in_a_batch():
    labels = np.repeat(np.arange(4), 3)                          # 3 images per class
    s = ClassBalancedBatchSampler(labels, batch_size=8, per_class=2, seed=1, drop_last=False)
    for epoch in range(5):
        s.set_epoch(epoch)
        for b in s:
            assert len(set(b)) == len(b)
            assert all(v == 2 for v in Counter(labels[b].tolist()).values())


def test_drop_last_false_gives_a_short_last_batch():
    labels = np.repeat(np.arange(10), 5)                         # 50 images
    s = ClassBalancedBatchSampler(labels, batch_size=8, per_class=2, drop_last=False)
    batches = list(s)
    assert len(s) == len(batches) == 7 and len(batches[-1]) == 2


@pytest.mark.parametrize("kwargs, match", [
    ({"labels": [0, 0, 1, 1], "batch_size": 6}, r"needs 3 classes per batch.*a batch_size of at most 4"),
    ({"labels": [0, 0, 1, 1], "batch_size": 3}, "multiple of per_class"),
    ({"labels": [], "batch_size": 2}, "non-empty"),
    ({"labels": [0, 0], "per_class": 0}, "per_class=0"),
])
def test_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClassBalancedBatchSampler(**{"batch_size": 4, **kwargs})


def test_a_class_smaller_than_per_class_repeats_its_images_in_its_batch():
    """As pytorch-metric-learning's MPerClassSampler: a class of 1 or 3 images beside classes of 6
    fills its per_class places by repeating its images; the others never repeat within a batch,
    and the batches are the same for the same seed."""
    labels = np.array([0] * 6 + [1] + [2] * 3 + [3] * 6)
    s = ClassBalancedBatchSampler(labels, batch_size=8, per_class=4, seed=3)
    assert s.repeated == {1: 1, 2: 3}
    seen = set()
    for b in s.batches(0) + s.batches(1):
        counts = Counter(labels[b].tolist())
        assert len(b) == 8 and set(counts.values()) == {4}
        for c in counts:
            mine = [i for i in b if labels[i] == c]
            assert len(set(mine)) == {0: 4, 1: 1, 2: 3, 3: 4}[c]      # repeats only where too few
            seen.add(c)
    assert seen == {0, 1, 2, 3}
    assert s.batches(2) == ClassBalancedBatchSampler(labels, batch_size=8, per_class=4, seed=3).batches(2)
