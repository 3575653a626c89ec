"""The gateway's two services: connecting with retries, health, and a drafter that may come
and go (the gateway then decodes target-only and reconnects in the background)."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from dflash_serve.feature_refs import SharedBufferInfo
from dflash_serve.service_info import DrafterInfo, TargetInfo
from gateway.config import GatewayConfig
from gateway.drafter_client import DrafterClient
from gateway.target_client import TargetClient

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
RECONNECT_MAX_WAIT_S = 10.0


class ServiceNotServingError(Exception):
    """A service answered but is not SERVING yet (loading or draining)."""


async def wait_until_serving(channel: grpc.aio.Channel) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        raise ServiceNotServingError("not serving")


def retrying(deadline_s: float) -> AsyncRetrying:
    return AsyncRetrying(
        retry=retry_if_exception_type((grpc.aio.AioRpcError, ServiceNotServingError)),
        wait=wait_exponential(multiplier=0.05, max=RECONNECT_MAX_WAIT_S),
        stop=stop_after_delay(deadline_s),
        reraise=True,
    )


class Backends:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        sessions = {
            "session_transport": config.session_transport,
            "session_spin_us": config.session_spin_us,
        }
        self.target = TargetClient(config.target_address, **sessions)
        self.drafter = (
            DrafterClient(config.drafter_address, **sessions) if config.drafter_address else None
        )
        self.target_info: TargetInfo | None = None
        self.drafter_info: DrafterInfo | None = None
        self.shared_buffer: SharedBufferInfo | None = None
        self.is_drafter_usable = False
        self.feature_transport = "none"
        self._reconnect_task: asyncio.Task | None = None

    async def connect(self) -> None:
        """Wait (with backoff, up to connect_timeout_s) for the target; then the drafter."""
        async for attempt in retrying(self.config.connect_timeout_s):
            with attempt:
                await wait_until_serving(self.target.channel)
                self.target_info = await self.target.info()
        info, sessions = self.target_info, self.target.sessions.transport
        logger.info(
            "target ready: %s on %s, sessions on %s", info.model_name, info.device, sessions
        )
        if self.drafter is not None:
            try:
                await self._connect_drafter(self.config.connect_timeout_s)
            except (grpc.aio.AioRpcError, ServiceNotServingError) as error:
                logger.warning("drafter not reachable (%s); decoding target-only for now", error)
                self.schedule_drafter_reconnect()

    async def _connect_drafter(self, deadline_s: float) -> None:
        async for attempt in retrying(deadline_s):
            with attempt:
                await wait_until_serving(self.drafter.channel)
                info = await self.drafter.info()
        if info.tap_layer_ids != self.target_info.tap_layer_ids:
            logger.error(
                "drafter taps %s differ from the target's %s; restart the target with "
                "--drafter-model so they match. Decoding target-only.",
                info.tap_layer_ids,
                self.target_info.tap_layer_ids,
            )
            return
        self.drafter_info = info
        self.feature_transport = await self._choose_transport()
        self.is_drafter_usable = True
        logger.info(
            "drafter ready: %s, features %s, sessions on %s",
            info.model_name,
            self.feature_transport,
            self.drafter.sessions.transport,
        )

    async def _choose_transport(self) -> str:
        wanted = self.config.feature_transport
        on_gpus = self.target_info.device.startswith(
            "cuda"
        ) and self.drafter_info.device.startswith("cuda")
        if wanted == "inline" or (wanted == "auto" and not on_gpus):
            return "inline"
        try:
            self.shared_buffer = await self.target.feature_buffer()
            return "cuda_ipc"
        except grpc.aio.AioRpcError as error:
            if wanted == "cuda_ipc":
                raise
            logger.warning("CUDA IPC features unavailable (%s); using inline", error.details())
            return "inline"

    def drafter_failed(self, error: BaseException) -> None:
        """Called when a request saw the drafter fail: stop using it until it is back."""
        if self.is_drafter_usable:
            logger.warning("drafter failed (%s); target-only until it reconnects", error)
        self.is_drafter_usable = False
        self.schedule_drafter_reconnect()

    def schedule_drafter_reconnect(self) -> None:
        if self.drafter is None or (self._reconnect_task and not self._reconnect_task.done()):
            return
        self._reconnect_task = asyncio.ensure_future(self._reconnect_forever())

    async def _reconnect_forever(self) -> None:
        while not self.is_drafter_usable:
            try:
                await self._connect_drafter(deadline_s=RECONNECT_MAX_WAIT_S * 6)
            except (grpc.aio.AioRpcError, ServiceNotServingError) as error:
                logger.info("drafter still unavailable (%s); retrying", type(error).__name__)
            if not self.is_drafter_usable:
                await asyncio.sleep(RECONNECT_MAX_WAIT_S)

    async def is_healthy(self) -> bool:
        """Both services SERVING and in use (the drafter only if one is configured)."""
        if self.target_info is None or (self.drafter and not self.is_drafter_usable):
            return False
        channels = [self.target.channel] + ([self.drafter.channel] if self.drafter else [])
        try:
            for channel in channels:
                await wait_until_serving(channel)
        except (grpc.aio.AioRpcError, ServiceNotServingError):
            return False
        return True

    async def close(self) -> None:
        if self._reconnect_task:
            self._reconnect_task.cancel()
        await self.target.close()
        if self.drafter:
            await self.drafter.close()
