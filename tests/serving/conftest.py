"""Serving fixtures: a small real gallery (augmented scikit-image photos) indexed twice, once
with the offline pretrained embedder and once with the small untrained CNN, so two indexes are
open side by side as the app compares models; and one real app server on 127.0.0.1."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from serving_testlib import DEMO_CLASSES
from shared_fixture import shared_fixture

REPO = Path(__file__).resolve().parents[2]
# Ray modules run in private network namespaces (tests/indexer/test_ray_netns.py), not here
collect_ignore = ["test_ray_serving.py"]
AUTH = ("tester", "s3cret-pass")
MAX_UPLOAD_MB = 1.0


@pytest.fixture(scope="session")
def demo_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(gallery, queries): 8 photo classes x 5 views, 2 held-out query views each."""
    from serving.demo import make_demo_gallery

    root = shared_fixture(tmp_path_factory, "serving-demo", lambda out: make_demo_gallery(
        out, views=5, queries=2, size=160, classes=DEMO_CLASSES, progress=False))
    return root / "gallery", root / "queries"


@pytest.fixture(scope="session")
def pretrained_index(tmp_path_factory, demo_dirs, pretrained_onnx) -> Path:
    from indexer import build_index

    return shared_fixture(tmp_path_factory, "pretrained",    # the directory's name is the index's
                          lambda out: build_index(demo_dirs[0], out, model=pretrained_onnx, progress=False))


@pytest.fixture(scope="session")
def small_index(tmp_path_factory, demo_dirs, small_onnx) -> Path:
    from indexer import build_index

    return shared_fixture(tmp_path_factory, "small",
                          lambda out: build_index(demo_dirs[0], out, model=small_onnx, progress=False))


@pytest.fixture(scope="session")
def chromium() -> str:
    """A Chromium for the browser tests (see browsers.py for where it looks); without one they
    skip with how to install one, or fail under CI=true."""
    from browsers import require_chromium

    return require_chromium(os.environ)


@pytest.fixture(scope="session")
def searcher(pretrained_index, small_index):
    from serving import Searcher

    return Searcher.open([pretrained_index, small_index], names=["pretrained", "small"])



@pytest.fixture
def gradio_client(tmp_path, monkeypatch):
    """``make(url, **kw)``: a gradio_client ``Client`` of the app at ``url`` whose downloads stay
    in ``tmp_path``: gradio_client 2.7 stages every download in a new folder of
    ``tempfile.gettempdir()`` and never removes it (33 empty folders in /tmp a suite run)."""
    from gradio_client import Client

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return lambda url, **kw: Client(url + "/", verbose=False, download_files=tmp_path / "downloads", **kw)


@contextmanager
def app_server(args: list, log_dir: Path, port: int, *, auth: tuple[str, str] | None = None,
               timeout: float = 180) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real `python app.py ARGS` on 127.0.0.1:PORT, with its own Gradio temp folder
    (log_dir/gradio-tmp); stopped by PID whatever happens. Yields (base_url, process)."""
    import httpx

    log = log_dir / "server.log"
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "GRADIO_TEMP_DIR": str(log_dir / "gradio-tmp")}
    cmd = [sys.executable, str(REPO / "app.py"), *map(str, args), "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"app.py exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/api/health", auth=auth, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"app.py did not come up in {timeout:.0f} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()                      # by PID: only the server we started
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="session")
def start_app():
    """:func:`app_server`, for tests that start their own server."""
    return app_server


@pytest.fixture(scope="session")
def server_dir(tmp_path_factory) -> Path:
    """The session server's log and Gradio temp folder (tests look for copied files in it)."""
    return tmp_path_factory.mktemp("server")


@pytest.fixture(scope="session")
def server(pretrained_index, small_index, demo_dirs, server_dir, free_port):
    """A real `python app.py` on a free loopback port with --auth; stopped by PID at the end,
    whatever happens. Yields (base_url, auth)."""
    args = ["--index", pretrained_index, "--index", small_index, "--name", "pretrained", "--name", "small",
            "--queries", demo_dirs[1], "--auth", f"{AUTH[0]}:{AUTH[1]}", "--max-upload-mb", MAX_UPLOAD_MB]
    with app_server(args, server_dir, free_port(), auth=AUTH) as (url, _):
        yield url, AUTH
