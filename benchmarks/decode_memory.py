"""Memory of decoding large uploads: the old full-size path vs reduced decoding with a bound.

    python benchmarks/decode_memory.py [--megapixels 36] [--concurrent 4] [--bursts 3] [--no-write]

Makes a camera-size JPEG (default 7360 x 4912 = 36 MP, under the 40 MP upload cap) from a real
photo (scikit-image's hubble_deep_field.jpg), then runs, each in a fresh process so that its
peak RSS (VmHWM) is its own, ``--bursts`` bursts of ``--concurrent`` simultaneous "uploads":

  * old:  what the server did before: full-size decode of the upload (load_image), a full-size
          copy for the embedder's preprocessing, all threads at once;
  * new:  what it does now: decode_upload(min_side=Preprocessing.decode_side) (JPEG DCT scaling,
          at most MAX_CONCURRENT_DECODES at a time), then the embedder's preprocessing on that.

Both then embed with the offline pretrained embedder (onnxruntime), as a search would. Reports
RSS before the bursts, the peak, and RSS after them (MB), and time per burst. Writes
benchmarks/RESULTS-decode.md and benchmarks/decode_memory.png unless --no-write.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def worker(mode: str, path: str, concurrent: int, bursts: int) -> dict:
    """Runs in its own process; returns the figures as a dict."""
    import numpy as np

    from embedder import OnnxEmbedder, default_model_path
    from embedder.images import load_image
    from serving.uploads import DEFAULT_MAX_UPLOAD_PIXELS, decode_upload

    emb = OnnxEmbedder(default_model_path(), device="cpu", threads=1)
    pre = emb.preprocessing
    data = Path(path).read_bytes()
    emb.embed_arrays(np.zeros((1, 3, pre.input_size, pre.input_size), np.float32))   # warm the session
    gc.collect()
    before = _status_mb("VmRSS")

    def one() -> None:
        if mode == "old":
            img = load_image(data, mode="RGB", max_pixels=DEFAULT_MAX_UPLOAD_PIXELS)
            x = pre.eval_array(load_image(img, mode=pre.mode))
        else:
            img = decode_upload(data, "upload.jpg", max_bytes=len(data), min_side=pre.decode_side)
            x = pre.eval_array(load_image(img, mode=pre.mode, min_side=pre.decode_side))
        emb.embed_arrays(x[None])

    times = []
    for _ in range(bursts):
        threads = [threading.Thread(target=one) for _ in range(concurrent)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times.append(time.perf_counter() - t0)
    gc.collect()
    time.sleep(0.5)
    return {"mode": mode, "before_mb": before, "peak_mb": _status_mb("VmHWM"),
            "after_mb": _status_mb("VmRSS"), "burst_s": float(np.median(times))}


def make_jpeg(out: Path, megapixels: float) -> Path:
    from PIL import Image
    from skimage import data_dir

    w = int(round((megapixels * 1e6 * 1.5) ** 0.5))      # 3:2, a camera's aspect
    h = int(round(w / 1.5))
    Image.open(Path(data_dir) / "hubble_deep_field.jpg").convert("RGB").resize((w, h), Image.BICUBIC) \
        .save(out, quality=90)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megapixels", type=float, default=36.0)
    p.add_argument("--concurrent", type=int, default=4, help="simultaneous uploads per burst (default 4)")
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--no-write", action="store_true", help="print only; do not write RESULTS-decode.md/PNG")
    p.add_argument("--worker", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker[0], a.worker[1], a.concurrent, a.bursts)))
        return 0
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp:
        jpeg = make_jpeg(Path(tmp) / "upload.jpg", a.megapixels)
        w, h = Image.open(jpeg).size
        rows = []
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        for mode in ("old", "new", "old", "new"):           # interleaved, twice: load drifts
            out = subprocess.run([sys.executable, __file__, "--worker", mode, str(jpeg), "--concurrent",
                                  str(a.concurrent), "--bursts", str(a.bursts)], env=env, check=True,
                                 capture_output=True, text=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
        size_mb = jpeg.stat().st_size / 1e6
    load = os.getloadavg()[0]
    head = (f"Command: `python benchmarks/decode_memory.py --megapixels {a.megapixels:g} --concurrent "
            f"{a.concurrent} --bursts {a.bursts}`  \n"
            f"Upload: {w} x {h} JPEG ({w * h / 1e6:.1f} MP, {size_mb:.1f} MB) made from scikit-image's "
            f"hubble_deep_field.jpg; {a.bursts} bursts of {a.concurrent} simultaneous uploads, each decoded, "
            f"preprocessed and embedded (pretrained EfficientNet-Lite0, onnxruntime, 1 thread); one fresh "
            f"process per run; load average {load:.1f} at the end (2 shared cores).\n\n"
            "| run | RSS before MB | peak RSS MB | RSS after MB | peak - before MB | after - before MB | s per burst |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    body = "".join(f"| {r['mode']} | {r['before_mb']:.0f} | {r['peak_mb']:.0f} | {r['after_mb']:.0f} | "
                   f"{r['peak_mb'] - r['before_mb']:.0f} | {r['after_mb'] - r['before_mb']:.0f} | "
                   f"{r['burst_s']:.2f} |\n" for r in rows)
    old = [r for r in rows if r["mode"] == "old"]
    new = [r for r in rows if r["mode"] == "new"]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    tail = (f"\nMean peak above the process's baseline: old **{mean(old, 'peak_mb') - mean(old, 'before_mb'):.0f} MB**, "
            f"new **{mean(new, 'peak_mb') - mean(new, 'before_mb'):.0f} MB**; RSS left after the bursts: old "
            f"+{mean(old, 'after_mb') - mean(old, 'before_mb'):.0f} MB, new +{mean(new, 'after_mb') - mean(new, 'before_mb'):.0f} MB; "
            f"time per burst new/old: {mean(new, 'burst_s') / mean(old, 'burst_s'):.2f}x.\n")
    text = head + body + tail
    print(text)
    if not a.no_write:
        (REPO / "benchmarks" / "RESULTS-decode.md").write_text("# Decoding memory (benchmarks/decode_memory.py)\n\n" + text)
        _plot(rows, REPO / "benchmarks" / "decode_memory.png", f"{w * h / 1e6:.0f} MP JPEG x {a.concurrent} at once")
    return 0


def _plot(rows: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    labels = [f"{r['mode']} #{i // 2 + 1}" for i, r in enumerate(rows)]
    x = range(len(rows))
    for off, key, name in ((-0.25, "before_mb", "before"), (0.0, "peak_mb", "peak"), (0.25, "after_mb", "after")):
        ax.bar([i + off for i in x], [r[key] for r in rows], width=0.25, label=name)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("RSS (MB)")
    ax.set_title(f"Server-side decode memory: {title}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
