"""The ``hf`` task's export: a directory that ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer``
load, or for a LoRA run the adapter that ``peft`` loads (and, merging, the base model with the adapter folded
in, the adapter itself under ``adapter/``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from peerd.errors import ConfigError, StateError
from peerd.tasks.hf.task import SOURCE_FILE

__all__ = ["export_hf"]


def export_hf(tensors: dict[str, torch.Tensor], artifacts: Path | None, out: Path, merge: bool) -> None:
    """Writes the trained ``tensors`` (the model's state dict without frozen weights) with the config and
    tokenizer saved in ``artifacts`` to ``out``."""
    from peerd.tasks.hf import require_libraries

    require_libraries()
    from transformers import AutoConfig, AutoTokenizer

    if artifacts is None or not (artifacts / SOURCE_FILE).is_file():
        raise StateError(f"{artifacts}: missing; it holds the model config and tokenizer an export of the hf task "
                         "needs, written by the peer beside its checkpoints", source=str(artifacts))
    source = json.loads((artifacts / SOURCE_FILE).read_text())
    config = AutoConfig.from_pretrained(artifacts)
    tokenizer = AutoTokenizer.from_pretrained(artifacts)
    if not source.get("lora"):
        if merge:
            raise ConfigError("--merge: this run trained every weight; it has no adapters to merge", field="--merge")
        model = _skeleton(config)
        _load(model, tensors, strict=True, source=str(artifacts))
        model.save_pretrained(out)
    else:
        _export_lora(tensors, artifacts, source.get("base"), config, out, merge)
    tokenizer.save_pretrained(out)


def _export_lora(tensors: dict[str, torch.Tensor], artifacts: Path, base_source: dict[str, Any] | None,
                 config: Any, out: Path, merge: bool) -> None:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig.from_pretrained(str(artifacts))
    if base_source is not None:  # peft writes the base model's name into the adapter config: its loaders find it
        config.name_or_path = base_source["model"]
        lora.revision = base_source.get("revision")
    base = _pretrained(base_source) if merge else _skeleton(config)
    model = get_peft_model(base, lora)
    _load(model, tensors, strict=False, source=str(artifacts))
    if merge:
        model.save_pretrained(out / "adapter")
        model.merge_and_unload().save_pretrained(out)
    else:
        model.save_pretrained(out)


def _skeleton(config: Any) -> Any:
    """The model of ``config`` without weights (on the meta device): the export assigns every trained one."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]


def _pretrained(base: dict[str, Any] | None) -> Any:
    from transformers import AutoModelForCausalLM

    if base is None:
        raise ConfigError("--merge: this run's base model was built from a config, not loaded: there are no base "
                          "weights to merge the adapter into", field="--merge")
    try:
        return AutoModelForCausalLM.from_pretrained(base["model"], revision=base.get("revision"), dtype=torch.float32)
    except Exception as e:  # OSError, ValueError, hub errors
        raise ConfigError(f"--merge needs the base model the run started from, {base['model']!r}, which could not "
                          f"be loaded: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}",
                          field="--merge") from e


def _load(model: Any, tensors: dict[str, torch.Tensor], strict: bool, source: str) -> None:
    """Assigns ``tensors`` to ``model``; every one must have a place in it, and with ``strict`` every weight of
    the model must be given."""
    try:
        result = model.load_state_dict(tensors, strict=strict, assign=True)
    except RuntimeError as e:
        raise StateError(f"{source}: the checkpoint's weights do not fit the saved model config: "
                         f"{str(e).splitlines()[0][:300]}", source=source) from e
    if result.unexpected_keys:
        raise StateError(f"{source}: the checkpoint holds weights the model has no place for: "
                         f"{', '.join(result.unexpected_keys[:5])}", source=source)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
