"""uvicorn's h11 protocol with a deadline on request heads: any received byte resets uvicorn's
keep-alive timer, so a client sending a header byte every few seconds holds a connection forever
(slowloris). Here each complete head must arrive within ``HEAD_TIMEOUT_S`` of connecting or of the
previous response; bodies have their own deadline in serving.limits.
"""
from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_TIMEOUT_S = 10.0


class GuardedH11Protocol(H11Protocol):
    head_timeout = HEAD_TIMEOUT_S

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def _arm_head_deadline(self) -> None:
        self.loop.call_later(self.head_timeout, self._head_deadline, self.cycle)

    def _head_deadline(self, cycle: Any) -> None:
        # still the cycle of when the deadline was set: no new request head arrived since
        if self.cycle is cycle and (cycle is None or cycle.response_complete) \
                and self.transport is not None and not self.transport.is_closing():
            self.transport.close()
