"""The ``hf`` task: a Hugging Face ``transformers`` causal LM, from a directory, the Hub or a config, trained on
local text files or a Hub data set, in full or as LoRA adapters. The libraries come with peerd's ``hf`` extra and
are imported only when this task is built, so light peers never load them."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from peerd.errors import ConfigError
from peerd.tasks.base import parse_options

__all__ = ["build_hf", "require_libraries"]


def build_hf(options: Mapping[str, Any], seed: int, shard_index: int, num_shards: int) -> Any:
    """The ``hf`` task for this shard; ConfigError naming the option or file for every bad input."""
    require_libraries()
    from peerd.tasks.hf.data import Corpus, resolve_files
    from peerd.tasks.hf.model import check_fit, identity, load_model, load_tokenizer, resolve_source
    from peerd.tasks.hf.options import HFOptions
    from peerd.tasks.hf.task import HFTask

    parsed = parse_options(HFOptions, options)
    files = resolve_files(parsed.data)  # first: a missing file is the cheapest mistake to report
    tokenizer, tokenizer_source = load_tokenizer(parsed)
    corpus = Corpus(parsed.data, files, tokenizer, parsed.seq_len, seed)
    model = load_model(parsed, seed)
    check_fit(parsed, model, tokenizer, tokenizer_source)
    task = HFTask(model, tokenizer, parsed, corpus, resolve_source(parsed), shard_index, num_shards)
    task.identity = identity(parsed, model, tokenizer)
    return task


def require_libraries() -> None:
    try:
        import datasets
        import peft  # noqa: F401 - checked here so a LoRA run does not fail later
        import transformers
    except ImportError as e:
        raise ConfigError(
            f"the hf task needs the Hugging Face libraries ({e.name} is missing): pip install 'peerd[hf]' "
            "(scripts/setup.sh installs them)", field="training.task.name") from e
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    datasets.disable_progress_bars()
    # What USE_TORCH=0 does for datasets alone (transformers needs torch): with torch in view, every streaming
    # data set puts an epoch counter in a shared-memory tensor, which goes through hivemind's torch_shm_manager;
    # one per stream opened, and freeing them after that manager has exited aborts the process. The task reads
    # arrow tables and needs none of datasets' torch integration.
    datasets.config.TORCH_AVAILABLE = False
    # Through peerd's log handler, once (datasets also prints its records with a handler of its own); its file
    # loaders log an ERROR right before raising, which the data pipeline turns into one line naming the file.
    library = logging.getLogger("datasets")
    for handler in [h for h in library.handlers if type(h) is logging.StreamHandler]:
        library.removeHandler(handler)
    datasets.utils.logging.enable_propagation()
    logging.getLogger("datasets.packaged_modules").setLevel(logging.CRITICAL)
