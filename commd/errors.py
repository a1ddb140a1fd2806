"""Errors inside the daemon.

    CallError            a request fails; carries the wire ErrorCode sent back to the rank
    └── (no subclasses: the code is the type on the wire)
    ConfigError          bad configuration at start (the CLI prints it and exits 2)

Anything else escaping a handler is a daemon bug: the connection gets an
INTERNAL error and is closed; other connections and worlds go on.
"""

from __future__ import annotations

from proto import ErrorCode


class CallError(Exception):
    """A request that fails with `code`; the message goes to the client verbatim."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ConfigError(Exception):
    """A configuration value is missing or invalid."""
