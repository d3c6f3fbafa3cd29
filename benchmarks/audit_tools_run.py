"""fastdup and imagededup on an injected gallery of ``benchmarks/audit_faults.py``, as a user
runs them, written in the audit's own JSONL layout so ``audit_faults.score`` scores all alike.

Runs in a throwaway venv (neither is a dependency of this project):

    python -m venv /tmp/venv-dup && /tmp/venv-dup/bin/pip install fastdup imagededup
    /tmp/venv-dup/bin/python benchmarks/audit_tools_run.py fastdup GALLERY OUT
    /tmp/venv-dup/bin/python benchmarks/audit_tools_run.py imagededup GALLERY OUT

- fastdup (its default model, its defaults but ``nearest_neighbors_k=10`` and labels from the
  class folders as annotations): duplicates = its connected components (``cc_threshold`` 0.96,
  its default); outliers = ``fd.outliers()`` ranked by its distance; mislabelled = its label
  score as its similarity gallery computes it (the share of an image's similar images, over
  its threshold 0.9, that carry another label), ranked by that share then by similarity.
- imagededup: duplicates = ``PHash().find_duplicates`` (its default max distance 10) grouped;
  it finds no outliers nor label issues.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def write(out: Path, kind: str, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{kind}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def groups_rows(groups: list[list[str]], direct: list[tuple[str, str]] | None = None) -> list[dict]:
    """Groups as the audit writes them; ``pairs``: the ``direct`` pairs a tool reported inside
    each group (imagededup), else every pair of the group (a fastdup component is its claim)."""
    rows = []
    for g, members in enumerate(groups):
        ids = {p: i for i, p in enumerate(sorted(members))}
        items = [{"id": ids[p], "path": p} for p in sorted(members)]
        if direct is None:
            pairs = [{"a": ids[a], "b": ids[b]} for i, a in enumerate(sorted(members)) for b in sorted(members)[i + 1:]]
        else:
            pairs = [{"a": ids[a], "b": ids[b]} for a, b in direct if a in ids and b in ids and a < b]
        rows.append({"group": g + 1, "items": [{**it, "id": f"{g}:{it['id']}"} for it in items],
                     "pairs": [{"a": f"{g}:{p['a']}", "b": f"{g}:{p['b']}"} for p in pairs]})
    return rows


def union(pairs: list[tuple[str, str]]) -> list[list[str]]:
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    out: dict[str, list[str]] = {}
    for x in parent:
        out.setdefault(find(x), []).append(x)
    return [v for v in out.values() if len(v) > 1]


def run_fastdup(gallery: Path, out: Path) -> None:
    import fastdup
    import pandas as pd

    files = sorted(p for p in gallery.rglob("*") if p.is_file() or p.is_symlink())
    rel = [str(p.relative_to(gallery)) for p in files]
    ann = pd.DataFrame({"filename": [str(p) for p in files], "label": [r.split("/")[0] for r in rel]})
    fd = fastdup.create(work_dir=str(out / "fastdup-work"), input_dir=str(gallery))
    if not (out / "fastdup-work" / "atrain_features.dat").exists():
        fd.run(annotations=ann, nearest_neighbors_k=10, overwrite=True)
    to_rel = lambda f: str(Path(f).relative_to(gallery)) if str(f).startswith(str(gallery)) else str(f)  # noqa: E731
    cc = fd.connected_components()
    cc = cc[0] if isinstance(cc, tuple) else cc      # fastdup 2.x: (per image, per component)
    col = "component_id"
    groups = [[to_rel(f) for f in grp["filename"]] for _, grp in cc.groupby(col) if len(grp) > 1]
    write(out, "duplicates", groups_rows(groups))
    ol = fd.outliers().sort_values("distance", ascending=True)
    fcol = "filename_outlier" if "filename_outlier" in ol.columns else "filename"
    seen, rows = set(), []
    for f in ol[fcol]:
        r = to_rel(f)
        if r not in seen:
            seen.add(r)
            rows.append({"rank": len(rows) + 1, "path": r})
    write(out, "outliers", rows)
    sim = fd.similarity()
    lab = dict(zip(rel, (r.split("/")[0] for r in rel)))
    a, b = sim["filename_from"].map(to_rel), sim["filename_to"].map(to_rel)
    score: dict[str, list] = {}
    for x, y, d in zip(a, b, sim["distance"]):
        score.setdefault(x, []).append((lab.get(x) != lab.get(y), d, lab.get(y)))
    ranked = []
    for x, lst in score.items():
        diff = sum(t for t, _, _ in lst) / len(lst)
        if diff > 0:
            votes: dict[str, int] = {}
            for t, _, l in lst:
                if t:
                    votes[l] = votes.get(l, 0) + 1
            ranked.append((-diff, -max(d for t, d, _ in lst if t), x, max(votes, key=votes.get)))
    ranked.sort()
    write(out, "mislabelled", [{"rank": i + 1, "path": x, "suggested": s} for i, (_, _, x, s) in enumerate(ranked)])


def run_imagededup(gallery: Path, out: Path) -> None:
    from imagededup.methods import PHash

    dups = PHash().find_duplicates(image_dir=str(gallery), recursive=True)
    pairs = [(a, b) for a, lst in dups.items() for b in lst]
    write(out, "duplicates", groups_rows(union(pairs), pairs))


if __name__ == "__main__":
    tool, gallery, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    {"fastdup": run_fastdup, "imagededup": run_imagededup}[tool](gallery.resolve(), out)
