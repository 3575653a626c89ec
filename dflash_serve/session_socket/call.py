"""A session stream over a service's local socket, used like a gRPC stream call.

`write`, `read` (a message, or grpc.aio.EOF when the service ended the stream) and `cancel`
behave as on grpc.aio's StreamStreamCall, and every failure is a grpc.aio.AioRpcError with
the status gRPC would have given (the service's own status from its SessionError frame,
DEADLINE_EXCEEDED, UNAVAILABLE when the connection breaks), so callers handle both
transports alike.
"""

from __future__ import annotations

import asyncio

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
        self._deadline = deadline  # the event loop's clock; None: no deadline

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

    async def write(self, message) -> None:
        try:
            self._writer.write(frame(REQUEST, message.SerializeToString()))
            async with asyncio.timeout_at(self._deadline):
                await self._writer.drain()
        except FrameError as error:
            raise rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)) from error
        except TimeoutError as error:
            self.cancel()
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from error
        except ConnectionError as error:
            self.cancel()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"session socket: {error}") from error

    async def read(self):
        try:
            async with asyncio.timeout_at(self._deadline):
                received = await read_frame(self._reader, self._spin_s)
        except TimeoutError as error:
            self.cancel()
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from error
        except (asyncio.IncompleteReadError, ConnectionError, FrameError) as error:
            self.cancel()
            detail = f"the session socket broke: {type(error).__name__}: {error}"
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, detail) from error
        if received is None:
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
        self._writer.close()
