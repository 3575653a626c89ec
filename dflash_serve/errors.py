"""Errors a person can act on: each names the file, tensor or field and what was expected."""


class DflashError(Exception):
    """Base class for errors raised at the project's public entry points."""


class CheckpointError(DflashError):
    """A checkpoint is missing, unreadable, or disagrees with its own config."""


class ConfigError(DflashError):
    """A config file or a flag holds a value the engine cannot serve."""


class InvalidRequestError(DflashError):
    """A request names ids, lengths or parameters outside what the model accepts."""


class CapacityError(DflashError):
    """No free sequence slot or not enough room in the preallocated state."""


class NotReadyError(DflashError):
    """The service is still loading its model or is draining."""
