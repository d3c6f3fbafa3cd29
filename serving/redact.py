"""No absolute server path in any API answer (it tells an attacker the layout and user names):
index directories become the index's name, files inside them paths relative to it, and other
absolute paths a manifest records their last component."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping


def _is_abs(s: str) -> bool:
    return len(s) > 1 and (s.startswith("/") or (len(s) > 2 and s[1] == ":" and s[2] in "/\\"))


def _is_outside(s: str) -> bool:
    """A path naming something outside the index directory: absolute, or relative through
    ``..`` (a sharded index's shards beside it: ``../../home/alice/shards/0`` is no better)."""
    return "\n" not in s and (_is_abs(s) or s == ".." or s.startswith("../") or s.startswith("..\\"))


def _public_keys(keys: list[str]) -> dict[str, str]:
    """Each outside-path key -> the fewest last components that keep the keys distinct
    (``/srv/s0/part.faiss`` -> ``s0/part.faiss``): a manifest's ``sharded.files`` is keyed by path."""
    out = {k: k for k in keys if not (isinstance(k, str) and _is_outside(k))}
    outside = [k for k in keys if k not in out]
    parts = {k: [p for p in k.replace("\\", "/").split("/") if p not in ("", "..", ".")] for k in outside}
    for k in outside:
        for n in range(1, max(len(parts[k]), 1) + 1):
            name = "/".join(parts[k][-n:]) or "?"
            clash = [o for o in outside if o != k and "/".join(parts[o][-n:]) == name] or name in out.values()
            if not clash:
                break
        out[k] = name if name not in out.values() else f"{name} ({len(out)})"
    return out


def public_value(obj: Any) -> Any:
    """A manifest (or any JSON value) with each path to outside the index directory (absolute,
    or relative through ``..``) cut to its last part, in keys as well as in values."""
    if isinstance(obj, dict):
        names = _public_keys(list(obj))
        return {names[k]: public_value(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [public_value(v) for v in obj]
    if isinstance(obj, str) and _is_outside(obj):
        return Path(obj.replace("\\", "/")).name or obj
    return obj


class Redactor:
    """Rewrites messages that name files of the served index directories."""

    def __init__(self, directories: Mapping[str, Path]) -> None:
        pairs = [(form, where) for name, d in directories.items()
                 for where, path in [(f"index {name!r}", d), *_shards(name, d)]
                 for form in {str(Path(path)), str(Path(path).resolve()), os.path.abspath(path)}
                 if _is_abs(form)]
        self._pairs = sorted(pairs, key=lambda p: -len(p[0]))     # longest first

    def text(self, msg: str) -> str:
        for form, where in self._pairs:
            msg = msg.replace(form + os.sep, f"{where} ").replace(form, where)
        return msg

    def description(self, info: dict) -> dict:
        """``Searcher.describe`` output fit for clients: no directory, a path-free manifest."""
        out = {k: v for k, v in info.items() if k != "directory"}
        out["manifest"] = public_value(info.get("manifest") or {})
        return out


def _shards(name: str, directory: Path) -> list[tuple[str, Path]]:
    """("index NAME shard I", its folder) for each part in a folder of its own outside the
    directory (messages about its files must not name it); none for a single index."""
    from indexer.layouts.layout import layout_of

    try:
        parts = layout_of(directory).parts
    except Exception:       # noqa: BLE001 - a damaged index: health says so; nothing to add here
        return []
    return [(f"index {name!r} shard {i}", p.shard) for i, p in enumerate(parts) if p.shard is not None]
