"""Errors rewardax raises for bad input: each says what was wrong, where, and what to do."""


class RewardaxError(Exception):
    """Base class: a problem with the user's input, files or configuration (not a bug)."""


class ConfigError(RewardaxError, ValueError):
    """A configuration field is unknown, malformed or inconsistent with another."""


class ModelLoadError(RewardaxError):
    """A checkpoint or model file cannot be read, or does not match its configuration."""


class DataError(RewardaxError, ValueError):
    """A dataset row, file or field is malformed; the message names the file, row and field."""


class CheckpointError(RewardaxError):
    """A training checkpoint cannot be written or restored."""


class NonFiniteError(RewardaxError, FloatingPointError):
    """The loss or the gradients became NaN or Inf."""
