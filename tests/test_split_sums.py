"""`SplitSums`: column slices and reshapes are views of the same partial sums, standing for the
same columns of the summed result; a shape only a copy could give is refused."""

import pytest
import torch

from dflash_serve.layers.split_sums import SplitSums, kernel_operand


def test_columns_and_reshape_stand_for_the_results_columns():
    partials = torch.randn(3, 8, 10)
    sums = SplitSums(partials, (2, 4, 10))
    part = sums.columns(2, 6).reshape(2, 4, 2, 2)
    assert part.partials.data_ptr() == partials[..., 2:].data_ptr()
    assert torch.equal(part.total(), sums.total()[..., 2:6].reshape(2, 4, 2, 2))
    view, split_stride, num_splits = kernel_operand(part)
    assert (split_stride, num_splits, view.dtype) == (80, 3, torch.float32)
    assert torch.equal(view, partials[0, :, 2:6].reshape(2, 4, 2, 2))
    assert kernel_operand(view)[1:] == (0, 0)


def test_reshape_that_needs_a_copy_is_refused():
    part = SplitSums(torch.randn(3, 8, 10), (8, 10)).columns(0, 6)
    with pytest.raises(ValueError, match="no view"):
        part.reshape(48)
