"""Checkpoint files of a :class:`~peerd.training.state.TrainingState`, and periodic checkpoints with resuming.

A file is ``torch.save`` of a plain dict ``{format, version: 2, fingerprint, step, tensors, meta}``, written
atomically (a temporary file, fsync, rename) and read back with ``weights_only=True`` (no pickle code runs),
then checked against the reader's template. :class:`Checkpointer` keeps the newest ``keep`` files and resumes
from the newest usable one: a truncated or foreign newest file is reported and the previous one is used.
``meta`` is what ``peerd export`` needs to write the model out without the peer: the task's config and the
names of the trainable parameters in the order of flat layouts (diloco's ``outer/shared``).

The directory is probed once at daemon start (:func:`check_directory`), so a path the peer cannot write is
refused before it trains; a write that fails later (disk full, permission taken away) costs only that checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import tempfile
from pathlib import Path
from typing import IO, Any

import torch

from peerd.config import CheckpointConfig
from peerd.errors import ConfigError, StateError
from peerd.training.state import Template, TrainingState, check_state

__all__ = ["PATTERN", "Checkpointer", "check_directory", "load_state", "read_checkpoint", "save_state"]

logger = logging.getLogger(__name__)

PATTERN = "ckpt-*.pt"
FORMAT = "peerd.training-state"
VERSION = 2


def save_state(path: Path, state: TrainingState, fingerprint: str, meta: dict[str, Any] | None = None) -> None:
    """Writes ``state`` to ``path`` atomically: readers see the old file or the new one, never half of one.
    ``meta``: plain data (strings, numbers, lists, dicts) stored beside the tensors for ``peerd export``."""
    # named by process: peers on one machine may share a directory, and two writers of one name would interleave
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as f:
            torch.save({"format": FORMAT, "version": VERSION, "fingerprint": fingerprint, "step": state.step,
                        "tensors": state.tensors, "meta": meta or {}}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):  # a half-written file on a full disk holds the space the next one needs
            partial.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)  # the rename itself survives a power cut


def read_checkpoint(file: Path | IO[bytes], source: str | None = None) -> dict[str, Any]:
    """The plain dict in a checkpoint ``file`` after checking its format and version; StateError naming
    ``source`` (default: the path) otherwise. Its tensors are not yet checked against anything."""
    source = source or str(file)
    try:
        data = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises several types (EOFError, RuntimeError, UnpicklingError, ...)
        raise StateError(f"{source}: not a readable peerd state ({type(e).__name__}: {str(e)[:200]})",
                         source=source) from e
    if not isinstance(data, dict) or not _is(data.get("format"), FORMAT):
        raise StateError(f"{source}: not a peerd training state", source=source)
    version = data.get("version")
    if _is(version, 1):
        raise StateError(f"{source}: a version-1 checkpoint (model and optimizer in one blob, written by an older "
                         f"peerd); this peerd reads version {VERSION} only: move it away and start without "
                         f"--resume, or join a swarm to download the state", source=source)
    if not _is(version, VERSION):
        raise StateError(f"{source}: state format version {_short(version)}, this peerd reads {VERSION}",
                         source=source)
    if not isinstance(data.get("tensors"), dict):
        raise StateError(f"{source}: no tensors", source=source)
    return data


def load_state(file: Path | IO[bytes], template: Template, fingerprint: str, source: str | None = None) -> TrainingState:
    """The state in ``file``, checked against ``template``; StateError naming ``source`` (default: the path)
    if it is unreadable, of another format, version or fingerprint, or does not fit the template."""
    source = source or str(file)
    data = read_checkpoint(file, source)
    if not _is(data.get("fingerprint"), fingerprint):
        raise StateError(f"{source}: state of another model/config (fingerprint {_short(data.get('fingerprint'))}, "
                         f"ours {fingerprint})", source=source)
    state = TrainingState(data.get("step"), data["tensors"])  # type: ignore[arg-type]  # check_state checks both
    check_state(state, template, source)
    return state


def check_directory(directory: Path) -> None:
    """Creates ``directory`` if needed and writes a probe file in it; ConfigError naming the path if that fails,
    so an unusable ``training.checkpoint.directory`` stops the peer at start, not at its first checkpoint."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory) as probe:
            probe.write(b"peerd")
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as e:
        reason = describe_os_error(e, directory)
        raise ConfigError(f"training.checkpoint.directory {directory} is not writable: {reason}",
                          field="training.checkpoint.directory", path=str(directory)) from e


def describe_os_error(error: OSError, named: Path) -> str:
    """``strerror (ENAME)``, plus the file the OS names when it is not ``named``, the one the message names."""
    code = errno.errorcode.get(error.errno, str(error.errno)) if error.errno is not None else "no errno"
    text = f"{error.strerror or error} ({code})"
    return f"{text} at {error.filename}" if error.filename and str(error.filename) != str(named) else text


def _is(value: Any, expected: str | int) -> bool:
    return type(value) is type(expected) and value == expected


def _short(value: Any) -> str:
    return repr(value)[:80] if isinstance(value, (str, int, float, type(None))) else type(value).__name__


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    def __init__(self, config: CheckpointConfig, directory: Path, meta: dict[str, Any] | None = None) -> None:
        """``meta``: stored in every checkpoint (:func:`save_state`)."""
        self.config = config
        self.directory = directory
        self.meta = meta

    def files(self) -> list[Path]:
        """Checkpoints, newest step first."""
        return sorted(self.directory.glob(PATTERN), reverse=True)

    def save(self, state: TrainingState, fingerprint: str) -> Path | None:
        """Writes ``state`` as the checkpoint of its step and drops all but the newest ``keep``.

        A write that fails (disk full, permission taken away) is logged as an error naming the path and errno
        and returns None: training goes on, and the older checkpoints are left as they were, so the newest
        good one is still there to resume from.
        """
        final = self.directory / f"ckpt-{state.step:09d}.pt"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            save_state(final, state, fingerprint, self.meta)
        except OSError as e:
            good = self.files()
            logger.error("Checkpoint of step %d to %s failed: %s; training goes on (newest good checkpoint: %s)",
                         state.step, final, describe_os_error(e, final), good[0] if good else "none")
            return None
        for old in self.files()[self.config.keep :]:
            try:
                old.unlink(missing_ok=True)
            except OSError as e:
                logger.warning("Could not remove the old checkpoint %s: %s", old, describe_os_error(e, old))
        return final

    def resume(self, template: Template, fingerprint: str) -> TrainingState | None:
        """The newest usable checkpoint's state; None if there is none at all, StateError listing every file's
        problem if none is usable."""
        problems = []
        for path in self.files():
            try:
                state = load_state(path, template, fingerprint)
            except (StateError, OSError) as e:
                logger.error("Checkpoint unusable, trying the previous one: %s", e)
                problems.append(str(e))
                continue
            logger.info("Resumed from %s at step %d", path, state.step)
            return state
        if problems:
            raise StateError(
                f"no usable checkpoint in {self.directory}:\n  " + "\n  ".join(problems), source=str(self.directory)
            )
        return None
