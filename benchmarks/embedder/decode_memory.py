"""Memory of decoding large uploads, per format: the previous decoder vs the bounded one.

    python -m benchmarks.embedder.decode_memory [--megapixels 36] [--concurrent 1 4] [--bursts 1]
                                       [--formats ...] [--old-ref 7c84ca7] [--out PATH] [--plot PATH]
                                       [--webp-megapixels MP] [--modes old new]

Makes one camera-size image (default 7360 x 4912 = 36 MP, under the upload caps) from a
real photo (scikit-image's hubble_deep_field.jpg) and saves it in every format Pillow opens:
JPEG, PNG RGB / RGBA / palette, WebP, GIF, TIFF (uncompressed and LZW) and BMP. Then, each in a
fresh process so that its peak RSS (VmHWM) is its own, ``--bursts`` bursts of N simultaneous
"uploads" for each N in ``--concurrent``, decoded with

  * old:  ``embedder/images.py`` as it was at ``--old-ref`` (git show), ``load_image(min_side=)``:
          JPEG DCT scaling, every other format decoded at full size;
  * new:  this tree's ``serving.uploads.decode_upload(min_side=)`` (the same ``load_image`` the
          indexer's decode threads call): the bounded decode of :mod:`embedder.decode_budget`,

each followed by the embedder's preprocessing and a real embedding (pretrained EfficientNet-Lite0,
onnxruntime, 1 thread), as a search request does. Reports RSS before the bursts, the peak and
RSS after them (MB), refusals and seconds per burst. Prints the table; writes it only with --out
(e.g. bench_out/decode.md, git-ignored), and the plot only with --plot (RELIABILITY.md's figure is
benchmarks/embedder/decode_memory.png). The kept figures are in RELIABILITY.md ("Decoding memory").

Issue 28 adds containers (``--formats "ICO PNG" "CUR PNG" MPO "WebP anim" "GIF anim" APNG``):
an icon whose directory says 256 x 256 around a 12000 x 12000 PNG, and two-frame MPO, GIF, APNG
and WebP files at their caps; and per-burst figures: with ``--bursts 3`` each burst's own peak
(the high-water mark is reset before it) and RSS after it, both against RSS before the first
burst: one process serving burst after burst, as a long-running app does.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from embedder.cli import run_main

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m benchmarks.embedder.decode_memory"

FORMATS = {   # name -> (file name, how the base RGB photo is saved)
    "JPEG": "x.jpg", "PNG RGB": "rgb.png", "PNG RGBA": "rgba.png", "PNG palette": "pal.png",
    "WebP": "x.webp", "GIF": "x.gif", "TIFF": "x.tif", "TIFF LZW": "lzw.tif", "BMP": "x.bmp",
    # issue 28: containers whose frame is another format, or one of several frames
    "ICO PNG": "icon.ico", "CUR PNG": "cursor.cur", "MPO": "x.mpo", "WebP anim": "anim.webp",
    "GIF anim": "anim.gif", "APNG": "anim.png",
    # issue 39: libjpeg keeps a progressive file's whole coefficient buffer, whatever draft asks
    "JPEG progressive": "prog.jpg", "MPO progressive": "prog.mpo",
    # phones' HEIC (pillow-heif) and AVIF (Pillow's own plugin), decoded since 2026-11-29
    "HEIC": "x.heic", "AVIF": "x.avif",
}
CONTAINERS = ["ICO PNG", "CUR PNG", "MPO", "WebP anim", "GIF anim", "APNG"]
WEBP = ("WebP", "WebP anim")         # made at --webp-megapixels (just under WebP's own cap)
ICON_SIDE = 12000                    # the icon: "256x256" in its directory, 12000^2 PNG inside


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def _old_images(path: str):
    """The old decoder: ``path`` is its images.py, alone (before issue 19) or inside a package
    folder holding the embedder modules it imports relatively (``old_embedder/``)."""
    folder = Path(path).parent
    if (folder / "__init__.py").exists():
        sys.path.insert(0, str(folder.parent))
        return importlib.import_module(f"{folder.name}.images")
    spec = importlib.util.spec_from_file_location("old_images", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _write_old(ref: str, tmp: Path) -> Path:
    """embedder/images.py at ``ref`` (and the modules beside it that it imports) as a package."""
    pkg = tmp / "old_embedder"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("images.py", "decode_budget.py", "containers.py"):
        out = subprocess.run(["git", "show", f"{ref}:embedder/{name}"], cwd=REPO, capture_output=True, text=True)
        if out.returncode == 0:
            (pkg / name).write_text(out.stdout)
    return pkg / "images.py"


def _reset_peak() -> None:
    """VmHWM back to the current RSS (Linux clear_refs 5), so each burst's peak is its own."""
    Path("/proc/self/clear_refs").write_text("5")


# the uploads' pixel cap at the refs the old mode measures (40 MP until 2026-11-30; now load_image's)
OLD_UPLOAD_CAP = 40_000_000


def worker(mode: str, path: str, concurrent: int, bursts: int, old_module: str) -> dict:
    """Runs in its own process; returns the figures as a dict."""
    import numpy as np

    from embedder import ImageLoadError, OnnxEmbedder, default_model_path, load_image
    from serving.uploads import UploadError, decode_upload

    old = _old_images(old_module) if mode == "old" else None
    emb = OnnxEmbedder(default_model_path(), device="cpu", threads=1)
    pre = emb.preprocessing
    data = Path(path).read_bytes()
    emb.embed_arrays(np.zeros((1, 3, pre.input_size, pre.input_size), np.float32))   # warm the session
    gc.collect()
    before = _status_mb("VmRSS")
    outcomes: list[str] = []

    def one() -> None:
        try:
            if old is not None:
                img = old.load_image(data, mode="RGB", max_pixels=OLD_UPLOAD_CAP,
                                     min_side=pre.decode_side)
            else:
                img = decode_upload(data, Path(path).name, max_bytes=len(data), min_side=pre.decode_side)
            x = pre.eval_array(load_image(img, mode=pre.mode, min_side=pre.decode_side))
            emb.embed_arrays(x[None])
            outcomes.append(f"ok {img.size[0]}x{img.size[1]}")
        except (ImageLoadError, UploadError) as e:
            outcomes.append(f"refused: {e}")
        except Exception as e:  # noqa: BLE001 - the old decoder's own ImageLoadError (another class)
            refused = any(c.__name__ == "ImageLoadError" for c in type(e).__mro__)
            outcomes.append(f"{'refused' if refused else 'error'}: {e}")

    times, per_burst = [], []
    peak = before
    for _ in range(bursts):
        _reset_peak()
        threads = [threading.Thread(target=one) for _ in range(concurrent)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times.append(time.perf_counter() - t0)
        burst_peak = _status_mb("VmHWM")
        gc.collect()
        time.sleep(0.5)
        per_burst.append((burst_peak - before, _status_mb("VmRSS") - before))   # each vs the start
        peak = max(peak, burst_peak)
    return {"mode": mode, "concurrent": concurrent, "before_mb": before, "peak_mb": peak,
            "after_mb": _status_mb("VmRSS"), "burst_s": float(np.median(times)),
            "refused": sum(o.startswith("refused") for o in outcomes),
            "outcome": sorted(set(o[:400] for o in outcomes)), "per_burst": per_burst}


def make_images(out: Path, megapixels: float, names: list[str], webp_megapixels: float | None = None
                ) -> dict[str, Path]:
    import numpy as np
    from PIL import Image
    from skimage import data_dir

    from embedder import open_image  # noqa: F401 - importing it registers pillow-heif (which writes .heic)
    from benchmarks.inputs.container_files import ico_around, multi_frame, png_rows

    bases: dict[float, Image.Image] = {}

    def base_at(mp: float) -> Image.Image:
        if mp not in bases:
            bw = int(round((mp * 1e6 * 1.5) ** 0.5))      # 3:2, a camera's aspect
            bases[mp] = Image.open(Path(data_dir) / "hubble_deep_field.jpg").convert("RGB").resize(
                (bw, int(round(bw / 1.5))), Image.BICUBIC)
        return bases[mp]

    paths = {}
    for name in names:
        p = out / FORMATS[name]
        base = base_at(webp_megapixels if name in WEBP and webp_megapixels else megapixels)
        w, h = base.size
        if name in ("ICO PNG", "CUR PNG"):
            p.write_bytes(ico_around(png_rows(ICON_SIDE, ICON_SIDE, grey=128), cursor=name == "CUR PNG"))
        elif name in ("MPO", "GIF anim", "APNG", "WebP anim"):
            p.write_bytes(multi_frame(base, {"GIF anim": "GIF", "WebP anim": "WebP"}.get(name, name)))
        elif name == "PNG RGBA":
            rgba = base.copy()
            rgba.putalpha(Image.fromarray((np.add.outer(np.arange(h), np.arange(w)) % 256).astype(np.uint8)))
            rgba.save(p)
        elif name in ("PNG palette", "GIF"):
            base.quantize(256).save(p)
        elif name == "WebP":
            base.save(p, quality=80, method=0)
        elif name == "TIFF LZW":
            base.save(p, compression="tiff_lzw")
        elif name == "JPEG":
            base.save(p, quality=90)
        elif name == "JPEG progressive":            # 4:4:4, as the probe
            base.save(p, quality=90, progressive=True, subsampling=0)
        elif name == "MPO progressive":
            base.save(p, "MPO", save_all=True, append_images=[base.transpose(Image.FLIP_LEFT_RIGHT)],
                      quality=90, progressive=True, subsampling=0)
        else:
            base.save(p)
        paths[name] = p
        if name in WEBP or name in ("ICO PNG", "CUR PNG"):
            print(f"{name}: {Image.open(p).size if name in WEBP else (ICON_SIDE, ICON_SIDE)}", flush=True)
        print(f"made {p.name}: {p.stat().st_size / 1e6:.1f} MB", flush=True)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--megapixels", type=float, default=36.0)
    p.add_argument("--concurrent", type=int, nargs="+", default=[1, 4],
                   help="simultaneous uploads per burst, one run per value (default 1 4)")
    p.add_argument("--bursts", type=int, default=1)
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS), metavar="FORMAT",
                   help=f"default: all of {', '.join(FORMATS)}")
    p.add_argument("--old-ref", default="7c84ca7", help="git revision of the previous decoder (default 7c84ca7)")
    p.add_argument("--webp-megapixels", type=float, default=None,
                   help="make the WebP files this size instead (WebP's own cap is lower than the upload "
                        "cap: 10.5 MP with the default budget)")
    p.add_argument("--modes", nargs="+", default=["old", "new"], choices=["old", "new"],
                   help="which decoders to run (default both)")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the table to this Markdown file (default: print only; the kept "
                        "figures are in RELIABILITY.md)")
    p.add_argument("--plot", type=Path, default=None,
                   help="also draw the peaks to this PNG (RELIABILITY.md shows benchmarks/embedder/decode_memory.png)")
    p.add_argument("--no-write", action="store_true", help=argparse.SUPPRESS)  # the default now; old commands
    p.add_argument("--worker", nargs=3, metavar=("MODE", "PATH", "OLD"), help=argparse.SUPPRESS)
    return run_main(PROG, p, argv, handler=run)


def run(args: argparse.Namespace) -> int | None:
    a = args
    if a.worker:
        print(json.dumps(worker(a.worker[0], a.worker[1], a.concurrent[0], a.bursts, a.worker[2])))
        return 0
    from PIL import Image
    from tqdm import tqdm

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old_module = _write_old(a.old_ref, Path(tmp))
        images = make_images(Path(tmp), a.megapixels, a.formats, a.webp_megapixels)
        w, h = Image.open(images[a.formats[0]]).size if a.formats[0] not in ("ICO PNG", "CUR PNG") else (0, 0)
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        runs = [(f, n, m) for f in a.formats for n in a.concurrent for m in ("old", "new") if m in a.modes]
        for fmt, n, mode in tqdm(runs, desc="runs", unit="run"):
            out = subprocess.run([sys.executable, "-m", "benchmarks.embedder.decode_memory", "--worker", mode,
                                  str(images[fmt]), str(old_module), "--concurrent", str(n),
                                  "--bursts", str(a.bursts)], env=env, cwd=REPO, capture_output=True, text=True)
            if out.returncode != 0:      # e.g. killed for memory: a row that says so
                r = {"mode": mode, "concurrent": n, "error": f"exit {out.returncode}: "
                     + (out.stderr.strip().splitlines() or ["?"])[-1][:120]}
            else:
                r = json.loads(out.stdout.strip().splitlines()[-1])
            r.update(format=fmt, file_mb=images[fmt].stat().st_size / 1e6)
            rows.append(r)
            tqdm.write(json.dumps(r))
    text = _table(rows, a, w, h)
    print(text)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text("# Decoding memory (benchmarks/embedder/decode_memory.py)\n\n" + text)
    if a.plot is not None:
        a.plot.parent.mkdir(parents=True, exist_ok=True)
        _plot(rows, a.plot, f"{w} x {h} ({w * h / 1e6:.0f} MP)")
    return 0


def _table(rows: list[dict], a: argparse.Namespace, w: int, h: int, load: float | None = None) -> str:
    conc = " ".join(map(str, a.concurrent))
    extra = ""
    if a.formats != list(FORMATS)[:9]:
        extra += " --formats " + " ".join(f'"{f}"' if " " in f else f for f in a.formats)
    if a.webp_megapixels:
        extra += f" --webp-megapixels {a.webp_megapixels:g}"
    if a.old_ref != "7c84ca7":
        extra += f" --old-ref {a.old_ref}"
    if a.modes != ["old", "new"]:
        extra += " --modes " + " ".join(a.modes)
    what_size = f"{w} x {h} ({w * h / 1e6:.1f} MP)" if w else f"{a.megapixels:g} MP"
    if a.webp_megapixels:
        what_size += f", WebP at {a.webp_megapixels:g} MP"
    if any(f in ("ICO PNG", "CUR PNG") for f in a.formats):
        what_size += (f"; ICO/CUR: a {ICON_SIDE} x {ICON_SIDE} PNG inside a directory that says 256 x 256 "
                      "(the issue's icon)")
    head = (f"Command: `python -m benchmarks.embedder.decode_memory --megapixels {a.megapixels:g} --concurrent {conc} "
            f"--bursts {a.bursts}{extra}`  \n"
            f"Upload: {what_size} made from scikit-image's hubble_deep_field.jpg, saved in "
            f"each format; {a.bursts} burst(s) of N simultaneous uploads, each decoded, preprocessed and "
            f"embedded (pretrained EfficientNet-Lite0, onnxruntime, 1 thread); one fresh process per run; "
            f"old = embedder/images.py at {a.old_ref}; load average "
            f"{os.getloadavg()[0] if load is None else load:.1f} at the end "
            f"(2 shared cores). Goal: peak - before < 200 MB at N = 4, after - before < 50 MB.\n\n"
            "| format | file MB | N | run | RSS before MB | peak - before MB | after - before MB | s per burst | outcome |"
            + (" per burst: peak / after - before MB |" if a.bursts > 1 else "") + "\n"
            "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |" + (" --- |" if a.bursts > 1 else "") + "\n")
    body = ""
    for r in rows:
        if "error" in r:
            body += f"| {r['format']} | {r['file_mb']:.1f} | {r['concurrent']} | {r['mode']} | | | | | {r['error']} |\n"
            continue
        msg = r["outcome"][0] if r["outcome"] else "no outcome recorded"
        reason = msg[msg.find("needs about"):].split(", so ")[0] if "needs about" in msg else \
            msg.split(": ", 2)[-1][:110]
        what = f"{r['refused']}/{r['concurrent'] * a.bursts} refused: " + reason if r["refused"] else msg
        bursts = (" " + ", ".join(f"{p:.0f} / {q:.0f}" for p, q in r.get("per_burst", [])) + " |"
                  if a.bursts > 1 else "")
        body += (f"| {r['format']} | {r['file_mb']:.1f} | {r['concurrent']} | {r['mode']} | {r['before_mb']:.0f} | "
                 f"{r['peak_mb'] - r['before_mb']:.0f} | {r['after_mb'] - r['before_mb']:.0f} | {r['burst_s']:.2f} | "
                 f"{what.replace('|', '/')} |{bursts}\n")
    new4 = [r for r in rows if r["mode"] == "new" and r["concurrent"] == max(a.concurrent) and "error" not in r]
    tail = ""
    if new4:
        worst = max(new4, key=lambda r: r["peak_mb"] - r["before_mb"])
        resid = max(new4, key=lambda r: r["after_mb"] - r["before_mb"])
        tail = (f"\nNew, {max(a.concurrent)} at once: highest peak above baseline **{worst['peak_mb'] - worst['before_mb']:.0f} MB** "
                f"({worst['format']}), highest residual **{resid['after_mb'] - resid['before_mb']:.0f} MB** ({resid['format']}).\n")
    return head + body + tail


def _plot(rows: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(r["concurrent"] for r in rows)
    fmts = list(dict.fromkeys(r["format"] for r in rows))
    fig, ax = plt.subplots(figsize=(9.6, 4.6))
    width = 0.2
    for k, (mode, key, label) in enumerate((("old", "peak_mb", "old peak"), ("new", "peak_mb", "new peak"),
                                             ("old", "after_mb", "old residual"), ("new", "after_mb", "new residual"))):
        vals = []
        for f in fmts:
            r = next((r for r in rows if r["format"] == f and r["mode"] == mode and r["concurrent"] == n), None)
            vals.append(max(1.0, r[key] - r["before_mb"]) if r and "error" not in r else 0.0)
        ax.bar([i + (k - 1.5) * width for i in range(len(fmts))], vals, width=width, label=label)
    ax.axhline(200, color="k", lw=0.8, ls="--")
    ax.text(len(fmts) - 0.5, 210, "goal: peak < 200 MB", ha="right", fontsize=8)
    ax.set_yscale("log")
    refused = {r["format"] for r in rows if r["mode"] == "new" and r.get("refused")}
    ax.set_xticks(range(len(fmts)), [f + ("\n(new: refused)" if f in refused else "") for f in fmts], fontsize=8)
    ax.set_ylabel("RSS above baseline (MB, log)")
    ax.set_title(f"Decode memory, {n} uploads at once, {title}")
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
