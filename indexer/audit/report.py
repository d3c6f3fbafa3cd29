"""Writing an audit: JSONL and CSV per kind, PNG contact sheets, summary.json, a printed summary.
Nothing is written half: the files go into a temporary folder beside ``--out`` that replaces it
by renames (an older audit moved aside first), so a reader sees the old audit or the new one and
a failed audit leaves ``--out`` as it was.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

THUMB = 112             # pixels, a contact sheet's thumbnail side
SHEET_ROWS = 20         # rows per contact sheet
SHEET_COLS = 6          # the item and 5 neighbours (or a group's members)


@contextmanager
def replacing_dir(out: Path) -> Iterator[Path]:
    """A fresh temporary folder beside ``out`` that replaces ``out`` when the block succeeds."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".audit-{out.name}.", dir=out.parent))
    try:
        yield tmp
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".audit-{out.name}.old.", dir=out.parent))
            os.replace(out, old / out.name)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_rows(folder: Path, name: str, rows: Sequence[dict], columns: Sequence[str],
               csv_rows: Sequence[dict] | None = None) -> None:
    """``name.jsonl`` (every field, nested lists too) and ``name.csv`` (``columns`` of ``csv_rows``,
    default ``rows``)."""
    with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    with open(folder / f"{name}.csv", "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows if csv_rows is None else csv_rows:
            w.writerow({c: r.get(c) for c in columns})


def contact_sheet(path: Path, rows: Sequence[Sequence[tuple[Any, str]]], title: str) -> bool:
    """A PNG of ``rows`` of (image bytes, caption) cells; False (nothing written) when empty.
    An image that does not decode any more is a grey cell with its caption."""
    from PIL import Image, ImageDraw

    from embedder import load_image
    from embedder.images import label_font

    rows = [r for r in rows[:SHEET_ROWS] if r]
    if not rows:
        return False
    cap, pad = 26, 4
    cols = max(len(r) for r in rows)
    W, H = cols * (THUMB + pad) + pad, 24 + len(rows) * (THUMB + cap + pad)
    sheet = Image.new("RGB", (W, H), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((pad, 6), title, fill="black", font=label_font(10, title))
    for i, row in enumerate(rows):
        y = 24 + i * (THUMB + cap + pad)
        for j, (data, caption) in enumerate(row[:cols]):
            x = pad + j * (THUMB + pad)
            try:
                im = load_image(data, min_side=THUMB, stored=True)
                im.thumbnail((THUMB, THUMB))
                sheet.paste(im, (x + (THUMB - im.width) // 2, y + (THUMB - im.height) // 2))
            except Exception:           # noqa: BLE001 - a damaged blob is a grey cell, not a failed audit
                draw.rectangle((x, y, x + THUMB, y + THUMB), fill=(200, 200, 200))
            if j == 0:
                draw.rectangle((x - 2, y - 2, x + THUMB + 1, y + THUMB + 1), outline="red", width=2)
            font = label_font(10, caption)
            for li, line in enumerate(_wrap(caption, font, THUMB)[:2]):
                draw.text((x, y + THUMB + 2 + li * 11), line, fill="black", font=font)
    sheet.save(path, format="PNG")
    return True


def _wrap(text: str, font: Any, width: int) -> list[str]:
    """``text`` cut into lines of at most ``width`` pixels (a CJK character is ~2 Latin ones wide)."""
    lines = [""]
    for c in text:
        if lines[-1] and font.getlength(lines[-1] + c) > width:
            lines.append("")
        lines[-1] += c
    return lines


__all__ = ["replacing_dir", "write_rows", "contact_sheet"]
