"""Training progress in the terminal: a live line on stderr, or periodic log records.

On a terminal (stderr is a TTY and logs are text) one line shows step, loss, samples/s and peers, redrawn
every second by a ``rich`` live display; log records written to that terminal are printed above it, so the
two never share a line. Anywhere else (a file, a pipe, ``--log-format json``) no line is drawn at all: a
normal log record every ``LOG_PERIOD`` seconds says the same, so it is formatted like every other record
(a JSON line in JSON mode) and no carriage return or escape code ever reaches a log file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TextIO

from peerd.config import LoggingConfig

if TYPE_CHECKING:  # imported when a line goes live: a daemon in a pipe does not need rich's modules in memory
    from rich.console import Console
    from rich.live import Live

logger = logging.getLogger(__name__)

LIVE_PERIOD = 1.0
LOG_PERIOD = 10.0

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
         f"(swarm {_fmt(training.get('swarm_samples_per_second'), '.1f')})"
         + (f", {_fmt(training.get('tokens_per_second'), '.0f')} tokens/s" if training.get("tokens_per_second")
            else "")),
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


class _AboveLine:
    """The stream of a log handler while the line is live: each write, one whole record as ``StreamHandler``
    writes it, is printed above the line, in the handler's own format."""

    def __init__(self, console: Console) -> None:
        from rich.text import Text

        self._console, self._text = console, Text

    def write(self, text: str) -> None:
        # soft_wrap: the terminal wraps a long record, as before; rich would break it at words with newlines
        self._console.print(self._text(text), end="", soft_wrap=True)

    def flush(self) -> None:
        pass


class TerminalProgress:
    """Shows a training snapshot in the terminal until :meth:`stop`; build it with :meth:`start`."""

    def __init__(self, snapshot: Snapshot, display: Live | None) -> None:
        self._snapshot = snapshot
        self._display = display
        self._task: asyncio.Task[None] | None = None
        self._redirected: list[tuple[logging.StreamHandler[Any], Any]] = []

    @property
    def live(self) -> bool:
        return self._display is not None

    @classmethod
    def start(
        cls, config: LoggingConfig, snapshot: Snapshot, stream: TextIO | None = None
    ) -> TerminalProgress:
        """Starts the periodic task on the running loop; ``stream`` defaults to the current stderr."""
        stream = stream if stream is not None else sys.stderr
        display = None
        if is_live_terminal(stream, config):
            from rich.console import Console
            from rich.live import Live

            # Forced: the decision is is_live_terminal's alone; rich's own (FORCE_COLOR, TTY_INTERACTIVE...)
            # could differ and then draw into a pipe, or draw nothing until the end.
            console = Console(file=stream, force_terminal=True, force_interactive=True)
            display = Live(console=console, auto_refresh=False, redirect_stdout=False, redirect_stderr=False)
        progress = cls(snapshot, display)
        if display is not None:
            progress._go_live(display, stream)
        progress._task = asyncio.ensure_future(progress._run())
        return progress

    def _go_live(self, display: Live, stream: TextIO) -> None:
        _quiet(display.start)
        # rich hides the cursor while live; a daemon killed outright would leave the user's terminal so
        _quiet(lambda: display.console.show_cursor(True))
        above = _AboveLine(display.console)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
                self._redirected.append((handler, handler.setStream(above)))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for handler, stream in self._redirected:
            handler.setStream(stream)
        self._redirected.clear()
        if self._display is not None:
            _quiet(self._display.stop)  # keeps the last state in the scrollback, on a line of its own

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
        if self._display is not None:
            # cut at the terminal's width: a wrapped line could no longer be redrawn in place
            from rich.text import Text

            display, text = self._display, Text(line, no_wrap=True, overflow="ellipsis")
            _quiet(lambda: display.update(text, refresh=True))
        else:
            logger.info("progress: %s", line)


def _quiet(draw: Callable[[], object]) -> None:
    try:
        draw()
    except (OSError, ValueError):  # terminal gone or stream closed: nothing left to show it on
        pass
