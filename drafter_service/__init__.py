"""The drafter service: the DFlash drafter and its context KV cache per session."""
