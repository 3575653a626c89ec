"""Benchmarks: Qwen3.5-4B-shaped random checkpoints and the measurements made on them."""
