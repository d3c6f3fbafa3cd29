"""onnxruntime inference for exported embedders: what the indexer and the search service run.

No torch here: serving stays a light process. Images are decoded and preprocessed in a thread
pool while the session runs the previous batch (PIL decoding and onnxruntime both release the
GIL, so threads overlap for real). ``embed_iter`` reports bad images as failures instead of
stopping, because one corrupt file must not abort indexing a gallery.
"""
from __future__ import annotations

import json
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from .errors import ModelLoadError
from .hashing import file_sha256
from .images import ImageLoadError, ImageSource, load_image, DEFAULT_MAX_PIXELS
from .preprocess import Preprocessing

ONNX_FORMAT = "das-embedder-onnx/1"


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``metadata_props`` of an exported embedder (raises ModelLoadError otherwise)."""
    import onnxruntime as ort

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(path, "ONNX model file not found")
    try:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own Fail/InvalidProtobuf types
        raise ModelLoadError(path, f"not a loadable ONNX model ({type(e).__name__}: {str(e)[:200]})") from e
    return _checked_metadata(path, sess)


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
                 batch_size: int = 32, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> None:
        import onnxruntime as ort

        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(self.path, "ONNX model file not found")
        self.batch_size = batch_size
        self.max_pixels = max_pixels
        self.threads = threads
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            so.intra_op_num_threads = threads
        want_cuda = device in ("auto", "cuda") and "CUDAExecutionProvider" in ort.get_available_providers()
        providers = (["CUDAExecutionProvider", "CPUExecutionProvider"] if want_cuda
                     else ["CPUExecutionProvider"])
        try:
            self.session = ort.InferenceSession(str(self.path), so, providers=providers)
        except Exception as e:
            raise ModelLoadError(self.path, f"not a loadable ONNX model ({type(e).__name__}: "
                                            f"{str(e)[:200]})") from e
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
        """Yield ``(keys, embeddings, failures)`` per batch, in input order.

        ``items`` are ``(key, source)`` pairs, consumed lazily (a generator over a huge gallery
        is fine: at most a few batches are in flight). Images that fail to load are reported in
        ``failures`` of the batch during which they were met and never stop the iteration.
        """
        workers = workers or min(8, os.cpu_count() or 1)
        ahead = self.batch_size * 2 + workers  # bounded prefetch: memory stays O(batch)
        if total is None and hasattr(items, "__len__"):
            total = len(items)  # type: ignore[arg-type]
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, desc="embedding", unit="img")
        it = iter(items)
        pending: deque[tuple[Any, Future]] = deque()
        keys: list[Any] = []
        arrays: list[np.ndarray] = []
        failures: list[tuple[Any, ImageLoadError]] = []

        def _prep(src: ImageSource, key: Any) -> np.ndarray:
            # paths name themselves in errors; bytes and PIL images are named by their key
            return self.prepare(src, name=None if isinstance(src, (str, os.PathLike)) else str(key))

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="embed-decode") as pool:
            def fill() -> None:
                while len(pending) < ahead:
                    try:
                        key, src = next(it)
                    except StopIteration:
                        return
                    pending.append((key, pool.submit(_prep, src, key)))

            try:
                fill()
                while pending:
                    key, fut = pending.popleft()
                    try:
                        arrays.append(fut.result())
                        keys.append(key)
                    except ImageLoadError as e:
                        failures.append((key, e))
                    except Exception as e:  # noqa: BLE001 - a decoder bug must not stop indexing
                        failures.append((key, ImageLoadError(str(key), f"{type(e).__name__}: {e}")))
                    if bar is not None:
                        bar.update(1)
                    fill()
                    if len(arrays) == self.batch_size:
                        # The pool keeps decoding the queued items while the session runs.
                        yield keys, self.embed_arrays(np.stack(arrays)), failures
                        keys, arrays, failures = [], [], []
                if arrays or failures:
                    emb = self.embed_arrays(np.stack(arrays)) if arrays else np.zeros((0, self.dim), np.float32)
                    yield keys, emb, failures
            finally:
                for _, fut in pending:
                    fut.cancel()
                if bar is not None:
                    bar.close()
