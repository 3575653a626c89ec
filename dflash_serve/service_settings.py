"""Settings every model service takes (network, device, capacity, batching, shutdown)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_serve.errors import ConfigError

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
MAX_SOCKET_PATH_BYTES = 107
# How long a step waits at most for other sessions' requests; the wait ends as soon as every
# open, recently active session has sent one, so sessions in step wait nothing. The target
# waits long enough for sessions in the drafter's step to come back (a draft step plus the
# hand-offs: ~3-10 ms on an H200), so sessions that fell out of step share a verify again;
# the drafter waits only for the spread of one verify's replies. Were both to wait long, each
# would wait out the sessions the other holds.
DEFAULT_MAX_WAIT_US = {"target": 20_000, "drafter": 1_000}


@dataclass(frozen=True)
class ServiceSettings:
    host: str = "127.0.0.1"
    port: int = 0
    device: str = "cpu"
    dtype: str = "auto"  # bfloat16 on a GPU, float32 on the CPU (see drafter_dtype)
    max_sessions: int = 16
    max_context_tokens: int = 4096
    max_batch_size: int = 16
    max_wait_us: int | None = None  # None: DEFAULT_MAX_WAIT_US of the service
    # A step also stops waiting once no request has come for this long (None: never).
    max_gap_us: int | None = None
    # torch intra-op threads of the engine thread. One is fastest for the small per-step ops
    # of decoding on a CPU: two OpenMP teams (the loading thread's and the engine thread's)
    # spinning on the same cores cost the embedded pair 40 % of its decode speed.
    engine_threads: int = 1
    grace_period_s: float = 5.0
    # On a GPU: row-independent Triton kernels and CUDA graphs for verify/decode (needs triton).
    gpu_fast_path: bool = True
    gpu_memory_fraction: float | None = None  # cap for this process on a shared GPU
    # Sessions also on a local Unix socket (protos/session_socket.proto), which a gateway on
    # this host uses instead of gRPC: "auto" (a fresh path under the temp directory), a path,
    # or "off".
    session_socket: str = "auto"
    # How long a session on the socket polls for its next request before sleeping in the
    # event loop; None: session_socket.framing.GPU_SPIN_US on the GPU fast path, else 0.
    session_spin_us: int | None = None

    def uses_gpu_fast_path(self) -> bool:
        """On a GPU unless turned off; ConfigError when it is wanted but triton is missing."""
        if not (self.device.startswith("cuda") and self.gpu_fast_path):
            return False
        from dflash_serve.kernels import is_triton_available

        if not is_triton_available():
            raise ConfigError(
                "the GPU fast path needs triton (it comes with CUDA builds of torch); "
                "install it or start with --no-gpu-fast-path"
            )
        return True

    def apply_memory_cap(self) -> None:
        """Cap this process's share of the GPU (two services share one card)."""
        if self.gpu_memory_fraction is not None and self.device.startswith("cuda"):
            import torch

            torch.cuda.set_per_process_memory_fraction(
                self.gpu_memory_fraction, torch.device(self.device)
            )

    def session_socket_path(self, service: str) -> str:
        """Where to serve the session socket: the path given, or a fresh one for "auto"."""
        if self.session_socket != "auto":
            return self.session_socket
        from dflash_serve.session_socket.server import auto_socket_path

        return auto_socket_path(service)

    def session_spin_s(self) -> float:
        if self.session_spin_us is not None:
            return self.session_spin_us / 1e6
        from dflash_serve.session_socket.framing import GPU_SPIN_US

        on_fast_path = self.device.startswith("cuda") and self.gpu_fast_path
        return GPU_SPIN_US / 1e6 if on_fast_path else 0.0

    def wait_us(self, service: str) -> int:
        """max_wait_us, or the service's default."""
        return DEFAULT_MAX_WAIT_US[service] if self.max_wait_us is None else self.max_wait_us

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def drafter_dtype(self) -> str:
        """The drafter's dtype: `resolved_dtype`, except that "auto" on a CPU that multiplies
        bf16 natively (AVX512-BF16, AMX) is bfloat16: the drafter's proposals need not be
        exact (the target decides every token), DFlash checkpoints are bf16, and there its
        matmuls take half the time (the embedded drafter's step: ~25 % less)."""
        if self.dtype == "auto" and self.device == "cpu" and cpu_multiplies_bf16_natively():
            return "bfloat16"
        return self.resolved_dtype

    def validate(self, service: str) -> None:
        checks = {
            "port": 0 <= self.port <= 65535,
            "max_sessions": self.max_sessions >= 1,
            "max_context_tokens": self.max_context_tokens >= 2,
            "max_batch_size": self.max_batch_size >= 1,
            "max_wait_us": self.max_wait_us is None or self.max_wait_us >= 0,
            "max_gap_us": self.max_gap_us is None or self.max_gap_us >= 1,
            "engine_threads": self.engine_threads >= 1,
            "grace_period_s": self.grace_period_s >= 0,
            "session_spin_us": self.session_spin_us is None or self.session_spin_us >= 0,
            "dtype": self.dtype in DTYPE_CHOICES,
            # a Unix socket's path holds at most 107 bytes
            "session_socket": bool(self.session_socket)
            and len(self.session_socket.encode()) <= MAX_SOCKET_PATH_BYTES,
            "gpu_memory_fraction": self.gpu_memory_fraction is None
            or 0 < self.gpu_memory_fraction <= 1,
        }
        bad = {name: getattr(self, name) for name, ok in checks.items() if not ok}
        if bad:
            raise ConfigError(f"{service} service: invalid settings {bad}")


def cpu_multiplies_bf16_natively() -> bool:
    """Whether oneDNN runs bf16 matmuls on this CPU's own bf16 instructions."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN, or without the check
        return False
