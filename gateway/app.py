"""Assemble and run the gateway: listen at once, connect to the services in the background
(/health answers 503 until both are healthy), stop gracefully on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

from aiohttp import web

from dflash_serve.startup_heap import freeze_startup_objects
from gateway.backends import Backends
from gateway.config import GatewayConfig
from gateway.generation import Generator
from gateway.metrics import GatewayMetrics
from gateway.routes import Admission, Routes

logger = logging.getLogger(__name__)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    from dflash_serve.checkpoint.resolve import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(path))


def build_app(config: GatewayConfig, tokenizer) -> tuple[web.Application, Backends]:
    metrics = GatewayMetrics(config.served_model_name)
    backends = Backends(config)
    generator = Generator(config, backends, tokenizer, metrics)
    admission = Admission(
        config.max_concurrent_requests,
        config.max_queued_requests,
        metrics,
        config.served_model_name,
    )
    app = web.Application()
    Routes(generator, admission, config.served_model_name).register(app)
    return app, backends


async def serve(
    config: GatewayConfig, ready: asyncio.Event | None = None, freeze_startup: bool = False
) -> None:
    """Serve until SIGTERM/SIGINT. `freeze_startup` (a gateway process of its own): once
    listening, keep the garbage collector off everything start-up made (startup_heap)."""
    tokenizer = await asyncio.to_thread(load_tokenizer, config.tokenizer_path)
    app, backends = build_app(config, tokenizer)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    logger.info("gateway listening on %s:%d", config.host, port)
    stopped = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopped.set)
    connecting = asyncio.ensure_future(backends.connect())
    connecting.add_done_callback(_report_connect_failure)
    if freeze_startup:
        freeze_startup_objects()  # the tokenizer, routes, clients and every import
    if ready is not None:
        ready.set()
    await stopped.wait()
    logger.info("gateway stopping")
    connecting.cancel()
    await runner.cleanup()
    await backends.close()


def _report_connect_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("could not reach the target service: %s", task.exception())
