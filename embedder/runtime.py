"""onnxruntime inference for exported embedders (no torch: serving stays light). Images decode in
one thread pool while the session runs the previous batch; one corrupt file never aborts indexing.
"""
from __future__ import annotations

import itertools
import json
import os
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from .errors import ModelLoadError
from .hashing import file_sha256
from .images import BY_SIDE, ImageLoadError, ImageSource, load_image
from .preprocess import Preprocessing

ONNX_FORMAT = "das-embedder-onnx/1"
DECODE_WORKERS = min(8, os.cpu_count() or 1)        # decode threads unless told
T, R = TypeVar("T"), TypeVar("R")
_END = object()


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``metadata_props`` of an exported embedder (raises ModelLoadError otherwise)."""
    path = Path(path)
    return _checked_metadata(path, load_session(path))


def load_session(path: str | os.PathLike, so: Any = None, providers: Sequence[str] = ("CPUExecutionProvider",)
                 ) -> Any:
    """A quiet onnxruntime session of ``path`` (CPU unless told), or ModelLoadError naming the file."""
    import onnxruntime as ort

    path, so = Path(path), so or ort.SessionOptions()
    if not path.is_file():
        raise ModelLoadError(path, "ONNX model file not found")
    so.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), so, providers=list(providers))
    except Exception as e:  # onnxruntime raises its own Fail/InvalidProtobuf types
        if path.suffix in (".pt", ".pth"):      # a training run's best.pt given where its export goes
            raise ModelLoadError(path, "a PyTorch checkpoint, not an ONNX model: give the run's model.onnx "
                                       "(or two.onnx), or export it: "
                                       f"`python -m embedder export {path} --out model.onnx`") from e
        raise ModelLoadError(path, f"not a loadable ONNX model ({type(e).__name__}: {str(e)[:200]})") from e


def _checked_metadata(path: Path, sess: Any) -> dict[str, str]:
    meta = dict(sess.get_modelmeta().custom_metadata_map)
    if meta.get("format") != ONNX_FORMAT or "preprocessing" not in meta or "dim" not in meta:
        raise ModelLoadError(path, f"ONNX model is not a das embedder (metadata format "
                                   f"{meta.get('format')!r}, expected {ONNX_FORMAT!r}); export it "
                                   "with `python -m embedder export`")
    return meta


class OnnxEmbedder:
    """An exported embedder in an onnxruntime session, with its own preprocessing."""

    def __init__(self, path: str | os.PathLike, device: str = "auto", threads: int | None = None,
                 batch_size: int = 32, max_pixels: int | None | str = BY_SIDE) -> None:
        import onnxruntime as ort

        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path, self.batch_size = Path(path), batch_size
        self.max_pixels, self.threads = max_pixels, threads
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            so.intra_op_num_threads = threads
        want_cuda = device in ("auto", "cuda") and "CUDAExecutionProvider" in ort.get_available_providers()
        providers = (["CUDAExecutionProvider", "CPUExecutionProvider"] if want_cuda
                     else ["CPUExecutionProvider"])
        self.session = load_session(self.path, so, providers)
        # onnxruntime-gpu lists CUDA even without a GPU and silently falls back: trust only
        # what the created session reports.
        self.provider = "cuda" if self.session.get_providers()[0] == "CUDAExecutionProvider" else "cpu"
        if device == "cuda" and self.provider != "cuda":
            raise RuntimeError(f"{self.path}: device='cuda' requested but onnxruntime could not use "
                               f"CUDA (providers: {self.session.get_providers()})")
        self.metadata = _checked_metadata(self.path, self.session)
        self.preprocessing = Preprocessing.from_dict(json.loads(self.metadata["preprocessing"]))
        self.dim = int(self.metadata["dim"])
        self.normalized = self.metadata.get("normalized") == "true"
        self.backbone = self.metadata.get("backbone", "")
        self.input_name = self.session.get_inputs()[0].name
        self.model_hash = file_sha256(self.path)

    def __repr__(self) -> str:
        return (f"OnnxEmbedder({str(self.path)!r}, backbone={self.backbone!r}, dim={self.dim}, "
                f"provider={self.provider!r})")

    # ---- arrays -------------------------------------------------------------------------------
    def embed_arrays(self, x: np.ndarray) -> np.ndarray:
        """Preprocessed (N, C, H, W) float32 -> (N, dim) float32, run in batches of batch_size."""
        x = np.asarray(x, dtype=np.float32)
        pre = self.preprocessing
        want = (pre.channels(), pre.input_size, pre.input_size)
        if x.ndim != 4 or tuple(x.shape[1:]) != want:
            raise ValueError(f"embed_arrays expects (N, {want[0]}, {want[1]}, {want[2]}) float32 "
                             f"arrays from Preprocessing.eval_array, got shape {x.shape}")
        if len(x) == 0:
            return np.zeros((0, self.dim), np.float32)
        outs = [self.session.run(None, {self.input_name: np.ascontiguousarray(x[i:i + self.batch_size])})[0]
                for i in range(0, len(x), self.batch_size)]
        return np.concatenate(outs).astype(np.float32, copy=False)

    # ---- images -------------------------------------------------------------------------------
    def prepare(self, source: ImageSource, name: str | None = None) -> np.ndarray:
        """Load + preprocess one image: (C, H, W) float32; raises ImageLoadError."""
        img = load_image(source, mode=self.preprocessing.mode, max_pixels=self.max_pixels, name=name,
                         min_side=self.preprocessing.decode_side)
        return self.preprocessing.eval_array(img)

    def embed(self, images: Sequence[ImageSource], progress: bool = False) -> np.ndarray:
        """(N, dim) embeddings in input order; raises ImageLoadError on the first bad image."""
        chunks = []
        for _, emb, failures in self.embed_iter(enumerate(images), progress=progress,
                                                total=len(images)):
            if failures:
                raise failures[0][1]
            chunks.append(emb)
        return np.concatenate(chunks) if chunks else np.zeros((0, self.dim), np.float32)

    def embed_iter(self, items: Iterable[tuple[Any, ImageSource]], workers: int | None = None,
                   progress: bool = False, total: int | None = None,
                   ) -> Iterator[tuple[list[Any], np.ndarray, list[tuple[Any, ImageLoadError]]]]:
        """``(keys, embeddings, failures)`` per batch of ``(key, source)`` pairs, in input order."""
        workers = workers or DECODE_WORKERS
        if total is None and hasattr(items, "__len__"):
            total = len(items)  # type: ignore[arg-type]
        from tqdm.auto import tqdm

        failures: list[tuple[Any, ImageLoadError]] = []

        def settle(got: list[tuple[Any, Any]]) -> Iterator[tuple[Any, np.ndarray]]:
            bar.update(len(got))
            for key, x in got:
                if isinstance(x, ImageLoadError):
                    failures.append((key, x))
                else:
                    yield key, x

        with tqdm(total=total, desc="embedding", unit="img", disable=not progress) as bar:
            chunks = chunked(items, max(1, self.batch_size // workers))
            with closing(self.run(chunks, self.prepare_chunk, settle, workers=workers)) as batches:
                for keys, emb in batches:
                    if len(keys) or failures:
                        yield keys, emb, failures
                        failures = []

    def prepare_chunk(self, chunk: Sequence[tuple[Any, ImageSource]]) -> list[tuple[Any, Any]]:
        """(key, array or ImageLoadError) of each item (runs in a decode thread)."""
        out: list[tuple[Any, Any]] = []
        for key, src in chunk:
            try:    # paths name themselves in errors; bytes and PIL images are named by their key
                out.append((key, self.prepare(src, name=None if isinstance(src, (str, os.PathLike)) else str(key))))
            except ImageLoadError as e:
                out.append((key, e))
            except Exception as e:  # noqa: BLE001 - a decoder bug must not stop indexing
                out.append((key, ImageLoadError(str(key), f"{type(e).__name__}: {e}")))
        return out

    def run(self, chunks: Iterator[T], read: Callable[[T], R],
            settle: Callable[[R], Iterable[tuple[Any, np.ndarray]]], *, workers: int | None = None,
            seconds: dict[str, float] | None = None) -> Iterator[tuple[list[Any], np.ndarray]]:
        """``read(chunk)`` in the decode threads, ``settle(result)`` here picks the (key, array) pairs;
        yields ``(keys, raw embeddings)`` per batch and a last, possibly empty, one."""
        seconds = {} if seconds is None else seconds
        keys: list[Any] = []
        rows: list[np.ndarray] = []

        def timed(chunk: T) -> tuple[R, float]:
            t0 = time.perf_counter()
            return read(chunk), time.perf_counter() - t0

        def batch(n: int) -> tuple[list[Any], np.ndarray]:
            t0 = time.perf_counter()
            emb = self.embed_arrays(np.stack(rows[:n])) if n else np.zeros((0, self.dim), np.float32)
            seconds["embed"] = seconds.get("embed", 0.0) + time.perf_counter() - t0
            out = keys[:n]
            del keys[:n], rows[:n]
            return out, emb

        with closing(decode_ahead(timed, chunks, workers or DECODE_WORKERS)) as results:
            for got, dt in results:         # closed on an early exit: the pool stops at once
                seconds["read"] = seconds.get("read", 0.0) + dt
                for key, row in settle(got):
                    keys.append(key)
                    rows.append(row)
                while len(rows) >= self.batch_size:
                    yield batch(self.batch_size)
        yield batch(len(rows))


def write_metadata(proto: Any, meta: dict[str, str]) -> None:
    """Replace an ONNX model proto's ``metadata_props`` (what :func:`read_metadata` reads)."""
    del proto.metadata_props[:]
    for k, v in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = k, v


def chunked(items: Iterable[T], size: int, on_end: Callable[[int], None] | None = None
            ) -> Iterator[list[T]]:
    """Lists of ``size`` items; ``on_end(count)`` once exhausted (a lazy walk's bar learns its total)."""
    it, n = iter(items), 0
    while chunk := list(itertools.islice(it, size)):
        n += len(chunk)
        yield chunk
    if on_end is not None:
        on_end(n)


def decode_ahead(read: Callable[[T], R], chunks: Iterator[T], workers: int) -> Iterator[R]:
    """``read(chunk)`` in ``workers`` threads, in input order, at most ``2 * workers + 1`` chunks in
    flight; on an early exit queued chunks are cancelled and ``chunks`` is closed."""
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="embed-decode")
    pending: deque[Future] = deque()

    def submit_more() -> None:
        while len(pending) < 2 * workers + 1:
            chunk = next(chunks, _END)
            if chunk is _END:
                return
            pending.append(pool.submit(read, chunk))

    try:
        submit_more()
        while pending:
            done = pending.popleft().result()
            submit_more()
            yield done
    finally:
        for fut in pending:
            fut.cancel()
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
        pool.shutdown(wait=True)
