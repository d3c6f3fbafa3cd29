"""Indexer fixtures: small real galleries (Omniglot copies, scikit-image photos) and a CLI runner.

Galleries are copied into tmp dirs (never into the repo) because tests add bad files to them.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from shared_fixture import shared_fixture

from indexer_testlib import RAY_CHARS, RAY_FLAGS, copy_characters, run_cli

# test_ray.py and test_ray_cluster.py start Ray, which listens beyond loopback: the main run
# leaves them out and test_ray_netns.py runs each inside a private network namespace (run by
# hand, they run there too).
collect_ignore = ["test_ray.py", "test_ray_cluster.py"]


@pytest.fixture(scope="session")
def omniglot_gallery(tmp_path_factory: pytest.TempPathFactory, omniglot_root: Path) -> Path:
    """12 characters x 20 drawings = 240 real Omniglot images, labelled Alphabet/characterNN."""
    return shared_fixture(tmp_path_factory, "omniglot-gallery", lambda out: copy_characters(omniglot_root, out, 12))


@pytest.fixture(scope="session")
def built_index(tmp_path_factory: pytest.TempPathFactory, omniglot_gallery: Path, small_onnx: Path) -> Path:
    """A Flat index of ``omniglot_gallery`` built through the CLI, without DBA; tests must not modify it."""
    return shared_fixture(tmp_path_factory, "built-idx", lambda out: run_cli(
        "build", omniglot_gallery, "--model", small_onnx, "--out", out, "--quiet", "--no-dba"))


@pytest.fixture(scope="session")
def two_shards(tmp_path_factory: pytest.TempPathFactory, omniglot_gallery: Path, small_onnx: Path) -> Path:
    """``s0``, ``s1`` (``--shard i/2`` of ``omniglot_gallery``, IVF lists), ``merged`` (``indexer
    merge``) and ``sharded`` (``merge --sharded``): built once for the sharded and the re-ranking
    tests; tests must not modify them (copy first)."""
    def build(root: Path) -> None:
        flags = ["--quiet", "--flat-threshold", "100"]       # IVF lists: where "as one" can go wrong
        for i in range(2):
            run_cli("build", omniglot_gallery, "--model", small_onnx, "--shard", f"{i}/2",
                    "--out", root / f"s{i}", *flags)
        run_cli("merge", root / "s0", root / "s1", "--out", root / "merged", "--no-dba", *flags)
        run_cli("merge", "--sharded", root / "s0", root / "s1", "--out", root / "sharded", *flags)

    return shared_fixture(tmp_path_factory, "two_shards", build)


# The Ray build modules (test_ray.py, test_ray_cluster.py) share one gallery, its one-process
# build and one undisturbed `--ray --sharded` build on the run's cluster (``ray_cluster``): each
# module used to make its own, the same three things (~40 CPU-s of builds and Ray workers).
@pytest.fixture(scope="session")
def ray_gallery(tmp_path_factory: pytest.TempPathFactory, omniglot_root: Path) -> Path:
    """``RAY_CHARS`` Omniglot characters (600 images, ~300 per shard: more than one commit)."""
    root = tmp_path_factory.mktemp("ray-gallery")
    copy_characters(omniglot_root, root, RAY_CHARS)
    return root


@pytest.fixture(scope="session")
def ray_single(tmp_path_factory: pytest.TempPathFactory, ray_gallery: Path, small_onnx: Path):
    """The one-process build (``RAY_FLAGS``) a Ray build is compared with, opened."""
    from indexer import Index

    out = tmp_path_factory.mktemp("ray-single") / "idx"
    run_cli("build", ray_gallery, "--model", small_onnx, "--out", out, *RAY_FLAGS)
    return Index.open(out)


@pytest.fixture(scope="session")
def ray_sharded(tmp_path_factory: pytest.TempPathFactory, ray_cluster, ray_gallery: Path,
                small_onnx: Path) -> tuple[Path, str]:
    """`indexer build --ray HEAD --shards 2 --sharded` of ``ray_gallery`` on the run's cluster,
    undisturbed (both worker nodes up): (out, stdout). Tests must not modify it."""
    out = tmp_path_factory.mktemp("ray-sharded") / "idx"
    p = run_cli("build", ray_gallery, "--model", small_onnx, "--out", out, "--ray", ray_cluster.address,
                "--shards", "2", "--sharded", *RAY_FLAGS, timeout=300)
    return out, p.stdout
