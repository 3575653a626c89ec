"""Pieces shared by the target service, the drafter service and the gateway.

Layers, checkpoint loading, sampling and the speculative step loop live here so that no
service copies code from another and no service imports another.
"""

__version__ = "0.1.0"
