"""Every promise of the single index, held by the merged and the sharded index too (issue 28):
the same checks run over a single Flat index, a merged IVF index, a sharded IVF index whose
shards lie beside it, and a sharded Flat index whose shards lie under another top folder (its
manifest then names them by absolute path). Lock, counts, ``info``, ``--max-memory`` (CLI and
app) and health with no server path in the API's answers, against one real ``app.py`` serving
all four."""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from indexer_testlib import REPO, copy_characters, run_cli, serve_app
from indexer import Index, check_counts
from indexer.directory.lock import writer_lock

KINDS = ("single", "merged", "sharded", "sharded_flat")
BUDGET = "30K"      # below every kind's full index (240 x 64-d: 62 KB), above its SQ8 codes (17 KB)


def _outside_root() -> Path:
    """A folder that shares nothing but "/" with pytest's tmp folders: shards there are named
    by absolute path in the manifest (what `merge --sharded` of shards elsewhere writes)."""
    tmp = Path(tempfile.gettempdir()).resolve().parts[1]
    for top in ("/dev/shm", "/var/tmp", str(REPO.parent)):
        p = Path(top)
        if p.is_dir() and os.access(p, os.W_OK) and p.resolve().parts[1] != tmp:
            return p
    pytest.skip("no writable folder outside the temp folder's top level")


@pytest.fixture(scope="module")
def kinds(built_index: Path, two_shards: Path, tmp_path_factory) -> Iterator[dict[str, Path]]:
    outside = Path(tempfile.mkdtemp(prefix="das-kinds-", dir=_outside_root()))
    try:
        for i in range(2):          # shards of its own: a sharded index owns its shards' parts
            shutil.copytree(two_shards / f"s{i}", outside / f"f{i}")
        flat = tmp_path_factory.mktemp("kinds") / "sharded_flat"
        run_cli("merge", "--sharded", outside / "f0", outside / "f1", "--out", flat, "--quiet")
        yield {"single": built_index, "merged": two_shards / "merged", "sharded": two_shards / "sharded",
               "sharded_flat": flat}
    finally:
        shutil.rmtree(outside, ignore_errors=True)


@pytest.fixture(scope="module")
def app(kinds: dict[str, Path], tmp_path_factory, free_port) -> Iterator[str]:
    """One real ``app.py`` serving the four kinds within ``--max-memory``; stopped by PID."""
    args = [a for k in KINDS for a in ("--index", kinds[k], "--name", k)] + ["--max-memory", BUDGET]
    with serve_app(args, tmp_path_factory.mktemp("kinds-app"), free_port()) as (url, _):
        yield url


def _first_image(d: Path) -> tuple[int, str]:
    """(id, gallery-relative path) of one image the index holds."""
    from indexer import Index

    idx = Index.open(d)
    try:
        store = getattr(idx.store, "stores", [idx.store])[0]      # a sharded index: its first shard's
        i = int(store.all_embeddings(idx.model_hash)[0][0])
        return i, idx.meta(i)["path"]
    finally:
        idx.store.close()


@pytest.mark.parametrize("kind", KINDS)
def test_counts_agree(kinds: dict[str, Path], kind: str) -> None:
    c = check_counts(kinds[kind])
    assert c.ok and not c.busy and c.faiss == c.manifest == 240, c.message


class _Recording:
    """The index's own searchable, noting faiss's OpenMP thread count at each search."""

    def __init__(self, inner) -> None:
        self.inner, self.threads = inner, []
        self.d, self.ntotal = inner.d, inner.ntotal

    def search(self, q, k):
        import faiss

        self.threads.append(faiss.omp_get_max_threads())
        return self.inner.search(q, k)


@pytest.mark.parametrize("kind", KINDS)
def test_one_query_searches_on_one_openmp_thread(kinds: dict[str, Path], kind: str) -> None:
    """A single query runs faiss on one thread (libgomp's idle threads spin for milliseconds after
    a parallel loop, taking a core from the next request's embedding); a batch keeps the
    caller's threads, and the caller's count is its own again after either."""
    import faiss

    idx = Index.open(kinds[kind])
    rec = _Recording(idx.faiss)
    probe = Index(idx.layout, idx.store, rec, idx.neighbours)
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(2)
    try:
        x = idx.embeddings(idx.store.ids()[:3])
        one, batch = probe.answer(x[:1], 5), probe.answer(x, 5)
        assert rec.threads == [1, 2] and faiss.omp_get_max_threads() == 2
        assert one.ids.shape == (1, 5) and batch.ids.shape == (3, 5) and (one.ids >= 0).all()
    finally:
        faiss.omp_set_num_threads(before)
        idx.store.close()


@pytest.mark.parametrize("kind", KINDS)
def test_info_reports_counts_and_exits_zero(kinds: dict[str, Path], kind: str) -> None:
    p = run_cli("info", "--index", kinds[kind])
    assert "240 vectors" in p.stdout and "counts:   counts agree: 240" in p.stdout, p.stdout
    j = json.loads(run_cli("info", "--index", kinds[kind], "--json").stdout)
    assert j["manifest"]["count"] == 240 and j["counts"]["ok"] and j["counts"]["faiss"] == 240


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_writer_is_refused_in_one_line(kinds: dict[str, Path], kind: str,
                                                 omniglot_gallery: Path) -> None:
    d = kinds[kind]
    folder = next(p for p in sorted(omniglot_gallery.rglob("*")) if p.is_dir() and any(p.glob("*.png")))
    with writer_lock(d, "test: another writer"):
        assert check_counts(d).busy                 # counts not compared while a writer works
        p = run_cli("add", "--index", d, folder, "--quiet", check=False, fresh=True)
    assert p.returncode != 0
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "being written" in err[0] and "test: another writer" in err[0], p.stderr
    assert check_counts(d).ok and check_counts(d).faiss == 240      # nothing was written


@pytest.mark.parametrize("kind", KINDS)
def test_max_memory_search_through_the_cli(kinds: dict[str, Path], kind: str, omniglot_gallery: Path) -> None:
    _, path = _first_image(kinds[kind])          # every kind indexes omniglot_gallery
    p = run_cli("search", "--index", kinds[kind], "--max-memory", BUDGET, "-k", "3", "--json",
                omniglot_gallery / path, check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    hits = json.loads(p.stdout)
    assert hits[0]["path"] == path and hits[0]["score"] > 0.999


def test_app_serves_every_kind_healthy_within_max_memory(app: str) -> None:
    h = httpx.get(f"{app}/api/health", timeout=60)
    assert h.status_code == 200 and h.json()["indexes"] == list(KINDS), h.text
    listed = {i["name"]: i for i in httpx.get(f"{app}/api/indexes", timeout=60).json()}
    for kind in KINDS:      # each held as codes within the budget, re-ranked from its store(s)
        assert listed[kind]["size"] == 240 and listed[kind]["memory"], (kind, listed[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_app_answers_by_id_under_max_memory(app: str, kinds: dict[str, Path], kind: str) -> None:
    i, path = _first_image(kinds[kind])
    r = httpx.post(f"{app}/api/search", data={"index": kind, "id": str(i), "k": "3"}, timeout=60)
    assert r.status_code == 200, r.text
    got = [h["id"] for h in r.json()["results"]]
    from indexer import Index

    full = Index.open(kinds[kind])               # the whole index in RAM: what the codes re-rank to
    try:
        store = getattr(full.store, "stores", [full.store])[0]
        want = [int(j) for j in full.search_embeddings(store.get_embeddings(full.model_hash, [i]), 4)[1][0]]
    finally:
        full.store.close()
    assert got == [j for j in want if j != i][:3], (got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_no_server_path_in_api_answers(app: str, kinds: dict[str, Path], kind: str) -> None:
    """Keys as well as values: a sharded index's manifest keys its faiss files by path."""
    m = json.loads((kinds[kind] / "manifest.json").read_text())
    if kind == "sharded_flat":      # the case that leaked: shards outside --out, absolute keys
        assert any(k.startswith("/") for k in m["sharded"]["files"]), m["sharded"]["files"]
    listed = next(i for i in httpx.get(f"{app}/api/indexes", timeout=60).json() if i["name"] == kind)
    text = json.dumps(listed) + httpx.get(f"{app}/api/health", timeout=60).text
    for d in [kinds[kind], *[Path(p) for p in re.findall(r'"(/[^"]+)"', json.dumps(m))]]:
        assert str(Path(d).resolve().parent) not in text
    assert not re.findall(r'"(/[^"]*|\.\./[^"]*)"', text), text[:3000]
    assert listed["manifest"]["count"] == 240
    if m.get("sharded"):            # the records are still there, under names, one per file
        assert len(listed["manifest"]["sharded"]["files"]) == len(m["sharded"]["files"])


# ---------------------------------------------------------------------------- the library's face
def _writable_copy(kind: str, built_index: Path, two_shards: Path, root: Path) -> Path:
    """A copy of one kind that the test may change (the fixtures' must stay as built)."""
    from indexer import build_sharded

    if kind == "single":
        return Path(shutil.copytree(built_index, root / "single"))
    shutil.copytree(two_shards, root / "ts", ignore=shutil.ignore_patterns("sharded"))
    if kind == "merged":
        return root / "ts" / "merged"
    out = root / "ts" / kind            # shards beside it, named through ".."
    build_sharded([root / "ts" / "s0", root / "ts" / "s1"], out, progress=False,
                  index_type="flat" if kind == "sharded_flat" else "auto", flat_threshold=100)
    return out


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_add_never_replaces_an_image_stored_under_the_same_path(kind: str, built_index: Path, two_shards: Path,
                                                                 omniglot_root: Path, tmp_path: Path) -> None:
    """Two folders' ``c/0001.png`` are two pictures: `add` of the second skips it with the way to
    add it (--prefix, or remove first) and adds the rest; until 2026-11-30 it replaced the first
    (the index lost that image), in any shard. Re-adding the same files stays "unchanged"."""
    import indexer

    d = _writable_copy(kind, built_index, two_shards, tmp_path)
    new = copy_characters(omniglot_root, tmp_path / "new", 1, per_char=4, skip_chars=12)
    first = indexer.add_images(d, tmp_path / "new", progress=False)
    rel = new[0].relative_to(tmp_path / "new")
    clash = tmp_path / "clash"
    (clash / rel).parent.mkdir(parents=True)
    shutil.copy(new[1], clash / rel)                          # another picture under a stored path
    shutil.copy(new[1], clash / rel.parent / "other name.png")  # its content, new path: a duplicate
    c = indexer.add_images(d, clash, progress=False)
    assert [x["path"] for x in c.stats.skipped] == [rel.as_posix()] and "--prefix" in c.stats.skipped[0]["reason"]
    assert c.manifest.count == first.manifest.count and c.stats.duplicates == 1
    again = indexer.add_images(d, tmp_path / "new", progress=False)
    assert again.stats.unchanged == 4 and not again.stats.skipped
    one = copy_characters(omniglot_root, tmp_path / "one", 1, per_char=1, skip_chars=13)[0]
    c = indexer.add_images(d, one, prefix="singles/", progress=False)     # one image file, no folder for it
    assert c.stats.new == 1 and c.manifest.count == first.manifest.count + 1
    with Index.open(d) as idx:
        assert idx.meta(idx.id_for_path(f"singles/{one.name}"))["label"] == "singles"
    out = run_cli("add", one, "--index", d, "--prefix", "../up", check=False)      # stored paths stay inside
    assert out.returncode == 2 and "--prefix ../up: expected a folder path inside the index" in out.stderr


@pytest.mark.parametrize("kind", ["single", "sharded"])
def test_remove_a_folder_removes_every_stored_path_under_it(kind: str, built_index: Path, two_shards: Path,
                                                           omniglot_root: Path, tmp_path: Path) -> None:
    """`indexer remove dogs/`: a class the audit found wrong goes in one command (it took one path
    per image), in every shard that holds some; a folder with nothing stored under it refuses."""
    import indexer
    from indexer.errors import IndexerError

    d = _writable_copy(kind, built_index, two_shards, tmp_path)
    new = copy_characters(omniglot_root, tmp_path / "new", 1, per_char=4, skip_chars=12)
    first = indexer.add_images(d, tmp_path / "new", progress=False)
    folder = new[0].relative_to(tmp_path / "new").parent.as_posix() + "/"
    c = indexer.remove_items(d, [folder])
    assert c.manifest.count == first.manifest.count - 4 and check_counts(d).ok
    assert len(c.messages) == 1 and c.messages[0].startswith(f"removed 4 paths under {folder}")
    with pytest.raises(IndexerError, match="no stored path under it"):
        indexer.remove_items(d, [folder])


@pytest.mark.parametrize("kind", KINDS)
def test_add_remove_repair_info_through_the_library_hold_the_lock(
        kind: str, built_index: Path, two_shards: Path, omniglot_root: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``indexer.add_images(dir)`` is what `indexer add` runs, for every layout: it holds the
    writer lock (a second writer is refused while it writes) and reads the manifest once."""
    import threading

    import indexer
    from indexer import IndexBusyError
    from indexer.directory import manifest
    from indexer.build import update

    d = _writable_copy(kind, built_index, two_shards, tmp_path)
    new = copy_characters(omniglot_root, tmp_path / "new", 1, per_char=4, skip_chars=12)
    others: list[str] = []

    def probed(real):                   # another thread tries to write while the update syncs
        def run(*a, **kw):
            def other() -> None:
                try:
                    with writer_lock(d, "test: second writer"):
                        others.append("written")
                except IndexBusyError as e:
                    others.append(str(e))
            t = threading.Thread(target=other)
            t.start()
            t.join()
            return real(*a, **kw)
        return run

    monkeypatch.setattr(update, "sync", probed(update.sync))      # both layouts' one sync
    reads = []
    real_read = manifest.Manifest.read.__func__
    monkeypatch.setattr(manifest.Manifest, "read", classmethod(lambda cls, p: reads.append(p) or real_read(cls, p)))
    c = indexer.add_images(d, tmp_path / "new", progress=False)
    assert len(reads) == 1, reads                           # once, under the lock
    assert c.added == 4 and c.manifest.count == 244 and c.stats.new == 4
    assert len(others) == 1 and "being written by pid" in others[0] and "indexer add" in others[0], others
    facts = indexer.info(d)
    assert facts["counts"].ok and facts["manifest"].count == 244, facts["counts"].message
    assert facts["layout"] == ("sharded" if kind.startswith("sharded") else "single")
    gone = indexer.remove_items(d, [new[0].relative_to(tmp_path / "new").as_posix()])
    assert gone.manifest.count == 243 and gone.removed == 1 and len(others) == 2 and "indexer remove" in others[1]
    fixed = indexer.repair_index(d, progress=False)
    assert fixed.manifest.count == 243 and (fixed.added, fixed.removed) == (0, 0) and check_counts(d).ok
    idx = indexer.Index.open(d)
    try:
        assert len(idx) == 243 and isinstance(idx.layout, indexer.Sharded) == kind.startswith("sharded")
    finally:
        idx.close()
