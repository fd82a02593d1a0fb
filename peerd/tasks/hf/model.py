"""The ``hf`` task's model and tokenizer: loaded from a directory or the Hub, or built from a config, the same on
every peer; optionally wrapped in LoRA adapters; and what of them must match across the swarm (the identity)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from peerd.errors import ConfigError
from peerd.tasks.base import OPTIONS_FIELD, derive_seed, seeded_module
from peerd.tasks.hf.options import HFOptions, LoraOptions

__all__ = ["Source", "check_fit", "identity", "load_model", "load_tokenizer", "lora_config", "resolve_source"]

# Elements of each tensor that go into the weights digest: enough that two revisions of a model (which differ in
# nearly every element) never match, few enough that hashing a model of billions of parameters takes no time.
DIGEST_SAMPLES = 256
# Config keys that say where or by which version a model was saved, or how it runs, not what it is.
VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash", "use_cache")


class Source:
    """A model or tokenizer source: a local directory (``local``) or a Hub id with an optional revision."""

    def __init__(self, value: str, revision: str | None, field: str) -> None:
        path = Path(value).expanduser()
        self.field = field
        self.revision = revision
        self.local = path.is_dir()
        self.name = str(path.resolve()) if self.local else value
        if not self.local:
            if path.exists():
                raise ConfigError(f"{field}: {value} is a file, not a model directory", field=field, path=value)
            if value.startswith(("/", ".", "~")) or value.count("/") > 1 or value.endswith("/"):
                raise ConfigError(f"{field}: directory {value} does not exist", field=field, path=value)

    def failure(self, what: str, error: Exception) -> ConfigError:
        """The error of a load that failed, naming the option and why (no directory, and not on the Hub)."""
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        where = f"directory {self.name}" if self.local else (
            f"no directory {self.name!r} here and no Hub {what} of that id reachable")
        return ConfigError(f"{self.field}: could not load a {what} from {where}: {reason}", field=self.field)


def resolve_source(options: HFOptions) -> Source | None:
    return Source(options.model, options.revision, f"{OPTIONS_FIELD}.model") if options.model else None


def load_tokenizer(options: HFOptions) -> tuple[Any, Source]:
    from transformers import AutoTokenizer

    if options.tokenizer is not None:
        source = Source(options.tokenizer, options.tokenizer_revision, f"{OPTIONS_FIELD}.tokenizer")
    else:
        assert options.model is not None  # HFOptions requires a tokenizer when there is no model
        source = Source(options.model, options.revision, f"{OPTIONS_FIELD}.model")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.name, revision=source.revision)
    except Exception as e:  # OSError, ValueError, hub errors: each names the problem in its message
        raise source.failure("tokenizer", e) from e
    return tokenizer, source


def load_model(options: HFOptions, seed: int) -> torch.nn.Module:
    """The model every peer starts from: pretrained weights, or a config initialized from ``seed`` alone. Any
    weights a checkpoint lacks are initialized under the same seed too, so peers agree on them as well."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_seed = derive_seed(seed, "model")
    if options.config is not None:
        settings = dict(options.config)
        model_type = settings.pop("model_type")
        try:
            config = AutoConfig.for_model(model_type, **settings)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{OPTIONS_FIELD}.config: {e}", field=f"{OPTIONS_FIELD}.config.model_type") from e
        try:
            model = seeded_module(model_seed, lambda: AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=torch.float32))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{OPTIONS_FIELD}.config: no causal LM of this config: {e}",
                              field=f"{OPTIONS_FIELD}.config") from e
    else:
        source = resolve_source(options)
        assert source is not None
        try:
            model = seeded_module(model_seed, lambda: AutoModelForCausalLM.from_pretrained(
                source.name, revision=source.revision, dtype=torch.float32))
        except Exception as e:  # OSError, ValueError, hub errors
            raise source.failure("model", e) from e
    if options.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if options.lora is not None:
        model = _with_lora(model, options.lora, seed)
    return model  # type: ignore[no-any-return]


def lora_config(options: LoraOptions) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=options.r, lora_alpha=options.alpha, lora_dropout=options.dropout, task_type="CAUSAL_LM",
                      target_modules=options.target_modules)


def _with_lora(model: Any, options: LoraOptions, seed: int) -> Any:
    from peft import get_peft_model

    if model.is_gradient_checkpointing:
        model.enable_input_require_grads()  # the frozen embeddings' output must carry grad for checkpointing
    try:
        return seeded_module(derive_seed(seed, "lora"), lambda: get_peft_model(model, lora_config(options)))
    except ValueError as e:
        raise ConfigError(f"{OPTIONS_FIELD}.lora.target_modules: {str(e).splitlines()[0][:300]}",
                          field=f"{OPTIONS_FIELD}.lora.target_modules") from e


def base_config(model: Any) -> Any:
    """The transformers config of the (possibly LoRA-wrapped) model."""
    return model.get_base_model().config if hasattr(model, "get_base_model") else model.config


def check_fit(options: HFOptions, model: Any, tokenizer: Any, tokenizer_source: Source) -> None:
    """Refuses a tokenizer whose ids the model cannot embed and a seq_len beyond the model's positions."""
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise ConfigError(
            f"{tokenizer_source.field}: the tokenizer {tokenizer_source.name} has {len(tokenizer)} tokens, more than "
            f"the model's {embeddings} embeddings: use the model's own tokenizer, or a config with vocab_size >= "
            f"{len(tokenizer)}", field=tokenizer_source.field)
    positions = getattr(base_config(model), "max_position_embeddings", None)
    if isinstance(positions, int) and options.seq_len > positions:
        raise ConfigError(
            f"{OPTIONS_FIELD}.seq_len ({options.seq_len}) exceeds the model's max_position_embeddings ({positions}): "
            "lower seq_len", field=f"{OPTIONS_FIELD}.seq_len")


def identity(options: HFOptions, model: Any, tokenizer: Any) -> dict[str, Any]:
    """What makes two peers' models differ, beyond parameter names and shapes: where the weights come from (a Hub
    id, revision and commit; a local directory counts by content, not by path), the config, a digest of the
    weights and of the tokenizer's vocabulary, and the options that shape training. Data paths are left out
    (each machine keeps its files where it likes), as is gradient checkpointing (the same gradients, computed
    with less memory)."""
    config = {key: value for key, value in base_config(model).to_dict().items() if key not in VOLATILE_CONFIG_KEYS}
    source = resolve_source(options)
    hub = None if source is None or source.local else {
        "id": source.name, "revision": source.revision, "commit": getattr(base_config(model), "_commit_hash", None)}
    shaping = options.model_dump(exclude={"model", "revision", "tokenizer", "tokenizer_revision", "data", "config",
                                          "gradient_checkpointing"})
    return {"source": "config" if options.config is not None else "pretrained", "hub": hub, "config": config,
            "weights": weights_digest(model), "tokenizer": tokenizer_digest(tokenizer), "options": shaping}


def weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            flat = tensor.detach().reshape(-1)
            picks = torch.linspace(0, flat.numel() - 1, min(flat.numel(), DIGEST_SAMPLES)).long()
            digest.update(name.encode())
            digest.update(flat[picks].to(torch.float64).numpy().tobytes())
    return digest.hexdigest()[:32]


def tokenizer_digest(tokenizer: Any) -> str:
    vocabulary = sorted(tokenizer.get_vocab().items())
    special = sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items())
    return hashlib.sha256(json.dumps([vocabulary, special]).encode()).hexdigest()[:32]
