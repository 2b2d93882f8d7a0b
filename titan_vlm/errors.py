"""The errors a user can cause, in a leaf module every other module may import."""


class UserError(Exception):
    """A problem the user can fix (config, data, dump folder, checkpoints): the message is one
    line naming the key, file or folder. The trainer prints it once (rank 0), without a
    traceback, and exits with code 2."""


class ConfigError(UserError, ValueError):
    """A configuration problem; the message is one line and names the key or file."""
