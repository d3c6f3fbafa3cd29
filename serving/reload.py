"""Live indexes: a served index directory picks up ``indexer add/remove`` without a restart.

Writers rewrite ``manifest.json`` last and atomically, so a changed stamp means a complete new
state. A request notices it with one ``stat``; a background thread opens it (Index.reopen) and
swaps it in with one assignment; none waits. A state that cannot be opened leaves the previous
one serving and is reported by :meth:`IndexWatcher.problems` (``/api/health``: 503).
"""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, MutableMapping

from indexer.directory.index_dir import manifest_stamp

log = logging.getLogger(__name__)

RETRY_BROKEN_S = 2.0       # how often a state that failed to open is tried again


class IndexWatcher:
    """Watches the manifests of the indexes in ``live`` (name -> Index, swapped in place)."""

    def __init__(self, live: MutableMapping[str, Any], directories: MutableMapping[str, Path], *,
                 interval: float = 0.5) -> None:
        self.live, self.directories, self.interval = live, directories, interval
        self._stamps = {n: manifest_stamp(d) for n, d in directories.items()}
        self._checked: dict[str, float] = {}
        self._failed_at: dict[str, float] = {}
        self._errors: dict[str, str] = {}
        self._busy: set[str] = set()
        self._lock = threading.Lock()

    def poke(self, name: str) -> None:
        """Cheap per-request check; starts a background reload when the manifest changed."""
        d = self.directories.get(name)
        if d is None:
            return
        now = time.monotonic()
        if now - self._checked.get(name, -1e9) < self.interval:
            return
        self._checked[name] = now
        stamp = manifest_stamp(d)
        broken_retry = name in self._errors and now - self._failed_at.get(name, 0.0) >= RETRY_BROKEN_S
        if stamp == self._stamps.get(name) and not broken_retry:
            return
        with self._lock:
            if name in self._busy:
                return
            self._busy.add(name)
        threading.Thread(target=self._reload_guarded, args=(name,), daemon=True,
                         name=f"reload-{name}").start()

    def _reload_guarded(self, name: str) -> None:
        try:
            self._reload(name)
        except Exception:  # noqa: BLE001 - a reload thread must never die silently
            log.exception("reloading index %s", name)
        finally:
            with self._lock:
                self._busy.discard(name)

    def _reload(self, name: str) -> str | None:
        d = self.directories[name]
        for _ in range(5):
            stamp = manifest_stamp(d)
            try:
                new = self.live[name].reopen()
            except Exception as e:  # noqa: BLE001 - reported through problems() and /api/health
                if manifest_stamp(d) != stamp:
                    continue        # a writer replaced the state while we read it: read it again
                reason = str(e).splitlines()[0] if str(e) else type(e).__name__
                self._errors[name] = (f"index {name!r} changed on disk but cannot be opened ({reason}); "
                                      f"still serving its previous state")
                self._failed_at[name] = time.monotonic()
                log.warning("%s", self._errors[name])
                return self._errors[name]
            if manifest_stamp(d) != stamp:
                continue
            self.live[name] = new           # one assignment: requests see the old or the new
            self._stamps[name] = stamp
            self._errors.pop(name, None)
            log.info("index %s reloaded: %d vectors", name, len(new))
            return None
        return None                         # still changing; the next request tries again

    def problems(self) -> dict[str, str]:
        """name -> why the directory's current state is not being served."""
        return dict(self._errors)
