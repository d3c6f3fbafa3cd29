"""`indexer search --copies` on real bird photos (cub-dev, the default pretrained embedder): a
resized and re-encoded copy and a crop of a gallery photo find it marked as a copy; the other
photos of the species, and a new photo of it, are not copies; one image and a folder alike."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from PIL import Image

from indexer_testlib import run_cli


def test_copies_of_gallery_photos_are_marked_and_other_photos_are_not(tmp_path: Path, cub_root: Path,
                                                                       pretrained_onnx: Path) -> None:
    gallery, queries = tmp_path / "g", tmp_path / "q"
    species = sorted(p for p in cub_root.iterdir() if p.is_dir())[:2]
    for s in species:
        (gallery / s.name).mkdir(parents=True)
        photos = sorted(s.iterdir())
        for f in photos[:8]:
            (gallery / s.name / f.name).symlink_to(f)
    queries.mkdir()
    (queries / "new.jpg").symlink_to(sorted(species[0].iterdir())[8])        # not in the gallery
    original = sorted(species[0].iterdir())[0]
    im = Image.open(original).convert("RGB")
    w, h = im.size
    im.resize((int(w * 0.7), int(h * 0.7))).save(queries / "resized.jpg", quality=70)
    im.crop((int(w * 0.08), int(h * 0.08), int(w * 0.93), int(h * 0.93))).save(queries / "crop.jpg", quality=90)
    idx = tmp_path / "idx"
    run_cli("build", gallery, "--model", pretrained_onnx, "--out", idx, "--quiet")

    out = tmp_path / "r.csv"
    run_cli("search", queries, "--index", idx, "-k", "5", "--copies", "--out", out)
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    marked = {(r["query"], r["path"]) for r in rows if r["copy"] == "True"}
    assert marked == {("resized.jpg", f"{species[0].name}/{original.name}"),
                      ("crop.jpg", f"{species[0].name}/{original.name}")}, rows
    assert len(rows) == 15        # a new photo of the species: its hits checked, none a copy
    one = json.loads(run_cli("search", queries / "crop.jpg", "--index", idx, "-k", "3", "--copies", "--json").stdout)
    assert [h["copy"] for h in one] == [True, False, False] and one[0]["path"].endswith(original.name)
    assert "copy" not in json.loads(run_cli("search", queries / "crop.jpg", "--index", idx, "--json").stdout)[0]
    bad = run_cli("search", queries / "crop.jpg", "--index", idx, "--copies", "--box", "0,0,50,50", check=False)
    assert bad.returncode == 2 and "--copies checks whole images" in bad.stderr
