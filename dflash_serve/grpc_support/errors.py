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


async def abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
    """Log once, then end the RPC with the mapped status (raises, as context.abort does)."""
    status = status_for(error)
    if status == grpc.StatusCode.INTERNAL:
        logger.error("internal error", exc_info=error)
        message = f"internal error: {type(error).__name__}: {error}"
    else:
        logger.info("%s: %s", status.name, error)
        message = str(error)
    await context.abort(status, message)
