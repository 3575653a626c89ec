"""Shared fixtures: tiny checkpoints written once per test session."""

from __future__ import annotations

import os

import pytest
import torch

from dflash_serve.grpc_core_experiments import choose_grpc_core_experiments

# Without a GPU the Triton kernels run in Triton's interpreter; it is chosen when a kernel is
# defined (at import), so it must be set before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.tiny_checkpoints import KERNEL_FRIENDLY, write_causal_lm, write_conditional_generation

# The tests' own gRPC servers and clients run with the services' choice of grpc core
# experiments; grpc reads it once, when first imported (by a test module, after this).
choose_grpc_core_experiments()


@pytest.fixture(scope="session")
def causal_lm_dir(tmp_path_factory):
    return write_causal_lm(tmp_path_factory.mktemp("causal_lm"), seed=1)


@pytest.fixture(scope="session")
def kernel_friendly_dir(tmp_path_factory):
    """Head sizes the Triton kernels tile (tests/tiny_checkpoints.py: KERNEL_FRIENDLY)."""
    return write_causal_lm(
        tmp_path_factory.mktemp("kernel_friendly"), seed=7, overrides=KERNEL_FRIENDLY
    )


@pytest.fixture(scope="session")
def reference_model(kernel_friendly_dir):
    """The kernel-friendly checkpoint on the plain-torch reference path (fp32, CPU)."""
    from target_service.model.loader import load_target_model

    return load_target_model(kernel_friendly_dir)


@pytest.fixture(scope="session")
def cpu_kernel_model(kernel_friendly_dir):
    """The kernel-friendly checkpoint in bf16 on the Triton kernels (calls of up to 64 rows)
    on the CPU: interpreted where there is no GPU."""
    pytest.importorskip("triton")
    from target_service.model.loader import load_target_model

    model = load_target_model(kernel_friendly_dir, torch.bfloat16, "cpu")
    model.use_gpu_kernels(64)
    return model


@pytest.fixture(scope="session")
def conditional_generation_dir(tmp_path_factory):
    return write_conditional_generation(tmp_path_factory.mktemp("conditional_generation"), seed=2)


@pytest.fixture(scope="session")
def dflash_dir(tmp_path_factory):
    from tests.tiny_checkpoints import write_dflash

    return write_dflash(tmp_path_factory.mktemp("dflash"), seed=3)


@pytest.fixture(scope="session")
def embedded_pair():
    """The product's embedded default pair (the trained target and drafter it ships)."""
    from launcher.embedded_default import embedded_model_pair

    return embedded_model_pair()


@pytest.fixture(scope="session")
def byte_level_pair(tmp_path_factory):
    """A tiny random pair whose tokenizer maps every id below 256 to one byte."""
    from tests.byte_level_pair import write_byte_level_pair

    return write_byte_level_pair(tmp_path_factory.mktemp("byte_level_pair"))
