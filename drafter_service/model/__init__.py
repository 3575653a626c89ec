"""Our PyTorch implementation of the DFlash block drafter."""
