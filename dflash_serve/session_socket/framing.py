"""Frames of the session socket: length, kind byte, payload (protos/session_socket.proto)."""

from __future__ import annotations

import asyncio

from dflash_serve.grpc_support.server import MAX_MESSAGE_BYTES

DEADLINE = b"D"
REQUEST = b"Q"
RESPONSE = b"A"
ERROR = b"E"
KINDS = (DEADLINE, REQUEST, RESPONSE, ERROR)
HEADER_BYTES = 5
# How long a reader on the GPU fast path polls for the next frame before sleeping: longer
# than a verify step, so a session in step never sleeps (on the H200 host that halved each
# message's wake-up, 1.13 -> 0.84 ms of orchestration per step). Not on the CPU path, whose
# engines need every core (spinning there doubled the step on a 2-core machine).
GPU_SPIN_US = 20_000


class FrameError(ValueError):
    """The peer sent something that is not a frame of this protocol."""


def frame(kind: bytes, payload: bytes) -> bytes:
    if len(payload) > MAX_MESSAGE_BYTES:
        raise FrameError(f"a {len(payload)}-byte message exceeds {MAX_MESSAGE_BYTES} bytes")
    return len(payload).to_bytes(4, "little") + kind + payload


async def read_frame(
    reader: asyncio.StreamReader, spin_s: float = 0.0
) -> tuple[bytes, bytes] | None:
    """The next (kind, payload); None at a clean end of the stream (between frames).

    `spin_s`: first poll the event loop for up to this long instead of sleeping in it (see
    `spin_until_readable`). Raises FrameError for a bad header and
    asyncio.IncompleteReadError when the stream ends inside a frame."""
    if spin_s > 0:
        await spin_until_readable(reader, spin_s)
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


async def spin_until_readable(reader: asyncio.StreamReader, spin_s: float) -> None:
    """Yield to the event loop (which then polls its sockets without blocking) until a frame
    header has arrived, the stream ended, or `spin_s` passed. A process asleep in the loop
    wakes slowly after the milliseconds a step leaves it idle; one that polls does not."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + spin_s
    # StreamReader has no public count of buffered bytes.
    while len(reader._buffer) < HEADER_BYTES and not reader.at_eof() and loop.time() < give_up:
        await asyncio.sleep(0)
