"""No absolute server path in any API answer: where the indexes and galleries live on the
server's disk is nobody's business but the operator's (it tells an attacker the layout, the
user name in /home/..., what else to probe). Index directories become the index's name, files
inside them their path relative to it, and other absolute paths a manifest records (the gallery
folder, the model file it was built from) their last component."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping


def _is_abs(s: str) -> bool:
    return len(s) > 1 and (s.startswith("/") or (len(s) > 2 and s[1] == ":" and s[2] in "/\\"))


def public_value(obj: Any) -> Any:
    """A manifest (or any JSON value) with each absolute path string cut to its last part."""
    if isinstance(obj, dict):
        return {k: public_value(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [public_value(v) for v in obj]
    if isinstance(obj, str) and _is_abs(obj) and "\n" not in obj:
        return Path(obj).name or obj
    return obj


class Redactor:
    """Rewrites messages that name files of the served index directories."""

    def __init__(self, directories: Mapping[str, Path]) -> None:
        pairs = []
        for name, d in directories.items():
            for form in {str(Path(d)), str(Path(d).resolve()), os.path.abspath(d)}:
                if _is_abs(form):
                    pairs.append((form, name))
        self._pairs = sorted(pairs, key=lambda p: -len(p[0]))     # longest first

    def text(self, msg: str) -> str:
        for form, name in self._pairs:
            msg = msg.replace(form + os.sep, f"index {name!r} ").replace(form, f"index {name!r}")
        return msg

    def description(self, info: dict) -> dict:
        """``Searcher.describe`` output fit for clients: no directory, a path-free manifest."""
        out = {k: v for k, v in info.items() if k != "directory"}
        out["manifest"] = public_value(info.get("manifest") or {})
        return out
