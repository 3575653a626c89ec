"""How the gateway opens a service's session streams: over the service's local session
socket when it offers one that exists on this host (a fifth of gRPC's cost per message),
else over gRPC. Both carry the same messages; callers cannot tell them apart."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Awaitable, Callable

import grpc

from dflash_serve.session_socket.call import SessionSocketCall

logger = logging.getLogger(__name__)

# After the socket failed, sessions go over gRPC and GetInfo is asked again (a restarted
# service has a new socket) at most this often.
REFRESH_AFTER_FAILURE_S = 5.0


class SessionStreamEndedError(ConnectionError):
    """A service closed a session stream without an error status (e.g. it shut down)."""


async def write_request(call, request) -> None:
    """Send one request on a session stream. gRPC raises InvalidStateError, not an error
    status, on a stream the service had already ended (it shut down between two steps):
    that is SessionStreamEndedError here, as the same end is when reading."""
    try:
        await call.write(request)
    except asyncio.InvalidStateError as error:
        raise SessionStreamEndedError(f"the session stream had ended: {error}") from error


async def read_event(call, field: str):
    """The next response's `field`; a stream that ended early raises SessionStreamEndedError."""
    response = await call.read()
    if response is grpc.aio.EOF or response.WhichOneof("event") != field:
        raise SessionStreamEndedError(f"the session stream ended while waiting for {field}")
    return getattr(response, field)


def is_local_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


class SessionCalls:
    """`open` gives a stream call for one session. "auto" prefers the socket the service
    reported in GetInfo (`use_socket_if_local`), "grpc" never uses one. `spin_us`: how long
    a socket session polls for each response before sleeping; None: as long as the service
    polls for requests (GetInfo's session_spin_us). `refresh`: asks GetInfo again (it calls
    `use_socket_if_local`), after the socket failed."""

    def __init__(
        self,
        run_session,
        response_type: type,
        transport: str = "auto",
        spin_us: int | None = None,
        refresh: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self._run_session = run_session  # the gRPC stub's RunSession
        self._response_type = response_type
        self._transport = transport
        self._spin_us = spin_us
        self._refresh = refresh
        self._refreshed_at = float("-inf")
        self._refreshing: asyncio.Future | None = None
        self.socket_path: str | None = None
        self.spin_s = 0.0

    @property
    def transport(self) -> str:
        return "socket" if self.socket_path else "grpc"

    def use_socket_if_local(self, path: str, service_spin_us: int = 0) -> None:
        """`path`: GetInfoResponse.session_socket (empty: the service offers none); a path
        absent here means the service runs on another host (or container)."""
        usable = self._transport == "auto" and bool(path) and is_local_socket(path)
        self.socket_path = path if usable else None
        spin_us = service_spin_us if self._spin_us is None else self._spin_us
        self.spin_s = spin_us / 1e6

    async def open(self, timeout_s: float | None):
        if self.socket_path is not None:
            try:
                return await SessionSocketCall.connect(
                    self.socket_path, self._response_type, timeout_s, self.spin_s
                )
            except OSError as error:
                logger.warning(
                    "session socket %s unusable (%s); using gRPC", self.socket_path, error
                )
                self.socket_path = None
                self._schedule_refresh()
        return self._run_session(timeout=timeout_s)

    async def start(self, open_request, timeout_s: float | None) -> tuple[object, int]:
        """Open a stream and its session with `open_request` (the service's RunSessionRequest
        carrying `open`): the call and the slot the service gave the session. A refused,
        failed or cancelled start ends the stream at once."""
        call = await self.open(timeout_s)
        try:
            await write_request(call, open_request)
            return call, (await read_event(call, "opened")).slot
        except BaseException:
            call.cancel()
            raise

    def _schedule_refresh(self) -> None:
        loop = asyncio.get_running_loop()
        if self._refresh is None or loop.time() - self._refreshed_at < REFRESH_AFTER_FAILURE_S:
            return
        self._refreshed_at = loop.time()

        async def refresh() -> None:
            try:
                await self._refresh()
            except Exception as error:  # the service may be down: gRPC until the next try
                logger.info("could not ask for the session socket again: %s", error)

        self._refreshing = asyncio.ensure_future(refresh())
