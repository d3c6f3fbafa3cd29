"""Region and multi-image queries (issue 42 item 3) on the real demo gallery (augmented
scikit-image photos, the default pretrained embedder): a box picks which of two photos pasted
side by side is searched; several images fused find each of them; bad boxes and too many images
are one-line 400s naming the field, through the library and the HTTP API."""
from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
from PIL import Image

from serving import RequestError
from serving.queries import MAX_QUERY_IMAGES, fuse, parse_box

INDEX = "pretrained"


def gallery_photo(searcher, label: str) -> tuple[int, Image.Image]:
    """The first gallery item of ``label`` (its whole-photo view) and its pixels."""
    idx = searcher.index(INDEX)
    i = idx.ids_for_label(label)[0]
    return i, Image.open(io.BytesIO(idx.image_bytes(i))).convert("RGB")


@pytest.fixture(scope="module")
def two_photos(searcher, tmp_path_factory) -> dict:
    """Two photos of different classes pasted side by side into one PNG, and their boxes."""
    labels = searcher.index(INDEX).labels()
    (ia, a), (ib, b) = gallery_photo(searcher, labels[0]), gallery_photo(searcher, labels[3])
    canvas = Image.new("RGB", (a.width + b.width, max(a.height, b.height)), (127, 127, 127))
    canvas.paste(a, (0, 0))
    canvas.paste(b, (a.width, 0))
    path = tmp_path_factory.mktemp("regions") / "two.png"
    canvas.save(path)
    return {"path": path, "ids": (ia, ib), "labels": (labels[0], labels[3]),
            "boxes": ((0, 0, a.width, a.height), (a.width, 0, a.width + b.width, b.height))}


def test_a_box_searches_only_its_region(searcher, two_photos):
    whole = searcher.search(two_photos["path"], 5, index=INDEX, dba=False)
    for box, want in zip(two_photos["boxes"], two_photos["ids"]):
        q = searcher.query(two_photos["path"], box=box)
        assert q.image.size == (box[2] - box[0], box[3] - box[1])
        res = searcher.search(q, 5, index=INDEX, dba=False)
        # the region is that photo pixel for pixel: it finds itself, far ahead of the rest
        assert res.ids[0] == want and res.scores[0] > 0.99 and res.scores[1] < res.scores[0] - 0.02, res.scores
    assert whole.scores[0] < 0.99      # the whole composite is neither photo


def test_a_box_on_a_gallery_image_is_a_new_image_not_left_out(searcher, two_photos):
    ia = two_photos["ids"][0]
    w, h = Image.open(io.BytesIO(searcher.index(INDEX).image_bytes(ia))).size
    plain = searcher.search(ia, 3, index=INDEX, dba=False)
    assert ia not in plain.ids                                   # a gallery query leaves itself out
    region = searcher.search(searcher.query(id=ia, index=INDEX, box=f"0,0,{w},{h}"), 3, index=INDEX, dba=False)
    assert region.ids[0] == ia and region.query.label == two_photos["labels"][0]


def test_a_photo_over_64_mp_is_a_query_and_its_region_too(searcher, two_photos, tmp_path):
    """A query file or upload over 64 MP (the library's old cap: a 108 MP phone photo) is decoded
    drafted within the budget, whole or a box of it, and finds the photo it shows."""
    ia, a = gallery_photo(searcher, two_photos["labels"][0])
    big = tmp_path / "phone.jpg"
    a.resize((a.width * 9000 // a.height, 9000), Image.BILINEAR).save(big, quality=80)
    w, h = Image.open(big).size
    assert w * h > 64_000_000
    for q in (searcher.query(big), searcher.query(big, box=(0, 0, w, h))):
        assert searcher.search(q, 1, index=INDEX, dba=False).ids == [ia]


def test_several_images_fused_are_one_query_that_finds_each(searcher, two_photos):
    idx = searcher.index(INDEX)
    ia, ib = two_photos["ids"]
    parts = [searcher.query(idx.image_bytes(i), name=f"{i}.png") for i in (ia, ib)]
    q = searcher.fused(parts)
    res = searcher.search(q, 4, index=INDEX, dba=False)
    assert set(res.ids[:2]) == {ia, ib}            # each is itself (cos 1) and the other's mean
    # the scores are the inner products with the normalised mean of the two embeddings
    want = fuse(np.stack([searcher.embed(p, INDEX) for p in parts]))
    stored = idx.embeddings(res.ids)
    np.testing.assert_allclose(res.scores, stored @ want, atol=2e-3)
    assert q.label is None and "2 images fused" in q.name        # uploads: no label unless given
    report = searcher.probe(q, 3, index=INDEX, shifts=())   # probes work in embedding space
    assert [r.id for r in report.results["original"]] == res.ids[:3]


@pytest.mark.parametrize("box, words", [("1,2,3", "four integers"), ("0,0,1.5,4", "four integers"),
                                        ("5,5,5,9", "x0 < x1"), ("nan,0,1,1", "four integers")])
def test_parse_box_names_the_field(box, words):
    with pytest.raises(RequestError, match=words) as e:
        parse_box(box)
    assert e.value.message.startswith("box:")


def test_api_box_and_several_images(server, searcher, two_photos):
    url, auth = server
    data = two_photos["path"].read_bytes()
    with httpx.Client(auth=auth, timeout=60) as c:
        def post(files, **form):
            r = c.post(f"{url}/api/search", files=files, data={"k": "3", "dba": "false", **form})
            assert r.headers["content-type"].startswith("application/json") and "Traceback" not in r.text
            return r

        for box, want in zip(two_photos["boxes"], two_photos["ids"]):
            r = post([("image", ("two.png", data, "image/png"))], box=",".join(map(str, box)))
            assert r.status_code == 200, r.text
            assert r.json()["results"][0]["id"] == want
        # two photos as two uploads: one list, both found
        idx = searcher.index(INDEX)
        files = [("image", (f"{i}.png", idx.image_bytes(i), "image/png")) for i in two_photos["ids"]]
        r = post(files)
        assert r.status_code == 200 and {x["id"] for x in r.json()["results"][:2]} == set(two_photos["ids"]), r.text
        # bad input: one line naming the field, 400, nothing searched
        w, h = Image.open(two_photos["path"]).size
        r = post([("image", ("two.png", data, "image/png"))], box=f"0,0,{w + 1},{h}")
        assert r.status_code == 400 and r.json()["error"].startswith("box:") and f"{w}x{h}" in r.json()["error"]
        r = post(files, box="0,0,5,5")
        assert r.status_code == 400 and r.json()["error"].startswith("box:")
        # a box is decoded within the decode budget as any upload (it was decoded whole: +426 MB)
        from embedder.decode_budget import DEFAULT_DECODE_BUDGET

        side = int((DEFAULT_DECODE_BUDGET / 16) ** 0.5) + 64      # a WebP just over a server's budget
        webp = io.BytesIO()
        Image.new("RGB", (side, side), (120, 60, 30)).save(webp, format="WEBP", quality=10)
        r = post([("image", ("big.webp", webp.getvalue(), "image/webp"))], box="0,0,300,300")
        assert r.status_code == 413 and "budget" in r.json()["error"], r.text
        tiny = Image.new("RGB", (8, 8))
        buf = io.BytesIO()
        tiny.save(buf, format="PNG")
        many = [("image", (f"{n}.png", buf.getvalue(), "image/png")) for n in range(MAX_QUERY_IMAGES + 1)]
        r = post(many)
        assert r.status_code == 400 and r.json()["error"].startswith("image: at most"), r.text
        r = post(None)
        assert r.status_code == 400 and "no query" in r.json()["error"]
        # a misspelt field, or k in the query string, would search with the default k: refused
        r = post(files, kk="1")
        assert r.status_code == 400 and r.json()["error"].startswith("kk: not a field of /api/search"), r.text
        r = c.post(f"{url}/api/search", files=files, params={"k": "1"})
        assert r.status_code == 400 and r.json()["error"].startswith("k: send it as a form field"), r.text
        r = c.post(f"{url}/api/search", files=files, params={"dba": "false"}, data={"k": "1"})
        assert r.status_code == 200 and len(r.json()["results"]) == 1 and r.json()["dba"] is False, r.text
