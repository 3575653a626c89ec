"""A session stream over a service's local socket, used like a gRPC stream call.

`write`, `read` (a message, or grpc.aio.EOF when the service ended the stream) and `cancel`
behave as on grpc.aio's StreamStreamCall, and every failure is a grpc.aio.AioRpcError with
the status gRPC would have given (the service's own status from its SessionError frame,
DEADLINE_EXCEEDED, UNAVAILABLE when the connection breaks), so callers handle both
transports alike.
"""

from __future__ import annotations

import asyncio
import weakref

import grpc

from dflash_protos.session_socket_pb2 import SessionDeadline, SessionError
from dflash_serve.session_socket.framing import (
    DEADLINE,
    ERROR,
    REQUEST,
    RESPONSE,
    FrameError,
    frame,
    read_frame,
)

STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}


def rpc_error(status: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class SessionSocketCall:
    def __init__(
        self, reader, writer, response_type: type, deadline: float | None, spin_s: float = 0.0
    ) -> None:
        self._reader = reader
        self._spin_s = spin_s
        self._writer = writer
        self._response_type = response_type
        # One timer for the whole session, not one per read and write (each `timeout_at`
        # scheduled and cancelled a timer: ~4.5 us a message on the development machine).
        # The timer holds the call weakly: a call dropped without `cancel` is still collected
        # (and its connection closed, ending its session), not kept until the deadline.
        self._deadline_passed = False
        self._deadline_timer = (
            None
            if deadline is None
            else asyncio.get_running_loop().call_at(
                deadline, _pass_deadline_if_alive, weakref.ref(self)
            )
        )

    @classmethod
    async def connect(
        cls, path: str, response_type: type, timeout_s: float | None = None, spin_s: float = 0.0
    ) -> SessionSocketCall:
        """Connect to the service's socket (OSError when nothing listens there);
        `timeout_s` is the deadline of the whole session, as gRPC's `timeout` (the service
        is told it too, and ends the session when it passes); `spin_s`: how long `read`
        polls for a response before sleeping (framing.read_frame)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        async with asyncio.timeout_at(deadline):
            reader, writer = await asyncio.open_unix_connection(path)
        call = cls(reader, writer, response_type, deadline, spin_s)
        if timeout_s is not None:
            told = SessionDeadline(timeout_us=max(round(timeout_s * 1e6), 1))
            writer.write(frame(DEADLINE, told.SerializeToString()))
        return call

    def _pass_deadline(self) -> None:
        """The session's deadline: end the connection now, so that a read or write waiting on
        it ends; it and every later one report DEADLINE_EXCEEDED. Aborted, not closed: a
        close waits until our unsent bytes are flushed, forever if the service stopped
        reading, and a read or a blocked write would wait with it."""
        self._deadline_passed = True
        self._writer.transport.abort()

    def _broke(self, status: grpc.StatusCode, detail: str) -> grpc.aio.AioRpcError:
        """End the session; its error (DEADLINE_EXCEEDED if the deadline ended it)."""
        self.cancel()
        if self._deadline_passed:
            return rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        return rpc_error(status, detail)

    async def write(self, message) -> None:
        if self._deadline_passed:
            raise self._broke(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        try:
            self._writer.write(frame(REQUEST, message.SerializeToString()))
            await self._writer.drain()
            if self._deadline_passed:  # (a drain the abort ended returns as if flushed)
                raise ConnectionResetError("the session's deadline passed")
        except FrameError as error:
            raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)) from error
        except ConnectionError as error:
            raise self._broke(grpc.StatusCode.UNAVAILABLE, f"session socket: {error}") from error

    async def read(self):
        if self._deadline_passed:
            raise self._broke(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        try:
            received = await read_frame(self._reader, self._spin_s)
        except (asyncio.IncompleteReadError, ConnectionError, FrameError) as error:
            detail = f"the session socket broke: {type(error).__name__}: {error}"
            raise self._broke(grpc.StatusCode.UNAVAILABLE, detail) from error
        if received is None:
            if self._deadline_passed:  # (its end of the connection, between two frames)
                raise self._broke(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self._cancel_deadline()
            return grpc.aio.EOF
        kind, payload = received
        if kind == ERROR:
            self.cancel()
            error = SessionError.FromString(payload)
            status = STATUS_BY_CODE.get(error.code, grpc.StatusCode.UNKNOWN)
            raise rpc_error(status, error.message)
        if kind != RESPONSE:
            self.cancel()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the service sent a {kind!r} frame")
        return self._response_type.FromString(payload)

    def cancel(self) -> None:
        """End the session: the service closes it when it sees the connection end."""
        self._cancel_deadline()
        self._writer.close()

    def _cancel_deadline(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()


def _pass_deadline_if_alive(call_ref: weakref.ref) -> None:
    call = call_ref()
    if call is not None:
        call._pass_deadline()
