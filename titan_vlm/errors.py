"""The errors a user can cause, in a leaf module every other module may import."""


class ConfigError(ValueError):
    """A configuration problem; the message is one line and names the key or file."""
