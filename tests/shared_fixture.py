"""Session fixtures built once per test run, also under pytest-xdist (README's `-n auto`).

pytest-xdist gives each worker its own session, so a session fixture is built once per worker;
the indexes several modules read (on both workers) would be built twice. ``shared_fixture``
builds such a directory once, under the run's common temp folder, behind a file lock.
"""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

# The small exported model of a run (conftest's ``small_onnx``), handed to the Ray run's own
# pytest process by test_ray_netns.py, which would otherwise export it again.
SMALL_ONNX_ENV = "DAS_TEST_SMALL_ONNX"


def shared_fixture(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """``<the run's temp>/shared/<name>``, made once per run by ``build(path)``: under xdist by
    the first worker that asks (the others wait on its lock and reuse it), so an index the
    serving and the indexer modules both read is not built once per worker. Only for fixtures
    that tests read and never change. A build that failed is retried by the next asker."""
    base = factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)            # released when the file closes
        if not done.exists():
            if out.exists():
                shutil.rmtree(out)                  # what a failed build left
            build(out)
            done.touch()
    return out
