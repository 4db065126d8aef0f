"""Errors a user can fix. The CLI prints their message as one line (no traceback) and exits 2."""


class UserError(Exception):
    """Bad input: the message names the problem and the fix."""


class CheckpointError(UserError):
    pass


class ConfigError(UserError):
    pass


class DatasetUnavailable(UserError):
    pass


class OutOfMemoryBudget(UserError):
    pass
