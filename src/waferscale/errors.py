"""User-facing errors. The CLI prints `error: <message>` and exits 2 for any UserError, with no traceback."""


class UserError(Exception):
    """Bad input from the user: the message says what is wrong, where, and how to fix it."""


class ConfigError(UserError, ValueError):
    """A params YAML or a command-line value is wrong."""


class DataError(UserError):
    """A data path cannot be read, or its content does not fit the tokenizer/model."""


class CheckpointError(UserError):
    """A checkpoint is missing, partial, or belongs to another architecture."""


class AssetError(DataError, CheckpointError):
    """A named asset (weights, tokenizer or corpus shipped in a pip package) is unknown or not installed.

    Both a DataError and a CheckpointError: callers that load data or weights catch it as theirs."""
