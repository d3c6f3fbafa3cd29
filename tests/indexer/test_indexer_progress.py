"""build_index's on_done (what `--ray` counts progress with): every file found is reported once,
committed, unchanged, duplicate or skipped, on a fresh build and on a resumed one."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

from indexer_testlib import copy_characters
from indexer import build_index


def test_on_done_counts_every_file_once(tmp_path: Path, omniglot_root: Path, small_onnx: Path) -> None:
    gallery = tmp_path / "g"
    files = copy_characters(omniglot_root, gallery, 4)                  # 80 real images
    shutil.copy2(files[0], gallery / "copy_of_first.png")                # duplicate content
    (gallery / "broken.png").write_bytes(files[1].read_bytes()[:40])     # truncated: skipped
    counts: list[int] = []
    lock = threading.Lock()

    def on_done(k: int) -> None:
        with lock:                                                      # main and commit threads
            counts.append(k)

    out = tmp_path / "idx"
    m = build_index(gallery, out, small_onnx, progress=False, on_done=on_done, batch_size=8)
    ing = m["ingest"]
    assert ing["found"] == 82 and ing["duplicates"] == 1 and ing["skipped"] == 1, ing
    assert all(k > 0 for k in counts) and sum(counts) == 82

    # a rerun with new files: unchanged ones count too, nothing twice
    copy_characters(omniglot_root, gallery, 1, skip_chars=4)
    counts.clear()
    m = build_index(gallery, out, small_onnx, progress=False, on_done=on_done, batch_size=8)
    assert m["ingest"]["unchanged"] == 81 and m["ingest"]["new"] == 20, m["ingest"]
    assert sum(counts) == m["ingest"]["found"] == 102
