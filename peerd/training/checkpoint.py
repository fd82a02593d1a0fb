"""Periodic, atomic checkpoints (write to a temporary file, fsync, rename) and resuming from the newest
usable one: a truncated or foreign newest file is reported and the previous one is used instead."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from peerd.config import CheckpointConfig
from peerd.errors import StateError
from peerd.training.state import unpack_state

logger = logging.getLogger(__name__)

PATTERN = "ckpt-*.pt"


class Checkpointer:
    def __init__(self, config: CheckpointConfig, directory: Path) -> None:
        self.config = config
        self.directory = directory

    def files(self) -> list[Path]:
        """Checkpoints, newest step first."""
        return sorted(self.directory.glob(PATTERN), reverse=True)

    def save(self, blob: bytes, step: int) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"ckpt-{step:09d}.pt"
        partial = final.with_suffix(".pt.partial")
        with open(partial, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, final)  # readers see the old file or the new one, never half of one
        for old in self.files()[self.config.keep :]:
            old.unlink(missing_ok=True)
        return final

    def resume(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, fingerprint: str) -> int | None:
        """Loads the newest usable checkpoint and returns its step; None if there is none at all."""
        problems = []
        for path in self.files():
            try:
                step = unpack_state(path.read_bytes(), model, optimizer, fingerprint, source=str(path))
            except (StateError, OSError) as e:
                logger.error("Checkpoint unusable, trying the previous one: %s", e)
                problems.append(str(e))
                continue
            logger.info("Resumed from %s at step %d", path, step)
            return step
        if problems:
            raise StateError(
                f"no usable checkpoint in {self.directory}:\n  " + "\n  ".join(problems), source=str(self.directory)
            )
        return None
