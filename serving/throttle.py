"""Failed-login throttling per client address (HTTP basic auth on /api and Gradio's /login form).

Without it a stranger could try ~1,400 passwords a second. Past ``free`` failures per ``window``
seconds each failure blocks the address (``first_block`` s, doubling up to ``max_block``; 429 +
Retry-After, unchecked). A success, or ``window`` x 15 s without failures, forgets the address.
"""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass
class _Entry:
    failures: deque = field(default_factory=deque)   # monotonic times of recent failures
    strikes: int = 0                                   # failures past the free allowance
    blocked_until: float = 0.0
    last: float = 0.0


class LoginThrottle:
    def __init__(self, *, free: int = 10, window: float = 60.0, first_block: float = 1.0,
                 max_block: float = 900.0, max_clients: int = 10_000) -> None:
        if not first_block > 0:
            raise ValueError(f"first_block={first_block}: expected a positive number of seconds")
        self.free, self.window, self.max_block, self.max_clients = free, window, max_block, max_clients
        self.first_block = first_block
        self._table: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def retry_after(self, client: str, now: float | None = None) -> int:
        """Seconds the client must wait before its next login attempt (0: go ahead)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            e = self._table.get(client)
            if e is None:
                return 0
            if now - e.last > self.window * 15:
                del self._table[client]
                return 0
            return max(0, math.ceil(e.blocked_until - now))

    def failed(self, client: str, now: float | None = None) -> int:
        """Record a failed login; returns the block it caused in seconds (0: none yet)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            e = self._table.pop(client, None) or _Entry()
            self._table[client] = e                      # most recent last (eviction order)
            while len(self._table) > self.max_clients:
                self._table.popitem(last=False)
            if now - e.last > self.window * 15:
                e.strikes = 0
            e.last = now
            e.failures.append(now)
            while e.failures and now - e.failures[0] > self.window:
                e.failures.popleft()
            if len(e.failures) <= self.free:
                return 0
            e.strikes += 1
            block = min(self.max_block, self.first_block * 2.0 ** (e.strikes - 1))
            e.blocked_until = max(e.blocked_until, now + block)
            return math.ceil(block)

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._table.pop(client, None)
