"""What the target and drafter servicers share: readiness and simple unary answers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from dflash_serve.errors import DflashError, NotReadyError
from dflash_serve.grpc_support.errors import abort_with
from dflash_serve.grpc_support.server import GrpcServer
from dflash_serve.service_settings import ServiceSettings

logger = logging.getLogger(__name__)


class ModelServicer:
    """Holds the service's runtime once its model is loaded (None while loading)."""

    kind = "model"

    def __init__(self) -> None:
        self.runtime: Any = None

    def ready(self) -> Any:
        if self.runtime is None:
            raise NotReadyError(f"the {self.kind} model is still loading; retry shortly")
        return self.runtime

    async def answer(
        self,
        context: grpc.aio.ServicerContext,
        response_type: type,
        fields: Callable[[Any], dict],
    ):
        """`response_type(**fields(runtime))`, or the mapped error status."""
        try:
            return response_type(**fields(self.ready()))
        except DflashError as error:
            await abort_with(context, error)


async def serve_model(
    servicer: ModelServicer,
    service_name: str,
    add_servicer: Callable[[Any, grpc.aio.Server], None],
    settings: ServiceSettings,
    load_runtime: Callable[[], Any],
    model_name: str,
) -> None:
    """Listen at once (health NOT_SERVING), load the model in a thread, serve until SIGTERM."""
    server = GrpcServer(
        settings.host, settings.port, [service_name], lambda s: add_servicer(servicer, s)
    )
    port = await server.start()
    server.stop_on_signals(settings.grace_period_s)
    kind = servicer.kind
    logger.info("%s service listening on %s:%d; loading %s", kind, settings.host, port, model_name)
    servicer.runtime = await asyncio.to_thread(load_runtime)
    await server.set_serving(True)
    logger.info("%s service ready on %s:%d", kind, settings.host, port)
    await server.wait_until_stopped()
    servicer.runtime.close()
