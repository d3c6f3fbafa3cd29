"""Pictures for people: result captions and the probe grid (one row per probe, as in Figs. V-VI),
drawn with PIL into one PNG that looks the same everywhere."""
from __future__ import annotations

from typing import TYPE_CHECKING

from PIL import Image, ImageDraw, ImageFont

from embedder.images import label_font

from .thumbs import framed

if TYPE_CHECKING:
    from .searcher import ProbeReport, Result, Searcher


def caption(r: "Result") -> str:
    """What the gallery shows under a result: label and cosine score."""
    return f"{r.label if r.label is not None else '(no label)'} · {r.score:.3f}"


def match(r: "Result", query_label: str | None) -> bool | None:
    return None if query_label is None else (r.label == query_label)


def _thumb(searcher: "Searcher", r: "Result") -> Image.Image:
    """The result's thumbnail: the one its request read (``thumbnails=True``), else its index's now."""
    return r.thumbnail if r.thumbnail is not None else searcher.thumbnail(r.index, r.id)


def result_items(searcher: "Searcher", results: list["Result"],
                 query_label: str | None) -> list[tuple[Image.Image, str]]:
    """(framed thumbnail, caption) pairs for a gr.Gallery."""
    return [(framed(_thumb(searcher, r), match(r, query_label)), caption(r)) for r in results]


def _fit(text: str, font: ImageFont.ImageFont, width: int, draw: ImageDraw.ImageDraw) -> str:
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "…", font=font) > width:
        text = text[:-1]
    return text + "…"


def probe_grid(searcher: "Searcher", report: "ProbeReport", cell: int = 112, query_cell: int = 112) -> Image.Image:
    """Query image on the left, then one row per probe: name, stability figures, top-k with
    green/red frames (when the query's label is known) and label/score under each."""
    k = report.k
    label_w, pad, text_h = 190, 6, 28
    row_h = cell + text_h + pad
    rows = report.rows
    W = pad + query_cell + pad + label_w + k * (cell + pad)
    H = pad + 22 + len(rows) * row_h + pad
    out = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(out)
    f_small, f_name = label_font(11), label_font(14)
    q = report.query
    title = f"index {report.index} · query {q.name}" + (f" · label {q.label}" if q.label else "")
    f_title = label_font(14, title)
    d.text((pad, pad), _fit(title, f_title, W - 2 * pad, d), fill="black", font=f_title)
    qimg = searcher.query_image(q).copy()
    qimg.thumbnail((query_cell, query_cell))
    out.paste(qimg, (pad, pad + 22))
    x0 = pad + query_cell + pad
    for ri, row in enumerate(rows):
        y = pad + 22 + ri * row_h
        d.text((x0, y + 4), _fit(row.name, f_name, label_w - pad, d), fill="black", font=f_name)
        d.text((x0, y + 26), f"overlap@{k}: {row.overlap:.2f}", fill="#333", font=f_small)
        if row.precision is not None:
            d.text((x0, y + 42), f"precision@{k}: {row.precision:.2f}", fill="#333", font=f_small)
        for ci, res in enumerate(report.results[row.name][:k]):
            x = x0 + label_w + ci * (cell + pad)
            th = _thumb(searcher, res).copy()
            th.thumbnail((cell, cell))
            th = framed(th, match(res, q.label), width=4)
            out.paste(th, (x + (cell - th.width) // 2, y + (cell - th.height) // 2))
            f_label = label_font(11, str(res.label))
            d.text((x, y + cell + 2), _fit(str(res.label), f_label, cell, d), fill="black", font=f_label)
            d.text((x, y + cell + 15), f"{res.score:.3f}", fill="#555", font=f_small)
    return out
