"""Start the whole product as real processes: target, drafter and gateway."""

from __future__ import annotations

from launcher.service_processes import GATEWAY_LISTENING, start_service, wait_healthy


def start_gateway(target_address, drafter_address, tokenizer, *extra, timeout_s=60.0):
    """The gateway as a process; returns once /health answers 200."""
    args = ["gateway", "--target-address", target_address, "--tokenizer", str(tokenizer), *extra]
    if drafter_address:
        args += ["--drafter-address", drafter_address]
    return start_service(args, timeout_s, wait_ready=wait_healthy, listening=GATEWAY_LISTENING)


def start_stack(target_dir, drafter_dir, *gateway_args):
    """(target, drafter, gateway) processes on the given checkpoints."""
    common = ["--max-sessions", "8", "--max-context-tokens", "512"]
    target = start_service(
        ["target", "--model", str(target_dir), "--drafter-model", str(drafter_dir), *common]
    )
    drafter = start_service(
        ["drafter", "--model", str(drafter_dir), "--target-model", str(target_dir), *common]
    )
    gateway = start_gateway(target.address, drafter.address, target_dir, *gateway_args)
    return target, drafter, gateway
