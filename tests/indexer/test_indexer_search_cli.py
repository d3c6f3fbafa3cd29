"""`indexer search` beyond one whole image (issue 42 item 3), through the real CLI on the shared
Omniglot index: a folder searched in batches into JSONL or CSV with bad files skipped and
reported, and `--box` searching one region of an image; bad options are one line."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from PIL import Image

from indexer_testlib import run_cli


def drawings(gallery: Path, n: int) -> list[Path]:
    return sorted(gallery.rglob("*.png"))[:n]


def query_folder(tmp_path: Path, gallery: Path) -> tuple[Path, list[Path]]:
    """3 gallery drawings (in a sub-folder too), a truncated PNG and a text file."""
    q = tmp_path / "queries"
    (q / "sub").mkdir(parents=True)
    picks = drawings(gallery, 41)[::20]                  # three characters
    for i, p in enumerate(picks):
        (q / ("sub" if i else "") / p.name).write_bytes(p.read_bytes())
    (q / "broken.png").write_bytes(picks[0].read_bytes()[:60])
    (q / "notes.txt").write_text("not an image")
    return q, picks


def test_a_folder_is_searched_into_jsonl_and_csv_bad_files_reported(tmp_path, built_index, omniglot_gallery):
    q, picks = query_folder(tmp_path, omniglot_gallery)
    out = tmp_path / "r.jsonl"
    p = run_cli("search", q, "--index", built_index, "-k", "3", "--out", out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["query"] for r in rows) == sorted([picks[0].name, f"sub/{picks[1].name}", f"sub/{picks[2].name}"])
    for r in rows:
        assert len(r["results"]) == 3
        top = r["results"][0]                    # a drawing of the gallery finds itself (not left out)
        assert Path(top["path"]).name == Path(r["query"]).name and top["score"] > 0.999
    assert "broken.png" in p.stderr and "3 queries searched" in p.stderr
    assert not list(tmp_path.glob(".r.jsonl*")), "the temp file was left"
    out_csv = tmp_path / "r.csv"
    run_cli("search", q, "--index", built_index, "-k", "2", "--out", out_csv)
    with out_csv.open() as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == 3 * 2 and set(table[0]) == {"query", "rank", "id", "score", "label", "path", "novelty",
                                                      "suggested", "confidence"}
    assert {r["novelty"] for r in table} == {""} and {r["novelty"] for r in rows} == {None}   # built without DBA
    assert {r["rank"] for r in table} == {"1", "2"}


def test_a_box_searches_one_region(tmp_path, built_index, omniglot_gallery):
    a, b = drawings(omniglot_gallery, 41)[::40]          # two characters
    ia, ib = Image.open(a).convert("RGB"), Image.open(b).convert("RGB")
    canvas = Image.new("RGB", (ia.width + ib.width, max(ia.height, ib.height)), (255, 255, 255))
    canvas.paste(ia, (0, 0))
    canvas.paste(ib, (ia.width, 0))
    two = tmp_path / "two.png"
    canvas.save(two)
    for box, want in ((f"0,0,{ia.width},{ia.height}", a), (f"{ia.width},0,{canvas.width},{ib.height}", b)):
        hits = json.loads(run_cli("search", two, "--index", built_index, "-k", "2", "--box", box, "--json").stdout)
        assert Path(hits[0]["path"]).name == want.name and hits[0]["score"] > 0.999, (box, hits)


def test_bad_options_are_one_line(tmp_path, built_index, omniglot_gallery):
    q, picks = query_folder(tmp_path, omniglot_gallery)
    cases = [(["search", picks[0], "--box", "0,0,5000,10"], 1, "--box: 0,0,5000,10 is outside"),
             (["search", picks[0], "--box", "1,2,3"], 1, "--box: expected four integers"),
             (["search", q, "--box", "0,0,5,5"], 2, "--box is a region of one image"),
             (["search", q, "--out", tmp_path / "r.txt"], 2, "expected a .jsonl or .csv file"),
             (["search", tmp_path / "nothing.png"], 1, "no such image or folder"),
             (["search", "https://example.com/a.jpg"], 1, "a URL: images are not downloaded")]
    for args, code, words in cases:
        p = run_cli(*args, "--index", built_index, check=False)
        err = p.stderr.strip().splitlines()
        assert p.returncode == code and words in err[-1] and "Traceback" not in p.stderr, (args, p.stderr)
    empty = tmp_path / "empty"
    empty.mkdir()
    p = run_cli("search", empty, "--index", built_index, "--out", tmp_path / "e.jsonl", check=False)
    assert p.returncode == 1 and "no query images" in p.stderr and not (tmp_path / "e.jsonl").exists()
