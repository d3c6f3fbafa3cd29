"""New photos against a gallery of real bird photos (cub-dev, the default pretrained embedder,
DBA neighbourhoods): "no close match" (``Index.answer(...).novelty``, indexer.ann.new_photos.novelty)
flags photos of another domain, not new photos of the gallery's species; a gallery item asked
about itself is compared with the others only (else nothing would ever look novel); the suggested
label (indexer.suggest_label) is the species'; `indexer search` says both for one image and
writes them for a folder."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from indexer_testlib import run_cli


def test_p_values_are_the_galleries_own_ranks() -> None:
    """(1 + #{reference <= s}) / (n + 1): a query closer than every gallery item's nearest gets 1,
    one farther than all of them 1 / (n + 1)."""
    from indexer.ann.neighbours import DbaParams, Neighbourhoods
    from indexer.ann.new_photos import novelty

    sims = np.array([[0.9, 0.5], [0.7, 0.6], [0.8, 0.2], [0.6, 0.1]], np.float32)
    nb = Neighbourhoods(DbaParams(k=2), np.arange(4), np.zeros((4, 2), np.int64), sims, np.zeros((4, 3), np.float16))
    assert novelty(nb, np.array([0.95, 0.75, 0.6, 0.3])).tolist() == [1.0, 3 / 5, 2 / 5, 1 / 5]


def test_the_vote_weights_near_hits_and_breaks_ties_by_name() -> None:
    from indexer import suggest_label

    # one near hit outvotes two hits 0.2 less similar (e^-4 each at KNN_TEMP 0.05)
    label, share = suggest_label(["wren", "jay", "jay", None], [0.9, 0.7, 0.7, 0.95])
    assert label == "wren" and abs(share - 1 / (1 + 2 * np.exp(-4.0))) < 1e-12
    assert suggest_label(["b", "a"], [0.8, 0.8]) == ("a", 0.5)       # a float tie: the first name
    assert suggest_label([None, None], [0.9, 0.8]) is None and suggest_label([], []) is None


def test_new_photos_of_known_species_pass_and_other_domains_are_flagged(cub_dba, caltech_root, omniglot_paths):
    from indexer import NOVEL_P, Index

    index, held = cub_dba
    caltech = [sorted(d.iterdir())[0] for d in sorted(caltech_root.iterdir())[:4]]   # faces, leopards, motorbikes
    with Index.open(index) as idx:
        n = len(idx)
        found = idx.answer(idx.embed([str(p) for p in held + caltech + omniglot_paths[:2]]), 3)
        p = found.novelty
        assert p.shape == (len(held) + 6,) and found.ids.shape == (len(held) + 6, 3)
        assert (p[:len(held)] > 0.1).all(), p[:len(held)]               # a bird of a gallery species: typical
        assert np.allclose(p[len(held):], 1 / (n + 1)), p[len(held):]   # farther than every gallery nearest
        assert 1 / (n + 1) <= NOVEL_P
        # the per-request DBA switch changes the ranking, not the p-value (the plain nearest decides)
        assert np.array_equal(idx.answer(idx.embed([str(held[0])]), 3, dba=False).novelty, p[:1])
        # within labels there is no gallery-wide reference: no p-value
        assert idx.answer(idx.embed([str(held[0])]), 3, labels=[idx.labels()[0]]).novelty is None

        # each gallery item asked about its own stored vector: its nearest OTHER item decides, so
        # the p-values are the reference's own ranks (~uniform); with itself counted all would be 1
        ids = np.array([int(i) for lab in idx.labels() for i in idx.ids_for_label(lab)])
        own = idx.answer(idx.embeddings(ids), 2, exclude=list(ids)).novelty
        ref = idx.neighbours.nearest
        want = (1 + np.searchsorted(ref, idx.neighbours.sims[idx.neighbours.rows(ids), 0], side="right")) / (n + 1)
        assert np.abs(own - want).max() <= 1.5 / (n + 1)        # a float tie at a rank: one step
        assert np.mean(own <= 0.05) <= 0.05 + 1 / (n + 1) and own.max() == 1.0


def test_indexer_search_says_no_close_match_and_writes_the_p_value(cub_dba, caltech_root, tmp_path: Path):
    index, held = cub_dba
    face = sorted(sorted(caltech_root.iterdir())[0].iterdir())[0]
    r = run_cli("search", face, "--index", index, "-k", "2")
    assert "no close match in the gallery (p = 0.0083)" in r.stderr and len(r.stdout.splitlines()) == 2   # no label
    species = held[0].parent.name
    r = run_cli("search", held[0], "--index", index, "-k", "5")
    assert "no close match" not in r.stderr and f"suggested label: {species} (confidence " in r.stdout.splitlines()[-1]
    r = run_cli("search", held[0], "--index", index, "-k", "2", "--json")
    assert len(json.loads(r.stdout)) == 2
    q = tmp_path / "q"
    q.mkdir()
    (q / "bird.jpg").symlink_to(held[0])
    (q / "face.jpg").symlink_to(face)
    r = run_cli("search", q, "--index", index, "-k", "2", "--out", tmp_path / "r.jsonl")
    assert "1 of 2 queries have no close match in the gallery (novelty p <= 0.01), e.g. face.jpg" in r.stderr
    rows = {j["query"]: j for j in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())}
    assert rows["face.jpg"]["novelty"] == 1 / 121 and rows["bird.jpg"]["novelty"] > 0.1
    assert rows["bird.jpg"]["suggested"]["label"] == species and rows["bird.jpg"]["suggested"]["confidence"] > 0.5
    assert rows["face.jpg"]["suggested"] is None
    run_cli("search", q, "--index", index, "-k", "2", "--out", tmp_path / "r.csv")
    with (tmp_path / "r.csv").open() as fh:
        table = list(csv.DictReader(fh))
    assert {r["query"]: r["novelty"] for r in table}["face.jpg"] == f"{1 / 121:.6f}" and len(table) == 4
    assert {r["query"]: r["suggested"] for r in table} == {"bird.jpg": species, "face.jpg": ""}


def test_indexer_eval_says_how_often_the_suggested_label_is_right(cub_dba) -> None:
    """Leave-one-out: each gallery photo's suggested label (the vote of its top-8, itself left
    out) against its own label, as a user would check auto-labelling before trusting it."""
    from indexer import Index, suggest_label

    index, _ = cub_dba
    res = json.loads(run_cli("eval", "--index", index, "--leave-one-out", "--json").stdout)["suggested"]
    with Index.open(index) as idx:
        ids = [int(i) for lab in idx.labels() for i in idx.ids_for_label(lab)]
        found = idx.answer(idx.embeddings(ids), 8, exclude=ids)
        votes = [suggest_label([h.label for h in hits], [h.score for h in hits])
                 for hits in (idx.hits(s, i) for s, i in zip(found.scores, found.ids))]
        truth = [idx.meta(i)["label"] for i in ids]
    right = [v[0] == t for v, t in zip(votes, truth)]
    sure = [v[1] >= 0.9 for v in votes]
    # eval searches in its own batch order: a float tie at the 8th hit may swap one vote
    assert res["hits"] == 8 and abs(res["accuracy"] - sum(right) / len(ids)) <= 1 / len(ids) and res["accuracy"] > 0.8
    assert abs(res["confident"] - sum(sure) / len(ids)) <= 1 / len(ids) and res["confident_accuracy"] >= res["accuracy"]
    text = run_cli("eval", "--index", index, "--leave-one-out").stdout
    assert f"Suggested label (the vote of the top-8) right: {res['accuracy']:.4f}; confident (share >= 0.9) for " in text


def test_no_label_is_suggested_for_a_photo_unlike_the_gallery(cub_dba, caltech_root) -> None:
    """A Caltech face among birds: its hits still share one species' label, but with no close match
    the vote would be a confident wrong answer, so none is suggested (CLI and API alike)."""
    from indexer import NOVEL_P, suggest_label

    index, _ = cub_dba
    face = sorted(sorted(caltech_root.iterdir())[0].iterdir())[0]
    r = run_cli("search", face, "--index", index, "-k", "3")
    assert "no close match" in r.stderr and "suggested label" not in r.stdout
    assert suggest_label(["a", "a"], [0.5, 0.4], novelty=NOVEL_P) is None
    assert suggest_label(["a", "a"], [0.5, 0.4], novelty=0.5) == ("a", 1.0)
