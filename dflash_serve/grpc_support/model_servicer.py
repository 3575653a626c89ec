"""What the target and drafter servicers share: readiness and simple unary answers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from dflash_serve.errors import DflashError, NotReadyError
from dflash_serve.grpc_support.errors import abort_with


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
