"""The gateway's one frozen config, built by the launcher from flags."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_serve.errors import ConfigError

FEATURE_TRANSPORTS = ("auto", "inline", "cuda_ipc")
SESSION_TRANSPORTS = ("auto", "grpc")


@dataclass(frozen=True)
class GatewayConfig:
    target_address: str
    tokenizer_path: str  # the target checkpoint (its tokenizer and chat template)
    drafter_address: str | None = None  # None: target-only decoding
    served_model_name: str = "dflash"
    host: str = "127.0.0.1"
    port: int = 8000
    num_drafts: int = 15
    adaptive_drafting: bool = True  # draft less often while drafting does not pay
    max_concurrent_requests: int = 16
    max_queued_requests: int = 64
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 120.0
    feature_transport: str = "auto"
    # "auto": sessions on a service's local session socket when it offers one on this host
    # (cheaper per step than gRPC), else gRPC; "grpc": always gRPC.
    session_transport: str = "auto"
    # How long a socket session polls for each response before sleeping; None: as long as
    # the service polls for requests (its GetInfo: 20 ms on the GPU fast path, else 0).
    session_spin_us: int | None = None

    def validate(self) -> None:
        checks = {
            "port": 0 <= self.port <= 65535,
            "num_drafts": 0 <= self.num_drafts <= 15,
            "max_concurrent_requests": self.max_concurrent_requests >= 1,
            "max_queued_requests": self.max_queued_requests >= 0,
            "request_timeout_s": self.request_timeout_s > 0,
            "connect_timeout_s": self.connect_timeout_s > 0,
            "feature_transport": self.feature_transport in FEATURE_TRANSPORTS,
            "session_transport": self.session_transport in SESSION_TRANSPORTS,
            "session_spin_us": self.session_spin_us is None or self.session_spin_us >= 0,
        }
        bad = {name: getattr(self, name) for name, ok in checks.items() if not ok}
        if bad:
            raise ConfigError(f"gateway: invalid settings {bad}")
