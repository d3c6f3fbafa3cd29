"""Write constraints.txt: the exact version of every package that `pip install -e ".[cpu,dev]"`
brings in, read from the environment this runs in (the project's requirements followed
recursively, extras and environment markers included, so nothing the machine happens to have
beside them gets pinned).

Run it in an environment where the suite has just passed (e.g. the one `.ci/drift` made):

    python .ci/pin.py            # rewrites constraints.txt
    python .ci/pin.py --check    # exit 1 and the differences when the environment disagrees

pip's own resolver has no "lock" for a plain requirements list with extras; pip-tools and uv
would resolve afresh from the registry, which is not what we want here (the pins must be the
versions the suite passed with).
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "das-retrieval"
EXTRAS = ("cpu", "dev")
HEADER = """\
# Known-good versions: the suite passed with exactly these (python .ci/pin.py wrote this file).
# Used by README's install command and .ci/run: pip install -c constraints.txt -e ".[cpu,dev]"
# Newer releases inside pyproject.toml's bounds are tried by .ci/drift (CONTRIBUTING.md).
"""


def closure(project: str = PROJECT, extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """{distribution name: installed version} of everything ``project[extras]`` requires."""
    seen: dict[str, set[str]] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(project, extras)]
    while todo:
        name, want = todo.pop()
        key = canonicalize_name(name)
        if key in seen and set(want) <= seen[key]:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue                      # a requirement for another platform: not installed here
        seen.setdefault(key, set()).update(want)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (*want, "")):
                continue
            todo.append((req.name, tuple(sorted(req.extras))))
    seen.pop(canonicalize_name(project), None)
    return {md.distribution(k).metadata["Name"]: md.version(k) for k in sorted(seen)}


def render(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(pins.items(), key=lambda kv: kv[0].lower()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python .ci/pin.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "constraints.txt")
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    text = render(closure())
    if not args.check:
        args.out.write_text(text)
        print(f"{args.out}: {text.count('==')} pins")
        return 0
    old = {l.split("==")[0]: l.split("==")[1] for l in args.out.read_text().splitlines()
           if "==" in l and not l.startswith("#")}
    new = {l.split("==")[0]: l.split("==")[1] for l in text.splitlines() if "==" in l and not l.startswith("#")}
    diff = [f"{n}: {old.get(n, '-')} -> {new.get(n, '-')}" for n in sorted(set(old) | set(new), key=str.lower)
            if old.get(n) != new.get(n)]
    print("\n".join(diff) if diff else "the environment matches constraints.txt")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
