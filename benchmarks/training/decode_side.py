"""What a training sample of a phone photo costs when decoded whole against decoded as small as
the transform needs (``Preprocessing.train_decode_side``; the test split: ``decode_side``).

    python -m benchmarks.training.decode_side [--photos 8] [--rounds 3]

Phone-sized JPEGs (12 MP 4032x3024 and 48 MP 8064x6048, quality 90) made from cub-dev photos,
upscaled (their content is smooth: real phone photos carry more detail, so decode more slowly;
the ratio is what counts). Per photo and round, alternating: ``load_image`` + the training
transform (RandomResizedCrop, flip, tensor) and ``load_image`` + the eval transform, whole vs
reduced; CPU time of one thread (``time.process_time``), the default embedder's preprocessing
(224 px, resize 256). Why: the training loaders decoded every photo whole, every epoch.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from embedder.cli import run_main

PROG = "python -m benchmarks.training.decode_side"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
SIZES = {"12 MP": (4032, 3024), "48 MP": (8064, 6048)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--photos", type=int, default=8, help="cub-dev photos, one per folder")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cub", type=Path, default=SHARED / "cub-dev" / "images")
    return run_main(PROG, ap, argv, handler=run)


def run(a: argparse.Namespace) -> int:
    import torch
    from PIL import Image

    from embedder import Preprocessing, load_image

    torch.set_num_threads(1)
    pre = Preprocessing(input_size=224, resize=256)
    train_t, eval_t = pre.train_transform(), pre.eval_transform()
    folders = sorted(d for d in a.cub.iterdir() if d.is_dir())[: a.photos]
    if not folders:
        raise ValueError(f"--cub {a.cub}: no class folders")
    sources = [sorted(d.glob("*.jpg"))[0] for d in folders]
    print(f"{len(sources)} photos x {a.rounds} rounds; decode sides: training {pre.train_decode_side}, "
          f"test {pre.decode_side} (whole: None)")
    print("| photo | what | whole (ms) | reduced (ms) | whole / reduced |")
    print("| --- | --- | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for label, size in SIZES.items():
            files = []
            for i, src in enumerate(sources):
                f = Path(tmp) / f"{label.split()[0]}_{i}.jpg"
                Image.open(src).convert("RGB").resize(size, Image.BICUBIC).save(f, quality=90)
                files.append(f)
            for what, transform, side in (("training sample", train_t, pre.train_decode_side),
                                          ("test image", eval_t, pre.decode_side)):
                t = {None: [], side: []}
                for _ in range(a.rounds):
                    for f in files:
                        for s in (None, side) if len(t[None]) % 2 == 0 else (side, None):
                            c = time.process_time()
                            transform(load_image(f, min_side=s))
                            t[s].append(time.process_time() - c)
                whole, reduced = 1e3 * np.median(t[None]), 1e3 * np.median(t[side])
                print(f"| {label} | {what} | {whole:.0f} | {reduced:.0f} | {whole / reduced:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
