"""Training-test helpers: a recorder of the ops that would make a CUDA stream wait for the host."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops whose result size or value must be read on the host: on a GPU each one blocks until the
# device has caught up. Boolean-mask indexing goes through aten.index / index_put with a bool
# index (it calls nonzero inside).
_SYNC_OPS = {"aten::nonzero", "aten::_local_scalar_dense", "aten::masked_select",
             "aten::is_nonzero", "aten::equal", "aten::_unique2", "aten::unique_dim",
             "aten::unique_consecutive", "aten::masked_scatter"}


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


class HostSyncRecorder(TorchDispatchMode):
    """Records every dispatched op that syncs with the host (by name, in call order)."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _SYNC_OPS or (name in ("aten::index", "aten::index_put", "aten::index_put_")
                                 and _bool_index(args)):
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture()
def host_syncs():
    """``with host_syncs() as rec: ...`` then ``assert rec.syncs == []``."""

    @contextmanager
    def record():
        rec = HostSyncRecorder()
        with rec:
            yield rec

    return record
