"""Logging to stderr, as text for people or JSON lines for machines (``logging.format``)."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Hashable

from peerd.bounded import remember
from peerd.config import LoggingConfig


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(config: LoggingConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if config.format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.level)


def route_hivemind_logs(config: LoggingConfig) -> None:
    """hivemind installs its own handler; send its records through ours instead, one level quieter."""
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    level = logging.getLevelName(config.level)
    logging.getLogger("hivemind").setLevel(max(logging.WARNING, level))
    # When an initial peer refuses the join (e.g. a clock too far off), hivemind's DHT process closes its loop
    # with the handler of that peer's ping back still pending; asyncio and the interpreter then report the
    # abandoned coroutine, several lines of noise around the one line that says what to fix. The DHT process
    # is forked from here, so it inherits both filters.
    logging.getLogger("asyncio").addFilter(_abandoned_dht_rpc)
    warnings.filterwarnings("ignore", r"coroutine 'DHTProtocol\.rpc_\w+' was never awaited", RuntimeWarning)


def _abandoned_dht_rpc(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith("Task was destroyed but it is pending") and "/hivemind/dht/" in message)


class RateLimitedLog:
    """Logs at most one line per ``key`` (a peer id, a reason) every ``every`` seconds, remembering at most
    ``size`` keys, the least recently logged dropped first: a stranger can claim a new peer id in every
    message, so a per-peer memory must be bounded. Thread-safe (hivemind validates records on its own loop)."""

    def __init__(self, logger: logging.Logger, every: float = 60.0, size: int = 1024) -> None:
        self.logger = logger
        self.every = every
        self.size = size
        self._last: OrderedDict[Hashable, float] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, key: Hashable, level: int, message: str, *args: object) -> bool:
        """Logs ``message % args`` unless ``key`` was logged within ``every`` seconds; True if it logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.every:
                return False
            remember(self._last, key, now, self.size)
        self.logger.log(level, message, *args)
        return True

    def __len__(self) -> int:
        return len(self._last)
