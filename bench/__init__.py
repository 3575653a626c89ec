"""Benchmarks: Qwen3.5-4B-shaped random checkpoints and the measurements made on them."""

from dflash_serve.grpc_core_experiments import choose_grpc_core_experiments

# A bench module may import grpc before dflash_serve: choose first, as the services do.
choose_grpc_core_experiments()
