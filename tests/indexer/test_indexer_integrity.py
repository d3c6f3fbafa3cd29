"""Damaged index files end in one line naming the file and the repair, never in a signal or a
traceback; and a reader keeps working while a writer in another process grows the LMDB map.

Each case damages a copy of a real index built by the CLI (Omniglot, small CNN), then runs the
commands a user would: ``indexer info``, ``indexer search`` and ``app.py`` startup."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from indexer_testlib import REPO, copy_characters, run_cli


def _truncate(path: Path, keep: float = 0.5) -> None:
    os.truncate(path, int(path.stat().st_size * keep))


def _garble(path: Path, offset_frac: float = 0.5, n: int = 64) -> None:
    """Overwrite ``n`` bytes in the middle with other bytes: same size, different content."""
    with open(path, "r+b") as f:
        f.seek(int(path.stat().st_size * offset_frac))
        old = f.read(n)
        f.seek(-len(old), os.SEEK_CUR)
        f.write(bytes((b + 1) % 256 for b in old))


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


DAMAGE = {
    "truncated data.mdb": ("store.lmdb/data.mdb", _truncate),
    "garbage data.mdb": ("store.lmdb/data.mdb", _garbage),
    "truncated index.faiss": ("index.faiss", _truncate),
    "garbled index.faiss": ("index.faiss", _garble),
    "missing index.faiss": ("index.faiss", lambda p: p.unlink()),
    "missing model.onnx": ("model.onnx", lambda p: p.unlink()),
}


def _app(index: Path, port: int) -> subprocess.CompletedProcess:
    """app.py on a damaged index must stop at startup; one that starts serving instead is
    stopped by the timeout (subprocess.run kills it) and fails the test."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "GRADIO_ANALYTICS_ENABLED": "False"}
    try:
        return subprocess.run([sys.executable, str(REPO / "app.py"), "--index", str(index), "--port", str(port)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"app.py started serving a damaged index ({index})")


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_index_file_stops_every_command_in_one_line(case, built_index, omniglot_gallery, tmp_path,
                                                            free_port):
    idx = tmp_path / "idx"
    shutil.copytree(built_index, idx, ignore=shutil.ignore_patterns("lock.mdb"))
    rel, damage = DAMAGE[case]
    damage(idx / rel)
    query = next(omniglot_gallery.rglob("*.png"))
    runs = {"info": run_cli("info", "--index", idx, check=False),
            "search": run_cli("search", query, "--index", idx, "-k", "3", check=False),
            "app.py": _app(idx, free_port())}
    for cmd, p in runs.items():
        assert p.returncode == 1, f"{case}: {cmd} exited {p.returncode} (negative: killed by a signal)\n{p.stderr[-2000:]}"
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr, f"{case}: {cmd}:\n{p.stderr[-2000:]}"
        assert Path(rel).name in lines[0] and "indexer build" in lines[0], f"{case}: {cmd}: {lines[0]}"
    if rel == "index.faiss":           # the command named, with the gallery the manifest recorded, works
        gallery = json.loads((idx / "manifest.json").read_text())["gallery"]
        fix = f"`python -m indexer build {gallery} --out {idx}` (the stored images are not embedded again)"
        assert all(fix in p.stderr for p in runs.values()), runs["search"].stderr
        assert "0 embedded" in run_cli("build", gallery, "--out", idx).stdout
        assert run_cli("search", query, "--index", idx, "-k", "3").returncode == 0


def test_manifest_records_and_info_verifies_the_faiss_checksum(built_index):
    m = json.loads((built_index / "manifest.json").read_text())
    rec = m["index_file"]
    assert rec["bytes"] == (built_index / "index.faiss").stat().st_size and len(rec["sha256"]) == 64
    out = run_cli("info", "--index", built_index).stdout
    assert f"sha256 {rec['sha256'][:16]} verified" in out


def test_add_updates_the_checksum(built_index, omniglot_root, tmp_path):
    idx = tmp_path / "idx"
    shutil.copytree(built_index, idx, ignore=shutil.ignore_patterns("lock.mdb"))
    before = json.loads((idx / "manifest.json").read_text())["index_file"]
    copy_characters(omniglot_root, tmp_path / "more", 1, per_char=5, skip_chars=40)
    run_cli("add", tmp_path / "more", "--index", idx, "--quiet")
    after = json.loads((idx / "manifest.json").read_text())["index_file"]
    assert after != before and after["bytes"] == (idx / "index.faiss").stat().st_size
    run_cli("info", "--index", idx)     # verifies the new checksum


_GROW = """
import hashlib, sys
from indexer.store.gallery import GalleryStore, NewItem
data = b"x" * int(sys.argv[2])
with GalleryStore(sys.argv[1], readonly=False) as w:
    w.put_items([NewItem("padding.png", None, data, hashlib.sha256(data).hexdigest(), 1, 1)])
"""


def test_reader_survives_a_writer_growing_the_map(built_index, tmp_path):
    """A reader whose mapping is smaller than the file becomes (LMDB's MapResizedError) keeps
    answering, and sees the writer's data: what a server does during `indexer add`."""
    from indexer.store.gallery import GalleryStore

    store_dir = tmp_path / "store.lmdb"
    shutil.copytree(built_index / "store.lmdb", store_dir, ignore=shutil.ignore_patterns("lock.mdb"))
    size = (store_dir / "data.mdb").stat().st_size
    reader = GalleryStore(store_dir, map_size=size + 64 * 1024)   # a mapping just above the data
    n = len(reader)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", _GROW, str(store_dir), str(4 * 1024 * 1024)], check=True, env=env,
                   timeout=120)
    assert (store_dir / "data.mdb").stat().st_size > size + 64 * 1024      # the file outgrew the mapping
    assert len(reader) == n + 1                                             # MapResizedError handled
    assert len(reader.get_bytes(reader.id_for_path("padding.png"))) == 4 * 1024 * 1024
    reader.close()
