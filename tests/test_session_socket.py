"""The local session socket's parts on their own: framing, the server around a session
generator, the client call's gRPC-shaped errors, and how the gateway picks a transport.
(The real services over their sockets: tests/test_grpc_services.py.)"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import weakref

import grpc
import pytest

from dflash_protos import target_pb2
from dflash_protos.session_socket_pb2 import SessionError
from dflash_serve.errors import CapacityError, ConfigError
from dflash_serve.grpc_support.server import MAX_MESSAGE_BYTES
from dflash_serve.service_settings import ServiceSettings
from dflash_serve.session_socket.call import SessionSocketCall
from dflash_serve.session_socket.framing import (
    ERROR,
    REQUEST,
    RESPONSE,
    FrameError,
    frame,
    read_frame,
)
from dflash_serve.session_socket.server import SessionSocketServer
from gateway.session_calls import SessionCalls
from tests.raw_session import open_with_deadline, read_last_frame

Request, Response = target_pb2.RunSessionRequest, target_pb2.RunSessionResponse


def reader_of(data: bytes, end: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if end:
        reader.feed_eof()
    return reader


def test_frames_round_trip_and_bad_frames_are_refused():
    async def run():
        message = Request(verify=target_pb2.Verify(block_ids=[3, 1, 4])).SerializeToString()
        reader = reader_of(frame(REQUEST, message) + frame(RESPONSE, b""))
        assert await read_frame(reader) == (REQUEST, message)
        assert await read_frame(reader) == (RESPONSE, b"")
        assert await read_frame(reader) is None  # a clean end between frames
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(reader_of(frame(REQUEST, message)[:-1]))
        with pytest.raises(asyncio.IncompleteReadError):
            await read_frame(reader_of(b"\x03\x00"))
        with pytest.raises(FrameError, match="kind"):
            await read_frame(reader_of((1).to_bytes(4, "little") + b"Z" + b"x"))
        oversized = (MAX_MESSAGE_BYTES + 1).to_bytes(4, "little") + REQUEST
        with pytest.raises(FrameError, match="exceeds"):  # refused before reading the payload
            await read_frame(reader_of(oversized, end=False))

    asyncio.run(run())
    with pytest.raises(FrameError):
        frame(REQUEST, bytes(MAX_MESSAGE_BYTES + 1))


def test_a_frame_arriving_a_byte_at_a_time_is_read_whole():
    async def run():
        reader = asyncio.StreamReader()
        data = frame(REQUEST, verify(*range(16)).SerializeToString())

        async def trickle():
            for index in range(len(data)):
                reader.feed_data(data[index : index + 1])
                await asyncio.sleep(0)

        feeding = asyncio.ensure_future(trickle())
        got = await asyncio.wait_for(read_frame(reader), 5)
        await feeding
        return got

    assert asyncio.run(run()) == (REQUEST, verify(*range(16)).SerializeToString())


class EchoSessions:
    """A stand-in servicer: answers each verify with its block reversed; records closes."""

    def __init__(self, fail_with: Exception | None = None) -> None:
        self.fail_with = fail_with
        self.closed = asyncio.Event()
        self.opened = 0

    async def session_responses(self, requests, on_open):
        self.opened += 1
        try:
            async for message in requests:
                if self.fail_with is not None:
                    raise self.fail_with
                ids = list(reversed(message.verify.block_ids))
                yield Response(step=target_pb2.StepResult(token_ids=ids))
        finally:
            self.closed.set()


async def serving(tmp_path, sessions: EchoSessions) -> SessionSocketServer:
    server = SessionSocketServer(str(tmp_path / "s.sock"), Request, sessions.session_responses)
    await server.start()
    return server


def verify(*ids: int):
    return Request(verify=target_pb2.Verify(block_ids=list(ids)))


def test_a_session_over_the_socket_and_its_end(tmp_path):
    async def run():
        sessions = EchoSessions()
        server = await serving(tmp_path, sessions)
        call = await SessionSocketCall.connect(server.path, Response, timeout_s=10)
        for block in ([1, 2, 3], [9], list(range(16))):
            await call.write(verify(*block))
            assert list((await call.read()).step.token_ids) == block[::-1]
        assert not sessions.closed.is_set()
        call.cancel()  # the client's end closes the session on the service
        await asyncio.wait_for(sessions.closed.wait(), 5)
        await server.close()
        assert not os.path.exists(server.path)

    asyncio.run(run())


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (CapacityError("all 4 target slots are in use"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
    ],
)
def test_service_errors_reach_the_client_as_grpc_statuses(tmp_path, error, status):
    async def run():
        sessions = EchoSessions(fail_with=error)
        server = await serving(tmp_path, sessions)
        call = await SessionSocketCall.connect(server.path, Response)
        await call.write(verify(1))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call.read()
        assert raised.value.code() == status
        assert str(error) in raised.value.details()
        assert sessions.closed.is_set()
        await server.close()

    asyncio.run(run())


def test_bad_frames_end_the_session_with_invalid_argument_and_the_server_goes_on(tmp_path):
    async def run():
        sessions = EchoSessions()
        server = await serving(tmp_path, sessions)
        for garbage in (
            frame(REQUEST, b"\xff\xff\xff"),  # not a RunSessionRequest
            frame(RESPONSE, b""),  # a client sends requests only
            b"\x01\x00\x00\x00Zx",  # no such kind
        ):
            reader, writer = await asyncio.open_unix_connection(server.path)
            writer.write(garbage)
            kind, payload = await asyncio.wait_for(read_frame(reader), 5)
            assert kind == ERROR
            error = SessionError.FromString(payload)
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and error.message
            assert await read_frame(reader) is None  # then the service hangs up
            writer.close()
        call = await SessionSocketCall.connect(server.path, Response)
        await call.write(verify(7, 8))
        assert list((await call.read()).step.token_ids) == [8, 7]
        call.cancel()
        await server.close()

    asyncio.run(run())


def test_client_sees_deadline_broken_connection_and_end_of_stream(tmp_path):
    async def run():
        async def silent(reader, writer):
            await reader.read()  # reads until the client gives up, never answers

        async def half_frame(reader, writer):
            await reader.read(5)
            writer.write(frame(RESPONSE, b"\x08\x01")[:-1])
            writer.close()

        async def hang_up(reader, writer):
            await reader.read(5)
            writer.close()  # between frames: the end of the stream, as gRPC's EOF

        results = []
        for name, handler in (("silent", silent), ("half", half_frame), ("eof", hang_up)):
            path = str(tmp_path / f"{name}.sock")
            server = await asyncio.start_unix_server(handler, path=path)
            call = await SessionSocketCall.connect(path, Response, timeout_s=0.3)
            await call.write(verify(1))
            try:
                results.append(await call.read())
            except grpc.aio.AioRpcError as error:
                results.append(error.code())
            server.close()
        return results

    assert asyncio.run(run()) == [
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.aio.EOF,
    ]


def test_draining_refuses_new_sessions_and_lets_open_ones_finish(tmp_path):
    async def run():
        sessions = EchoSessions()
        server = await serving(tmp_path, sessions)
        call = await SessionSocketCall.connect(server.path, Response)
        await call.write(verify(1, 2))
        await call.read()  # the session has begun
        draining = asyncio.ensure_future(server.drain(grace_s=30))
        await asyncio.sleep(0)
        late = await SessionSocketCall.connect(server.path, Response)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await late.write(verify(1))
            await late.read()
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in raised.value.details()
        await call.write(verify(4, 5))  # the open session goes on during the grace period
        assert list((await call.read()).step.token_ids) == [5, 4]
        assert not draining.done()
        call.cancel()
        await asyncio.wait_for(draining, 5)  # done as soon as the open session ended
        assert sessions.closed.is_set()
        await server.close()

    asyncio.run(run())


def test_a_session_still_open_after_the_grace_period_is_ended_and_closed(tmp_path):
    async def run():
        sessions = EchoSessions()
        server = await serving(tmp_path, sessions)
        call = await SessionSocketCall.connect(server.path, Response)
        await call.write(verify(1))
        await call.read()
        await asyncio.wait_for(server.drain(grace_s=0.2), 5)
        assert sessions.closed.is_set()  # before drain returned: the runtime may close next
        assert await call.read() is grpc.aio.EOF
        await server.close()

    asyncio.run(run())


def test_the_service_ends_a_session_at_its_deadline(tmp_path):
    """The client tells the service its deadline; the service frees the session when it
    passes even if the client never reads again and keeps its connection open (as gRPC's
    deadline does). A raw connection, since SessionSocketCall ends its own at the deadline."""

    async def run():
        sessions = EchoSessions()
        server = await serving(tmp_path, sessions)
        reader, writer = await open_with_deadline(server.path, 300_000, verify(3))
        await asyncio.sleep(0.6)
        closed_by_service = sessions.closed.is_set()
        kind, code = await read_last_frame(reader, writer)
        await server.close()
        return closed_by_service, kind, code

    code = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert asyncio.run(run()) == (True, ERROR, code)


def test_the_client_ends_a_session_at_its_deadline_without_a_timer_per_message(tmp_path):
    """One timer for the session's deadline: reads and writes arm none of their own, and a
    read waiting when the deadline passes, or a write after it, fails DEADLINE_EXCEEDED."""

    async def run():
        sessions = EchoSessions()
        server = await serving(tmp_path, sessions)
        loop = asyncio.get_running_loop()
        timers = []
        call_at = loop.call_at
        loop.call_at = lambda *args, **kwargs: timers.append(args) or call_at(*args, **kwargs)
        call = await SessionSocketCall.connect(server.path, Response, timeout_s=0.3)
        for step in range(20):
            if step == 1:  # (the service, in this loop too, armed its deadline at step 0)
                armed_before = len(timers)
            await call.write(verify(step))
            assert list((await call.read()).step.token_ids) == [step]
        armed_by_messages = len(timers) - armed_before
        loop.call_at = call_at
        codes = []
        for attempt in (call.read, lambda: call.write(verify(1))):
            try:
                await attempt()
            except grpc.aio.AioRpcError as error:
                codes.append(error.code())
        await server.close()
        return armed_by_messages, codes

    armed_by_messages, codes = asyncio.run(run())
    assert armed_by_messages == 0
    assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2


def test_the_deadline_ends_calls_on_a_service_that_stopped_reading(tmp_path):
    """A service that stopped reading (stopped, or stuck in a GPU wait): a write blocked on
    the full socket, and a read while our own bytes are still unsent, both end at the
    deadline with DEADLINE_EXCEEDED (a plain close would wait for the flush forever)."""

    async def run(waiting: str):
        stalled = asyncio.Event()

        async def never_reads(reader, writer):
            await stalled.wait()

        path = str(tmp_path / f"{waiting}.sock")
        server = await asyncio.start_unix_server(never_reads, path=path)
        call = await SessionSocketCall.connect(path, Response, timeout_s=0.3)
        large = verify(*range(1 << 16))

        async def until_the_deadline():
            transport = call._writer.transport
            while True:
                if waiting == "read" and transport.get_write_buffer_size() > 0:
                    return await call.read()
                await call.write(large)

        try:
            await asyncio.wait_for(until_the_deadline(), 10)
        except grpc.aio.AioRpcError as error:
            return error.code()
        finally:
            stalled.set()
            server.close()

    for waiting in ("write", "read"):
        assert asyncio.run(run(waiting)) == grpc.StatusCode.DEADLINE_EXCEEDED, waiting


def test_a_call_dropped_without_cancel_is_collected_before_its_deadline(tmp_path):
    async def run():
        server = await serving(tmp_path, EchoSessions())
        call = await SessionSocketCall.connect(server.path, Response, timeout_s=600)
        dropped = weakref.ref(call)
        del call
        gc.collect()
        await server.close()
        return dropped() is None

    assert asyncio.run(run())


def test_what_lies_at_the_socket_path(tmp_path):
    async def run():
        path = tmp_path / "s.sock"
        path.write_text("not a socket")
        with pytest.raises(ConfigError, match="not a socket"):
            await SessionSocketServer(str(path), Request, EchoSessions().session_responses).start()
        path.unlink()
        first = await serving(tmp_path, EchoSessions())
        with pytest.raises(ConfigError, match="another process"):
            await serving(tmp_path, EchoSessions())
        stale = socket.socket(socket.AF_UNIX)
        stale_path = str(tmp_path / "stale.sock")
        stale.bind(stale_path)  # a socket file nobody listens on (its service was killed)
        stale.close()
        taker = SessionSocketServer(stale_path, Request, EchoSessions().session_responses)
        await taker.start()  # replaces it
        await taker.close()
        # A path taken over by a newer server is not removed by the older one's close.
        os.unlink(first.path)
        second = await serving(tmp_path, EchoSessions())
        await first.close()
        assert os.path.exists(second.path)
        await second.close()
        assert not os.path.exists(second.path)

    asyncio.run(run())


class FakeGrpc:
    def __init__(self) -> None:
        self.timeouts = []

    def __call__(self, timeout=None):
        self.timeouts.append(timeout)
        return "grpc call"


def test_the_gateway_uses_a_socket_only_when_it_is_local_and_allowed(tmp_path):
    async def run():
        server = await serving(tmp_path, EchoSessions())
        chosen = {}
        for transport, path in (
            ("auto", server.path),
            ("grpc", server.path),
            ("auto", ""),  # the service offers none
            ("auto", str(tmp_path / "elsewhere.sock")),  # on another host
        ):
            grpc_open = FakeGrpc()
            calls = SessionCalls(grpc_open, Response, transport)
            calls.use_socket_if_local(path)
            call = await calls.open(timeout_s=5)
            chosen[(transport, path)] = (calls.transport, type(call).__name__, grpc_open.timeouts)
            if isinstance(call, SessionSocketCall):
                call.cancel()
        await server.close()
        return chosen

    chosen = asyncio.run(run())
    assert list(chosen.values()) == [
        ("socket", "SessionSocketCall", []),
        ("grpc", "str", [5]),
        ("grpc", "str", [5]),
        ("grpc", "str", [5]),
    ]


def test_a_stale_socket_file_falls_back_to_grpc(tmp_path):
    path = str(tmp_path / "stale.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)  # a socket file nobody listens on (its service was killed)
    stale.close()

    async def run():
        grpc_open = FakeGrpc()
        calls = SessionCalls(grpc_open, Response)
        calls.use_socket_if_local(path)
        assert calls.transport == "socket"
        call = await calls.open(timeout_s=2)
        return call, calls.transport, grpc_open.timeouts

    assert asyncio.run(run()) == ("grpc call", "grpc", [2])


def test_session_socket_settings():
    settings = ServiceSettings(session_socket="auto")
    path = settings.session_socket_path("target")
    assert os.path.isdir(os.path.dirname(path)) and "dflash-target-" in path
    os.rmdir(os.path.dirname(path))
    assert ServiceSettings(session_socket="/run/x.sock").session_socket_path("t") == "/run/x.sock"
    ServiceSettings(session_socket="off").validate("target")
    for bad in ("", "/tmp/" + "x" * 120):
        with pytest.raises(ConfigError, match="session_socket"):
            ServiceSettings(session_socket=bad).validate("target")


@pytest.mark.parametrize("spin_s", [0.5, 0.02])
def test_a_spinning_reader_gets_frames_that_come_during_and_after_its_spin(spin_s):
    """Within the spin (0.5 s) the frame is found by polling; after it (0.02 s) the reader
    sleeps until it comes. Either way, the same frame, and a clean end after it."""

    async def run():
        reader = asyncio.StreamReader()
        payload = verify(1, 2).SerializeToString()

        async def send_later():
            await asyncio.sleep(0.1)
            reader.feed_data(frame(REQUEST, payload))
            await asyncio.sleep(0.05)
            reader.feed_eof()

        sender = asyncio.ensure_future(send_later())
        got = await asyncio.wait_for(read_frame(reader, spin_s), 5)
        end = await asyncio.wait_for(read_frame(reader, spin_s), 5)
        await sender
        return got, end

    assert asyncio.run(run()) == ((REQUEST, verify(1, 2).SerializeToString()), None)


def test_spinning_is_for_sessions_on_a_gpu_unless_set():
    calls = SessionCalls(FakeGrpc(), Response)
    calls.use_socket_if_local("", service_spin_us=20_000)  # the client follows the service
    assert calls.spin_s == 0.02
    calls.use_socket_if_local("", service_spin_us=0)
    assert calls.spin_s == 0
    calls = SessionCalls(FakeGrpc(), Response, spin_us=500)
    calls.use_socket_if_local("", service_spin_us=0)
    assert calls.spin_s == 0.0005
    assert ServiceSettings(device="cuda").session_spin_s() == 0.02
    assert ServiceSettings(device="cuda", gpu_fast_path=False).session_spin_s() == 0
    assert ServiceSettings(device="cpu").session_spin_s() == 0
    assert ServiceSettings(device="cpu", session_spin_us=100).session_spin_s() == 0.0001
    with pytest.raises(ConfigError, match="session_spin_us"):
        ServiceSettings(session_spin_us=-1).validate("drafter")


def test_an_unexpected_failure_reads_the_same_on_grpc_and_on_the_socket(tmp_path):
    """Both carriers report a bug inside a session as INTERNAL with the same message."""
    from dflash_serve.grpc_support.model_servicer import ModelServicer

    class Aborted(Exception):
        pass

    class Context:
        def add_done_callback(self, callback):
            pass

        async def abort(self, status, message):
            self.status = status, message
            raise Aborted

    class Failing(ModelServicer):
        session_responses = EchoSessions(fail_with=RuntimeError("boom")).session_responses

    async def run():
        async def one_request():
            yield verify(1)

        context = Context()
        with pytest.raises(Aborted):
            async for _ in Failing().RunSession(one_request(), context):
                pass
        server = await serving(tmp_path, EchoSessions(fail_with=RuntimeError("boom")))
        call = await SessionSocketCall.connect(server.path, Response)
        await call.write(verify(1))
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call.read()
        await server.close()
        return context.status, (raised.value.code(), raised.value.details())

    over_grpc, over_socket = asyncio.run(run())
    assert (
        over_grpc == over_socket == (grpc.StatusCode.INTERNAL, "internal error: RuntimeError: boom")
    )


def test_a_message_too_large_for_a_frame_is_resource_exhausted(tmp_path, monkeypatch):
    from dflash_serve.session_socket import framing

    monkeypatch.setattr(framing, "MAX_MESSAGE_BYTES", 64)

    async def run():
        server = await serving(tmp_path, EchoSessions())
        codes = []
        call = await SessionSocketCall.connect(server.path, Response)
        try:
            await call.write(verify(*range(100)))  # the client's request
        except grpc.aio.AioRpcError as error:
            codes.append(error.code())
        await call.write(verify(*range(20)))  # the session goes on with messages that fit
        assert list((await call.read()).step.token_ids) == list(range(20))[::-1]
        call.cancel()
        await server.close()
        return codes

    assert asyncio.run(run()) == [grpc.StatusCode.RESOURCE_EXHAUSTED]
