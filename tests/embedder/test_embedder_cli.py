"""`python -m embedder`: help, one-line errors, checkpoint -> ONNX -> info end to end."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from embedder import Embedder, EmbedderConfig, OnnxEmbedder, save_checkpoint
from embedder.checkpoint import file_sha256

def _run(*args: str, fresh: bool = False) -> subprocess.CompletedProcess:
    """``python -m embedder ARGS``: its ``main`` in this process (tests/inprocess.py), or a real
    subprocess when ``fresh`` (the entry point itself)."""
    from inprocess import run_main, run_module

    from embedder.__main__ import main
    return run_module("embedder", args) if fresh else run_main(main, "embedder", args)


@pytest.mark.parametrize("argv", [["--help"], ["export", "--help"], ["pretrained", "--help"],
                                  ["info", "--help"]])
def test_help(argv):
    r = _run(*argv)
    assert r.returncode == 0 and "usage:" in r.stdout


@pytest.mark.parametrize("argv,fragment", [
    (["info", "no/such/model.onnx"], "ONNX model file not found"),
    (["export", "no/such/ckpt.pt", "--out", "x.onnx"], "checkpoint file not found"),
    (["info", "{fake}"], "not a loadable ONNX model"),
    (["export", "{fake}", "--out", "x.onnx"], "not a readable PyTorch checkpoint"),
    (["pretrained", "--name", "lite9-gem"], "unknown pretrained embedder 'lite9-gem'"),
])
def test_bad_input_one_line_error(argv, fragment, tmp_path):
    fake = tmp_path / "fake.bin"
    fake.write_text("neither a model nor a checkpoint")
    r = _run(*[a.format(fake=fake) for a in argv])
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in r.stderr
    # the line names the command that failed (the CLI kit's policy: a script running several knows which)
    assert lines[0].startswith(f"python -m embedder {argv[0]}: error: ")


def test_bad_usage_exits_2_with_usage_and_one_line(capsys):
    """An unknown option (argparse's) and options that do not fit together (the CLI kit's
    UsageError) are both usage errors: the usage, one error line, exit 2."""
    from embedder.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["info", "m.onnx", "--bogus"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[0].startswith("usage:") and "unrecognized arguments: --bogus" in err[-1]
    for argv, line in ((["pretrained", "--name", "lite0-avg", "--backbone", "timm:x"], "exclude each other"),
                       (["pretrained", "--pooling", "gem"], "go with --backbone"),
                       (["quantize", "m.onnx", "--calibration", ".", "--out", "q.onnx", "--images", "0"], ">= 1")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[0].startswith("usage:") and err[-1].startswith(f"python -m embedder {argv[0]}: error: ") \
            and line in err[-1]


def test_no_command_is_usage_error():
    r = _run(fresh=True)
    assert r.returncode == 2 and "usage:" in r.stderr


def test_export_and_info(tmp_path, omniglot_paths):
    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "m.pt", Embedder(EmbedderConfig(backbone="small_cnn", dim=16)))
    out = tmp_path / "m.onnx"
    r = _run("export", str(ckpt), "--out", str(out), "--parity-images", *map(str, omniglot_paths[:4]))
    assert r.returncode == 0, r.stderr
    assert "parity check passed" in r.stdout
    rt = OnnxEmbedder(out)
    assert rt.dim == 16 and rt.metadata["source_hash"] == file_sha256(ckpt)
    info = _run("info", str(out), "--json")
    assert info.returncode == 0
    meta = json.loads(info.stdout)
    assert meta["dim"] == "16" and json.loads(meta["preprocessing"])["mode"] == "L"
