"""Triton kernels of the target alone (GDN inputs and recurrence).

Kernels both services use live in dflash_serve.kernels.
"""
