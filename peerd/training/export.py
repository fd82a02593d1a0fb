"""Trained weights out of peerd: ``peerd export`` from a checkpoint directory, and the trainer's own export at
``max_steps`` (``training.export.directory``), through one function, :func:`export_model`.

A task with an exporter of its own in the registry (the ``hf`` task: a directory ``from_pretrained`` loads)
writes its format; every other task's model state dict becomes ``model.safetensors``. Beside it, ``task.json``
holds the task's config, the fingerprint and the step. A diloco checkpoint exports the swarm's shared parameters
(``outer/shared``), not the peer's own mid-phase weights. The output directory must be new or empty, and is
written under a temporary name first, so a failed export leaves nothing half-written and overwrites nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from peerd.config import TaskConfig
from peerd.errors import ConfigError, StateError
from peerd.tasks import Task
from peerd.tasks.registry import EXPORTERS, resolve
from peerd.training.checkpoint import PATTERN, read_checkpoint
from peerd.training.state import TrainingState

__all__ = [
    "artifacts_directory",
    "check_export_directory",
    "export_checkpoint",
    "export_model",
    "export_task_state",
    "model_tensors",
    "save_artifacts",
]

TASK_FILE = "task.json"


def artifacts_directory(checkpoints: Path, fingerprint: str) -> Path:
    """Where a trainer keeps the files besides weights that an export of its task needs (a model config, a
    tokenizer), next to its checkpoints."""
    return checkpoints / f"model-{fingerprint}"


def save_artifacts(task: Task, directory: Path) -> None:
    """Writes ``task``'s export files to ``directory`` once: into a temporary sibling first, renamed into place
    unless another peer sharing the checkpoint directory got there first (the same files: same fingerprint)."""
    if directory.exists():
        return
    directory.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        task.save_artifacts(partial)
        if any(partial.iterdir()):
            os.rename(partial, directory)
    except OSError:
        if not directory.exists():
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def export_checkpoint(directory: Path, out: Path, step: int | None = None, merge: bool = False) -> Path:
    """Exports the checkpoint of ``step`` (default: the newest) in ``directory`` to ``out``; returns the file
    exported. ConfigError or StateError naming the directory, file or option for every problem."""
    if not directory.is_dir():
        raise ConfigError(f"--checkpoint {directory}: no such directory", field="--checkpoint", path=str(directory))
    files = sorted(directory.glob(PATTERN), reverse=True)
    if not files:
        raise ConfigError(f"--checkpoint {directory}: holds no checkpoint ({PATTERN})", field="--checkpoint",
                          path=str(directory))
    path = files[0]
    if step is not None:
        path = directory / f"ckpt-{step:09d}.pt"
        if not path.is_file():
            steps = ", ".join(str(int(f.stem.removeprefix("ckpt-"))) for f in files if f.stem[5:].isdigit())
            raise ConfigError(f"--step {step}: no checkpoint of that step in {directory} (steps there: {steps})",
                              field="--step")
    data = read_checkpoint(path)
    meta, fingerprint = data.get("meta"), data.get("fingerprint")
    if not isinstance(meta, dict) or not isinstance(meta.get("task"), dict) or not isinstance(fingerprint, str):
        raise StateError(f"{path}: holds no description of its task (meta.task), which an export needs",
                         source=str(path))
    tensors = model_tensors(data["tensors"], meta.get("parameters"), str(path))
    export_model(tensors, meta["task"], fingerprint, data.get("step"), artifacts_directory(directory, fingerprint),
                 out, merge)
    return path


def model_tensors(tensors: dict[str, torch.Tensor], parameters: Any, source: str) -> dict[str, torch.Tensor]:
    """The model's state dict in a checkpoint's tensors; in diloco, its trainable parameters (named in the order
    of the flat layout by ``parameters``) taken from the shared parameters ``outer/shared``."""
    model = {name.removeprefix("model/"): t for name, t in tensors.items() if name.startswith("model/")}
    shared = tensors.get("outer/shared")
    if shared is None:
        return model
    if not isinstance(parameters, list) or not all(isinstance(p, str) and p in model for p in parameters):
        raise StateError(f"{source}: the parameter names of its shared parameters are missing or do not match "
                         "its tensors", source=source)
    offset = 0
    for name in parameters:
        count = model[name].numel()
        if offset + count > shared.numel():
            break
        model[name] = shared[offset : offset + count].view_as(model[name]).clone()
        offset += count
    if offset != shared.numel() or shared.dtype != torch.float32:
        raise StateError(f"{source}: outer/shared holds {shared.numel()} values, its parameters {offset}",
                         source=source)
    return model


def export_task_state(task: Task, config: TaskConfig, state: TrainingState, out: Path, merge: bool) -> None:
    """Exports a live trainer's ``state`` (captured as for a joiner: diloco's shared parameters) of ``task``."""
    tensors = {name.removeprefix("model/"): t for name, t in state.tensors.items() if name.startswith("model/")}
    with tempfile.TemporaryDirectory(prefix="peerd-export-") as artifacts:
        task.save_artifacts(Path(artifacts))
        export_model(tensors, config.model_dump(mode="json"), task.fingerprint, state.step, Path(artifacts), out,
                     merge)


def check_export_directory(out: Path, field: str = "--out") -> None:
    """ConfigError naming ``field`` unless ``out`` is a new or empty directory whose parent can be written."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{field} {out}: exists and is not an empty directory; name a new one (nothing was "
                          "written)", field=field, path=str(out))
    parent = out.parent if not out.exists() else out
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"{field} {out}: cannot be created ({parent} is not a writable directory)", field=field,
                          path=str(out))


def export_model(tensors: dict[str, torch.Tensor], task: dict[str, Any], fingerprint: str, step: Any,
                 artifacts: Path | None, out: Path, merge: bool = False) -> None:
    """Writes the model state dict ``tensors`` of a run of ``task`` (its config as a dict) to ``out``.
    ``artifacts``: the task's saved files besides weights (:meth:`~peerd.tasks.Task.save_artifacts`)."""
    check_export_directory(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        name = str(task.get("name"))
        if name in EXPORTERS:
            resolve(EXPORTERS[name], name)(tensors, artifacts, partial, merge)
        elif merge:
            raise ConfigError(f"--merge applies to LoRA runs of the hf task, not to task {name!r}", field="--merge")
        else:
            _save_safetensors(tensors, partial / "model.safetensors")
        (partial / TASK_FILE).write_text(json.dumps({"task": task, "fingerprint": fingerprint, "step": step},
                                                    indent=2, default=str) + "\n")
        if out.exists():
            out.rmdir()  # empty, checked above
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    seen: set[int] = set()
    unshared = {}
    for name, tensor in tensors.items():  # safetensors refuses tensors that share memory (tied weights)
        pointer = tensor.untyped_storage().data_ptr()
        unshared[name] = tensor.contiguous().clone() if pointer in seen else tensor.contiguous()
        seen.add(pointer)
    save_file(unshared, str(path), metadata={"format": "pt"})
