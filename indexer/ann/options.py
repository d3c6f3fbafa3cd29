"""``BuildOptions``: how an index is chosen and tuned, one frozen value checked once, when made,
in one line naming the option, before any work (build, ``--shard``, ``--ray``, merge and the
sharded build all take and hand on the same choices).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from embedder.cli import memory_size

from ..directory.manifest import DEFAULT_TARGET_RECALL
from ..errors import IndexerError
from .faiss_index import DEFAULT_FLAT_THRESHOLD, INDEX_TYPES


@dataclass(frozen=True)
class BuildOptions:
    """``index_memory``: the BUILD's budget in bytes (``--index-memory``; a size text is accepted):
    types whose codes alone exceed it are not built. Not the serving ``--max-memory``."""

    index_type: str = "auto"
    flat_threshold: int = DEFAULT_FLAT_THRESHOLD
    nlist: int | None = None
    target_recall: float = DEFAULT_TARGET_RECALL
    seed: int = 0
    index_memory: int | None = None

    def __post_init__(self) -> None:
        if self.index_type not in INDEX_TYPES:
            raise IndexerError(f"index type {self.index_type!r}: expected one of {', '.join(INDEX_TYPES)}")
        if not 0 < self.target_recall <= 1:
            raise IndexerError(f"target recall {self.target_recall}: expected 0 < target <= 1")
        for name in ("flat_threshold", "nlist"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise IndexerError(f"{name.replace('_', '-')} {v}: expected a positive integer")
        try:
            object.__setattr__(self, "index_memory", memory_size(self.index_memory))
        except ValueError as e:
            raise IndexerError(str(e)) from None

    @classmethod
    def of(cls, options: "BuildOptions | None" = None, **kw: Any) -> "BuildOptions":
        """``options`` with the keyword spellings of the build functions applied (``max_memory``
        is the old name of ``index_memory``); checked once, here."""
        if "max_memory" in kw:
            kw["index_memory"] = kw.pop("max_memory")
        unknown = set(kw) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"unknown build option(s): {', '.join(sorted(unknown))}")
        if options is None:
            return cls(**kw)
        return replace(options, **kw) if kw else options     # already checked: passed on as is


# ---------------------------------------------------------------------------- the build's default
#: below this many gallery images the default stays fp32: int8 calibration reads
#: embedder.quantize.DEFAULT_IMAGES (256) of the gallery's own images
INT8_MIN_IMAGES = 256


def dba_min_images(k: int) -> int:
    """Gallery images from which DBA is on by default (2k + 1): below, every item's k - 1
    neighbours reach across most of the gallery, and averaging with strangers only blurs."""
    return 2 * k + 1


#: the default's DBA stops at this many images of DBA_MAX_AT_DIM-d embeddings (a line says so; --dba
#: computes it anyway), narrower ones at the same cost (:func:`dba_max_images`): its neighbour pass is
#: an exact k-NN of the gallery against itself, n^2 d (2 Zen 4 cores: 11 s for 20k x 2,560, so ~4.5
#: min at 100k and ~7 h at 1M), and a server holds its n x d float16 vectors (0.5 GB at 100k x 2,560)
DBA_MAX_IMAGES = 100_000
DBA_MAX_AT_DIM = 2_560


def dba_max_images(dim: int | None) -> int:
    """The largest gallery whose default DBA costs what 100,000 x 2,560's does (n^2 d): 141,421 at
    1,280-d, 447,213 at 128-d (n x d held: <= 256M half floats up to 2,560-d); None: the 2,560-d bound."""
    return int(DBA_MAX_IMAGES * math.sqrt(DBA_MAX_AT_DIM / max(1, dim or DBA_MAX_AT_DIM)))


#: the training-free embedder (embedder.pretrained names) of a build without --model, and the one
#: int8 uses on a CPU with int8 dot products (embedder.quantize.int8_dot_product): there the
#: two-backbone int8 model builds at 1.07-1.23x Lite1 fp32's rate and ranks higher on every set;
#: with AVX2 alone at 0.63-0.80x (docs/benchmarks/quality-round5.md#default-switched-by-cpu)
EMBEDDER = "lite1-gem4-224"
EMBEDDER_INT8_DOT = "lite0+lite1-gem4"


def default_embedder_of(source_hash: str | None) -> str | None:
    """Which of the build's default embedders an exported one is, by its metadata's
    ``source_hash`` (the weights' hash, which int8 versions keep); None for any other network. A
    rebuild resumes with an index's own embedder, and `indexer merge` gives the shards' model the
    rule of a build without --model."""
    from embedder.pretrained import resolve_spec

    return next((n for n in (EMBEDDER, EMBEDDER_INT8_DOT)
                 if source_hash is not None and resolve_spec(n).source_hash() == source_hash), None)


@dataclass(frozen=True)
class BuildDefaults:
    """What ``indexer build`` runs with: ``int8``, ``dba`` and, without --model, the pretrained
    ``embedder``; ``notes``: a line per automatic choice that turned something off or hangs on
    the machine."""

    int8: bool
    dba: bool
    notes: tuple[str, ...] = ()
    embedder: str | None = None


def resolve_defaults(int8: bool | None, dba: bool | None, *, model_given: bool, images: int,
                     mode: str = "process", dba_k: int = 8, int8_dot: str | None = None,
                     kept: str | None = None, labelled: bool = True, backbone: str | None = None,
                     dim: int | None = None, kept_int8: bool = False) -> BuildDefaults:
    """The one place ``indexer build``'s default is decided (docs/benchmarks/quality-round5.md):
    ``int8``/``dba`` None = auto. Every embedder gets int8 from :data:`INT8_MIN_IMAGES` images
    and DBA from :func:`dba_min_images` up to :func:`dba_max_images` of ``dim`` (the --model's or a
    merge's shards'; else the chosen embedder's); a ``--model`` embedder's DBA
    only on a ``labelled`` gallery, where the build measures it (``dba_where_it_helps``): it was
    validated for the default alone, and a fine-tuned pair in fp32 lost 0.9 R@1 with it. ``mode``:
    "process" (one process, a ``--ray`` build merged, ``indexer merge``), "shard" (DBA is the
    merge's) or "parts" (a sharded index, its shards kept as its parts: DBA is not computed there).
    ``images``: the gallery's count or a bound of it (a count, not a sample, so a rerun resumes the
    same way); ``backbone``: the --model's, int8 only where
    ``embedder.quantize.int8_by_default`` says. The embedder (without --model): ``kept`` (the one
    the index at --out was built with, so a rerun elsewhere resumes; int8 if ``kept_int8``) unless
    the rebuild changes its precision, which embeds every image again anyway, else
    :data:`EMBEDDER_INT8_DOT` in int8 where ``int8_dot`` names the CPU's int8 dot product, except for
    ``--shard`` builds, which may run on machines that differ; else :data:`EMBEDDER`."""
    notes = []
    if int8 is None:
        from embedder.quantize import int8_by_default

        if backbone is not None and not int8_by_default(backbone):
            int8 = False
            notes.append(f"fp32 embedder: --model's backbone {backbone} is not one of this project's "
                         "convolutional ones, whose int8 was measured on retrieval (--int8 quantises its "
                         "MatMuls: a ViT-S builds ~2x as fast)")
        else:
            int8 = images >= INT8_MIN_IMAGES
            if not int8:
                notes.append(f"fp32 embedder: the gallery holds {images} images, int8 calibration needs "
                             f"{INT8_MIN_IMAGES} of them (--int8 quantises on what there is)")
    if kept and kept_int8 != bool(int8):     # fp32 <-> int8 (a gallery grown past 256): every image is
        kept = None                          # embedded again anyway, so by the default a fresh build takes
    embedder = None
    if not model_given:
        from embedder.pretrained import resolve_spec

        embedder = kept or (EMBEDDER_INT8_DOT if int8 and int8_dot and mode != "shard" else EMBEDDER)
        dim = dim or resolve_spec(embedder).dim     # a merge gives its shards' width
    most = dba_max_images(dim)
    if dba is None:
        dba = (mode == "process" and dba_min_images(dba_k) <= images <= most
               and (labelled or not model_given))
        if not dba:
            notes.append("no DBA: " + (
                "--shard builds leave it to `indexer merge`" if mode == "shard" else
                "sharded indexes do not compute it yet" if mode == "parts" else
                f"the gallery holds {images} images, DBA with k={dba_k} needs "
                f"{dba_min_images(dba_k)}" if images < dba_min_images(dba_k) else
                f"the gallery holds over {most:,} images of {dim or DBA_MAX_AT_DIM}-d: DBA's exact neighbour "
                "pass grows as n^2 d (hours from 1M x 2,560 on a CPU) and a server holds its n x d vectors "
                "(--dba computes it anyway)" if images > most else
                "a --model embedder's DBA is measured on the gallery's labels, and it has none (--dba forces it)"))
    if embedder == EMBEDDER_INT8_DOT and not kept:
        notes.append(f"two-backbone embedder {EMBEDDER_INT8_DOT} in int8: this CPU has int8 dot "
                     f"products ({int8_dot})")
    return BuildDefaults(bool(int8), bool(dba), tuple(notes), embedder)
