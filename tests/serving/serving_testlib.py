"""Helpers the serving tests share (a module, not conftest: tests/indexer has a conftest too)."""
from __future__ import annotations

from pathlib import Path

from embedder.folders import walk_gallery

# the demo gallery's classes (scikit-image's sample pictures), for conftest's fixtures and the tests
DEMO_CLASSES = ["astronaut", "chelsea", "coffee", "rocket", "motorcycle", "coins", "retina", "page"]


def labelled_folder(root: Path) -> list[tuple[Path, str]]:
    """(file, label) of every readable image under ``root/<label>/``, sorted: the query files."""
    return sorted((f.abspath, f.label) for f in walk_gallery(root) if f.problem is None and f.label)
