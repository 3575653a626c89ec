"""The one place that maps our errors to gRPC status codes and logs them."""

from __future__ import annotations

import logging

import grpc

from dflash_serve.errors import (
    CapacityError,
    CheckpointError,
    ConfigError,
    InvalidRequestError,
    NotReadyError,
)

logger = logging.getLogger(__name__)

STATUS_BY_ERROR: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotReadyError, grpc.StatusCode.UNAVAILABLE),
    (CheckpointError, grpc.StatusCode.FAILED_PRECONDITION),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
)


def status_for(error: Exception) -> grpc.StatusCode:
    for error_type, status in STATUS_BY_ERROR:
        if isinstance(error, error_type):
            return status
    return grpc.StatusCode.INTERNAL


def status_and_message(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The mapped status and the message a client sees; logged once here."""
    status = status_for(error)
    if status == grpc.StatusCode.INTERNAL:
        logger.error("internal error", exc_info=error)
        return status, f"internal error: {type(error).__name__}: {error}"
    logger.info("%s: %s", status.name, error)
    return status, str(error)


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """End the RPC with the mapped status (raises, as context.abort does)."""
    await context.abort(*status_and_message(error))
