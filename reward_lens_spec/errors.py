"""Errors of the declarative layer."""


class SpecError(ValueError):
    """A spec or template is malformed. The message starts with ``file:line``."""
