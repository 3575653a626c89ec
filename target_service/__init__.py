"""The target service: Qwen3.5 with its KV cache and recoverable Gated DeltaNet state."""
