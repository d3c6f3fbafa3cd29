"""New photos in a real app.py serving 120 bird photos with DBA (the default pretrained embedder):
the API's ``novelty`` and ``suggested`` and the Search tab's status line, for a photo of another
domain and a new photo of a gallery species; the p-value is the indexer's own."""
from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def birds_server(cub_dba, start_app, tmp_path_factory, free_port):
    with start_app(["--index", cub_dba[0], "--name", "birds"], tmp_path_factory.mktemp("novelty-server"),
                   free_port()) as (url, _):
        yield url


def test_api_and_search_tab_say_no_close_match(birds_server, cub_dba, caltech_root, gradio_client):
    from gradio_client import handle_file

    from indexer import Index

    index, held = cub_dba
    face = sorted(sorted(caltech_root.iterdir())[0].iterdir())[0]
    with Index.open(index) as idx:
        want = idx.answer(idx.embed([str(face), str(held[0])]), 3).novelty
        gid = idx.ids_for_label(idx.labels()[0])[0]
    assert want[0] == 1 / 121 and want[1] > 0.1
    for path, p, novel in ((face, want[0], True), (held[0], want[1], False)):
        r = httpx.post(f"{birds_server}/api/search", files={"image": (path.name, path.read_bytes())},
                       data={"k": "3"}, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()["novelty"]                       # flat: no approx nested in a dict
        assert set(got) == {"p", "unlike_gallery"} and abs(got["p"] - p) < 1e-9 and got["unlike_gallery"] is novel
        if not novel:                                   # the bird's species, by the hits' vote
            assert r.json()["suggested"]["label"] == path.parent.name, r.json()
        else:                                           # no close match: no label suggested
            assert "suggested" not in r.json(), r.json()
    # a gallery image asked about itself: compared with the others, so it is no novelty
    r = httpx.post(f"{birds_server}/api/search", data={"id": str(gid), "k": "3"}, timeout=60)
    assert r.status_code == 200 and r.json()["novelty"]["p"] > 1 / 121, r.text
    # within labels: no gallery-wide reference, no field
    r = httpx.post(f"{birds_server}/api/search", data={"id": str(gid), "label": r.json()["results"][0]["label"]},
                   timeout=60)
    assert r.status_code == 200 and "novelty" not in r.json(), r.text

    client = gradio_client(birds_server)
    status, gallery = client.predict(handle_file(str(face)), None, None, 3, api_name="/search")
    assert "**birds**: no close match in the gallery (p = 0.0083)" in status and len(gallery) == 3, status
    assert "Suggested label" not in status, status
    status, _ = client.predict(handle_file(str(held[0])), None, None, 3, api_name="/search")
    assert "no close match" not in status and "⚠" not in status, status
    assert f"Suggested label · birds: **{held[0].parent.name}** (" in status, status
