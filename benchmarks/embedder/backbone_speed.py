"""Speed of timm backbones (ViT-S/14, ViT-B/16, ConvNeXt-T at 224 px) against the default Lite1
on the CPU, in one run: onnxruntime images/s on preprocessed photos (decode excluded), `indexer
build` images/s on real cub-dev photos (decode, preprocessing, ONNX, store, index), and the
trunk cache's size per image for ``trainable = "last:N"``.

Random weights (speed does not depend on them; no ViT weights are reachable here); each model is
the training-free embedder (pooled features, no head, L2) exported with the parity check, as
`python -m embedder pretrained --backbone timm:NAME` makes it. ORT calls are interleaved across
models and the builds alternate, so the ratios against Lite1 are measured under the same load;
the absolute rates move with the neighbours' load (stated with the figures). Prints a Markdown
section (with the command); --out PATH also puts it into that file (e.g. bench_out/embedder.md,
git-ignored). Kept figures: docs/benchmarks/embedder.md ("timm backbones").

    python -m benchmarks.embedder.backbone_speed --threads 2 --images 200 --min-time 3
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from embedder.cli import UsageError, run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.embedder.backbone_speed"
#: (label, backbone, pooling, trainable whose trunk cache is sized)
MODELS = [
    ("Lite1 (default)", "default", "gem", "last:2"),
    ("ViT-S/14 @ 224", "timm:vit_small_patch14_dinov2.lvd142m", "cls", "last:2"),
    ("ViT-B/16 @ 224", "timm:vit_base_patch16_clip_224.openai", "model", "last:2"),
    ("ConvNeXt-T @ 224", "timm:convnext_tiny.fb_in22k", "model", "last:1"),
]


def _build(backbone: str, pooling: str):
    import torch

    from embedder import Embedder, EmbedderConfig, pretrained_embedder
    from embedder import preprocessing_for

    torch.manual_seed(0)
    if backbone == "default":
        return pretrained_embedder()
    pre = preprocessing_for(backbone)
    if pre.input_size != 224:   # DINOv2's own 518 px: the issue's rows are at 224 (resize kept 1.0)
        pre = dataclasses.replace(pre, input_size=224, resize=round(224 * pre.resize / pre.input_size))
    return Embedder(EmbedderConfig(backbone=backbone, dim=0, pooling=pooling, pretrained=False), pre).eval()


def _cache_bytes(model, trainable: str, views: int) -> int:
    """Bytes per image of the trunk cache: (1 + views) activations of the frozen prefix, fp16."""
    import torch

    from training.stages import split_stages

    split = split_stages(model, trainable)
    x = torch.zeros(1, 3, model.preprocessing.input_size, model.preprocessing.input_size)
    with torch.no_grad():
        a = split.prefix(x)
    return int((1 + views) * a[0].numel() * 2)


def _gallery(root: Path, out: Path, n: int) -> Path:
    """The first n cub-dev photos (round robin over species), linked into out/<species>/."""
    species = sorted(p for p in root.iterdir() if p.is_dir())
    files = [sorted(s.glob("*.jpg")) for s in species]
    picked = [f for group in zip(*files) for f in group][:n]
    for f in picked:
        (out / f.parent.name).mkdir(parents=True, exist_ok=True)
        (out / f.parent.name / f.name).symlink_to(f)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads (ORT and the build)")
    ap.add_argument("--batch", type=int, default=32, help="ORT batch size")
    ap.add_argument("--images", type=int, default=200, help="cub-dev photos per `indexer build`")
    ap.add_argument("--builds", type=int, default=2, help="alternating builds per model (median)")
    ap.add_argument("--views", type=int, default=3, help="trunk_views for the cache size")
    ap.add_argument("--min-time", type=float, default=3.0, help="seconds per ORT model")
    ap.add_argument("--cub", type=Path, default=REPO.parent / "shared" / "data" / "cub-dev" / "images")
    ap.add_argument("--only", nargs="+", default=None, help="labels' first words to keep (e.g. Lite1 ViT-S/14)")
    ap.add_argument("--int8", action="store_true",
                    help="also each timm model's int8 version (`embedder quantize`: its MatMuls, dynamically)")
    ap.add_argument("--out", type=Path, default=None,
                    help="also write the section into this Markdown file (default: print only; kept "
                         "figures: docs/benchmarks/embedder.md)")
    return run_main(PROG, ap, argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int | None:
    if not args.cub.is_dir():
        raise UsageError(f"--cub {args.cub}: cub-dev images not found")

    import onnxruntime as ort
    import torch
    from tqdm import tqdm

    from benchmarks.embedder.embed_throughput import rates, write_section
    from embedder import default_parity_images, export_onnx, load_image
    from embedder.quantize import quantize_embedder
    from indexer import build_index

    torch.set_num_threads(args.threads)
    models = [m for m in MODELS if not args.only or m[0].split()[0] in args.only]
    photos = default_parity_images()
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        gallery = _gallery(args.cub, tmp / "gallery", args.images)
        sessions, onnx = [], {}
        for label, backbone, pooling, trainable in tqdm(models, desc="export"):
            model = _build(backbone, pooling)
            onnx[label] = export_onnx(model, tmp / f"{len(onnx)}.onnx", source_hash="random")
            if args.int8 and backbone.startswith("timm:"):
                onnx[f"{label}, int8"] = quantize_embedder(onnx[label], gallery, tmp / f"{len(onnx)}.onnx").out
            pre = model.preprocessing
            arrays = np.stack([pre.eval_array(load_image(p, mode=pre.mode)) for p in photos])
            batch = np.ascontiguousarray(np.resize(arrays, (args.batch, *arrays.shape[1:])), np.float32)
            so = ort.SessionOptions()
            so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = args.threads, 1, 3
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            for name in (n for n in onnx if n not in rows):
                sess = ort.InferenceSession(str(onnx[name]), so, providers=["CPUExecutionProvider"])
                sessions.append((sess, batch))
                rows[name] = {"backbone": backbone, "pooling": pooling, "trainable": trainable,
                              "dim": model.dim, "params": sum(p.numel() for p in model.parameters()),
                              "cache": _cache_bytes(model, trainable, args.views), "build": []}
            del model
        fns = [lambda x, s=s, b=b: s.run(None, {"x": b}) for s, b in sessions]
        measured = rates(fns, sessions[0][1], args.min_time)
        for label, r in zip(rows, measured):
            rows[label]["ort"] = r
        del sessions, fns
        for rep in range(args.builds):
            for label in tqdm(rows, desc=f"indexer build {rep + 1}/{args.builds}"):
                out = tmp / f"idx-{rep}-{list(rows).index(label)}"
                t0 = time.perf_counter()
                build_index(gallery, out, model=onnx[label], progress=False, workers=args.threads)
                rows[label]["build"].append(args.images / (time.perf_counter() - t0))
    load = os.getloadavg()[0]
    base = rows[models[0][0]]
    cmd = "python -m benchmarks.embedder.backbone_speed " + shlex.join(argv if argv is not None else sys.argv[1:])
    lines = [
        "## timm backbones: images/s on the CPU against the default Lite1 (issue 29)",
        "",
        f"Command: `{cmd}`  ",
        f"torch {torch.__version__}, onnxruntime {ort.__version__}, {args.threads} threads; random "
        f"weights (speed only), 224 px, training-free embedders (pooled features, L2); ORT at batch "
        f"{args.batch} on preprocessed photos, calls interleaved across models (median); `indexer "
        f"build` of {args.images} cub-dev photos, {args.builds} alternating builds per model "
        f"(median); trunk cache per image = (1 + {args.views} views) x the frozen prefix's output, "
        f"fp16. Load average {load:.1f} at the end on 2 cores shared with other jobs: compare the "
        f"ratios, not the absolute rates.",
        "",
        "| model | backbone | pooling | dim | params | ORT img/s | vs Lite1 | `indexer build` img/s | vs Lite1 | trunk cache / image |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, r in rows.items():
        b = float(np.median(r["build"]))
        lines.append(
            f"| {label} | `{r['backbone']}` | {r['pooling']} | {r['dim']} | {r['params'] / 1e6:.1f}M "
            f"| {r['ort']:.1f} | {r['ort'] / base['ort']:.2f}x | {b:.1f} | "
            f"{b / float(np.median(base['build'])):.2f}x | {r['cache'] / 1024:.0f} KiB ({r['trainable']}) |")
    for label in ("ViT-S/14 @ 224", "ViT-S/14 @ 224, int8"):
        if label in rows:
            b = float(np.median(rows[label]["build"]))
            lines += ["", f"Goal: a ViT-S gallery of 10,000 photos on 2 cores in <= 10 min ({label}): at "
                          f"the measured {b:.1f} img/s (`indexer build`, this load) 10,000 photos take "
                          f"{10000 / b / 60:.1f} min ({'met' if 10000 / b <= 600 else 'NOT met'} at this load)."]
    write_section(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
