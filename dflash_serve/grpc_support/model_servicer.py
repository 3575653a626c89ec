"""What the target and drafter servicers share: readiness, simple unary answers, the gRPC
form of their session streams, and serving them over gRPC and the local session socket."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import grpc

from dflash_serve import loop_profile
from dflash_serve.errors import DflashError, NotReadyError
from dflash_serve.grpc_support.errors import abort_with
from dflash_serve.grpc_support.server import GrpcServer, close_when_done
from dflash_serve.service_settings import ServiceSettings
from dflash_serve.session_socket.server import SessionSocketServer
from dflash_serve.startup_heap import freeze_startup_objects

logger = logging.getLogger(__name__)


class ModelServicer:
    """Holds the service's runtime once its model is loaded (None while loading)."""

    kind = "model"

    def __init__(self) -> None:
        self.runtime: Any = None
        self.session_socket_path = ""  # set while the local session socket is served
        self.session_spin_us = 0

    def info_fields(self, runtime) -> dict:
        """GetInfo's fields: the runtime's facts and the session socket's."""
        return asdict(runtime.info) | {
            "session_socket": self.session_socket_path,
            "session_spin_us": self.session_spin_us,
        }

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

    async def RunSession(self, request_iterator, context):
        """The session stream over gRPC: `session_responses`, errors as status codes; the
        session is closed when the RPC ends, even if its handler is never resumed."""
        try:
            responses = self.session_responses(
                request_iterator, lambda session: close_when_done(context, session)
            )
            async for response in responses:
                yield response
        except Exception as error:  # DflashError's status, else INTERNAL (as on the socket)
            await abort_with(context, error)

    def session_responses(self, requests, on_open: Callable[[Any], None]):
        """The service's session stream over any transport (an async generator): the
        responses to the `requests`, `on_open(session)` once the session exists."""
        raise NotImplementedError


async def serve_model(
    servicer: ModelServicer,
    service_name: str,
    add_servicer: Callable[[Any, grpc.aio.Server], None],
    request_type: type,
    settings: ServiceSettings,
    load_runtime: Callable[[], Any],
    model_name: str,
) -> None:
    """Listen at once (health NOT_SERVING), load the model in a thread, serve until SIGTERM.

    Sessions are served over gRPC and, unless turned off, over the local session socket
    (`request_type`: the service's RunSessionRequest), which stops taking sessions when
    draining starts."""
    server = GrpcServer(
        settings.host, settings.port, [service_name], lambda s: add_servicer(servicer, s)
    )
    port = await server.start()
    kind = servicer.kind
    socket_server = None
    if settings.session_socket != "off":
        spin_s = settings.session_spin_s()
        socket_server = SessionSocketServer(
            settings.session_socket_path(kind), request_type, servicer.session_responses, spin_s
        )
        await socket_server.start()
        servicer.session_socket_path = socket_server.path
        servicer.session_spin_us = round(spin_s * 1e6)
        server.on_drain(socket_server.drain)
    server.stop_on_signals(settings.grace_period_s)
    loop_profile.install_signal_toggle()
    logger.info("%s service listening on %s:%d; loading %s", kind, settings.host, port, model_name)
    if socket_server is not None:
        logger.info("%s sessions also on the local socket %s", kind, socket_server.path)
    servicer.runtime = await asyncio.to_thread(load_runtime)
    freeze_startup_objects()
    await server.set_serving(True)
    logger.info("%s service ready on %s:%d", kind, settings.host, port)
    await server.wait_until_stopped()
    if socket_server is not None:
        await socket_server.close()
    servicer.runtime.close()
