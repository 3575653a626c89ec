"""The one place that turns failures into OpenAI-shaped HTTP errors and logs them."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from http import HTTPStatus

from aiohttp import web

logger = logging.getLogger(__name__)


@dataclass
class ApiError(Exception):
    """An error a client sees: {"error": {"message", "type", "param", "code"}}."""

    status: int
    message: str
    param: str | None = None
    headers: dict[str, str] | None = None

    @property
    def error_type(self) -> str:
        return {
            400: "BadRequestError",
            404: "NotFoundError",
            503: "ServiceUnavailableError",
        }.get(self.status, "InternalServerError")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, param)


def error_response(error: ApiError) -> web.Response:
    if error.status >= 500:
        logger.warning("%d: %s", error.status, error.message)
    else:
        logger.info("%d: %s", error.status, error.message)
    return web.json_response(error.body(), status=error.status, headers=error.headers)


def sse_error_event(error: ApiError) -> bytes:
    return f"data: {json.dumps(error.body())}\n\n".encode()
