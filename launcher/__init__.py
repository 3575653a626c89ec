"""The `dflash-serve` command: starts services and tools; depends on them, nothing depends on it."""
