"""Project error types. Each message names the field or file at fault and the fix;
the CLI prints them without a traceback and exits non-zero."""


class TrainforgeError(Exception):
    """Base class for errors caused by user input (config, data, checkpoints)."""


class ConfigError(TrainforgeError, ValueError):
    """A config key is unknown, has the wrong type or an out-of-range value."""


class DataError(TrainforgeError):
    """Prepared data is missing, malformed, or fails its integrity check."""


class CheckpointError(TrainforgeError):
    """A checkpoint is missing, corrupt, or incompatible with the run."""
