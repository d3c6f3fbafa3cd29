"""`indexer build --ray`: what is refused before any Ray process starts (one line, exit 1).

Run in-process through the CLI's ``main`` (cheap); the Ray runs themselves are in test_ray.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from indexer import IndexerError
from indexer.__main__ import main
from indexer.build.ray_build import default_shards, plan_resources


def _one_line_error(capsys: pytest.CaptureFixture, argv: list, *needles: str) -> None:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("indexer build: error: "), err
    for n in needles:
        assert n in lines[0], lines[0]


def _usage_error(capsys: pytest.CaptureFixture, argv: list, needle: str) -> None:
    """Flags that parse but do not fit together: the usage line and one error line, exit 2."""
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("usage: ") and f"indexer build: error: {needle}" in err, err


def test_ray_not_installed_is_one_clear_line(omniglot_gallery: Path, small_onnx: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)       # `import ray` fails, as without the extra
    _one_line_error(capsys, ["build", omniglot_gallery, "--model", small_onnx, "--out", tmp_path / "o",
                             "--ray", "local", "--shards", "2", "--quiet"],
                    "--ray needs Ray", "pip install 'ray[default]")
    assert not (tmp_path / "o").exists()


def test_bad_ray_flags_are_refused(omniglot_gallery: Path, small_onnx: Path, tmp_path: Path, capsys) -> None:
    base = ["build", omniglot_gallery, "--model", small_onnx, "--out", tmp_path / "o", "--quiet"]
    _usage_error(capsys, [*base, "--shards", "2"], "--shards needs --ray")
    _usage_error(capsys, [*base, "--sharded"], "--sharded needs --ray")
    _usage_error(capsys, [*base, "--ray", "local", "--shard", "0/2"], "--shard and --ray exclude each other")
    _one_line_error(capsys, [*base, "--ray", "local", "--shards", "0"], "--shards=0")
    _one_line_error(capsys, [*base, "--ray", "local", "--cpus-per-shard", "0"], "--cpus-per-shard=0")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(capsys, ["build", empty, "--model", small_onnx, "--out", tmp_path / "o", "--ray", "local"],
                    "empty gallery")
    _one_line_error(capsys, ["build", omniglot_gallery, "--model", tmp_path / "nope.onnx",
                             "--out", tmp_path / "o", "--ray", "local"], "model not found")
    assert not (tmp_path / "o").exists()


def test_shard_tasks_reserve_a_gpu_where_the_cluster_has_gpus() -> None:
    """Placement from the cluster's node list (as ray.nodes() reports it); no GPU is lent here."""
    cpu_only = [{"CPU": 32.0, "memory": 1e11}, {"CPU": 16.0}]
    gpu_nodes = [{"CPU": 16.0, "GPU": 4.0}, {"CPU": 16.0, "GPU": 4.0}]
    assert default_shards(cpu_only) == 2 and default_shards(gpu_nodes) == 8
    assert plan_resources(gpu_nodes, 8) == {"num_cpus": 4, "num_gpus": 1}
    assert plan_resources(cpu_only, 2) == {"num_cpus": 24, "num_gpus": 0}
    assert plan_resources(cpu_only, 1) == {"num_cpus": 32, "num_gpus": 0}     # fits the biggest node
    assert plan_resources(cpu_only, 100) == {"num_cpus": 1, "num_gpus": 0}
    assert plan_resources([{"CPU": 2.0}], 2, cpus_per_shard=2)["num_cpus"] == 2
    with pytest.raises(IndexerError, match="no node of the cluster has that many CPUs"):
        plan_resources(cpu_only, 2, cpus_per_shard=64)


def test_refusals_come_before_the_default_plan(omniglot_gallery: Path, tmp_path: Path, capsys,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --model a build prints its plan (embedder, int8, DBA) and may export the default
    embedder first; a command that cannot run does neither: flags that exclude each other, an --out
    that is a file, a missing or empty gallery are its only line, and nothing is exported."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DAS_CACHE", str(cache))
    base = ["build", omniglot_gallery, "--out", tmp_path / "o", "--quiet"]
    _usage_error(capsys, [*base, "--shards", "2"], "--shards needs --ray")
    _usage_error(capsys, [*base, "--ray", "local", "--shard", "0/2"], "--shard and --ray exclude each other")
    _usage_error(capsys, [*base, "--ray", "local", "--sharded", "--dba"], "--dba is not available with --sharded")
    (tmp_path / "afile").write_text("not an index")
    _usage_error(capsys, ["build", omniglot_gallery, "--out", tmp_path / "afile"],
                 f"--out {tmp_path / 'afile'}: a file is there")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    _one_line_error(capsys, ["build", tmp_path / "empty", "--out", tmp_path / "o"], "empty gallery")
    _one_line_error(capsys, ["build", tmp_path / "nope", "--out", tmp_path / "o"], "gallery folder not found")
    _one_line_error(capsys, ["build", tmp_path / "afile", "--out", tmp_path / "o"], "a file, not a folder")
    assert not (tmp_path / "o").exists() and not any(cache.rglob("*.onnx"))
