"""int8 embedders (issue 30): `python -m embedder quantize` and `indexer build --int8`.

Real parts only: the shipped pretrained embedder quantised by onnxruntime on real cub-dev
photos, a real index built with it, retrieval compared with the fp32 model on the same photos.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from embedder import OnnxEmbedder
from embedder.hashing import file_sha256
from embedder.metrics import evaluate

REPO = Path(__file__).resolve().parents[2]


def _run(module: str, *args: object) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=600)


def _int8_weights(path: Path) -> int:
    """How many int8 weight tensors the graph holds (0 for an fp32 model)."""
    return sum(t.data_type == onnx.TensorProto.INT8 for t in onnx.load(str(path)).graph.initializer)


@pytest.fixture(scope="session")
def cub_gallery(tmp_path_factory, cub_root) -> tuple[Path, list[Path], np.ndarray]:
    """The first 12 photos of the last 8 cub-dev species (test half), as a class-folder gallery."""
    root = tmp_path_factory.mktemp("int8-gallery") / "gallery"
    files, labels = [], []
    for i, d in enumerate(sorted(p for p in cub_root.iterdir() if p.is_dir())[-8:]):
        (root / d.name).mkdir(parents=True)
        for f in sorted(d.glob("*.jpg"))[:12]:
            shutil.copy2(f, root / d.name / f.name)
            files.append(root / d.name / f.name)
            labels.append(i)
    return root, files, np.array(labels)


@pytest.fixture(scope="session")
def int8_index(cub_gallery, pretrained_onnx, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`indexer build --model LITE1 --int8 --no-dba` of the gallery (quantises the Lite1 default
    on it, named so that a CPU with int8 dot products does not pick the two-backbone one; 96
    photos: int8 only when asked, DBA off so a photo's own score stays ~1)."""
    out = tmp_path_factory.mktemp("int8-index") / "idx"
    r = _run("indexer", "build", cub_gallery[0], "--model", pretrained_onnx, "--out", out, "--int8",
             "--no-dba", "--quiet")
    assert r.returncode == 0, r.stderr
    return out, r


def test_build_int8_indexes_with_the_quantised_default(int8_index, pretrained_onnx):
    out, _ = int8_index
    manifest = json.loads((out / "manifest.json").read_text())
    meta = manifest["model"]["metadata"]
    q = json.loads(meta["quantization"])
    fp32 = OnnxEmbedder(pretrained_onnx)
    # the int8 model is the default's, with its preprocessing carried over
    assert q["fp32_sha256"] == fp32.model_hash and q["calibration_images"] == 96
    assert json.loads(meta["preprocessing"]) == json.loads(fp32.metadata["preprocessing"])
    assert manifest["model"]["dim"] == 1280 and manifest["model"]["normalized"] and manifest["count"] == 96
    assert _int8_weights(out / "model.onnx") > 50 and _int8_weights(pretrained_onnx) == 0
    # the stem convolution (reads the pixels) stays float: its weights are not int8
    assert len(q["float_nodes"]) == 1
    weights = {t.name: t.data_type for t in onnx.load(str(out / "model.onnx")).graph.initializer}
    assert weights["backbone.net.conv_stem.weight"] == onnx.TensorProto.FLOAT


def test_build_int8_rerun_resumes_with_the_same_model(int8_index, cub_gallery, pretrained_onnx, tmp_path):
    """Same gallery -> same calibration -> same int8 file: nothing is embedded again."""
    out, first = int8_index
    before = json.loads((out / "manifest.json").read_text())["model"]["hash"]
    r = _run("indexer", "build", cub_gallery[0], "--model", pretrained_onnx, "--out", out, "--int8",
             "--no-dba", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "0 new, 96 unchanged" in r.stdout
    assert json.loads((out / "manifest.json").read_text())["model"]["hash"] == before
    # that int8 model given as --model (96 photos: too few to quantise) is used as it is, no fp32 line
    shutil.copy2(out / "model.onnx", tmp_path / "int8.onnx")
    r = _run("indexer", "build", cub_gallery[0], "--model", tmp_path / "int8.onnx", "--out", out, "--no-dba", "--quiet")
    assert r.returncode == 0 and "0 new, 96 unchanged" in r.stdout and "fp32" not in r.stderr, r.stderr
    assert json.loads((out / "manifest.json").read_text())["model"]["hash"] == before


def test_int8_index_is_searched_with_its_int8_model(int8_index, cub_gallery):
    """What the app and `indexer search` do: open the index (model checked) and embed a query
    with the index's own int8 copy; a gallery photo finds itself first."""
    out, _ = int8_index
    _, files, _ = cub_gallery
    r = _run("indexer", "search", files[5], "-k", "3", "--index", out, "--json")
    assert r.returncode == 0, r.stderr
    hits = json.loads(r.stdout)
    assert hits[0]["path"].endswith(files[5].name) and hits[0]["score"] > 0.99


def test_int8_retrieves_like_fp32(int8_index, cub_gallery, pretrained_onnx):
    """Same photos through both models: embeddings nearly parallel, ranking quality kept."""
    _, files, labels = cub_gallery
    a = OnnxEmbedder(pretrained_onnx).embed(files)
    b = OnnxEmbedder(int8_index[0] / "model.onnx").embed(files)
    cos = (a * b).sum(1)
    assert cos.mean() > 0.98 and np.allclose(np.linalg.norm(b, axis=1), 1, atol=1e-4)
    ra, rb = evaluate(a, labels, clustering=False), evaluate(b, labels, clustering=False)
    assert abs(ra["R@1"] - rb["R@1"]) <= 3 / len(files) and abs(ra["MAP@R"] - rb["MAP@R"]) <= 0.02, (ra, rb)


@pytest.mark.parametrize("module,argv,fragment", [
    ("embedder", ["quantize", "--help"], "--calibration DIR"),
    ("indexer", ["build", "--help"], "--int8"),
    ("embedder", ["pretrained", "--help"], "lite0+lite1-gem4"),
])
def test_help_names_the_new_options(module, argv, fragment):
    r = _run(module, *argv)
    assert r.returncode == 0 and fragment in r.stdout


def test_quantize_cli_skips_a_corrupt_image_and_carries_metadata(small_onnx, omniglot_paths, tmp_path):
    calib = tmp_path / "calib"
    calib.mkdir()
    for f in omniglot_paths[:12]:
        shutil.copy2(f, calib / f"{f.parent.name}-{f.name}")
    (calib / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    out = tmp_path / "small-int8.onnx"
    r = _run("embedder", "quantize", small_onnx, "--calibration", calib, "--out", out, "--quiet")
    assert r.returncode == 0, r.stderr
    assert "broken.png" in r.stderr and "1 skipped" in r.stdout and "12 images" in r.stdout
    meta = OnnxEmbedder(out).metadata
    fp32 = OnnxEmbedder(small_onnx).metadata
    assert {k: v for k, v in meta.items() if k != "quantization"} == fp32
    assert json.loads(meta["quantization"])["fp32_sha256"] == file_sha256(small_onnx)
    assert _int8_weights(out) > 0
    # an int8 model is not quantised twice
    r = _run("embedder", "quantize", out, "--calibration", calib, "--out", tmp_path / "again.onnx")
    assert r.returncode == 1 and "already quantised" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_quantize_calibrates_in_bounded_memory(pretrained_onnx, cub_gallery, tmp_path):
    """onnxruntime's calibration session holds ~125 MB an image of Lite1's activations: at the
    old batch of 16, quantising Lite1 peaked at 1.34 GB (the two-backbone default's first
    `indexer build`: 5.2 GB); at the default batch (2) ~0.5 GB (1.9 GB)."""
    calib = tmp_path / "calib"
    calib.mkdir()
    for f in cub_gallery[1][::6]:
        shutil.copy2(f, calib / f"{f.parent.name}-{f.name}")
    # VmHWM: this process's own peak (ru_maxrss would start at the forking pytest worker's RSS)
    wrap = ("import runpy, sys; sys.argv = ['embedder', *sys.argv[1:]]\n"
            "try: runpy.run_module('embedder', run_name='__main__')\n"
            "finally: print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0], file=sys.stderr)")
    out = tmp_path / "q.onnx"
    r = subprocess.run([sys.executable, "-c", wrap, "quantize", str(pretrained_onnx), "--calibration",
                        str(calib), "--out", str(out), "--quiet"], capture_output=True,
                       text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "2"},
                       timeout=600)
    assert r.returncode == 0 and "calibrated on 16 images" in r.stdout, r.stderr
    peak_gb = int(r.stderr.split()[-1]) / 1e6
    assert peak_gb < 0.9, peak_gb


@pytest.mark.parametrize("case,fragment", [
    ("missing", "calibration folder not found"),
    ("empty", "no images"),
    ("corrupt", "none of the 2 calibration images could be read"),
])
def test_quantize_bad_calibration_one_line_error(case, fragment, small_onnx, tmp_path):
    calib = tmp_path / "calib"
    if case != "missing":
        calib.mkdir()
    if case == "corrupt":
        (calib / "a.jpg").write_bytes(b"not a jpeg")
        (calib / "b.png").write_bytes(b"")
    out = tmp_path / "q.onnx"
    r = _run("embedder", "quantize", small_onnx, "--calibration", calib, "--out", out, "--quiet")
    assert r.returncode == 1 and fragment in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def test_calibration_follows_linked_class_folders_once(tmp_path: Path, cub_root) -> None:
    """A calibration folder made of links to class folders (how a gallery is often assembled,
    and what `indexer build` follows) is read through its links; a link back up is walked once."""
    from embedder.quantize import calibration_files

    classes = sorted(p for p in cub_root.iterdir() if p.is_dir())[:2]
    cal = tmp_path / "cal"
    cal.mkdir()
    for c in classes:
        (cal / c.name).symlink_to(c, target_is_directory=True)
    (cal / "loop").symlink_to(cal, target_is_directory=True)
    (cal / ".thumbnails").mkdir()                      # hidden: not walked, as by `indexer build`
    shutil.copy(next(classes[0].glob("*.jpg")), cal / ".thumbnails")
    files = calibration_files(cal, n=10_000)
    want = sum(1 for c in classes for f in c.iterdir() if f.suffix.lower() in (".jpg", ".jpeg", ".png"))
    assert len(files) == want and want > 0
    assert {f.parent.name for f in files} == {c.name for c in classes}


@pytest.fixture(scope="module")
def default_and_corrected(pretrained_onnx, cub_gallery, tmp_path_factory):
    """The default embedder quantised on every 12th gallery photo (8: a calibration of 32 costs
    twice as much in the suite) with the default recipe, and with the same recipe plus bias
    correction: {"default" | "corrected": (path, report)}."""
    from dataclasses import replace

    from embedder.quantize import DEFAULT_RECIPE, quantize_embedder

    _, files, _ = cub_gallery
    tmp = tmp_path_factory.mktemp("recipes")
    out = {}
    for name, recipe in (("default", DEFAULT_RECIPE), ("corrected", replace(DEFAULT_RECIPE, bias_correction=True))):
        out[name] = (tmp / f"{name}.onnx", quantize_embedder(pretrained_onnx, files[::12], tmp / f"{name}.onnx",
                                                            recipe=recipe))
    return out


def test_default_recipe_is_applied_and_its_float_nodes_stay_float(pretrained_onnx, cub_gallery,
                                                                  default_and_corrected):
    """The recipe chosen on cub-val (issue 41, embedder.quantize.DEFAULT_RECIPE) is what runs:
    its method and options are in the metadata, the nodes it keeps float are float in the int8
    graph (fp32 weights, no QuantizeLinear on their outputs) while the rest is int8, and the
    int8 embeddings stay parallel to fp32's (the check quantize_embedder makes)."""
    from embedder.quant_graph import float_node_names
    from embedder.quantize import DEFAULT_RECIPE

    _, files, _ = cub_gallery
    out, r = default_and_corrected["default"]
    q = json.loads(OnnxEmbedder(out).metadata["quantization"])
    assert (q["calibration"], q["per_channel"], q["float_policy"], q["reduce_range"], q["bias_correction"]) == (
        DEFAULT_RECIPE.method, DEFAULT_RECIPE.per_channel, DEFAULT_RECIPE.float_nodes,
        DEFAULT_RECIPE.reduce_range, DEFAULT_RECIPE.bias_correction)
    assert DEFAULT_RECIPE.tag == "minmax-pc-stem-256-rr"   # the recipe chosen on cub-val (issue 41)
    assert q["calibration_images"] == len(files[::12])
    want = float_node_names(onnx.load(str(pretrained_onnx)), DEFAULT_RECIPE.float_nodes)
    assert q["float_nodes"] == want and want
    g = onnx.load(str(out)).graph
    kinds = {t.name: t.data_type for t in g.initializer}
    nodes = {n.name: n for n in g.node}
    consumers: dict[str, list[str]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n.op_type)
    for name in want:
        n = nodes[name]      # still in the graph, not fused into a quantised op
        if n.op_type == "Conv":
            assert kinds[n.input[1]] == onnx.TensorProto.FLOAT, name
        assert "QuantizeLinear" not in [c for o in n.output for c in consumers.get(o, [])], name
    quantised_convs = [n for n in g.node if n.op_type == "Conv" and n.name not in want]
    assert quantised_convs and all(kinds.get(n.input[1]) is None for n in quantised_convs)  # via DequantizeLinear
    assert r.mean_cosine >= 0.97 and r.min_cosine >= 0.9, (r.mean_cosine, r.min_cosine)


def test_bias_correction_moves_only_biases_and_brings_int8_closer_to_fp32(pretrained_onnx, cub_gallery,
                                                                          default_and_corrected):
    """Bias correction changes the int32 biases of the quantised convs and nothing else, and on
    photos the calibration never saw the corrected int8 embeddings are closer to fp32's (cub-val,
    1,480 photos: mean cosine 0.983 -> 0.996; here ~0.983 -> ~0.996 too)."""
    _, files, _ = cub_gallery
    held_out = [f for i, f in enumerate(files) if i % 12][:32]
    graphs = {k: onnx.load(str(p)).graph for k, (p, _) in default_and_corrected.items()}
    arrays = {k: {t.name: onnx.numpy_helper.to_array(t) for t in g.initializer} for k, g in graphs.items()}
    assert arrays["default"].keys() == arrays["corrected"].keys()
    changed = {n for n, a in arrays["corrected"].items() if not np.array_equal(a, arrays["default"][n])}
    biases = {n.input[0] for n in graphs["corrected"].node
              if n.op_type == "DequantizeLinear" and n.input[0].endswith("_bias_quantized")}
    assert changed and all(n.endswith("_bias_quantized") for n in changed), sorted(changed)[:5]
    assert len(changed) >= 0.9 * len(biases) > 0          # (nearly) every quantised conv
    fp32 = OnnxEmbedder(pretrained_onnx).embed(held_out)
    cos = {}
    for k, (path, _) in default_and_corrected.items():
        e = OnnxEmbedder(path).embed(held_out)
        cos[k] = float(((e * fp32).sum(1) / np.linalg.norm(e, axis=1) / np.linalg.norm(fp32, axis=1)).mean())
    assert cos["corrected"] > cos["default"] + 0.004, cos


def test_drawings_the_default_quantises_badly_get_their_biases_corrected(pretrained_onnx, omniglot_paths,
                                                                        tmp_path):
    """Line drawings (Omniglot): the default recipe's int8 model misses the int8/fp32 check (mean
    cosine ~0.93 < 0.95, which stopped `indexer build` at its default on such a gallery), so its
    biases are corrected (~0.996) and that model is written, its metadata saying so, with one
    line why; the recipe without that fallback refuses the same calibration, nothing written."""
    from dataclasses import replace

    from embedder.quantize import DEFAULT_RECIPE, MIN_MEAN_COSINE, QuantizationError, quantize_embedder

    files, lines = omniglot_paths[:16], []
    r = quantize_embedder(pretrained_onnx, files, tmp_path / "q.onnx", log=lines.append)
    q = json.loads(OnnxEmbedder(r.out).metadata["quantization"])
    assert q["bias_correction"] is True and r.mean_cosine >= MIN_MEAN_COSINE, (q, r.mean_cosine)
    assert len(lines) == 1 and "correcting the int8 convolutions' biases" in lines[0], lines
    with pytest.raises(QuantizationError, match="int8 model's embeddings differ from fp32"):
        quantize_embedder(pretrained_onnx, files, tmp_path / "strict.onnx",
                          recipe=replace(DEFAULT_RECIPE, correct_when_off=False))
    assert not (tmp_path / "strict.onnx").exists()


def test_recipe_options_are_checked_and_named():
    from embedder.quantize import QuantizationError, QuantRecipe

    assert QuantRecipe("percentile", False, "stem+head", 64, 99.99).tag == "pct99.99-pt-stem+head-64"
    assert QuantRecipe(reduce_range=True).tag == "minmax-pc-stem-256-rr"
    assert QuantRecipe(float_nodes="full-res", reduce_range=True).tag == "minmax-pc-full-res-256-rr"
    assert QuantRecipe(reduce_range=True, bias_correction=True).tag == "minmax-pc-stem-256-rr-bc"
    for bad in (dict(method="kl"), dict(float_nodes="tail"), dict(images=0)):
        with pytest.raises(QuantizationError):
            QuantRecipe(**bad)


def test_head_nodes_are_the_pooling_inputs(pretrained_onnx):
    """head_nodes: the conv feeding GeM (through its clamp), that clamp, and the clamp of the L2
    norm: the quantisable nodes next to the float pooling and normalisation."""
    from embedder.quant_graph import head_nodes, input_convs

    g = onnx.load(str(pretrained_onnx))
    ops = {n.name: n.op_type for n in g.graph.node}
    heads = head_nodes(g)
    assert [ops[h] for h in heads] == ["Conv", "Clip", "Clip"]
    assert not set(heads) & set(input_convs(g))


def test_full_res_nodes_are_the_layers_before_the_first_downsampling(pretrained_onnx):
    """full_res_nodes: the stem and every Conv/Clip/Add whose output keeps the stem's 112 x 112
    (Lite1 at 224: the stem, block 0 and block 1's expansion), not one node past the first
    stride-2 conv; without shapes (no shape inference) or with dynamic sizes only the stem."""
    from embedder.quant_graph import QUANTIZED_OPS, full_res_nodes, input_convs

    raw = onnx.load(str(pretrained_onnx))
    g = onnx.shape_inference.infer_shapes(raw)
    shape = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in g.graph.value_info}
    quantisable = [n for n in g.graph.node if n.op_type in QUANTIZED_OPS]
    names = full_res_nodes(g)
    assert names == [n.name for n in quantisable[:len(names)]]          # a prefix, in graph order
    assert [n.op_type for n in quantisable[:len(names)]] == ["Conv", "Clip", "Conv", "Clip", "Conv", "Conv", "Clip"]
    assert all(shape[n.output[0]][2:] == [112, 112] for n in quantisable[:len(names)])
    assert shape[quantisable[len(names)].output[0]][2:] == [56, 56]
    for v in g.graph.value_info:                     # spatial sizes unknown (a dynamic-size export)
        for d in v.type.tensor_type.shape.dim[2:]:
            d.dim_param = "size"
    assert full_res_nodes(g) == input_convs(g)
    del raw.graph.value_info[:]
    assert full_res_nodes(raw) == input_convs(raw)
