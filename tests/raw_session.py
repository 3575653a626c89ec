"""A session on a service's socket without SessionSocketCall, for the tests of the service's
own deadline: the client call ends its connection itself at the deadline, a raw one does not."""

from __future__ import annotations

import asyncio

from dflash_protos.session_socket_pb2 import SessionDeadline, SessionError
from dflash_serve.session_socket.framing import (
    DEADLINE,
    ERROR,
    REQUEST,
    RESPONSE,
    frame,
    read_frame,
)


async def open_with_deadline(path: str, timeout_us: int, request):
    """Connect, tell the service `timeout_us`, send `request` and read its response."""
    reader, writer = await asyncio.open_unix_connection(path)
    told = SessionDeadline(timeout_us=timeout_us).SerializeToString()
    writer.write(frame(DEADLINE, told) + frame(REQUEST, request.SerializeToString()))
    assert (await read_frame(reader))[0] == RESPONSE
    return reader, writer


async def read_last_frame(reader, writer) -> tuple[bytes, int | None]:
    """The next frame's kind and, for an error frame, its status code; then hang up. Bounded:
    a service that never ends the session fails the test instead of hanging it."""
    kind, payload = await asyncio.wait_for(read_frame(reader), 5)
    writer.close()
    return kind, SessionError.FromString(payload).code if kind == ERROR else None
