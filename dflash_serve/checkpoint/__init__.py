"""Reading checkpoints from disk: safetensors (single or sharded), 4-bit formats, hub ids."""
