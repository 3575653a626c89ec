"""Generated gRPC stubs; regenerate with `python protos/generate.py`."""
