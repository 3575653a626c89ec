"""Pieces shared by the target service, the drafter service and the gateway.

Layers, checkpoint loading, sampling and the speculative step loop live here so that no
service copies code from another and no service imports another.
"""

from dflash_serve.grpc_core_experiments import choose_grpc_core_experiments

__version__ = "0.1.0"

# Before anything imports grpc, which reads it once (see grpc_core_experiments).
choose_grpc_core_experiments()
