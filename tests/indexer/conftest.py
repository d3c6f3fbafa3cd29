"""Indexer fixtures: small real galleries (Omniglot copies, scikit-image photos) and a CLI runner.

Galleries are copied into tmp dirs (never into the repo) because tests add bad files to them.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from shared_fixture import shared_fixture

from indexer_testlib import REPO, copy_characters, run_cli  # noqa: F401 (fixtures use them)

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
    """A Flat index of ``omniglot_gallery`` built through the CLI; tests must not modify it."""
    return shared_fixture(tmp_path_factory, "built-idx", lambda out: run_cli(
        "build", omniglot_gallery, "--model", small_onnx, "--out", out, "--quiet"))


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
        run_cli("merge", root / "s0", root / "s1", "--out", root / "merged", *flags)
        run_cli("merge", "--sharded", root / "s0", root / "s1", "--out", root / "sharded", *flags)

    return shared_fixture(tmp_path_factory, "two_shards", build)
