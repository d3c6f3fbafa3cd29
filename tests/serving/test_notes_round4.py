"""Issue 39's NOTEs that were fixed: options that must be refused at parse time (exit 2), a
garbage forwarded address that must not be a new client, the 415 list, and the ONNX metadata
that must not carry the server's path of a weights file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import app
from embedder.runtime import read_metadata
from serving.limits import NOT_AN_ADDRESS, client_key
from serving.uploads import UploadError, decode_upload


@pytest.mark.parametrize("argv", [["--max-upload-mb", "nan"], ["--max-upload-mb", "inf"],
                                  ["--forwarded-allow-ips", "*"], ["--forwarded-allow-ips", "127.0.0.1,garbage"]])
def test_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        app.parse_args(argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_good_forwarded_ips_are_kept() -> None:
    assert app.parse_args(["--forwarded-allow-ips", "127.0.0.1, 10.0.0.0/8,::1"]).forwarded_allow_ips == \
        ["127.0.0.1", "10.0.0.0/8", "::1"]


def test_a_forwarded_address_that_is_no_address_is_one_client() -> None:
    keys = {client_key({"client": (junk, 1)}) for junk in ("x", "unknown", "a" * 40, "1.2.3.4.5", "")}
    assert keys == {NOT_AN_ADDRESS}
    assert client_key({"client": ("203.0.113.9", 1)}) == "203.0.113.9"
    assert client_key({"client": ("::1", 1)}) == "::1"


def test_415_lists_every_accepted_format() -> None:
    with pytest.raises(UploadError) as e:
        decode_upload(b"not an image at all", "x.bin")
    assert e.value.status == 415 and "TIFF" in str(e.value) and "ICO" in str(e.value)
    with pytest.raises(UploadError) as e:           # a camera's raw photo: what it is, the list once
        decode_upload(b"MM\x00*" + b"\x00" * 64, "DSC_0001.NEF")
    msg = str(e.value)
    assert e.value.status == 415 and "camera raw file" in msg and msg.count("TIFF") == 1, msg


def test_onnx_metadata_names_the_weights_file_not_its_path(tmp_path: Path) -> None:
    import timm

    from embedder import Embedder, EmbedderConfig, export_onnx
    from embedder.hashing import file_sha256

    w = tmp_path / "secret-dir" / "r10.pth"
    w.parent.mkdir()
    torch.manual_seed(0)
    torch.save(timm.create_model("resnet10t", pretrained=False).state_dict(), w)
    model = Embedder(EmbedderConfig(backbone="timm:resnet10t", dim=0, pooling="avg", pretrained=True,
                                    weights=str(w))).eval()
    out = export_onnx(model, tmp_path / "m.onnx", source_hash=file_sha256(w))
    meta = read_metadata(out)
    assert "secret-dir" not in json.dumps(meta)
    assert json.loads(meta["config"])["weights"] == "r10.pth"
    assert meta["weights_file"] == "r10.pth" and meta["weights_sha256"] == file_sha256(w)


def test_upload_folder_cap_answers_429_until_uploads_expire(tmp_path: Path) -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from serving.limits import RequestGuard

    async def ok(request):                      # stands in for Gradio's upload route
        await request.body()
        return PlainTextResponse("stored")

    inner = Starlette(routes=[Route("/gradio_api/upload", ok, methods=["POST"])])
    mb = 2 ** 20
    guarded = RequestGuard(inner, max_bytes=mb + 4096, limit=mb, upload_dir=str(tmp_path),
                           upload_dir_cap=3 * mb)
    client = TestClient(guarded)
    assert client.post("/gradio_api/upload", content=b"x" * 1000).status_code == 200
    (tmp_path / "old-upload").write_bytes(b"\1" * (2 * mb + 1))      # 2 MB held + 1 MB more > 3 MB
    r = client.post("/gradio_api/upload", content=b"x" * 1000)
    assert r.status_code == 429 and "upload folder is full" in r.text and r.headers["retry-after"]
    (tmp_path / "old-upload").unlink()                                # expired
    assert client.post("/gradio_api/upload", content=b"x" * 1000).status_code == 200
