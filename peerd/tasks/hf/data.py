"""The ``hf`` task's text: files or a Hub data set, streamed through ``datasets``, tokenized, packed, dealt.

Every peer reads the same records in the same order: the files in the order given (each glob sorted), a record
per JSON line or Parquet row (its ``field``), or per block of whole lines of plain text (about
``text_block_chars``), or the Hub data set's rows. Every ``val_every``-th record from the start, as many as it
takes to pack ``val_batches * batch_size`` sequences, holds the validation set, identical on every peer; the
other records are numbered in order and dealt round-robin, training record ``j`` to shard ``j % num_shards``, so
shards are disjoint from each other and from validation. A peer tokenizes only its own records, packs their tokens (an end-of-text token after each JSON
or Parquet record) into ``seq_len`` sequences and shuffles them in a bounded buffer; nothing holds more than that buffer,
so a corpus of any size streams. Every epoch replays the shard, reshuffled.
"""

from __future__ import annotations

import glob
import itertools
import os
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from peerd.errors import ConfigError
from peerd.tasks.base import OPTIONS_FIELD, derive_seed
from peerd.tasks.hf.options import STDLIB, DataOptions

__all__ = ["Corpus", "resolve_files"]

FIELD = f"{OPTIONS_FIELD}.data"
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
ROWS_PER_READ = 1024
TOKENIZE_RECORDS = 64  # records per call of the tokenizer: its batched call is several times faster than one by one
Record = tuple[str, bool]  # text, and whether it ends a document


def resolve_files(options: DataOptions) -> list[tuple[Path, str]]:
    """Every data file with its format, in reading order; ConfigError naming the pattern or file that is
    missing or empty, so a typo stops the peer before it trains. Empty files a glob matches are skipped (a
    tree of sources has its empty ``__init__.py`` files), unless it matches nothing else."""
    found: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for pattern in options.files:
        expanded = os.path.expanduser(pattern.replace(STDLIB, sysconfig.get_paths()["stdlib"]))
        if glob.has_magic(expanded):
            matched = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
            paths = [path for path in matched if path.stat().st_size > 0]
            if not paths:
                what = "only empty files" if matched else "no file"
                raise ConfigError(f"{FIELD}.files: {pattern!r} matches {what}", field=f"{FIELD}.files")
        else:
            paths = [Path(expanded)]
        for path in paths:
            if not path.is_file():
                what = "is not a file" if path.exists() else "does not exist"
                raise ConfigError(f"data file {path} {what} ({FIELD}.files)", field=f"{FIELD}.files", path=str(path))
            if path.stat().st_size == 0:
                raise ConfigError(f"data file {path} is empty ({FIELD}.files)", field=f"{FIELD}.files", path=str(path))
            if path not in seen:
                seen.add(path)
                fmt = options.format if options.format != "auto" else FORMATS.get(path.suffix.lower(), "text")
                found.append((path, fmt))
    return found


class Corpus:
    """The records of the configured data, tokenized and packed into sequences; see the module docstring."""

    def __init__(self, options: DataOptions, files: list[tuple[Path, str]], tokenizer: Any, seq_len: int,
                 seed: int) -> None:
        """``files``: :func:`resolve_files` of ``options`` (empty for a Hub data set)."""
        self.options = options
        self.files = files
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.seed = seed
        self.eos: list[int] = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.last_held_out = -1  # the last record of the validation set, set by validation()

    # --- records ------------------------------------------------------------------------------------------------

    def records(self) -> Iterator[Record]:
        if self.options.dataset is not None:
            yield from self._hub_records()
            return
        # one stream per run of files of one format: a builder per file would cost more than reading small files
        for fmt, run in itertools.groupby(self.files, key=lambda item: item[1]):
            paths = [path for path, _ in run]
            try:
                yield from self._text_blocks(paths) if fmt == "text" else self._field_values(paths, fmt)
            except (GeneratorExit, ConfigError):
                raise
            except Exception as e:  # pyarrow, json and datasets raise many types for a malformed file
                raise self._locate(paths, fmt, e) from e

    def _open(self, paths: list[Path], fmt: str) -> Iterator[dict[str, list[Any]]]:
        """The rows of ``paths`` as columns, a thousand rows at a time."""
        import datasets

        extra: dict[str, Any] = {}
        if fmt == "text":
            extra = {"keep_linebreaks": True, "encoding_errors": self.options.encoding_errors}
        stream = datasets.load_dataset(fmt, data_files=[str(p) for p in paths], split="train", streaming=True,
                                       **extra)
        # arrow tables: datasets' own rows cost a Python dict each, over ten times the reading itself
        for table in stream.with_format("arrow").iter(batch_size=ROWS_PER_READ):
            yield table.to_pydict()

    def _text_blocks(self, paths: list[Path]) -> Iterator[Record]:
        parts: list[str] = []
        size = 0
        for columns in self._open(paths, "text"):
            for line in columns["text"]:
                parts.append(line)
                size += len(line)
                if size >= self.options.text_block_chars:
                    yield "".join(parts), False
                    parts, size = [], 0
        if parts:
            yield "".join(parts), False

    def _field_values(self, paths: list[Path], fmt: str) -> Iterator[Record]:
        for columns in self._open(paths, fmt):
            values = columns.get(self.options.field)
            if values is None or not all(isinstance(value, str) for value in values):
                raise self._locate(paths, fmt, None)
            for value in values:
                yield value, True

    def _locate(self, paths: list[Path], fmt: str, error: Exception | None) -> ConfigError:
        """The error naming the file (and record) of a run that failed: each file of it read alone."""
        field = self.options.field
        for path in paths:
            try:
                rows = (row for columns in self._open([path], fmt) for row in _rows(columns))
                for number, row in enumerate(rows, start=1):
                    if fmt != "text" and not isinstance(row.get(field), str):
                        problem = (f"has no field {field!r} (its fields: {', '.join(map(str, row))})"
                                   if row.get(field) is None else f"has a {type(row[field]).__name__} in "
                                   f"field {field!r}, not text")
                        return ConfigError(f"data file {path}: record {number} {problem} ({FIELD}.field)",
                                           field=f"{FIELD}.field", path=str(path))
            except Exception as e:  # noqa: BLE001 - whatever it is, it is this file's, and the message says so
                hint = f" ({FIELD}.encoding_errors: replace reads on)" if isinstance(e, UnicodeDecodeError) else ""
                return ConfigError(f"data file {path}: not readable as {fmt}: {_first_line(e)}{hint}",
                                   field=f"{FIELD}.files", path=str(path))
        names = ", ".join(str(path) for path in paths[:3]) + (", ..." if len(paths) > 3 else "")
        return ConfigError(f"data files {names}: not readable as {fmt}: {_first_line(error)}", field=f"{FIELD}.files")

    def _hub_records(self) -> Iterator[Record]:
        import datasets

        options, field = self.options, self.options.field
        try:
            stream = datasets.load_dataset(options.dataset, name=options.dataset_config, split=options.split,
                                           revision=options.revision, streaming=True)
            for number, row in enumerate(stream, start=1):
                value = row.get(field)
                if not isinstance(value, str):
                    raise ConfigError(f"{FIELD}.dataset {options.dataset!r}: row {number} has no text field "
                                      f"{field!r} (its fields: {', '.join(map(str, row))})", field=f"{FIELD}.field")
                yield value, True
        except (GeneratorExit, ConfigError):
            raise
        except Exception as e:  # offline, unknown id, gated: datasets raises many types
            raise ConfigError(f"{FIELD}.dataset {options.dataset!r} could not be read: {_first_line(e)}",
                              field=f"{FIELD}.dataset") from e

    # --- tokens and sequences ---------------------------------------------------------------------------------

    def _tokens(self, records: Iterable[Record]) -> Iterator[list[int]]:
        """Token ids per record, an end-of-text token after each document; tokenized in batches."""
        batch: list[Record] = []
        for record in records:
            batch.append(record)
            if len(batch) == TOKENIZE_RECORDS:
                yield from self._tokenize(batch)
                batch = []
        if batch:
            yield from self._tokenize(batch)

    def _tokenize(self, batch: list[Record]) -> Iterator[list[int]]:
        ids = self.tokenizer([text for text, _ in batch], add_special_tokens=False)["input_ids"]
        for tokens, (_, ends) in zip(ids, batch, strict=True):
            yield tokens + self.eos if ends else tokens

    def _pack(self, token_lists: Iterable[list[int]]) -> Iterator[list[int]]:
        buffer: list[int] = []
        for tokens in token_lists:
            buffer.extend(tokens)
            if len(buffer) >= self.seq_len:
                whole = len(buffer) - len(buffer) % self.seq_len
                for at in range(0, whole, self.seq_len):
                    yield buffer[at : at + self.seq_len]
                del buffer[:whole]

    def validation(self, count: int) -> torch.Tensor:
        """``count`` sequences, ``(count, seq_len)``, from every ``val_every``-th record of the data from the start
        (spread over the corpus, not only its first file); remembers the last record they took, so that training
        never reads those records."""
        last = -1

        def tokens() -> Iterator[list[int]]:
            nonlocal last
            for index, record in enumerate(self.records()):  # one at a time: the next ones stay unread
                if index % self.options.val_every == 0:
                    last = index
                    yield from self._tokenize([record])

        sequences = list(itertools.islice(self._pack(tokens()), count))
        if len(sequences) < count:
            raise ConfigError(
                f"the data holds {len(sequences)} sequences of seq_len {self.seq_len} for validation (every "
                f"{self.options.val_every}th record), fewer than the {count} the validation set needs (val_batches "
                f"x batch_size): add data, or lower {OPTIONS_FIELD}.val_batches, {OPTIONS_FIELD}.seq_len or "
                f"{FIELD}.val_every", field=f"{OPTIONS_FIELD}.val_batches"
            )
        self.last_held_out = last
        return torch.tensor(sequences, dtype=torch.long)

    def held_out(self, index: int) -> bool:
        """Whether record ``index`` belongs to the validation set (only once :meth:`validation` has run)."""
        return index % self.options.val_every == 0 and index <= self.last_held_out

    def train_sequences(self, shard: int, num_shards: int, epoch: int) -> Iterator[list[int]]:
        """This shard's sequences for one epoch, shuffled within the buffer: the training records (all but the
        held-out ones, numbered in order) whose number is ``shard`` modulo ``num_shards``."""
        def dealt() -> Iterator[Record]:
            training = itertools.count()
            for index, record in enumerate(self.records()):
                if not self.held_out(index) and next(training) % num_shards == shard:
                    yield record

        generator = torch.Generator().manual_seed(derive_seed(self.seed, "shuffle", shard, epoch))
        yield from shuffled(self._pack(self._tokens(dealt())), self.options.shuffle_buffer, generator)


def shuffled(items: Iterable[list[int]], buffer_size: int, generator: torch.Generator) -> Iterator[list[int]]:
    """``items`` in a random order drawn from ``generator``, holding at most ``buffer_size`` of them at once."""
    buffer: list[list[int]] = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        at = int(torch.randint(buffer_size, (1,), generator=generator))
        buffer[at], item = item, buffer[at]
        yield item
    while buffer:
        at = int(torch.randint(len(buffer), (1,), generator=generator))
        buffer[at], buffer[-1] = buffer[-1], buffer[at]
        yield buffer.pop()


def _rows(columns: dict[str, list[Any]]) -> Iterator[dict[str, Any]]:
    names = list(columns)
    for values in zip(*(columns[name] for name in names), strict=True):
        yield dict(zip(names, values, strict=True))


def _first_line(error: BaseException | None) -> str:
    if error is None:
        return "no further detail"
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
