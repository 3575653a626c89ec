"""Start a grpc.aio server with standard health and reflection, and stop it gracefully.

Health is NOT_SERVING from start until the caller marks it ready (weights loaded, warm-up
done) and again as soon as draining starts on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


class GrpcServer:
    """One aio server hosting `service_names` (full names, e.g. dflash.target.v1.TargetService)."""

    def __init__(
        self,
        host: str,
        port: int,
        service_names: Sequence[str],
        add_servicers: Callable[[grpc.aio.Server], None],
    ) -> None:
        self.address = f"{host}:{port}"
        self.service_names = tuple(service_names)
        self.server = grpc.aio.server(options=CHANNEL_OPTIONS)
        add_servicers(self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        self.port = 0
        self._stopped = asyncio.Event()
        self._drain_callbacks: list[Callable[[float], Awaitable[None]]] = []

    def on_drain(self, callback: Callable[[float], Awaitable[None]]) -> None:
        """When draining starts, run `callback(grace_s)` beside gRPC's own drain (the
        session socket drains its sessions so)."""
        self._drain_callbacks.append(callback)

    async def start(self) -> int:
        """Bind and start (health NOT_SERVING); returns the bound port."""
        self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise OSError(f"could not bind {self.address}")
        await self.set_serving(False)
        await self.server.start()
        return self.port

    async def set_serving(self, is_serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if is_serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    def stop_on_signals(self, grace_s: float) -> None:
        """SIGTERM/SIGINT: report NOT_SERVING, let in-flight work finish, then stop."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.stop(grace_s)))

    async def stop(self, grace_s: float) -> None:
        if self._stopped.is_set():
            return
        logger.info("draining (grace %.1f s)", grace_s)
        await self.set_serving(False)
        drains = [callback(grace_s) for callback in self._drain_callbacks]
        await asyncio.gather(self.server.stop(grace_s), *drains)
        self._stopped.set()

    async def wait_until_stopped(self) -> None:
        await self._stopped.wait()


def close_when_done(context: grpc.aio.ServicerContext, session) -> None:
    """Close `session` when its RPC ends, however it ends.

    A stream the client cancels may never resume the handler's generator, so its
    `finally` cannot be relied on; closing is idempotent.
    """
    loop = asyncio.get_running_loop()

    def on_done(_context) -> None:
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(session.close()))

    context.add_done_callback(on_done)
