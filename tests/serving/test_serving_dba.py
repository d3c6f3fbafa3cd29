"""DBA re-ranking switched per request: the JSON API's ``dba`` field (form field or query
parameter) and the Search tab's checkbox, against a real app.py serving an index built with
``--dba`` beside one built without; the answers are the indexer's own for each setting."""
from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest


@pytest.fixture(scope="module")
def dba_index(tmp_path_factory, demo_dirs, pretrained_index) -> Path:
    """The session's pretrained index rebuilt with --dba (its store reused: nothing re-embedded)."""
    from indexer import build_index
    from indexer.ann.neighbours import DbaParams

    out = tmp_path_factory.mktemp("idx-dba") / "dba"
    shutil.copytree(pretrained_index, out)
    build_index(demo_dirs[0], out, progress=False, model=out / "model.onnx", dba=DbaParams(k=3, alpha=3.0))
    return out


@pytest.fixture(scope="module")
def dba_server(dba_index, small_index, start_app, tmp_path_factory, free_port):
    args = ["--index", dba_index, "--index", small_index, "--name", "dba", "--name", "small"]
    with start_app(args, tmp_path_factory.mktemp("dba-server"), free_port()) as (url, _):
        yield url


def _expected(index_dir: Path, gid: int, k: int, dba: bool) -> list[tuple[int, float]]:
    from indexer import Index

    idx = Index.open(index_dir)
    s, i = idx.search_embeddings(idx.embeddings([gid]), k, dba=dba, exclude=[gid])
    return [(int(a), float(b)) for a, b in zip(i[0], s[0])]


def test_api_switch(dba_server, dba_index):
    from indexer import Index

    idx = Index.open(dba_index)
    gid = idx.ids_for_label(idx.labels()[0])[0]
    plain, dba = _expected(dba_index, gid, 5, False), _expected(dba_index, gid, 5, True)
    assert plain != dba                           # re-ranking changes the answer here

    def ask(data: dict, params: dict | None = None) -> httpx.Response:
        return httpx.post(f"{dba_server}/api/search", data={"id": str(gid), "k": "5", **data},
                          params=params, timeout=60)

    for form, params, want, used in (({}, None, dba, True), ({"dba": "true"}, None, dba, True),
                                     ({"dba": "false"}, None, plain, False),
                                     ({}, {"dba": "off"}, plain, False), ({}, {"dba": "1"}, dba, True)):
        r = ask(form, params)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["dba"] is used
        # the server's search is _expected's call on the same stored vector: the same ids (ties
        # included); scores compared flat (recent pytest.approx refuses nested data)
        assert [x["id"] for x in body["results"]] == [i for i, _ in want]
        assert [x["score"] for x in body["results"]] == pytest.approx([s for _, s in want], abs=1e-5)
    r = ask({"dba": "maybe"})
    assert r.status_code == 400 and "dba: expected true or false" in r.json()["error"]
    r = ask({"dba": "true", "index": "small"})
    assert r.status_code == 400 and "'small' was built without DBA" in r.json()["error"]
    for form in ({"index": "small"}, {"index": "small", "dba": "false"}):   # same photos: same ids
        r = ask(form)
        assert r.status_code == 200 and r.json()["dba"] is False, r.text


def test_ui_checkbox(dba_server, dba_index, gradio_client):
    from indexer import Index

    idx = Index.open(dba_index)
    gid = idx.ids_for_label(idx.labels()[0])[0]
    client = gradio_client(dba_server)
    for checked in (True, False):
        status, dba_gal, small_gal = client.predict(None, str(gid), None, 4, checked, api_name="/search_dba")
        assert "⚠" not in status, status
        want = _expected(dba_index, gid, 4, checked)
        labels = {i: idx.meta(i).get("label") for i, _ in want}
        assert [g["caption"] for g in dba_gal] == [f"{labels[i]} · {s:.3f}" for i, s in want]
        assert len(small_gal) == 4              # the index without DBA answers plainly either way
    # "/search" keeps its four inputs (the index's default: DBA here)
    status, dba_gal, _ = client.predict(None, str(gid), None, 4, api_name="/search")
    assert "⚠" not in status
    want = _expected(dba_index, gid, 4, True)
    assert [g["caption"] for g in dba_gal] == [f"{idx.meta(i).get('label')} · {s:.3f}" for i, s in want]


def test_evaluate_tab_shows_both_settings_and_mcnemar_z(dba_server, dba_index, gradio_client):
    """The Evaluate tab, as `indexer eval`: an index with DBA gets a row with it (served first) and
    one without, and McNemar's z of the two at R@1, each equal to the indexer's own figures; an
    index without DBA one row."""
    from indexer import Index
    from indexer.layouts.evaluate import dba_verdict, evaluate_gallery, weakest

    with Index.open(dba_index) as idx:
        want = evaluate_gallery(idx, (1, 4), max_queries=2000)
    status, table, _ = gradio_client(dba_server).predict("gallery (leave-one-out)", "1, 4", api_name="/evaluate")
    assert table["headers"] == ["index", "DBA", "queries", "n", "R@1", "R@4"]
    rows = table["data"]
    assert [r[:2] for r in rows] == [["dba", "on"], ["dba", "off"], ["small", "off"]]
    for row, rec in zip(rows, (want["recall"], want["recall_plain"])):
        assert row[4:] == [round(100 * rec[1], 2), round(100 * rec[4], 2)]
    assert f"dba McNemar z {want['dba_z']:+.2f} ({dba_verdict(want['dba_z'])})" in status, status
    assert "small McNemar" not in status
    lab, r1, n = weakest(want["per_label"])[0]          # and each index's weakest labels
    assert f"dba: weakest labels at R@1: {lab} {100 * r1:.0f}% ({n})" in status, status
    assert "small: weakest labels at R@1: " in status
    s = want["suggested"]                               # and how often the suggested label is right
    assert (f"dba: suggested label (vote of the top-4) right {100 * s['accuracy']:.1f}%; confident for "
            f"{100 * s['confident']:.0f}% of the queries") in status, status


def test_label_filter_in_the_api_and_the_search_tab(dba_server, dba_index, gradio_client):
    """``label`` (repeatable) restricts the answer to those classes, DBA on: the indexer's own
    answer; a class the index lacks is a 400 naming it, before anything is decoded."""
    from indexer import Index

    idx = Index.open(dba_index)
    labels = idx.labels()
    gid = idx.ids_for_label(labels[0])[0]
    only = labels[2:4]
    s, i = idx.search_embeddings(idx.embeddings([gid]), 6, dba=True, exclude=[gid], labels=only)
    r = httpx.post(f"{dba_server}/api/search", data={"id": str(gid), "k": "6", "label": only}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["labels"] == only and {x["label"] for x in body["results"]} <= set(only)
    assert [x["id"] for x in body["results"]] == [int(v) for v in i[0] if v >= 0]
    assert [x["score"] for x in body["results"]] == pytest.approx([float(v) for v in s[0] if v == v], abs=1e-5)
    r = httpx.post(f"{dba_server}/api/search", files={"image": ("x.png", b"not decoded")},
                   data={"label": [labels[1], "no-such-class"]}, timeout=60)
    assert r.status_code == 400 and "'no-such-class': no image has it" in r.json()["error"], r.text
    r = httpx.post(f"{dba_server}/api/search", data={"id": str(gid), "label": "x" * 100_000}, timeout=60)
    assert r.status_code == 400 and len(r.json()["error"]) < 300, r.text[:300]
    # the values label takes, with their counts
    r = httpx.get(f"{dba_server}/api/labels/dba", timeout=60)
    assert r.status_code == 200 and r.json()["labels"] == {lab: len(idx.ids_for_label(lab)) for lab in labels}
    assert sum(r.json()["labels"].values()) == len(idx)
    assert httpx.post(f"{dba_server}/api/labels/dba", timeout=60).status_code == 405
    r = httpx.get(f"{dba_server}/api/labels/nowhere", timeout=60)
    assert r.status_code in (400, 404) and "nowhere" in r.json()["error"], r.text
    client = gradio_client(dba_server)
    status, dba_gal, small_gal = client.predict(None, str(gid), None, 4, True, None, None, [labels[1]],
                                                api_name="/search_dba")
    assert f"only {labels[1]}" in status and "⚠" not in status, status
    for gal in (dba_gal, small_gal):            # both indexes hold the same classes
        assert len(gal) == 4 and all(g["caption"].startswith(f"{labels[1]} · ") for g in gal)
    with pytest.raises(Exception, match="no-such-class"):     # Gradio checks the dropdown's choices
        client.predict(None, str(gid), None, 4, True, None, None, ["no-such-class"], api_name="/search_dba")


def test_api_copies_marks_the_querys_own_picture(dba_server, dba_index, tmp_path, gradio_client):
    """``copies=true`` and the Search tab's checkbox: an upload of a gallery photo resized and
    re-encoded has that photo marked as a copy and no other; a box with it is a 400 naming the field."""
    import io

    from PIL import Image

    from indexer import Index

    idx = Index.open(dba_index)
    gid = idx.ids_for_label(idx.labels()[0])[0]
    im = Image.open(io.BytesIO(idx.image_bytes(gid))).convert("RGB")
    buf = io.BytesIO()
    im.resize((im.width * 3 // 4, im.height * 3 // 4)).save(buf, "JPEG", quality=75)
    r = httpx.post(f"{dba_server}/api/search", files={"image": ("copy.jpg", buf.getvalue())},
                   data={"k": "4", "copies": "true"}, timeout=60)
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert [x["copy"] for x in res] == [x["id"] == gid for x in res] and res[0]["id"] == gid
    r = httpx.post(f"{dba_server}/api/search", files={"image": ("copy.jpg", buf.getvalue())}, timeout=60)
    assert "copy" not in r.json()["results"][0]
    r = httpx.post(f"{dba_server}/api/search", files={"image": ("copy.jpg", buf.getvalue())},
                   data={"copies": "true", "box": "0,0,40,40"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"].startswith("copies:"), r.text
    r = httpx.post(f"{dba_server}/api/search", data={"id": str(gid), "copies": "maybe"}, timeout=60)
    assert r.status_code == 400 and "copies: expected true or false" in r.json()["error"], r.text
    # the Search tab's checkbox: the original's caption says so, on both indexes (same photos)
    from gradio_client import handle_file

    copy = tmp_path / "copy.jpg"
    copy.write_bytes(buf.getvalue())
    status, dba_gal, small_gal = gradio_client(dba_server).predict(
        handle_file(str(copy)), None, None, 4, True, None, None, [], True, api_name="/search_dba")
    assert "⚠" not in status, status
    want = f"{idx.meta(gid)['label']} · "
    for gal, least in ((dba_gal, 1), (small_gal, 0)):      # the untrained small model may not find it
        marked = [g["caption"] for g in gal if g["caption"].endswith(" · copy")]
        assert least <= len(marked) <= 1 and all(m.startswith(want) for m in marked), [g["caption"] for g in gal]
