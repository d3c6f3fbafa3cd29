"""What preparing one photo for the network costs, step by step, against the network itself.

    python -m benchmarks.embedder.preprocess_cost [--images 200] [--rounds 5]

On cub-dev photos (the gallery kind of issue 30's ingest goal), one thread, CPU time per image
(``time.process_time``, less sensitive than wall time to the shared machine's load), rounds
alternating: the decode (``embedder.images.load_image``, JPEG DCT scaling included), the resize +
centre crop (``Preprocessing.eval_image``), the float conversion + normalisation of today's
``Preprocessing.eval_array`` and of the form it replaced (kept here as the reference: the same
``/ 255``, ``- mean``, ``/ std`` broadcast over a trailing axis of 3, then a float transpose; the
two give the same bits, checked on 50 photos every run),
and the default embedder's network in fp32 and, with ``--int8 MODEL``, in int8 (batches of 16).
Why: `indexer build --int8` is bounded by what it does besides the network (docs/benchmarks/embedder.md, int8).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from embedder.cli import run_main

PROG = "python -m benchmarks.embedder.preprocess_cost"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def five_pass(pre, img) -> np.ndarray:
    """``eval_array`` before: the reference the new form must equal bit for bit."""
    a = np.asarray(pre.eval_image(img), dtype=np.float32) / 255.0
    a = (a - np.asarray(pre.mean, np.float32)) / np.asarray(pre.std, np.float32)
    return np.ascontiguousarray(a.transpose(2, 0, 1), dtype=np.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=200, help="cub-dev photos, spread over the folders")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cub", type=Path, default=SHARED / "cub-dev" / "images")
    ap.add_argument("--int8", type=Path, default=None, help="an int8 copy of the default embedder")
    return run_main(PROG, ap, argv, handler=run)


def run(a: argparse.Namespace) -> int:
    from embedder import OnnxEmbedder
    from embedder import load_image
    from embedder.pretrained import default_model_path

    files = sorted(a.cub.glob("*/*.jpg"))
    files = files[:: max(1, len(files) // a.images)][:a.images]
    nets = {"network fp32": OnnxEmbedder(default_model_path(), threads=1)}
    if a.int8:
        nets["network int8"] = OnnxEmbedder(a.int8, threads=1)
    pre = nets["network fp32"].preprocessing
    side = pre.decode_side
    imgs = [load_image(f, mode=pre.mode, min_side=side) for f in files]
    for i in imgs[:50]:
        np.testing.assert_array_equal(pre.eval_array(i), five_pass(pre, i))
    x = np.stack([pre.eval_array(i) for i in imgs])
    steps = {
        "decode (load_image)": lambda: [load_image(f, mode=pre.mode, min_side=side) for f in files],
        "resize + crop (eval_image)": lambda: [pre.eval_image(i) for i in imgs],
        "to float, normalised: eval_array minus eval_image (today)": lambda: [pre.eval_array(i) for i in imgs],
        "to float, normalised: five passes (before)": lambda: [five_pass(pre, i) for i in imgs],
        **{n: (lambda e=e: [e.embed_arrays(x[j:j + 16]) for j in range(0, len(x), 16)]) for n, e in nets.items()},
    }
    cost: dict[str, list[float]] = {k: [] for k in steps}
    for r in range(a.rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            t0 = time.process_time()
            steps[name]()
            cost[name].append((time.process_time() - t0) / len(files) * 1e3)
    ms = {k: float(np.median(v)) for k, v in cost.items()}
    resize = ms["resize + crop (eval_image)"]
    ms["to float, normalised: eval_array minus eval_image (today)"] -= resize
    ms["to float, normalised: five passes (before)"] -= resize
    print(f"\n{len(files)} cub-dev photos, CPU ms per image, one thread, median of {a.rounds} alternating "
          f"rounds; today's eval_array gives the five-pass form's bits.\n")
    print("| step | CPU ms / image |\n| --- | ---: |")
    for k, v in ms.items():
        print(f"| {k} | {v:.2f} |")
    old, new = ms["to float, normalised: five passes (before)"], ms["to float, normalised: eval_array minus eval_image (today)"]
    print(f"\nnormalisation: {old / max(new, 1e-9):.1f}x less CPU; decode + preprocess per image "
          f"{ms['decode (load_image)'] + resize + old:.2f} -> {ms['decode (load_image)'] + resize + new:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
