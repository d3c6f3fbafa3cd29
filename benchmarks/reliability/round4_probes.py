"""Issue 39's probes (round 4), one table row each: names that are not UTF-8 and over-long
paths in a gallery, a damaged DBA ``neighbours.npz`` under ``indexer info``, a temp folder
another user prepared, weights files that do not fit a timm backbone, and progressive JPEG's
decode charge. (The wedged shard of the fan-out is tests/indexer/test_fanout_wedged.py's
scenario: it drives the router's internals, which benchmarks do not touch.)

    python -m benchmarks.reliability.round4_probes [--out PATH]

Runs the real CLI (``indexer``, ``embedder pretrained``, ``app.py``) in subprocesses on files
made in a temporary folder. Prints the table (probe | expected | observed); ``--out`` also writes it. The kept rows are in
RELIABILITY.md ("Issue 39"). An observation that misses its expectation starts "UNEXPECTED:".
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from embedder.cli import run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.reliability.round4_probes"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
Row = tuple[str, str, str]


def _run(args: list[str], env: dict | None = None, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, *args], cwd=REPO, env={**ENV, **(env or {})}, capture_output=True,
                       text=True, timeout=timeout)
    return p, time.perf_counter() - t0


def _row(probe: str, expected: str, ok: bool, observed: str) -> Row:
    return probe, expected, observed if ok else f"UNEXPECTED: {observed}"


def _line(p: subprocess.CompletedProcess, root: Path) -> str:
    lines = p.stderr.strip().splitlines()
    return (lines[-1] if lines else "").replace(str(root), "TMP")[:200]


def _small_model(root: Path) -> Path:
    import torch

    from embedder import Embedder, EmbedderConfig, export_onnx

    torch.manual_seed(0)
    return export_onnx(Embedder(EmbedderConfig(backbone="small_cnn", dim=64)).eval(), root / "small.onnx",
                       source_hash="probe-small-cnn")


def _gallery(root: Path, n: int = 12) -> Path:
    from PIL import Image

    g = root / "gallery"
    for c in range(3):
        (g / f"c{c}").mkdir(parents=True, exist_ok=True)
        for i in range(n // 3):
            rng = np.random.default_rng(c * 100 + i)
            Image.fromarray((rng.random((48, 48)) * 255).astype(np.uint8)).save(g / f"c{c}" / f"{i}.png")
    return g


def names_rows(root: Path, model: Path) -> list[Row]:
    """FAIL 6: a Latin-1 name and a path past PATH_MAX in the gallery."""
    g = _gallery(root / "names")
    src = next(g.rglob("*.png"))
    shutil.copy(src, os.fsencode(g / "c0") + b"/caf\xe9.png")
    fd = os.open(g, os.O_RDONLY | os.O_DIRECTORY)
    total = len(os.fsencode(g))
    while total < 4200:
        os.mkdir("d" * 200, dir_fd=fd)
        nfd = os.open("d" * 200, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd, total = nfd, total + 201
    out = os.open("deep.png", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(out, src.read_bytes())
    os.close(out)
    os.close(fd)
    idx = root / "names-idx"
    p, s = _run(["-m", "indexer", "build", str(g), "--model", str(model), "--out", str(idx), "--quiet"])
    report = [json.loads(x) for x in (idx / "report.jsonl").read_text().splitlines()] if p.returncode == 0 else []
    latin = [r for r in report if "not valid UTF-8" in r["reason"]]
    deep = [r for r in report if "too long" in r["reason"]]
    ok = p.returncode == 0 and len(latin) == 1 and len(deep) == 1
    return [_row("`indexer build` of a gallery holding `caf\\xe9.png` (Latin-1) and a file under a 4,200-byte path",
                 "exit 0; both named in report.jsonl; the rest indexed",
                 ok, f"exit {p.returncode} in {s:.1f} s; count {json.loads((idx / 'manifest.json').read_text())['count'] if ok else '?'}; "
                     f"report: {latin[0]['path'] if latin else '-'} ({latin[0]['reason'][:60] if latin else ''}...), "
                     f"{deep[0]['reason'] if deep else '-'}")]


def dba_rows(root: Path, model: Path) -> list[Row]:
    """FAIL 3: the 7 damages of neighbours.npz against `indexer info` and `info --deep`."""
    g = _gallery(root / "dba")
    base = root / "dba-idx"
    _run(["-m", "indexer", "build", str(g), "--model", str(model), "--out", str(base), "--dba", "--quiet"])
    nb = "neighbours.npz"

    def manifest(d: Path, **kw: object) -> None:
        m = json.loads((d / "manifest.json").read_text())
        m["neighbours"].update(kw)
        (d / "manifest.json").write_text(json.dumps(m))

    def rewrite(d: Path, **arrays: np.ndarray) -> None:
        with np.load(d / nb) as z:
            a = {k: z[k] for k in z.files}
        a.update(arrays)
        with open(d / nb, "wb") as f:
            np.savez(f, **a)
        data = (d / nb).read_bytes()
        manifest(d, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())

    def garble(d: Path) -> None:
        b = bytearray((d / nb).read_bytes())
        for i in range(0, len(b), 97):
            b[i] ^= 0x5A
        (d / nb).write_bytes(bytes(b))

    def k_of(d: Path) -> dict:
        return json.loads((d / "manifest.json").read_text())["neighbours"]

    cases: dict[str, Callable[[Path], None]] = {
        "deleted": lambda d: (d / nb).unlink(),
        "truncated": lambda d: (d / nb).write_bytes((d / nb).read_bytes()[:1000]),
        "garbled": garble,
        "wrong shapes": lambda d: rewrite(d, aug=np.load(d / nb)["aug"][:, :-1].copy()),
        "pickle inside": lambda d: rewrite(d, aug=np.array([{"x": 1}], dtype=object)),
        "wrong k in manifest": lambda d: manifest(d, k=k_of(d)["k"] + 1),
        "wrong alpha in manifest": lambda d: manifest(d, alpha=k_of(d)["alpha"] + 1.5),
    }
    seen = []
    good = True
    for name, damage in cases.items():
        d = root / f"dba-{name.replace(' ', '-')}"
        shutil.copytree(base, d)
        damage(d)
        for deep in ([], ["--deep"]):
            p, s = _run(["-m", "indexer", "info", "--index", str(d), *deep])
            lines = p.stderr.strip().splitlines()
            good &= p.returncode != 0 and len(lines) == 1 and nb in lines[0]
        seen.append(f"{name}: exit {p.returncode}, {s:.1f} s")
    return [_row("neighbours.npz: deleted, truncated, garbled, wrong shapes, a pickle inside, wrong k, wrong alpha; "
                 "`indexer info` and `info --deep`", "exit 1, one line naming neighbours.npz, each of 14",
                 good, "; ".join(seen))]


def tempdir_rows(root: Path) -> list[Row]:
    """FAIL 5: a world-writable parent holding a link to a victim folder."""
    base = root / "shared-tmp"
    base.mkdir()
    os.chmod(base, 0o777)
    victim = root / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (base / f"das-retrieval-app-{port}").symlink_to(victim, target_is_directory=True)
    idx = root / "names-idx"
    p, s = _run([str(REPO / "app.py"), "--index", str(idx), "--host", "127.0.0.1", "--port", str(port)],
                env={"GRADIO_TEMP_DIR": str(base)}, timeout=120)
    kept = (victim / "precious.txt").exists()
    ok = p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and kept
    return [_row("app.py with its temp parent pre-created 0777 holding `das-retrieval-app-PORT -> victim`",
                 "exit 1, one line naming the folder; the victim's files untouched",
                 ok, f"exit {p.returncode} in {s:.1f} s, victim intact: {kept}: \"{_line(p, root)}\"")]


def weights_rows(root: Path) -> list[Row]:
    """FAIL 2: weights that do not fit `timm:resnet18` (the issue's commands)."""
    import struct

    import timm
    import torch

    rows = []
    torch.manual_seed(0)
    sd = timm.create_model("resnet18", pretrained=False).state_dict()
    files = {
        "`{\"model_state_dict\": sd, \"epoch\": 3}` of resnet18 (a wrapper timm does not unwrap)":
            ("wrapped.pth", {"model_state_dict": sd, "epoch": 3}, 0),
        "ViT-Tiny's weights for resnet18": ("vit.pth", timm.create_model("vit_tiny_patch16_224").state_dict(), 1),
        "resnet18 with one NaN": ("nan.pth", {**sd, "conv1.weight": sd["conv1.weight"].clone().fill_(float("nan"))}, 1),
    }
    for what, (name, obj, want) in files.items():
        torch.save(obj, root / name)
    huge = root / "huge.safetensors"
    with open(huge, "wb") as f:
        f.write(struct.pack("<Q", 90_000_000) + b"{")
        f.truncate(90_000_100)
    files["a 90 MB-header safetensors naming no key"] = ("huge.safetensors", None, 1)
    for what, (name, _, want) in files.items():
        p, s = _run(["-m", "embedder", "pretrained", "--backbone", "timm:resnet18", "--weights", str(root / name),
                     "--pooling", "avg", "--out", str(root / f"{name}.onnx")], env={"HF_HUB_OFFLINE": "1"})
        rc = 0 if p.returncode == 0 else 1
        ok = rc == want and (want == 0 or len(p.stderr.strip().splitlines()) == 1)
        rows.append(_row(f"`embedder pretrained --backbone timm:resnet18 --weights F`, F = {what}",
                         "loaded (unwrapped)" if want == 0 else "exit 1, one line naming F",
                         ok, f"exit {p.returncode} in {s:.1f} s" + ("" if want == 0 else f": \"{_line(p, root)}\"")))
    return rows


def jpeg_rows() -> list[Row]:
    """FAIL 1: the decode budget's charge for the issue's 6300^2 4:4:4 progressive JPEG."""
    from PIL import Image

    from embedder import ImageTooLargeError, load_image

    b = io.BytesIO()
    Image.new("RGB", (6300, 6300)).save(b, "JPEG", progressive=True, subsampling=0)
    data = b.getvalue()
    try:
        load_image(data, min_side=224, name="p.jpg")
        observed, ok = "decoded", False
    except ImageTooLargeError as e:
        observed, ok = str(e), "progressive JPEG" in str(e)
    return [_row(f"6300x6300 4:4:4 progressive JPEG ({len(data) / 1e3:.0f} KB), decode at 224 px",
                 "charged libjpeg's coefficients (~227 MB); over the 160 MB budget alone: refused unread (413)",
                 ok, f"\"{observed[:200]}\"")]


def all_rows(root: Path) -> list[Row]:
    """Every row, on files made under ``root`` (created if missing): the runner's hook."""
    root.mkdir(parents=True, exist_ok=True)
    model = _small_model(root)
    return (names_rows(root, model) + dba_rows(root, model) + tempdir_rows(root) + weights_rows(root)
            + jpeg_rows())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="also write the table to this Markdown file")
    return run_main(PROG, p, argv, handler=run)


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        rows = all_rows(Path(tmp))
    text = "| probe | expected | observed |\n| --- | --- | --- |\n" + "\n".join(
        "| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
