"""The gateway: OpenAI-compatible HTTP API running the speculative loop over the services."""
