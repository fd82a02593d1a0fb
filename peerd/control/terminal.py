"""Training progress in the terminal: a line on stderr redrawn in place, or periodic log records.

On a terminal (stderr is a TTY and logs are text) one line shows step, loss, samples/s and peers, redrawn
every second; log records erase it first and redraw it after, so the two never share a line. Anywhere
else (a file, a pipe, ``--log-format json``) no line is drawn at all: a normal log record every
``LOG_PERIOD`` seconds says the same, so it is formatted like every other record (a JSON line in JSON mode)
and no carriage return or escape code ever reaches a log file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from peerd.config import LoggingConfig

logger = logging.getLogger(__name__)

LIVE_PERIOD = 1.0
LOG_PERIOD = 10.0
_ERASE = "\r\x1b[2K"  # back to column 0, clear the whole line

Snapshot = Callable[[], Mapping[str, Any] | None]


def _fmt(value: Any, spec: str) -> str:
    return "-" if not isinstance(value, (int, float)) or isinstance(value, bool) else format(value, spec)


def format_progress(training: Mapping[str, Any]) -> str:
    """One line from a ``TrainingReport.as_dict()``."""
    peers = training.get("peers_training", 0)
    step = f"step {training.get('step', '-')}"
    if training.get("mode") == "diloco":  # the outer step is the phase; inner steps count within it
        step = f"phase {training.get('step', '-')} (inner step {training.get('inner_steps', 0)})"
    parts = [
        step,
        f"loss {_fmt(training.get('loss'), '.4f')}",
        f"val {_fmt(training.get('validation_loss'), '.4f')}",
        (f"{_fmt(training.get('samples_per_second'), '.1f')} samples/s "
         f"(swarm {_fmt(training.get('swarm_samples_per_second'), '.1f')})"),
        f"{peers} peer{'' if peers == 1 else 's'}",
        f"rounds {training.get('rounds_ok', 0)} ok/{training.get('rounds_solo', 0)} solo"
        + (" (AVERAGING STOPPED)" if (training.get("averaging") or {}).get("stalled") else ""),
        str(training.get("state", "")),
        str(training.get("device", "")),
    ]
    return " | ".join(parts)


def is_live_terminal(stream: TextIO, config: LoggingConfig) -> bool:
    """Redraw in place only where a person watches plain text: not into files, pipes or JSON logs."""
    return config.format == "text" and stream.isatty() and os.environ.get("TERM") != "dumb"


class _ErasingHandler(logging.Handler):
    """Wraps a root handler so each record is written on a line of its own, below the progress line."""

    def __init__(self, inner: logging.Handler, progress: TerminalProgress) -> None:
        super().__init__(inner.level)
        self.inner = inner
        self._progress = progress

    def handle(self, record: logging.LogRecord) -> bool:
        # One lock around erase, write and redraw: records may come from worker threads too.
        with self._progress.lock:
            self._progress.erase()
            handled = self.inner.handle(record)
            self._progress.draw()
        return bool(handled)

    def emit(self, record: logging.LogRecord) -> None:
        self.inner.emit(record)


class TerminalProgress:
    """Shows a training snapshot in the terminal until :meth:`stop`; build it with :meth:`start`."""

    def __init__(self, snapshot: Snapshot, stream: TextIO, live: bool) -> None:
        self._snapshot = snapshot
        self._stream = stream
        self.live = live
        self.lock = threading.RLock()
        self._line = ""
        self._task: asyncio.Task[None] | None = None
        self._wrapped: list[tuple[logging.Handler, _ErasingHandler]] = []

    @classmethod
    def start(
        cls, config: LoggingConfig, snapshot: Snapshot, stream: TextIO | None = None
    ) -> TerminalProgress:
        """Starts the periodic task on the running loop; ``stream`` defaults to the current stderr."""
        stream = stream if stream is not None else sys.stderr
        progress = cls(snapshot, stream, is_live_terminal(stream, config))
        if progress.live:
            progress._wrap_root_handlers()
        progress._task = asyncio.ensure_future(progress._run())
        return progress

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.live:
            self._unwrap_root_handlers()
            with self.lock:
                if self._line:  # keep the last state in the scrollback, on a line of its own
                    self.erase()
                    self._write(self._line + "\n")
                self._line = ""

    async def _run(self) -> None:
        period = LIVE_PERIOD if self.live else LOG_PERIOD
        while True:
            await asyncio.sleep(period)  # a display refresh period, not a synchronisation
            self.tick()

    def tick(self) -> None:
        """Shows the current snapshot once: redraws the line, or logs it."""
        training = self._snapshot()
        if training is None:
            return
        line = format_progress(training)
        if self.live:
            with self.lock:
                self._line = self._fit(line)
                self.draw()
        else:
            logger.info("progress: %s", line)

    def _fit(self, line: str) -> str:
        # A line wider than the terminal wraps, and then the carriage return no longer reaches its start.
        width = shutil.get_terminal_size(fallback=(120, 24)).columns - 1
        return line if len(line) <= width else line[: max(0, width - 3)] + "..."

    def erase(self) -> None:
        if self._line:
            self._write(_ERASE)

    def draw(self) -> None:
        if self._line:
            self._write(_ERASE + self._line)

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (OSError, ValueError):  # terminal gone or stream closed: nothing left to show it on
            pass

    def _wrap_root_handlers(self) -> None:
        root = logging.getLogger()
        for index, handler in enumerate(root.handlers):
            wrapper = _ErasingHandler(handler, self)
            root.handlers[index] = wrapper
            self._wrapped.append((handler, wrapper))

    def _unwrap_root_handlers(self) -> None:
        root = logging.getLogger()
        for handler, wrapper in self._wrapped:
            if wrapper in root.handlers:
                root.handlers[root.handlers.index(wrapper)] = handler
            wrapper.close()
        self._wrapped.clear()
