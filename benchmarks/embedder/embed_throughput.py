"""Images/s of torch eager vs onnxruntime on CPU for the default backbones, in one run.

Both sides get the same preprocessed real photos (scikit-image) and the same thread count, so
the ratio ORT/torch is measured on one machine at one moment; absolute numbers on a shared
CPU move with the neighbours' load, the ratio much less. Decoding is excluded: this measures
the network. Prints a Markdown table (with the command); --out PATH also puts it into that
file (e.g. bench_out/embedder.md, git-ignored). Kept figures: docs/benchmarks/embedder.md.

    python -m benchmarks.embedder.embed_throughput --threads 2 --min-time 3
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from embedder.cli import UsageError, run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.embedder.embed_throughput"

OPT_LEVELS = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
              "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}


def _build(name: str):
    import torch

    from embedder import Embedder, EmbedderConfig, pretrained_embedder

    from embedder.pretrained import DEFAULT

    torch.manual_seed(0)
    if name == "efficientnet_lite0":   # the pretrained default before issue 23
        return pretrained_embedder("lite0-avg"), "pretrained ImageNet, avg, 224 px, 1280-d"
    if name == "default":              # today's pretrained default (embedder.pretrained.DEFAULT)
        return pretrained_embedder(DEFAULT), f"pretrained ImageNet, {DEFAULT} (default), 1280-d"
    if name.startswith("timm:"):       # issue 29: any timm model, training-free form, at 224 px
        import dataclasses

        from embedder import preprocessing_for

        pre = preprocessing_for(name)
        if pre.input_size != 224:
            pre = dataclasses.replace(pre, input_size=224,
                                      resize=round(224 * pre.resize / pre.input_size))
        pooling = "cls" if "dinov2" in name else "model"
        model = Embedder(EmbedderConfig(backbone=name, dim=0, pooling=pooling), pre).eval()
        return model, f"random init, {pooling} pooling, 224 px, {model.dim}-d"
    dim = 64 if name == "small_cnn" else 128
    return Embedder(EmbedderConfig(backbone=name, dim=dim)).eval(), f"random init, {dim}-d"


def rates(fns, batch: np.ndarray, min_time: float, min_reps: int = 3) -> list[float]:
    """Images/s for each fn, calls interleaved so every side sees the same neighbours' load.

    The median call time is used: on a CPU shared with other jobs a few calls are slowed by
    descheduled threads, and the median ignores those without favouring either side.
    """
    for fn in fns:
        fn(batch)  # warm-up (allocations, ORT kernel selection, oneDNN primitive caches)
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while len(times[0]) < min_reps or time.perf_counter() - start < min_time * len(fns):
        for t, fn in zip(times, fns):
            t0 = time.perf_counter()
            fn(batch)
            t.append(time.perf_counter() - t0)
    return [len(batch) / float(np.median(t)) for t in times]


def write_section(path: Path | None, lines: list[str]) -> None:
    """Print ``lines`` and, unless ``path`` is None, put them into ``path`` as the section headed
    ``lines[0]``: the old section (up to the next ``## `` heading) replaced, or the new one
    appended. The file may hold other benchmarks' sections too (backbone_speed.py)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text().split("\n") if path.is_file() else []
    start = next((i for i, line in enumerate(old) if line.strip() == lines[0]), None)
    if start is not None:
        end = next((i for i in range(start + 1, len(old)) if old[i].startswith("## ")), len(old))
        text = "\n".join(old[:start] + lines + [""] + old[end:]).rstrip("\n") + "\n"
    elif old:
        text = "\n".join(old).rstrip("\n") + "\n\n" + text
    path.write_text(text)
    print(f"wrote {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--backbones", nargs="+", default=["efficientnet_lite0", "default", "resnet50", "small_cnn"],
                    help="efficientnet_lite0: the old pretrained default (avg pooling); default: "
                         "embedder.pretrained.DEFAULT; resnet18|34|50, small_cnn and timm:NAME "
                         "(e.g. timm:vit_small_patch14_dinov2.lvd142m, at 224 px) random init")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="intra-op thread counts to measure (same for torch and ORT)")
    ap.add_argument("--opt-level", choices=sorted(OPT_LEVELS), default="all",
                    help="onnxruntime graph optimisation level")
    ap.add_argument("--spin", action="store_true", help="let ORT worker threads spin between runs")
    ap.add_argument("--min-time", type=float, default=1.5, help="seconds per measurement")
    ap.add_argument("--out", type=Path, default=None,
                    help="also write the table into this Markdown file as its section (default: print "
                         "only; kept figures: docs/benchmarks/embedder.md)")
    return run_main(PROG, ap, argv, handler=lambda args: run(args, argv))


def run(args: argparse.Namespace, argv: list[str] | None) -> int | None:
    known = {"efficientnet_lite0", "default", "resnet18", "resnet34", "resnet50", "small_cnn"}
    bad = [b for b in args.backbones if b not in known and not b.startswith("timm:")]
    if bad:
        raise UsageError(f"--backbones {bad[0]!r}: expected one of {', '.join(sorted(known))} "
                         "or timm:NAME")
    if min(args.threads) < 1 or args.min_time <= 0 or min(args.batch_sizes) < 1:
        raise UsageError("--threads, --min-time and --batch-sizes must be positive")

    import onnxruntime as ort
    import torch
    from tqdm import tqdm

    from embedder import default_parity_images, export_onnx, load_image

    photos = default_parity_images()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in tqdm(args.backbones, desc="backbones"):
            model, what = _build(name)
            path = export_onnx(model, Path(tmp) / f"{name}.onnx")  # includes the parity check
            pre = model.preprocessing
            arrays = np.stack([pre.eval_array(load_image(p, mode=pre.mode)) for p in photos])
            for threads in args.threads:
                torch.set_num_threads(threads)
                so = ort.SessionOptions()
                so.intra_op_num_threads = threads
                so.inter_op_num_threads = 1
                so.graph_optimization_level = getattr(ort.GraphOptimizationLevel,
                                                      OPT_LEVELS[args.opt_level])
                so.log_severity_level = 3
                if not args.spin:  # spinning ORT threads would steal the CPU from the next torch call
                    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
                sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

                def run_torch(x: np.ndarray) -> None:
                    with torch.inference_mode():
                        model(torch.from_numpy(x))

                def run_ort(x: np.ndarray) -> None:
                    sess.run(None, {"x": x})

                for bs in args.batch_sizes:
                    batch = np.ascontiguousarray(np.resize(arrays, (bs, *arrays.shape[1:])), np.float32)
                    t_rate, o_rate = rates([run_torch, run_ort], batch, args.min_time)
                    rows.append((name, what, threads, bs, t_rate, o_rate))
                    tqdm.write(f"{name} threads={threads} batch={bs}: torch {t_rate:.1f} img/s, "
                               f"ORT {o_rate:.1f} img/s ({o_rate / t_rate:.2f}x)")

    cmd = "python -m benchmarks.embedder.embed_throughput " + shlex.join(argv if argv is not None else sys.argv[1:])
    lines = [
        "## Embedder throughput: torch eager vs onnxruntime (CPU)",
        "",
        f"Command: `{cmd}`  ",
        f"torch {torch.__version__}, onnxruntime {ort.__version__}, same intra-op thread count on both sides, "
        f"ORT optimisation level `{args.opt_level}`; preprocessed real photos, decoding excluded; "
        "calls interleaved, median call time; CPU shared with other jobs (load average "
        f"{os.getloadavg()[0]:.1f} at the end of the run), so compare the ratio, not the absolute rates.",
        "",
        "| backbone | weights | threads | batch | torch img/s | ORT img/s | ORT/torch |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, what, threads, bs, t, o in rows:
        lines.append(f"| {name} | {what} | {threads} | {bs} | {t:.1f} | {o:.1f} | {o / t:.2f}x |")
    b32 = [r for r in rows if r[3] == 32]
    if b32:
        ok = all(r[5] / r[4] >= 1.5 for r in b32)
        lines += ["", f"Goal ORT >= 1.5x torch eager at batch 32: {'met' if ok else 'NOT met'} "
                      f"({', '.join(f'{r[0]}/{r[2]}t {r[5] / r[4]:.2f}x' for r in b32)})."]
    write_section(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
