"""Frames of the session socket: length, kind byte, payload (protos/session_socket.proto)."""

from __future__ import annotations

import asyncio

from dflash_serve.grpc_support.server import MAX_MESSAGE_BYTES

REQUEST = b"Q"
RESPONSE = b"A"
ERROR = b"E"
KINDS = (REQUEST, RESPONSE, ERROR)
HEADER_BYTES = 5


class FrameError(ValueError):
    """The peer sent something that is not a frame of this protocol."""


def frame(kind: bytes, payload: bytes) -> bytes:
    if len(payload) > MAX_MESSAGE_BYTES:
        raise FrameError(f"a {len(payload)}-byte message exceeds {MAX_MESSAGE_BYTES} bytes")
    return len(payload).to_bytes(4, "little") + kind + payload


async def read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """The next (kind, payload); None at a clean end of the stream (between frames).

    Raises FrameError for a bad header and asyncio.IncompleteReadError when the stream ends
    inside a frame."""
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as error:
        if not error.partial:
            return None
        raise
    size, kind = int.from_bytes(header[:4], "little"), header[4:]
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind!r}")
    if size > MAX_MESSAGE_BYTES:
        raise FrameError(f"a {size}-byte frame exceeds {MAX_MESSAGE_BYTES} bytes")
    return kind, await reader.readexactly(size) if size else b""
