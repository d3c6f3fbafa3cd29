"""Shared fixtures: real data only (Omniglot from ../shared, scikit-image's photos).

Fixtures that build models or ONNX files are session-scoped because exporting is the slow
part of the suite on 2 cores; tests must not mutate what they get from them.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from shared_fixture import SMALL_ONNX_ENV, shared_fixture

REPO = Path(__file__).resolve().parents[1]

# Under pytest-xdist (README's command runs `-n 2`): how many workers share this machine. Each
# gets its share of the cores for torch, faiss and OpenMP, and so do the processes it starts
# (they inherit OMP_NUM_THREADS): two workers with a thread per core each would run 4 spinning
# OpenMP threads on 2 cores.
XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if XDIST_WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // XDIST_WORKERS))

# The fused DAS kernels (training/das_triton.py) are checked on CPU in Triton's interpreter,
# which has to be switched on before anything imports triton. Never on a CUDA machine: there
# the same tests run the compiled kernels.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


# The modules that take minutes, longest first: they start first, so that under xdist
# (`--dist loadfile`) the short ones fill the other worker around them instead of one of them
# starting last and running alone (figures: CONTRIBUTING.md, "How long the suite takes").
SLOW_FIRST = ("tests/indexer/test_ray_netns.py", "tests/training/test_device_suite.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {m: i for i, m in enumerate(SLOW_FIRST)}
    items.sort(key=lambda it: rank.get(it.nodeid.split("::")[0], len(rank)))   # stable


def _omniglot_root() -> Path:
    env = os.environ.get("DAS_OMNIGLOT")
    return Path(env) if env else (REPO.parent / "shared" / "data" / "omniglot")


@pytest.fixture(scope="session")
def omniglot_root() -> Path:
    root = _omniglot_root()
    if not (root / "images_background").is_dir():
        pytest.fail(f"Omniglot not found at {root} (expected images_background/); set DAS_OMNIGLOT")
    return root


def _shared_images(name: str) -> Path:
    root = REPO.parent / "shared" / "data" / name / "images"
    if not root.is_dir():
        pytest.fail(f"{name} not found at {root} (expected <class>/<images> folders)")
    return root


@pytest.fixture(scope="session")
def cub_root() -> Path:
    """cub-dev: 50 CUB-200-2011 species, class folders of photos (fine-grained)."""
    return _shared_images("cub-dev")


@pytest.fixture(scope="session")
def caltech_root() -> Path:
    """caltech101-dev: 50 Caltech-101 categories, class folders of photos."""
    return _shared_images("caltech101-dev")


def class_names(root: Path) -> list[str]:
    """The class folders of ``root`` in the order training's loaders sort them (natural order,
    case-insensitive), so that the first half here is their training half."""
    import re

    return sorted((d.name for d in root.iterdir() if d.is_dir()),
                  key=lambda s: [int(t) if t.isdigit() else t.lower() for t in re.split(r"(\d+)", s)])


def few_per_class(src: Path, dst: Path, classes: list[str], per_class: int) -> Path:
    """A class-folder dataset of ``classes`` of ``src`` with their first ``per_class`` photos
    (symlinks: real photos, read in place). Training and benchmark tests that only need the code
    paths run on this instead of whole categories (Caltech's first classes hold 80 photos each)."""
    for c in classes:
        (dst / c).mkdir(parents=True)
        for f in sorted((src / c).iterdir())[:per_class]:
            (dst / c / f.name).symlink_to(f)
    return dst


@pytest.fixture(scope="session")
def caltech_mini(caltech_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """caltech101-dev's first 3 and its 26th-28th categories (the first classes of its training
    and test halves), 12 photos each: a 6-class dataset whose halves are 3 + 3 classes."""
    names = class_names(caltech_root)
    return few_per_class(caltech_root, tmp_path_factory.mktemp("caltech-mini"), names[:3] + names[25:28], 12)


@pytest.fixture(scope="session")
def cub_mini(cub_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cub-dev's first 4 species and its 26th-29th (the first of its training and test halves),
    12 photos each: 4 + 4 species, what fine-tuning tests need of the code paths in seconds."""
    names = class_names(cub_root)
    return few_per_class(cub_root, tmp_path_factory.mktemp("cub-mini"), names[:4] + names[25:29], 12)


@pytest.fixture(scope="session")
def cub_dba(cub_root: Path, tmp_path_factory: pytest.TempPathFactory, pretrained_onnx: Path) -> tuple[Path, list[Path]]:
    """(index, held): cub-dev's first 6 species, 20 photos each, indexed by the default pretrained
    embedder with DBA neighbourhoods (120 items: a p-value of 1/121 exists); held: each species'
    21st photo, not in the gallery."""
    from indexer import build_index
    from indexer.ann.neighbours import DbaParams

    names = class_names(cub_root)[:6]
    root = shared_fixture(tmp_path_factory, "cub-dba", lambda out: build_index(
        few_per_class(cub_root, out / "gallery", names, 20), out / "index", model=pretrained_onnx,
        progress=False, dba=DbaParams()))
    return root / "index", [sorted((cub_root / c).iterdir())[20] for c in names]


@pytest.fixture(scope="session")
def photo_paths() -> list[Path]:
    """The colour photos scikit-image ships (real images, no download)."""
    from skimage import data_dir

    names = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "motorcycle_left.png",
             "hubble_deep_field.jpg", "ihc.png", "retina.jpg"]
    paths = [Path(data_dir) / n for n in names if (Path(data_dir) / n).exists()]
    assert len(paths) >= 5, f"scikit-image photos missing under {data_dir}"
    return paths


@pytest.fixture(scope="session")
def omniglot_paths(omniglot_root: Path) -> list[Path]:
    """A small, fixed set of real Omniglot images: 6 characters x 4 drawings."""
    base = omniglot_root / "images_background"
    chars = sorted(p for a in sorted(base.iterdir())[:3] for p in sorted(a.iterdir())[:2])
    return [f for c in chars for f in sorted(c.glob("*.png"))[:4]]


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Keep exported default models out of the user's ~/.cache during tests. Under xdist the
    workers share one cache (their base temps' common parent): the default model is exported
    once, not once a worker (``default_model_path`` is safe for concurrent first use)."""
    if "DAS_CACHE" not in os.environ:
        base = tmp_path_factory.getbasetemp()
        cache = (base.parent if XDIST_WORKERS else base) / "das-cache"
        cache.mkdir(exist_ok=True)
        os.environ["DAS_CACHE"] = str(cache)
    return Path(os.environ["DAS_CACHE"])


@pytest.fixture(scope="session")
def small_onnx(tmp_path_factory: pytest.TempPathFactory, omniglot_paths: list[Path]) -> Path:
    """An exported small_cnn Omniglot embedder (untrained, seeded; 64-d, L2-normalised): exported
    once per run (``shared_fixture``: the dynamo export and its imports are ~20 CPU-s a process),
    and not again in the Ray run, which gets this file as ``SMALL_ONNX_ENV`` (test_ray_netns.py)."""
    given = os.environ.get(SMALL_ONNX_ENV)
    if given:
        return Path(given)

    def export(out: Path) -> None:
        import torch

        from embedder import Embedder, EmbedderConfig, export_onnx

        torch.manual_seed(0)
        model = Embedder(EmbedderConfig(backbone="small_cnn", dim=64)).eval()
        out.mkdir(parents=True)
        export_onnx(model, out / "small_cnn.onnx", source_hash="untrained-small-cnn-seed0",
                    parity_images=omniglot_paths[:8])

    return shared_fixture(tmp_path_factory, "small-onnx", export) / "small_cnn.onnx"


@pytest.fixture(scope="session")
def pretrained_onnx() -> Path:
    """The default pretrained embedder (embedder.pretrained.DEFAULT, 1280-d), cached in $DAS_CACHE."""
    from embedder import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every Ray module of the run (they run in one process, in one
    network namespace: test_ray_netns.py): a head without CPU (the drivers' node, never killed)
    + 2 worker nodes of 1 CPU, so that two shard tasks run at once, one on each worker node.
    Each cluster brought up and down costs ~10 s and ~25 CPU-s of raylets, agents and the
    workers a new driver starts; the modules kill and revive worker nodes, which later ones
    take as they find them (node ids are looked up, never kept)."""
    from ray_testlib import local_cluster

    with local_cluster() as lc:
        yield lc


@pytest.fixture(scope="session")
def free_port():
    """A callable returning a currently free TCP port on 127.0.0.1 (servers, gloo rendezvous)."""
    import socket

    def _free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return _free
