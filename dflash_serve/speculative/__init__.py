"""The speculative step loop, written against session protocols so that the same loop runs
in-process (tests, benchmarks) and over gRPC (the gateway)."""
