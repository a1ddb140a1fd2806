"""Logging set-up: readable lines by default, JSON lines for log shippers.

A JSON line carries ts, level, logger and message, and the world, epoch and rank
when the call passed them with `extra=` (every line about a world does), so a
log pipeline can select one world's story without parsing messages.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import TextIO

CONTEXT_FIELDS = ("world", "epoch", "rank")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line: dict[str, object] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup_logging(level: str, fmt: str, stream: TextIO | None = None) -> None:
    """Configure the root logger once, at start (replacing what was there)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
