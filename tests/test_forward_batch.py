"""ForwardBatch: the positions a forward computes once for all its attention layers."""

from __future__ import annotations

import torch

from target_service.model.forward_batch import ForwardBatch


def test_positions_are_each_start_plus_the_token_index():
    batch = ForwardBatch((2, 0), (5, 17), 3, is_verify=True).on_device("cpu")
    assert batch.positions("cpu").tolist() == [[5, 6, 7], [17, 18, 19]]


def test_with_positions_computes_them_once_for_every_later_reader():
    batch = ForwardBatch((2, 0), (5, 17), 3, is_verify=True).on_device("cpu")
    once = batch.with_positions("cpu")
    assert torch.equal(once.positions("cpu"), batch.positions("cpu"))
    assert once.positions("cpu") is once.positions("cpu")  # no new tensor per layer
    assert batch.positions("cpu") is not batch.positions("cpu")
    assert (once.slots, once.start_positions, once.num_tokens) == ((2, 0), (5, 17), 3)
