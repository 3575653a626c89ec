"""The fused q/k-norm kernel applies one eps and one kind to both norms: who may use it."""

from __future__ import annotations

import pytest

from dflash_serve.layers.norms import RMSNorm
from drafter_service.model.config import DFlashConfig
from drafter_service.model.dflash import DrafterAttention
from tests.tiny_checkpoints import dflash_config_dict


def test_norms_share_settings_only_with_equal_eps_and_kind():
    norm = RMSNorm(8, 1e-6, zero_centred=True)
    assert norm.shares_settings(RMSNorm(16, 1e-6, zero_centred=True))  # the dim is not a setting
    assert not norm.shares_settings(RMSNorm(8, 1e-5, zero_centred=True))
    assert not norm.shares_settings(RMSNorm(8, 1e-6, zero_centred=False))


def test_drafter_attention_refuses_to_fuse_norms_that_differ():
    attention = DrafterAttention(DFlashConfig.from_dict(dflash_config_dict()))
    attention.stack_for_fused_inputs()  # the checkpoint's norms share their settings
    assert attention.qkv_weight is not None
    mismatched = DrafterAttention(DFlashConfig.from_dict(dflash_config_dict()))
    mismatched.k_norm.eps *= 10
    with pytest.raises(ValueError, match="one eps and one kind"):
        mismatched.stack_for_fused_inputs()
    assert mismatched.qkv_weight is None
    # The plain path applies each norm on its own: its stacked matmul takes any norms.
    mismatched.stack_projections()
    assert mismatched.qkv_weight is not None
