"""The Gradio 6 app over a Searcher: Search, Probes, Evaluate, Index and Audit tabs. Every handler
turns bad input into a visible message (gr.Warning toast and status line) and empty outputs, never
a stack trace; the handlers have api_names so gradio_client can call them."""
from __future__ import annotations

import io
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Mapping

import gradio as gr
import numpy as np
from gradio.utils import get_upload_folder, is_in_or_equal
from PIL import Image

from embedder.containers import ACCEPTED_TEXT
from indexer import IndexerError, Manifest, no_close_match
from indexer.directory.index_dir import MANIFEST

from .evaluate import dba_line, evaluate_folder, evaluate_gallery, recall_figure
from .probes import DEFAULT_SCALES, DEFAULT_SHIFTS
from .queries import MAX_QUERY_IMAGES, Box, check_count, parse_box
from .redact import Redactor
from .render import probe_grid, result_items
from .results import RequestError, check_k
from .searcher import Query, Searcher, UnknownIdError
from .uploads import DEFAULT_MAX_UPLOAD_BYTES, UploadError, check_size, decode_upload

GALLERY_LOO = "gallery (leave-one-out)"
# Most numbers a list field (scales, shift values, k values) may hold: each scale or shift value
# is one more search per open index (400 values cost 26 CPU-seconds in one request).
MAX_LIST_VALUES = 16
#: the Audit tab's galleries (kind, title) and how many images each shows
AUDIT_GALLERIES = (("mislabelled", "Likely mislabelled (label → suggested · score)"),
                   ("duplicates", "Near-duplicate groups"), ("outliers", "Outliers (score)"))
AUDIT_SHOWN = 24
P_MAX_TOPK, P_MAX_RANDOM = 64, 6        # the Probes sliders' ranges, checked again server-side


def query_image(**kw: Any) -> gr.Image:
    """gr.Image whose preprocessing failure becomes a clear gr.Error (the instance's preprocess
    is wrapped: Gradio writes a .pyi stub beside any subclass)."""
    comp = gr.Image(**kw)
    inner = comp.preprocess

    def preprocess(payload: Any) -> Any:
        try:
            return inner(payload)
        except Exception:
            name = getattr(payload, "orig_name", None) or "upload"
            raise gr.Error(f"{name}: not a readable image; expected a {ACCEPTED_TEXT} file") from None

    comp.preprocess = preprocess  # type: ignore[method-assign]
    return comp


def _floats(text: str, what: str, most: int = MAX_LIST_VALUES) -> list[float]:
    text = (text or "").strip()
    if not text:
        return []
    parts = [t for t in text.replace(";", ",").split(",") if t.strip()]
    if len(parts) > most:
        raise RequestError(f"{what}: at most {most} values, got {len(parts)}")
    try:
        vals = [float(t) for t in parts]
    except ValueError:
        raise RequestError(f"{what}: expected comma-separated numbers like '0.5, 2', got {text!r}") from None
    if any(not np.isfinite(v) for v in vals):
        raise RequestError(f"{what}: expected finite numbers, got {text!r}")
    return vals


def _pick_choices(searcher: Searcher, per_label: int = 2, limit: int = 400) -> list[tuple[str, str]]:
    """Gallery images offered as example queries: a couple per class of the default index."""
    idx = searcher.index()
    return list(islice(((f"{lab} — {idx.meta(i).get('path', str(i))}", str(i))
                        for lab in idx.labels() for i in idx.ids_for_label(lab)[:per_label]), limit))


def _describe_md(info: Mapping[str, Any]) -> str:
    """The Index tab's table: live counts and the manifest fields a user asks about first."""
    m = Manifest.from_dict(info["manifest"], where=f"index {info['name']!r}", strict=False)
    rows = [("images", info.get("size")), ("classes", info.get("labels")), ("dim", info.get("dim")),
            ("model", m.model.backbone), ("model file", m.model.source), ("model sha256", m.model_hash[:16]),
            ("index type", m.index_type), ("nprobe", m.nprobe), ("measured recall@10 (vs exact)", m.recall_at_10),
            ("target recall", m.target_recall), ("built", m.built_at)]
    body = "\n".join(f"| {k} | {'—' if v in (None, '') else v} |" for k, v in rows)
    return f"### {info['name']}\n\n| field | value |\n| --- | --- |\n{body}\n"


def _query_inputs(prefix: str, picks: list[tuple[str, str]], labels: list[str], *, height: int,
                  label_text: str) -> tuple[gr.Image, gr.Dropdown, gr.Dropdown]:
    """The Search and Probes tabs' query column: an upload or a gallery pick (each clears the other)."""
    img = query_image(type="filepath", image_mode=None, label="Query image", sources=["upload", "clipboard"],
                      elem_id=f"{prefix}-image", height=height)
    pick = gr.Dropdown(picks, value=None, label="…or a gallery image", elem_id=f"{prefix}-pick",
                       allow_custom_value=True)
    label = gr.Dropdown(labels, value=None, label=label_text, elem_id=f"{prefix}-label")
    pick.input(lambda: None, None, img, queue=False, api_name=False)
    img.upload(lambda: None, None, pick, queue=False, api_name=False)
    return img, pick, label


def build_ui(searcher: Searcher, *, query_sets: Mapping[str, Path] | None = None,
             max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES, title: str = "DAS image retrieval") -> gr.Blocks:
    """The Blocks app; mount it with gr.mount_gradio_app (see app.py)."""
    names = searcher.names
    query_sets = dict(query_sets or {})
    picks = _pick_choices(searcher)
    redactor = Redactor(searcher.directories)
    labels = sorted({lab for n in names for lab in searcher.index(n).labels()})

    def upload(path: str, box: Box | None = None) -> Image.Image:
        p = Path(path)
        if not is_in_or_equal(str(p), get_upload_folder()):
            # Gradio refuses such paths before this runs (serving.server); never read one
            raise UploadError(f"{p.name}: not an upload; upload the image through the page")
        check_size(p.stat().st_size, p.name, max_upload_bytes)
        return decode_upload(p.read_bytes(), p.name, max_bytes=max_upload_bytes, min_side=searcher.decode_side,
                             box=box)     # a region: decoded no larger than the box needs

    def make_query(img_path: str | None, pick: str | None, label: str | None, region: str | None = None,
                   more: list[str] | None = None) -> Query:
        """The query column's values -> one Query (fused with the ``more`` images, if any)."""
        box = parse_box(region)
        check_count(len(more or []) + 1, "more images")
        img = upload(img_path, box) if img_path else None
        extra = [searcher.query(upload(m), name=Path(m).name) for m in more or []]
        if img is None and not pick and extra and box is None:   # the "more" files alone (a phone's
            return searcher.fused(extra, label=label or None)    # HEIC: the image box takes no HEIC)
        if img is not None and box is not None:
            q = searcher.region_query(img, box, Path(img_path).name, label or None)
        else:
            q = searcher.query(img, id=pick or None, label=label or None,
                               name=Path(img_path).name if img_path else None, box=box)
        return searcher.fused([q, *extra], label=label or None) if extra else q

    def fail(e: Exception, n_out: int) -> list[Any]:
        msg = getattr(e, "message", None) or str(e)
        gr.Warning(msg)
        return [f"**⚠ {msg}**"] + [None] * n_out

    # -- handlers -------------------------------------------------------------------------
    def do_search(img_path: str | None, pick: str | None, label: str | None, k: float,
                  dba: bool = True, region: str | None = None, more: list[str] | None = None,
                  only: list[str] | None = None, copies: bool = False) -> list[Any]:
        try:
            if copies and ((region or "").strip() or more):
                raise RequestError("copies: checked for one whole query image (no box, no more images)")
            q = make_query(img_path, pick, label, region, more)
            kk = int(k)
            # checked: each index's default (DBA where built with it); unchecked: plain everywhere
            found = searcher.search_all(q, kk, dba=None if dba else False, thumbnails=True, labels=only)
            data = Path(img_path).read_bytes() if copies and img_path else None   # None: the gallery pick's
            out = [[(im, cap + (" · copy" if m.get("copy") else "")) for (im, cap), m in zip(
                    result_items(searcher, res.results, q.label),
                    searcher.copies(q, data, res.results, n) if copies else [{}] * len(res.results))]
                   for n, res in found.items()]
        except (ValueError, UnknownIdError, IndexerError) as e:    # RequestError, UploadError, ImageLoadError
            return fail(e, len(names))
        known = f"label **{q.label}** (green = same label, red = different)" if q.label else \
            "label unknown (pick one to see green/red frames)"
        partial = "".join(f"\n\n**⚠ {n}: partial answer, shard(s) {', '.join(map(str, r.partial))} did "
                          f"not answer in time (a lost node?); results come from the other shards**"
                          for n, r in found.items() if r.partial)
        within = f" · only {', '.join(only)}" if only else ""
        novel = "".join(f"\n\n**{n}**: {no_close_match(r.novelty)} (another kind of photo?)"
                        for n, r in found.items() if r.unlike_gallery)
        votes = " · ".join(f"{n}: **{r.suggested[0]}** ({r.suggested[1]:.2f})" for n, r in found.items() if r.suggested)
        votes = f"\n\nSuggested label · {votes}" if votes else ""
        return [f"Query **{q.name}** · top-{kk}{within} · {known}{votes}{partial}{novel}"] + out

    def do_probes(img_path: str | None, pick: str | None, label: str | None, k: float, topk: float,
                  scales: str, n_random: float, r_s: float, shifts: str, shift_label: str | None,
                  seed: float) -> list[Any]:
        try:
            q = make_query(img_path, pick, label)
            sc = _floats(scales, "scales")
            sh = _floats(shifts, "shift r_b values")
            if not 0 <= int(n_random) <= P_MAX_RANDOM or not 1 <= int(topk) <= P_MAX_TOPK:
                raise RequestError(f"random scalings: expected 0..{P_MAX_RANDOM}, K channels: 1..{P_MAX_TOPK}; "
                                   f"got {int(n_random)} and {int(topk)}")
            reports = searcher.probe_all(q, int(k), topk=int(topk), scales=sc, n_random=int(n_random),
                                         scale_range=float(r_s), shifts=sh,
                                         shift_label=(shift_label or None) if not q.label else None,
                                         seed=int(seed), thumbnails=True)
        except (ValueError, UnknownIdError, IndexerError) as e:
            return fail(e, len(names) + 1)
        grids = [probe_grid(searcher, reports[n]) for n in names]
        table = [[r["index"], r["probe"], round(r["overlap@k"], 3),
                  None if r["precision@k"] is None else round(r["precision@k"], 3)]
                 for n in names for r in reports[n].summary()]
        notes = sorted({note for rep in reports.values() for note in rep.notes})
        status = f"Query **{q.name}**" + (f" · label **{q.label}**" if q.label else "") + \
            "".join(f"\n\n*{n}*" for n in notes)
        return [status] + grids + [table]

    def do_eval(source: str, ks_text: str) -> list[Any]:
        try:
            ks = [check_k(int(v)) for v in _floats(ks_text, "k values")] or [1, 2, 4, 8]
            if source == GALLERY_LOO:
                results = [evaluate_gallery(searcher, index=n, ks=ks) for n in names]
            elif source in query_sets:
                results = [evaluate_folder(searcher, query_sets[source], index=n, ks=ks, source=source)
                           for n in names]
            else:
                raise RequestError(f"query set {source!r}: expected one of {[GALLERY_LOO, *query_sets]}")
        except (ValueError, FileNotFoundError, IndexerError) as e:
            return fail(e, 2)
        head = ["index", "DBA", "queries", "n"] + [f"R@{k}" for k in sorted(set(ks))]
        rows = [[row.get(h) for h in head] for r in results for row in r.rows()]   # no R@k past an index's size
        png = Image.open(io.BytesIO(recall_figure(results)))
        skipped = sum(len(r.skipped) for r in results)
        msg = f"Recall@k (%) on **{results[0].source}**" + (f" · {skipped} unreadable files skipped" if skipped else "")
        line = dba_line(results)
        msg += f"\n\n{line}" if line else ""
        msg += "".join(f"\n\n{r.index}: weakest labels at R@1: " + ", ".join(
            f"{lab} {100 * v:.0f}% ({n})" for lab, v, n in r.weakest[:5]) for r in results if r.weakest)
        msg += "".join(f"\n\n{r.index}: suggested label (vote of the top-{s['hits']}) right "
                       f"{100 * s['accuracy']:.1f}%; confident for {100 * s['confident']:.0f}% of the queries"
                       for r in results if (s := r.suggested))
        import pandas as pd  # a gradio dependency; headers travel with the data this way

        return [msg, pd.DataFrame(rows, columns=head), png]

    def do_audit(name: str) -> list[Any]:
        """The Audit tab: each list as thumbnails with captions, the ids behind them (for a click)."""
        try:
            found = searcher.audit(name)
        except (ValueError, IndexerError) as e:
            return fail(e, len(AUDIT_GALLERIES) + 1) + [[[] for _ in AUDIT_GALLERIES]]
        items = {"mislabelled": [(x, f"{x['label']} → {x['suggested']} · {x['score']:.2f}")
                                 for x in found.get("mislabelled", [])],
                 "duplicates": [(x, f"group {g['group']} · {x['label'] or ''} · max cos {g['max_cosine']:.3f}"
                                    + (" · identical files" if g["identical_files"] else ""))
                                for g in found["duplicates"] for x in g["items"]],
                 "outliers": [(x, f"{x['label'] or ''} · {x['score']:.2f}") for x in found["outliers"]]}
        gals = [[(searcher.thumbnail(name, x["id"]), cap) for x, cap in items[kind][:AUDIT_SHOWN]]
                for kind, _ in AUDIT_GALLERIES]
        ids = [[x["id"] for x, _ in items[kind][:AUDIT_SHOWN]] for kind, _ in AUDIT_GALLERIES]
        conf = [[c["label_a"], c["label_b"], c["edges"], c["rate"]] for c in found.get("confused", [])]
        f = found["summary"]["found"]
        why = "".join(f"\n\n{kind}: {reason}" for kind, reason in found["summary"]["skipped"].items()
                      if reason != "not asked for")
        msg = (f"**{name}**: {found['summary']['images']} images · {f.get('mislabelled', 0)} likely mislabelled · "
               f"{f['duplicate_groups']} near-duplicate groups · outliers ranked · "
               f"{f.get('confused_pairs', 0)} confused class pairs{why}")
        return [msg, *gals, conf, ids]

    def open_in_search(n: int) -> Callable[..., list[Any]]:
        """The click handler of the n-th audit gallery: the Search tab, that image picked (the
        upload cleared). A named function: Gradio passes SelectData by the annotation."""
        def clicked(ids: list[list[int]], evt: gr.SelectData) -> list[Any]:
            return [gr.Tabs(selected="search"), None, str(ids[n][evt.index])]
        return clicked

    # -- layout ---------------------------------------------------------------------------
    # delete_cache: result thumbnails Gradio writes to its cache are removed after an hour.
    with gr.Blocks(title=title, analytics_enabled=False, delete_cache=(1800, 3600)) as demo:
        gr.Markdown(f"# {title}\nIndexes: " + ", ".join(f"**{n}** ({len(searcher.index(n))} images)" for n in names))
        with gr.Tabs(selected="search") as tabs:
            with gr.Tab("Search", id="search"):
                with gr.Row():
                    with gr.Column(scale=1):
                        s_query = _query_inputs("search", picks, labels, height=260,
                                                label_text="Query label (optional: frames results green/red)")
                        s_region = gr.Textbox(label="Box x0,y0,x1,y1 (optional: search that region of the "
                                                    "image, in its pixels)", elem_id="search-box")
                        s_more = gr.File(file_count="multiple", file_types=["image", ".heic", ".heif", ".avif"],
                                         type="filepath",
                                         label=f"More query images (optional, up to {MAX_QUERY_IMAGES - 1}: "
                                               "one result list for all of them; a phone's HEIC goes here)", elem_id="search-more")
                        s_only = gr.Dropdown(labels, value=[], multiselect=True, elem_id="search-only",
                                             label="Only these labels (optional: results from these classes)")
                        s_copies = gr.Checkbox(False, elem_id="search-copies",
                                               label="Mark copies of the query (resized, re-encoded, cropped)")
                        s_k = gr.Slider(1, 50, value=8, step=1, label="k", elem_id="search-k")
                        with_dba = [n for n in names if searcher.index(n).has_dba]
                        s_dba = gr.Checkbox(value=True, elem_id="search-dba", interactive=bool(with_dba),
                                            label="DBA re-ranking (neighbourhood-augmented gallery vectors)"
                                                  + (f": {', '.join(with_dba)}" if with_dba else
                                                     ": no open index was built with --dba"))
                        s_btn = gr.Button("Search", variant="primary", elem_id="search-btn")
                    with gr.Column(scale=3):
                        s_status = gr.Markdown(elem_id="search-status")
                        s_gals = [gr.Gallery(label=f"Results — {n}", columns=4, height="auto", object_fit="contain",
                                             elem_id=f"search-results-{i}", format="png") for i, n in enumerate(names)]
                # The button sends the checkbox too (endpoint "search_dba"); "search" keeps its four
                # inputs for programs written against it (each index's default: DBA where built with
                # it): an event with no trigger on the page, an API endpoint only.
                s_btn.click(do_search, [*s_query, s_k, s_dba, s_region, s_more, s_only, s_copies],
                            [s_status, *s_gals], api_name="search_dba")
                gr.on([], do_search, [*s_query, s_k], [s_status, *s_gals], api_name="search")

            with gr.Tab("Probes", id="probes"):
                gr.Markdown("Test-time semantic scaling (top-K channels of the query embedding scaled) and "
                            "semantic shifting (query + r_b × difference of two gallery embeddings of one class), "
                            "as in the DAS paper's supplementary section L. Each row: the probe's top-k, with "
                            "overlap@k against the original top-k and precision@k when the query's label is known.")
                with gr.Row():
                    with gr.Column(scale=1):
                        p_query = _query_inputs("probe", picks, labels, height=220, label_text="Query label (optional)")
                        p_k = gr.Slider(1, 20, value=6, step=1, label="k")
                        p_topk = gr.Slider(1, P_MAX_TOPK, value=4, step=1, label="K channels scaled (top-K by value)")
                        p_scales = gr.Textbox(", ".join(f"{s:g}" for s in DEFAULT_SCALES), label="Scales")
                        p_nrand = gr.Slider(0, P_MAX_RANDOM, value=0, step=1, label="Random scalings (per channel U[1-r_s, 1+r_s])")
                        p_rs = gr.Slider(0.05, 0.95, value=0.5, step=0.05, label="r_s")
                        p_shifts = gr.Textbox(", ".join(f"{s:g}" for s in DEFAULT_SHIFTS), label="Shift r_b values")
                        p_shift_label = gr.Dropdown(labels, value=None, label="Shift class (when the query's label is unknown)")
                        p_seed = gr.Number(0, precision=0, label="Seed")
                        p_btn = gr.Button("Run probes", variant="primary", elem_id="probe-btn")
                    with gr.Column(scale=3):
                        p_status = gr.Markdown(elem_id="probe-status")
                        p_grids = [gr.Image(label=f"Probes — {n}", show_label=False, type="pil", format="png", interactive=False,
                                            elem_id=f"probe-grid-{i}") for i, n in enumerate(names)]
                        p_table = gr.Dataframe(headers=["index", "probe", "overlap@k", "precision@k"],
                                               label="Stability", interactive=False, elem_id="probe-table")
                p_btn.click(do_probes, [*p_query, p_k, p_topk, p_scales, p_nrand, p_rs, p_shifts, p_shift_label, p_seed],
                            [p_status, *p_grids, p_table], api_name="probes")

            with gr.Tab("Evaluate", id="evaluate"):
                gr.Markdown("Recall@k of every open index: leave-one-out on the gallery (each labelled image "
                            "queries the rest), or on a labelled query folder (`<folder>/<label>/<images>`) "
                            "given to the server with `--queries`; an index with DBA with and without it, "
                            "and whether the difference at R@1 is beyond the noise.")
                with gr.Row():
                    e_src = gr.Dropdown([GALLERY_LOO, *query_sets], value=(list(query_sets) or [GALLERY_LOO])[0],
                                        label="Queries", elem_id="eval-source")
                    e_ks = gr.Textbox("1, 2, 4, 8", label="k values")
                    e_btn = gr.Button("Evaluate", variant="primary", elem_id="eval-btn")
                e_status = gr.Markdown()
                with gr.Row():
                    e_table = gr.Dataframe(label="Recall@k (%)", interactive=False, elem_id="eval-table")
                    e_plot = gr.Image(label="Recall@k", type="pil", format="png", interactive=False)
                e_btn.click(do_eval, [e_src, e_ks], [e_status, e_table, e_plot], api_name="evaluate")

            with gr.Tab("Index", id="index"):
                for n in names:
                    info = redactor.description(searcher.describe(n))     # no server paths on the page
                    gr.Markdown(_describe_md(info))
                    gr.JSON(info.get("manifest", {}), label=f"{MANIFEST} — {n}")

            with gr.Tab("Audit", id="audit"):
                gr.Markdown("The gallery audited from its index's own neighbours (computed once per index "
                            "version, kept beside the index): likely mislabelled images (label → the label "
                            "their neighbours suggest), near-duplicate groups, outliers and the most confused "
                            "class pairs. Click an image to search with it.")
                with gr.Row():
                    a_index = gr.Dropdown(names, value=names[0], label="Index", elem_id="audit-index")
                    a_btn = gr.Button("Audit", variant="primary", elem_id="audit-btn")
                a_status = gr.Markdown(elem_id="audit-status")
                a_gals = [gr.Gallery(label=title, columns=6, height="auto", object_fit="contain", format="png",
                                     allow_preview=False, elem_id=f"audit-{kind}")
                          for kind, title in AUDIT_GALLERIES]
                a_conf = gr.Dataframe(headers=["class a", "class b", "neighbour edges", "rate"],
                                      label="Most confused class pairs", interactive=False, elem_id="audit-confused")
                a_ids = gr.State([[] for _ in AUDIT_GALLERIES])
            a_btn.click(do_audit, [a_index], [a_status, *a_gals, a_conf, a_ids], api_name="audit")
            for n, gal in enumerate(a_gals):     # a click searches with that gallery image
                gal.select(open_in_search(n), [a_ids], [tabs, s_query[0], s_query[1]], api_name=False).then(
                    do_search, [*s_query, s_k, s_dba], [s_status, *s_gals], api_name=False)
    return demo


__all__ = ["build_ui", "query_image"]
