"""The driver's one walk (``split_walk``) hands each shard exactly the files ``--shard i/n``
would have walked to, problems included, and a task reading its list sees what a walk sees."""
from __future__ import annotations

import os
from pathlib import Path

from embedder.folders import walk_gallery
from indexer.store.walk import read_file_list, shard_of, split_walk


def test_split_walk_lists_equal_per_shard_walks(tmp_path: Path, omniglot_gallery: Path) -> None:
    gallery = tmp_path / "g"
    gallery.mkdir()
    for f in sorted(omniglot_gallery.rglob("*.png"))[:90]:
        dst = gallery / f.relative_to(omniglot_gallery)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(f.read_bytes())
    (gallery / "odd dir.jpg").mkdir()                     # problems travel with the list
    os.symlink(gallery / "missing.png", gallery / "dangling.png")
    (gallery / "ünïcode label").mkdir()
    (gallery / "ünïcode label" / "a b.png").write_bytes(b"not a png")
    (gallery / ".thumbnails").mkdir()                     # hidden entries are not walked
    (gallery / ".thumbnails" / "t.png").write_bytes(sorted(omniglot_gallery.rglob("*.png"))[0].read_bytes())
    (gallery / "ünïcode label" / "._a b.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    lists = [tmp_path / "lists" / str(i) / "files.jsonl" for i in range(3)]
    for p in lists:
        p.parent.mkdir(parents=True)
    counts = split_walk(gallery, lists)
    walked = list(walk_gallery(gallery))
    assert sum(counts) == len(walked) > 90
    for i, p in enumerate(lists):
        mine = list(read_file_list(gallery, p))
        assert len(mine) == counts[i] > 0
        assert mine == [f for f in walked if shard_of(f.relpath, 3) == i]
    problems = {f.relpath: f.problem for f in walked if f.problem}
    assert set(problems) == {"odd dir.jpg", "dangling.png"}, problems
    assert not [f.relpath for f in walked if "/." in f"/{f.relpath}"]
