"""The server's read timeouts: a connection must send its request head in time, a body must not stall.

uvicorn closes an idle keep-alive connection after a few seconds but has no timeout for the
request head: a client that opens a connection and sends nothing, or a header a byte at a
time (slow-loris), holds the connection forever. HeaderTimeoutProtocol, uvicorn's h11
protocol with a timer, closes a connection whose request head is not complete within
`header_timeout` seconds of the connection or of the previous response (and one whose unread
body goes on after its response). The body's timeout (no data for `timeout` seconds: a 408)
is in llm.serving.requests.read_json, which reads the body.

llm.params.ServerTimeouts declares both as `serve` flags: `-to, --timeout` as llama-server names
its read timeout, and `--timeout-header`.
"""
from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from llm.params import ServerTimeouts

log = logging.getLogger(__name__)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol that closes a connection left waiting on its client: a timer runs
    while the client owes a request head (h11's IDLE state for the client: after connecting or
    after a response) or, once the response is sent, the rest of a body nobody reads (a 413 or
    401 answered before the body); it stops when a complete head arrives. Make the class with
    `header_timeout_protocol`."""

    header_timeout = ServerTimeouts().header_timeout
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._update_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._update_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_header_timer()

    def _waiting_on_client(self) -> bool:
        their, ours = self.conn.their_state, self.conn.our_state
        return not self.transport.is_closing() and (their is h11.IDLE or (their is h11.SEND_BODY and ours is h11.DONE))

    def _update_header_timer(self) -> None:
        """Start the timer when the connection begins to wait on its client, stop it otherwise (a
        timer already running keeps running: a head sent a byte at a time does not restart it)."""
        if not self._waiting_on_client():
            self._cancel_header_timer()
        elif self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self._waiting_on_client():
            log.info("closing the connection from %s: it sent no complete request within %g s",
                     self.client, self.header_timeout)
            self.transport.close()


def header_timeout_protocol(header_timeout: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class for uvicorn's `http=` with this header timeout (uvicorn builds one
    protocol object per connection from the class)."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": header_timeout})
