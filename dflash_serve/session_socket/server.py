"""Serve a service's session streams on a local Unix socket (protos/session_socket.proto).

A gRPC message on a Python session stream costs ~0.1 ms each way on an H200 host, several
times what the same bytes cost on a plain socket (`bench.grpc_latency`); at four messages a
speculative step that was a quarter of the step. The servicer's own `session_responses`
runs here unchanged: only the carrier differs, so both transports give the same tokens,
the same errors (as SessionError frames carrying the gRPC status) and the same session
lifetime (the connection's end closes the session).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from dflash_protos.session_socket_pb2 import SessionError
from dflash_serve.grpc_support.errors import status_and_message
from dflash_serve.session_socket.framing import (
    ERROR,
    REQUEST,
    RESPONSE,
    FrameError,
    frame,
    read_frame,
)

logger = logging.getLogger(__name__)

LINGER_S = 5.0
SessionResponses = Callable[[AsyncIterator[Any], Callable[[Any], None]], AsyncIterator[Any]]


class SessionSocketServer:
    def __init__(
        self,
        path: str,
        request_type: type,
        session_responses: SessionResponses,
        spin_s: float = 0.0,
    ) -> None:
        """`spin_s`: how long a session polls for its next request before sleeping."""
        self.path = path
        self._spin_s = spin_s
        self._request_type = request_type
        self._session_responses = session_responses
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._is_draining = False

    async def start(self) -> None:
        """Listen at `path` (a stale socket file left by a killed process is replaced)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._connection, path=self.path)

    def stop_accepting(self) -> None:
        """No new sessions (draining): a new connection hears UNAVAILABLE at once, as a new
        RPC does from a draining gRPC server (closing the listener instead would leave a
        connection caught in its backlog waiting for an answer); open sessions go on."""
        self._is_draining = True

    async def close(self) -> None:
        """Stop listening, end every open connection (their sessions close) and remove the
        socket file and, for an "auto" path, its directory."""
        self.stop_accepting()
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        parent = Path(self.path).parent
        if parent.name.startswith("dflash-"):
            with contextlib.suppress(OSError):
                parent.rmdir()

    async def _requests(self, reader: asyncio.StreamReader):
        while (received := await read_frame(reader, self._spin_s)) is not None:
            kind, payload = received
            if kind != REQUEST:
                raise FrameError(f"a client sends request frames only, not {kind!r}")
            try:
                message = self._request_type.FromString(payload)
            except DecodeError as error:
                raise FrameError(f"not a {self._request_type.__name__}: {error}") from error
            yield message

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        if self._is_draining:
            await self._end_with_error(
                reader, writer, grpc.StatusCode.UNAVAILABLE, "the service is shutting down"
            )
            return
        self._writers.add(writer)
        responses = self._session_responses(self._requests(reader), lambda session: None)
        error = None
        try:
            async for response in responses:
                writer.write(frame(RESPONSE, response.SerializeToString()))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: its session is closed below
        except FrameError as bad_frame:
            logger.info("session socket: bad frame: %s", bad_frame)
            error = grpc.StatusCode.INVALID_ARGUMENT, str(bad_frame)
        except Exception as failure:  # the client must hear why its session ended
            error = status_and_message(failure)  # DflashError's status, else INTERNAL
        finally:
            await responses.aclose()
            self._writers.discard(writer)
        if error is None:
            writer.close()
        else:
            await self._end_with_error(reader, writer, *error)

    @staticmethod
    async def _end_with_error(reader, writer, status: grpc.StatusCode, message: str) -> None:
        """Send the SessionError, then linger until the client hangs up (at most
        LINGER_S): closing at once could reset the connection under a client still
        writing (a draft's feature chunks) and lose the error before it is read."""
        error = SessionError(code=status.value[0], message=message)
        with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
            writer.write(frame(ERROR, error.SerializeToString()))
            writer.write_eof()
            await asyncio.wait_for(drain_until_eof(reader), LINGER_S)
        writer.close()


async def drain_until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass
