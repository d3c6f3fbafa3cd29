"""What tracing activations out of place (``embedder.export_onnx`` does it) buys an ONNX export.

    python -m benchmarks.embedder.export_time [--rounds 2] [--model lite1-gem4]

torch's dynamo exporter with a dynamic batch (as ``export_onnx`` calls it) of a pretrained
network, its in-place activations (timm's ReLU6 / SiLU ``inplace=True``) as they come and switched
out of place, each export in a fresh process (a user exports once per process: the first export
pays torch.export's warm-up too), alternating. Why: decomposing each in-place op costs torch
~0.1 s of symbolic-shape work; the ONNX graphs are the same (checked here, node by node).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from embedder.cli import run_main

PROG = "python -m benchmarks.embedder.export_time"
MODES = ("in place (as built)", "out of place (export_onnx)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="processes per mode, alternating")
    ap.add_argument("--model", default=None, help="a pretrained spec (embedder.pretrained); default: the default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench_out/export_time"))
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    return run_main(PROG, ap, argv, handler=run)


def child(a: argparse.Namespace) -> dict:
    import warnings

    import torch

    from contextlib import nullcontext

    from embedder import out_of_place, pretrained_embedder

    torch.set_num_threads(a.threads)
    net = pretrained_embedder(a.model).eval()
    path = a.out / f"{MODES.index(a.child)}.onnx"
    side = net.preprocessing.input_size
    t0 = time.perf_counter()
    with warnings.catch_warnings(), (out_of_place(net) if a.child == MODES[1] else nullcontext(0)) as flipped:
        warnings.simplefilter("ignore")
        # the call embedder.export makes (dynamo, a dynamic batch), without its parity check
        torch.onnx.export(net, (torch.randn(2, 3, side, side),), str(path), dynamo=True, external_data=False,
                          optimize=True, verbose=False, dynamic_shapes={"x": {0: torch.export.Dim("batch")}},
                          input_names=["x"], output_names=["embedding"])
    return {"s": time.perf_counter() - t0, "flipped": flipped, "path": str(path)}


def _graph(path: str) -> list:
    """Op types, attributes and initializers of an ONNX file, without the value names (they differ)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(path)
    nodes = [(n.op_type, [str(onnx.helper.get_attribute_value(x)) for x in n.attribute]) for n in m.graph.node]
    inits = sorted((i.name, numpy_helper.to_array(i).tobytes()) for i in m.graph.initializer)
    return [nodes, inits]


def run(a: argparse.Namespace) -> int:
    if a.child:
        print(json.dumps(child(a)))
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    last: dict[str, dict] = {}
    for r in range(a.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            cmd = [sys.executable, "-m", "benchmarks.embedder.export_time", "--child", mode,
                   "--threads", str(a.threads), "--out", str(a.out), *(["--model", a.model] if a.model else [])]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            last[mode] = json.loads(out.strip().splitlines()[-1])
            times[mode].append(last[mode]["s"])
            print(f"round {r}: {mode}: {last[mode]['s']:.1f} s", flush=True)
    same = _graph(last[MODES[0]]["path"]) == _graph(last[MODES[1]]["path"])
    base, new = statistics.median(times[MODES[0]]), statistics.median(times[MODES[1]])
    result = {"model": a.model or "default", "threads": a.threads, "rounds": a.rounds,
              "median_s": {MODES[0]: base, MODES[1]: new}, "speedup": base / new,
              "activations_switched": last[MODES[1]]["flipped"], "same_graph": same}
    (a.out / "export_time.json").write_text(json.dumps(result, indent=2))
    print(f"median {base:.1f} s -> {new:.1f} s ({base / new:.2f}x), {result['activations_switched']} "
          f"activations switched, same ONNX graph: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
