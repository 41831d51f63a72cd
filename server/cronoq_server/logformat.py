"""The server's log lines: text for a terminal, or one JSON object per line for log shippers."""

from __future__ import annotations

import datetime
import json
import logging

# The attributes every LogRecord has; any other attribute came from a call's `extra` and is kept.
_RECORD_ATTRIBUTES = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """{"time", "level", "logger", "message", "shard", ...}: one line; a traceback is the
    "exception" field (a string with escaped newlines), never lines of its own."""

    def __init__(self, shard: str):
        super().__init__()
        self.shard = shard

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "shard": self.shard,
        }
        line.update({k: v for k, v in vars(record).items() if k not in _RECORD_ATTRIBUTES and k not in line})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def setup_logging(level: str, log_format: str, shard: str | None) -> None:
    """The root logger's one handler (stderr) in the given format."""
    shard_name = shard or "unsharded"
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(shard_name))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [shard={shard_name}] %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
