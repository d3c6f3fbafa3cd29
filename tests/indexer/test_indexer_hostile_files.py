"""Issue 28's notes on the indexer side: a manifest of the wrong shape, garbage inside a store,
two sharded indexes over the same shard folders, and class folders that are symlinks. Each
ends in one line naming the file (and the key), or is handled as a careful tool would."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from indexer_testlib import garbage_inside, run_cli, serve_app
from indexer import IndexerError, check_counts


def _one_line(p, *needles: str) -> str:
    assert p.returncode != 0, p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr[-3000:]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _image(gallery: Path) -> Path:
    return next(iter(sorted(gallery.rglob("*.png"))))


# ---------------------------------------------------------------------------- the manifest
@pytest.mark.parametrize("key,value", [("nprobe", "abc"), ("count", "240"), ("search_params", 8),
                                       ("index_file", {"bytes": "x"})])
def test_manifest_of_the_wrong_type_is_refused_naming_file_and_key(built_index: Path, tmp_path: Path,
                                                                   omniglot_gallery: Path, key: str,
                                                                   value: object) -> None:
    d = tmp_path / "idx"
    shutil.copytree(built_index, d)
    m = json.loads((d / "manifest.json").read_text())
    m[key] = value
    (d / "manifest.json").write_text(json.dumps(m))
    for args in (["info", "--index", d], ["search", "--index", d, _image(omniglot_gallery)]):
        _one_line(run_cli(*args, check=False), str(d / "manifest.json"), repr(key))
    from serving import Searcher

    with pytest.raises(IndexerError, match=f"manifest.json.*'{key}'"):
        Searcher.open([d], names=["x"])


def test_deeply_nested_manifest_is_one_line(built_index: Path, tmp_path: Path) -> None:
    d = tmp_path / "idx"
    shutil.copytree(built_index, d)
    (d / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    _one_line(run_cli("info", "--index", d, check=False), str(d / "manifest.json"), "nested too deep")


# ---------------------------------------------------------------------------- the store
def test_info_deep_names_garbage_inside_the_store(built_index: Path, tmp_path: Path) -> None:
    """4 KB pages of garbage written inside data.mdb (its size unchanged, its meta pages intact):
    the open-time checks cannot see it; ``info --deep`` reads every record and says so."""
    d = tmp_path / "idx"
    shutil.copytree(built_index, d, ignore=shutil.ignore_patterns("lock.mdb"))
    assert "every record read" in run_cli("info", "--index", d, "--deep").stdout
    data = d / "store.lmdb" / "data.mdb"
    size = data.stat().st_size
    garbage_inside(data)
    assert data.stat().st_size == size
    _one_line(run_cli("info", "--index", d, "--deep", check=False), str(data), "damaged")


def test_garbage_inside_a_served_store_answers_503_naming_the_file(built_index: Path, tmp_path: Path,
                                                                    free_port) -> None:
    """Written in place under the running app (same inode, same size: nothing a stat sees), a
    request that reads a damaged page is refused 503 naming data.mdb, and the server lives."""
    d = tmp_path / "idx"
    shutil.copytree(built_index, d, ignore=shutil.ignore_patterns("lock.mdb"))
    with serve_app(["--index", d, "--name", "x"], tmp_path, free_port()) as (url, proc):
        import httpx

        from indexer import Index

        idx = Index.open(d)
        some = int(idx.store.all_embeddings(idx.model_hash)[0][0])
        idx.store.close()
        search = lambda: httpx.post(f"{url}/api/search", data={"index": "x", "id": str(some), "k": "3"},  # noqa: E731
                                    timeout=60)
        assert search().status_code == 200
        garbage_inside(d / "store.lmdb" / "data.mdb")
        r = search()
        assert r.status_code == 503 and "store.lmdb/data.mdb: damaged" in r.json()["error"], r.text
        assert str(d) not in r.text                                  # named, not located
        h = httpx.get(f"{url}/api/health", timeout=60)
        assert h.status_code == 503 and "data.mdb: damaged" in h.json()["error"], h.text
        assert proc.poll() is None


# ---------------------------------------------------------------------------- shard folders
def test_second_sharded_index_over_the_same_shards_is_refused(two_shards: Path, tmp_path: Path) -> None:
    for i in range(2):
        shutil.copytree(two_shards / f"s{i}", tmp_path / f"s{i}")
    s0, s1 = tmp_path / "s0", tmp_path / "s1"
    run_cli("merge", "--sharded", s0, s1, "--out", tmp_path / "a", "--quiet")
    before = (s0 / "part.faiss").read_bytes()
    p = run_cli("merge", "--sharded", s0, s1, "--out", tmp_path / "b", "--quiet", "--index-type", "ivf",
                check=False)
    _one_line(p, str(s0), "belongs to the sharded index", str((tmp_path / "a").resolve()))
    assert (s0 / "part.faiss").read_bytes() == before and check_counts(tmp_path / "a").ok
    run_cli("merge", "--sharded", s0, s1, "--out", tmp_path / "a", "--quiet")   # its own: a rebuild
    assert check_counts(tmp_path / "a").ok

    from indexer.directory.lock import writer_lock

    with writer_lock(s1, "test: a shard being rebuilt"):      # a shard folder being written
        p = run_cli("merge", "--sharded", s0, s1, "--out", tmp_path / "a", "--quiet", check=False, fresh=True)
    _one_line(p, str(s1), "being written", "test: a shard being rebuilt")


def test_health_names_an_overwritten_part(two_shards: Path, tmp_path: Path) -> None:
    """What the refusal above prevents, done by hand (the owner record removed): the served
    index's health names the rewritten part and who rewrote it, not a count mismatch."""
    for i in range(2):
        shutil.copytree(two_shards / f"s{i}", tmp_path / f"s{i}")
    s0, s1 = tmp_path / "s0", tmp_path / "s1"
    run_cli("merge", "--sharded", s0, s1, "--out", tmp_path / "a", "--quiet", "--flat-threshold", "100")
    from serving import Searcher

    searcher = Searcher.open([tmp_path / "a"], names=["a"])
    assert searcher.health() == {}
    (s0 / "part.owner").unlink()
    (s1 / "part.owner").unlink()
    run_cli("merge", "--sharded", s0, s1, "--out", tmp_path / "b", "--quiet")      # Flat parts now
    problem = searcher.health()["a"]
    assert "part.faiss: overwritten since the sharded index" in problem, problem
    assert "counts differ" not in problem and str((tmp_path / "b").resolve()) in problem
    with pytest.raises(IndexerError, match="overwritten"):
        check_counts(tmp_path / "a")


# ---------------------------------------------------------------------------- the gallery walk
def test_symlinked_class_folders_are_followed_once(omniglot_gallery: Path, small_onnx: Path,
                                                    tmp_path: Path) -> None:
    """As `find -L` / `rsync -L`: linked folders are indexed under the link's name; a link back
    up (a loop) or a second link to a walked folder is named in the report, not walked."""
    classes = sorted(p for p in omniglot_gallery.rglob("*") if p.is_dir() and any(p.glob("*.png")))[:2]
    g = tmp_path / "gallery"
    g.mkdir()
    (g / "a_first").symlink_to(classes[0], target_is_directory=True)     # walked in name order
    (g / "b_second").symlink_to(classes[1], target_is_directory=True)
    (g / "c_again").symlink_to(classes[0], target_is_directory=True)
    (g / "d_loop").symlink_to(g, target_is_directory=True)
    out = tmp_path / "idx"
    p = run_cli("build", g, "--model", small_onnx, "--out", out, "--quiet")
    m = json.loads((out / "manifest.json").read_text())
    n = len(list(classes[0].glob("*.png"))) + len(list(classes[1].glob("*.png")))
    assert m["count"] == n, p.stdout
    from indexer import Index

    idx = Index.open(out)
    assert sorted(idx.labels()) == ["a_first", "b_second"]
    report = [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()]
    named = {r["path"] for r in report if "not followed" in r["reason"]}
    assert named == {"c_again", "d_loop"}, report
    idx.store.close()


# ---------------------------------------------------------------------------- a full disk
FULL_DISK_SCRIPT = r"""
set -u
mount -t tmpfs -o size=4m tmpfs "$MNT" || exit 77
"$PY" -m indexer build "$SMALL" --model "$MODEL" --out "$MNT/idx" --quiet >/dev/null 2>&1 || exit 78
avail=$(df -k --output=avail "$MNT" | tail -1)
dd if=/dev/zero of="$MNT/fill" bs=1k count=$((avail - 150)) 2>/dev/null
stat -c %s "$MNT/idx/store.lmdb/data.mdb" > "$OUT/before"
df -k --output=avail "$MNT" | tail -1 > "$OUT/free_before"
"$PY" -m indexer add --index "$MNT/idx" "$BIG" --quiet 2> "$OUT/add.err"; echo $? > "$OUT/add.rc"
stat -c %s "$MNT/idx/store.lmdb/data.mdb" > "$OUT/after"
df -k --output=avail "$MNT" | tail -1 > "$OUT/free_after"
rm "$MNT/fill"
"$PY" -m indexer add --index "$MNT/idx" "$BIG" --quiet > /dev/null 2> "$OUT/resume.err"; echo $? > "$OUT/resume.rc"
"$PY" -m indexer info --index "$MNT/idx" --deep --json > "$OUT/info.json" 2> "$OUT/info.err"
exit 0
"""


def test_full_disk_during_add_says_so_and_gives_back_the_failed_write(omniglot_gallery: Path, small_onnx: Path,
                                                                       tmp_path: Path) -> None:
    """A 4 MB tmpfs in a private mount namespace (root, or a user namespace where allowed),
    filled to 150 KB free before `indexer add` of 200 images: one line naming data.mdb with
    the space needed, data.mdb back to its size before the add (the failed transaction's pages
    given back), free space as it was, and the same command resumes once space is freed."""
    import subprocess
    import sys

    classes = sorted(p for p in omniglot_gallery.rglob("*") if p.is_dir() and any(p.glob("*.png")))
    small, mnt, out = tmp_path / "small", tmp_path / "mnt", tmp_path / "out"
    for d in (small, mnt, out):
        d.mkdir()
    (small / "c").symlink_to(classes[0], target_is_directory=True)
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-rm"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "2",
           "MNT": str(mnt), "OUT": str(out), "PY": sys.executable, "SMALL": str(small),
           "BIG": str(omniglot_gallery), "MODEL": str(small_onnx)}
    try:
        p = subprocess.run([*unshare, "sh", "-c", FULL_DISK_SCRIPT], env=env, capture_output=True, text=True,
                           timeout=600)
    except FileNotFoundError:
        pytest.skip("no unshare(1): cannot make a small filesystem here")
    if p.returncode == 77 or (p.returncode != 0 and p.stderr.startswith("unshare:")):
        pytest.skip(f"cannot mount a small tmpfs here ({(p.stderr or '').strip()[:200]})")
    assert p.returncode == 0 and (out / "add.rc").exists(), p.stderr[-2000:]
    err = (out / "add.err").read_text().strip().splitlines()
    assert (out / "add.rc").read_text().strip() == "1" and len(err) == 1, err
    assert "no space left on device: " in err[0] and "/store.lmdb/data.mdb (needs about " in err[0], err[0]
    assert "given back" in err[0], err[0]
    assert (out / "after").read_text() == (out / "before").read_text()          # given back
    assert int((out / "free_after").read_text()) >= int((out / "free_before").read_text()) - 8
    assert (out / "resume.rc").read_text().strip() == "0", (out / "resume.err").read_text()
    info = json.loads((out / "info.json").read_text())
    assert info["counts"]["ok"] and info["manifest"]["count"] == 240, info["counts"]


# ---------------------------------------------------------------------------- Ray without its GCS
def _netns_without_loopback() -> list[str]:
    """`unshare -n` (a network namespace whose lo stays down: no 127.0.0.1), or skip."""
    import shutil as sh
    import subprocess

    if sh.which("unshare") is None:
        pytest.skip("no unshare(1)")
    prefix = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-r", "-n"]
    if subprocess.run([*prefix, "true"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    return prefix


@pytest.mark.parametrize("model", [True, False], ids=["model", "default"])
def test_ray_local_without_loopback_is_one_line(omniglot_gallery: Path, small_onnx: Path, tmp_path: Path,
                                                model: bool) -> None:
    """Ray's GCS lives on 127.0.0.1: with loopback down it used to log "Failed to connect to
    GCS" every 30 s forever. Refused before Ray starts, and with the default embedder before the
    build prints its plan or exports the model (the cache stays empty)."""
    pytest.importorskip("ray")
    import subprocess
    import sys

    cache = tmp_path / "cache"
    p = subprocess.run([*_netns_without_loopback(), sys.executable, "-m", "indexer", "build", omniglot_gallery,
                        *(["--model", small_onnx] if model else []), "--out", tmp_path / "idx", "--ray", "local",
                        "--quiet"],
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
                            "DAS_CACHE": str(cache)}, capture_output=True, text=True, timeout=300)
    _one_line(p, "--ray local", "loopback", "GCS")
    assert not cache.exists() or not any(cache.rglob("*.onnx"))


@pytest.mark.slow
def test_ray_init_that_never_returns_is_bounded(tmp_path: Path) -> None:
    """Past the loopback check (forced here), a `ray.init` that cannot reach its GCS is given
    up after DAS_RAY_CONNECT_TIMEOUT_S with one line, and the Ray processes it started are
    stopped (none is left whose parent was the driver)."""
    pytest.importorskip("ray")
    import subprocess
    import sys

    code = ("import indexer.ray.cluster as rb, os; rb.loopback_works = lambda: True; "
            "print('pid', os.getpid(), flush=True); rb.connect('local', 1)")
    p = subprocess.run([*_netns_without_loopback(), sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
                            "DAS_RAY_CONNECT_TIMEOUT_S": "8"}, timeout=240)
    assert p.returncode == 1, p.stderr[-2000:]
    ours = [line for line in p.stderr.splitlines() if line.startswith("indexer build: error:")]
    assert len(ours) == 1 and "Ray did not come up in 8 s" in ours[0], p.stderr[-2000:]
    driver = int(p.stdout.split()[1])
    import time

    time.sleep(1)
    left = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if re.search(rf"session_[0-9_-]+_{driver}\b", cmd):     # Ray's session folder names the driver
            left.append(cmd[:160])
    assert not left, left
