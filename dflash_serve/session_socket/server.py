"""Serve a service's session streams on a local Unix socket (protos/session_socket.proto).

A gRPC message on a Python session stream costs ~0.1 ms each way on an H200 host, several
times what the same bytes cost on a plain socket (`bench.grpc_latency`); at four messages a
speculative step that was a quarter of the step. The servicer's own `session_responses`
runs here unchanged: only the carrier differs, so both transports give the same tokens,
the same errors (as SessionError frames carrying the gRPC status), the same deadlines and
the same session lifetime (the connection's end closes the session).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from dflash_protos.session_socket_pb2 import SessionDeadline, SessionError
from dflash_serve.errors import ConfigError
from dflash_serve.grpc_support.errors import status_and_message
from dflash_serve.session_socket.framing import (
    DEADLINE,
    ERROR,
    REQUEST,
    RESPONSE,
    FrameError,
    frame,
    read_frame,
)

logger = logging.getLogger(__name__)

LINGER_S = 5.0
AUTO_DIR_PREFIX = "dflash-"
MAX_PATH_BYTES = 107  # what a Unix socket address holds
SessionResponses = Callable[[AsyncIterator[Any], Callable[[Any], None]], AsyncIterator[Any]]


def auto_socket_path(service: str) -> str:
    """A fresh path for `service`'s socket under the temp directory (its own directory, so
    paths never collide and `close` can remove both)."""
    path = str(Path(tempfile.mkdtemp(prefix=f"{AUTO_DIR_PREFIX}{service}-")) / "session.sock")
    if len(path.encode()) > MAX_PATH_BYTES:
        os.rmdir(Path(path).parent)
        raise ConfigError(
            f"the temp directory's path is too long for a Unix socket ({path}); start with "
            "--session-socket PATH (at most 107 bytes) or --session-socket off"
        )
    return path


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
        self._sessions: set[asyncio.Task] = set()
        self._is_draining = False
        self._inode: int | None = None

    async def start(self) -> None:
        """Listen at `path`. A socket file left by a killed process is replaced; anything
        else there (a file, a live service's socket) is refused with ConfigError."""
        take_over_stale_socket(self.path)
        self._server = await asyncio.start_unix_server(self._connection, path=self.path)
        self._inode = os.stat(self.path).st_ino

    async def drain(self, grace_s: float) -> None:
        """No new sessions (a new connection hears UNAVAILABLE at once, as a new RPC does
        from a draining gRPC server); open ones may finish within `grace_s`, then end."""
        self._is_draining = True
        if self._sessions:
            await asyncio.wait(list(self._sessions), timeout=grace_s)
        for task in list(self._sessions):
            task.cancel()
        if self._sessions:
            await asyncio.wait(list(self._sessions))  # their sessions are closed after this

    async def close(self) -> None:
        """End every session (they close), stop listening, remove the socket file if it is
        still ours and, for an "auto" path, its directory."""
        await self.drain(0)
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        parent = Path(self.path).parent
        if parent.name.startswith(AUTO_DIR_PREFIX):
            with contextlib.suppress(OSError):
                parent.rmdir()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        if self._is_draining:
            await end_with_error(
                reader, writer, grpc.StatusCode.UNAVAILABLE, "the service is shutting down"
            )
            return
        task = asyncio.current_task()
        self._sessions.add(task)
        try:
            await self._session(reader, writer)
        except asyncio.CancelledError:
            pass  # ended by `drain`: its session has been closed
        finally:
            self._sessions.discard(task)
            writer.close()

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        deadline = asyncio.timeout(None)  # set by the client's SessionDeadline frame
        responses = self._session_responses(self._requests(reader, deadline), lambda _: None)
        error = None
        try:
            async with deadline:
                async for response in responses:
                    try:
                        payload = frame(RESPONSE, response.SerializeToString())
                    except FrameError as too_large:
                        error = grpc.StatusCode.RESOURCE_EXHAUSTED, str(too_large)
                        break
                    writer.write(payload)
                    await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: its session is closed below
        except TimeoutError:
            error = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        except FrameError as bad_frame:
            logger.info("session socket: bad frame: %s", bad_frame)
            error = grpc.StatusCode.INVALID_ARGUMENT, str(bad_frame)
        except Exception as failure:  # the client must hear why its session ended
            error = status_and_message(failure)  # DflashError's status, else INTERNAL
        finally:
            await responses.aclose()
        if error is None:
            writer.close()
        else:
            await end_with_error(reader, writer, *error)

    async def _requests(self, reader: asyncio.StreamReader, deadline: asyncio.Timeout):
        is_first = True
        while (received := await read_frame(reader, self._spin_s)) is not None:
            kind, payload = received
            if kind == DEADLINE and is_first:
                timeout_s = parse(SessionDeadline, payload).timeout_us / 1e6
                deadline.reschedule(asyncio.get_running_loop().time() + timeout_s)
            elif kind == REQUEST:
                yield parse(self._request_type, payload)
            else:
                raise FrameError(f"a client sends request frames (a deadline first), not {kind!r}")
            is_first = False


def parse(message_type: type, payload: bytes):
    try:
        return message_type.FromString(payload)
    except DecodeError as error:
        raise FrameError(f"not a {message_type.__name__}: {error}") from error


def take_over_stale_socket(path: str) -> None:
    """Remove a socket file nobody listens on; refuse to touch anything else at `path`."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"--session-socket {path}: something that is not a socket is there")
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # stale: its service is gone
        return
    finally:
        probe.close()
    raise ConfigError(f"--session-socket {path}: another process serves sessions there")


async def end_with_error(reader, writer, status: grpc.StatusCode, message: str) -> None:
    """Send the SessionError, then linger until the client hangs up (at most LINGER_S):
    closing at once could reset the connection under a client still writing (a draft's
    feature chunks) and lose the error before it is read."""
    error = SessionError(code=status.value[0], message=message)
    with contextlib.suppress(ConnectionError, TimeoutError):
        writer.write(frame(ERROR, error.SerializeToString()))
        writer.write_eof()
        await asyncio.wait_for(drain_until_eof(reader), LINGER_S)
    writer.close()


async def drain_until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass
