"""Our PyTorch implementation of the Qwen3.5 text model (transformers is only the test oracle)."""
