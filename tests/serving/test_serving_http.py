"""The JSON API and the Gradio API (gradio_client) against a real `python app.py` on 127.0.0.1,
plus the command line's bad-input behaviour."""
from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from PIL import Image

from serving_testlib import labelled_folder

REPO = Path(__file__).resolve().parents[2]


def _query(demo_dirs) -> tuple[Path, str]:
    return labelled_folder(demo_dirs[1])[0]


def test_search_endpoint_returns_results_and_thumbnails(server, demo_dirs):
    url, auth = server
    path, label = _query(demo_dirs)
    with httpx.Client(auth=auth, timeout=60) as c:
        r = c.post(f"{url}/api/search", files={"image": (path.name, path.read_bytes(), "image/jpeg")},
                   data={"k": "4"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["index"] == "pretrained" and body["k"] == 4 and len(body["results"]) == 4
        res = body["results"]
        assert [x["score"] for x in res] == sorted((x["score"] for x in res), reverse=True)
        assert set(res[0]) >= {"id", "score", "label", "path", "thumbnail"}
        assert res[0]["label"] == label
        t = c.get(url + res[0]["thumbnail"])           # relative to the server
        assert t.status_code == 200 and t.headers["content-type"] == "image/png"
        assert Image.open(io.BytesIO(t.content)).size[0] > 0
        # the other index, and a query by gallery id (left out of its own results)
        r2 = c.post(f"{url}/api/search", data={"k": "3", "index": "small", "id": str(res[0]["id"])})
        assert r2.status_code == 200, r2.text
        assert r2.json()["query"]["label"] == label
        assert res[0]["id"] not in [x["id"] for x in r2.json()["results"]]
        r3 = c.post(f"{url}/api/search", data={"k": "3", "path": res[0]["path"]})
        assert r3.status_code == 200 and [x["id"] for x in r3.json()["results"]] == \
            [x["id"] for x in c.post(f"{url}/api/search", data={"k": "3", "id": str(res[0]["id"])}).json()["results"]]
        # a path is only ever a key into the store: a server file is not found, not read
        r4 = c.post(f"{url}/api/search", data={"path": "/etc/passwd"})
        assert r4.status_code == 404 and "root:" not in r4.text
        info = c.get(f"{url}/api/indexes").json()
        assert [i["name"] for i in info] == ["pretrained", "small"] and info[0]["size"] == 40


def test_auth_is_required_everywhere(server, demo_dirs, gradio_client):
    url, auth = server
    path, _ = _query(demo_dirs)
    assert httpx.get(f"{url}/api/health").status_code == 401
    r = httpx.post(f"{url}/api/search", files={"image": ("q.jpg", path.read_bytes())},
                   auth=(auth[0], "wrong"), timeout=30)
    assert r.status_code == 401 and "authentication" in r.json()["error"]
    assert httpx.get(f"{url}/api/thumb/pretrained/1").status_code == 401
    # the Gradio app shows its login page, and gradio_client needs the password too
    assert '"auth_required":true' in httpx.get(f"{url}/").text.replace(" ", "")
    with pytest.raises(Exception):
        gradio_client(url).predict(None, None, None, 3, api_name="/search")


def test_bad_input_gets_4xx_json_never_a_trace(server, demo_dirs, tmp_path):
    url, auth = server
    path, _ = _query(demo_dirs)
    with httpx.Client(auth=auth, timeout=60) as c:
        def post(**kw):
            r = c.post(f"{url}/api/search", **kw)
            assert r.headers["content-type"].startswith("application/json"), r.text
            assert "Traceback" not in r.text
            return r.status_code, r.json()["error"]

        code, msg = post(files={"image": ("notes.txt", b"hello, not an image", "text/plain")})
        assert code == 415 and "notes.txt" in msg and "not a readable image" in msg
        big = os.urandom(int(1.5 * 1024 * 1024))     # server runs with --max-upload-mb 1
        code, msg = post(files={"image": ("big.jpg", big, "image/jpeg")})
        assert code == 413 and "limit" in msg
        code, msg = post(files={"image": ("q.jpg", path.read_bytes())}, data={"k": "zero"})
        assert code == 400 and "k" in msg
        code, msg = post(files={"image": ("q.jpg", path.read_bytes())}, data={"k": "0"})
        assert code == 400
        code, msg = post(data={"k": "3"})
        assert code == 400 and "image" in msg
        code, msg = post(data={"id": "12345"})
        assert code == 404 and "12345" in msg
        code, msg = post(files={"image": ("q.jpg", path.read_bytes())}, data={"index": "nope"})
        assert code == 404 and "nope" in msg
        code, msg = post(files={"image": ("empty.png", b"")})
        assert code in (400, 415)
        r = c.get(f"{url}/api/thumb/pretrained/999")
        assert r.status_code == 404 and "999" in r.json()["error"]
        r = c.get(f"{url}/api/thumb/pretrained/..%2F..%2Fetc%2Fpasswd")
        assert r.status_code == 404 and "root:" not in r.text
        r = c.get(f"{url}/api/thumb/nope/1")
        assert r.status_code == 404


def test_gradio_client_search_and_probes(server, demo_dirs, searcher, tmp_path, gradio_client):
    from gradio_client import handle_file
    from gradio_client.exceptions import AppError

    url, auth = server
    path, label = _query(demo_dirs)
    client = gradio_client(url, auth=auth)
    status, pre, small = client.predict(handle_file(str(path)), None, label, 3, api_name="/search")
    assert label in status
    assert len(pre) == 3 and len(small) == 3
    assert pre[0]["caption"].startswith(label) and Path(pre[0]["image"]).is_file()
    gid = searcher.index("pretrained").store.ids_for_label(label)[0]   # a gallery pick, label known
    out = client.predict(None, str(gid), None, 4, 4, "0.5, 2", 0, 0.5, "1", None, 0, api_name="/probes")
    status, grid_a, grid_b, table = out
    assert "⚠" not in status, status
    assert Path(grid_a).is_file() and Path(grid_b).is_file()
    probes = [row[1] for row in table["data"]]
    assert probes.count("original") == 2 and "scale x0.5" in probes and f"shift r_b=1 ({label})" in probes
    bad = tmp_path / "bad.png"
    bad.write_text("definitely not a PNG")
    with pytest.raises(AppError, match="not a readable image"):
        client.predict(handle_file(str(bad)), None, None, 3, api_name="/search")
    ev = client.predict("queries", "1, 4", api_name="/evaluate")
    assert "Recall" in ev[0]
    assert ev[1]["headers"] == ["index", "DBA", "queries", "n", "R@1", "R@4"]
    assert [row[:2] for row in ev[1]["data"]] == [["pretrained", "off"], ["small", "off"]]
    assert all(0 <= row[4] <= row[5] <= 100 for row in ev[1]["data"])


def test_cli_rejects_bad_arguments_in_one_line(tmp_path):
    """The CLI kit's policy (embedder.cli.run_main): bad usage -> usage and one error line, exit 2;
    what the user can fix (a missing index) -> one line, exit 1."""
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    for args, needle, code in ([["--index", str(tmp_path / "missing")], "not an index directory", 1],
                               [["--index", str(tmp_path), "--auth", "nopassword"], "USER:PASS", 2],
                               [["--port", "70000"], "--port", 2], [["--bogus"], "--bogus", 2],
                               [["--max-memory", "lots"], "--max-memory", 2]):
        r = subprocess.run([sys.executable, str(REPO / "app.py"), *args], capture_output=True, text=True,
                           env=env, timeout=60, cwd=tmp_path)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == code and lines[-1].startswith("app.py: error: ") and needle in lines[-1], r.stderr
        assert all(ln.startswith(("usage:", " ")) for ln in lines[:-1]) and (code == 2) == bool(lines[:-1])
    r = subprocess.run([sys.executable, str(REPO / "app.py"), "--help"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert r.returncode == 0 and "--index" in r.stdout and "--auth" in r.stdout


def test_an_image_too_large_to_decode_is_refused_413_before_decoding():
    """A readable WebP whose decode would cost more than the process's decode budget (libwebp
    holds ~16 bytes per pixel) is a 413 naming the file and the budget, not a 415 "not an
    image": the client sent a real image, just too large to decode here."""
    from embedder.decode_budget import BUDGET
    from serving.uploads import UploadError, decode_upload

    side = int((BUDGET.capacity / 16) ** 0.5) + 64      # just over the budget for a WebP
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (120, 60, 30)).save(buf, format="WEBP", quality=10)
    with pytest.raises(UploadError) as err:
        decode_upload(buf.getvalue(), "big.webp", max_pixels=None, min_side=224)
    assert err.value.status == 413
    assert "big.webp" in err.value.message and "budget" in err.value.message


def test_a_phone_photo_of_48_mp_is_searchable_and_one_over_pillows_cap_is_a_413():
    """Uploads had a 40 MP header cap (and 10 MB): a phone's 48 MP JPEG was refused. Now it is decoded
    drafted (1/8 in libjpeg), within the budget; the cap is Pillow's own refusal, said as a 413."""
    from embedder.images import REDUCED_MAX_PIXELS
    from serving.uploads import DEFAULT_MAX_UPLOAD_BYTES, UploadError, decode_upload

    buf = io.BytesIO()
    Image.new("L", (8000, 6000), 90).save(buf, format="JPEG", quality=30)
    img = decode_upload(buf.getvalue(), "phone.jpg", min_side=224)
    assert img.mode == "RGB" and 224 <= min(img.size) and max(img.size) <= 8000 // 8

    small = io.BytesIO()
    Image.new("RGB", (64, 48), (1, 2, 3)).save(small, format="JPEG")
    data = bytearray(small.getvalue())
    sof = data.index(b"\xff\xc0")              # baseline frame header: length, precision, height, width
    data[sof + 5:sof + 9] = (14000).to_bytes(2, "big") + (13000).to_bytes(2, "big")
    with pytest.raises(UploadError) as err:
        decode_upload(bytes(data), "huge.jpg", min_side=224)
    assert err.value.status == 413, err.value.message
    assert err.value.message == (f"huge.jpg: image too large: 182000000 pixels exceeds the limit of "
                                 f"{REDUCED_MAX_PIXELS} (a guard against decompression bombs)")
    import app   # its default, not imported there so that --help stays fast, is the serving one
    assert app.build_parser().parse_args([]).max_upload_mb * 2 ** 20 == DEFAULT_MAX_UPLOAD_BYTES