"""How the gateway opens a service's session streams: over the service's local session
socket when it offers one that exists on this host (a fifth of gRPC's cost per message),
else over gRPC. Both carry the same messages; callers cannot tell them apart."""

from __future__ import annotations

import logging
import os
import stat

from dflash_serve.session_socket.call import SessionSocketCall
from dflash_serve.session_socket.framing import GPU_SPIN_US

logger = logging.getLogger(__name__)


def is_local_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


class SessionCalls:
    """`open` gives a stream call for one session; "auto" prefers the socket the service
    reported in GetInfo (`use_socket_if_local`), "grpc" never uses one. `spin_us`: how long
    a socket session polls for each response before sleeping; None: GPU_SPIN_US when the
    service runs on a GPU, else 0 (`use_socket_if_local` learns its device)."""

    def __init__(
        self,
        run_session,
        response_type: type,
        transport: str = "auto",
        spin_us: int | None = None,
    ) -> None:
        self._run_session = run_session  # the gRPC stub's RunSession
        self._response_type = response_type
        self._transport = transport
        self._spin_us = spin_us
        self.socket_path: str | None = None
        self.spin_s = 0.0

    @property
    def transport(self) -> str:
        return "socket" if self.socket_path else "grpc"

    def use_socket_if_local(self, path: str, device: str = "cpu") -> None:
        """`path`: GetInfoResponse.session_socket (empty: the service offers none), `device`
        the service's. A path absent here means the service runs on another host (or
        container)."""
        usable = self._transport == "auto" and bool(path) and is_local_socket(path)
        self.socket_path = path if usable else None
        spin_us = self._spin_us
        if spin_us is None:
            spin_us = GPU_SPIN_US if device.startswith("cuda") else 0
        self.spin_s = spin_us / 1e6

    async def open(self, timeout_s: float | None):
        if self.socket_path is not None:
            try:
                return await SessionSocketCall.connect(
                    self.socket_path, self._response_type, timeout_s, self.spin_s
                )
            except OSError as error:
                logger.warning(
                    "session socket %s unusable (%s); using gRPC", self.socket_path, error
                )
                self.socket_path = None
        return self._run_session(timeout=timeout_s)
