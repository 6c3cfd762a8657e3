"""Training text the way people have it (a text file, .jsonl / .json / .parquet / .arrow / .csv, a `datasets`
folder, a Hub dataset id, or texts given in Python) -> packed, shuffled training sequences and a held-out set
that the training never sees."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .data import NamedTexts, add_to_text_hash, cut_windows, leading_token, load_texts
from .errors import GhostedError, MissingDependencyError
from .network import HUB_TIMEOUT_S, bounded_network

logger = logging.getLogger(__name__)

# file suffix -> the `datasets` builder that reads it
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise MissingDependencyError("Reading .jsonl/.parquet/.arrow files, datasets folders and Hub datasets needs "
                                     "the `datasets` package: pip install datasets.") from None
    return datasets


def _one_split(loaded: Any, split: str | None, where: str) -> Any:
    """A `DatasetDict` narrowed to `split` (or to its only split); a single dataset as it is."""
    if not hasattr(loaded, "keys"):
        return loaded
    names = list(loaded.keys())
    if split is None and len(names) == 1:
        return loaded[names[0]]
    if split is None or split not in names:
        wanted = "no split was named" if split is None else f"it has no split {split!r}"
        raise GhostedError(f"{where} has the splits {names} and {wanted}: pass --split NAME (split=).")
    return loaded[split]


def open_dataset(source: str, split: str | None = None, streaming: bool = False, what: str = "Training data") -> Any:
    """A `datasets` dataset from a data file, a folder (saved with `save_to_disk`, or of data files) or a Hub id;
    `split` defaults to "train" for data files and Hub ids."""
    datasets = _datasets()
    path = Path(source)
    if path.exists() and not (path.is_file() or path.is_dir()):
        raise GhostedError(f"{what} {source} is neither a regular file nor a folder (a FIFO or a device?): pass a "
                           "data file, a datasets folder or a Hub dataset id.")
    if path.is_file():
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise GhostedError(f"{path} is neither text nor one of {sorted(BUILDERS)}.")
        if path.stat().st_size == 0:
            raise GhostedError(f"{what} {path} is empty: give a file that holds text.")
        with reading(source):
            return datasets.load_dataset(builder, data_files=str(path), split=split or "train", streaming=streaming)
    if path.is_dir():
        with reading(source):
            if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
                return _one_split(datasets.load_from_disk(str(path)), split, str(path))
            return datasets.load_dataset(str(path), split=split or "train", streaming=streaming)
    if path.suffix.lower() in BUILDERS or source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise GhostedError(f"{what} {source} does not exist (a file, a datasets folder or a Hub dataset id).")
    check_hub_dataset(source, HUB_TIMEOUT_S)
    try:
        with bounded_network(HUB_TIMEOUT_S):
            return datasets.load_dataset(source, split=split or "train", streaming=streaming)
    except (FileNotFoundError, ConnectionError, ValueError) as error:  # the Hub's and datasets' "not found"
        raise GhostedError(f"Could not open the dataset {source!r} (split {split or 'train'!r}): {error}") from None


@contextlib.contextmanager
def reading(source: str) -> Iterator[None]:
    """What `datasets` and pyarrow raise about a file's content (their own error types, ValueError, even a bare
    StopIteration for an empty JSON-lines file) as one line naming the file and, for JSON lines, the first bad
    line."""
    try:
        yield
    except GhostedError:
        raise
    except Exception as error:  # datasets' and pyarrow's own error types, none shared
        cause = error
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        reason = next((str(e).splitlines()[0][:200] for e in (cause, error) if str(e).strip()), type(error).__name__)
        where = _bad_json_line(Path(source)) if Path(source).suffix.lower() == ".jsonl" else None
        raise GhostedError(f"Cannot read the data {source}{where or ''}: {reason}. Give a file of the format its "
                           "suffix names (one JSON object a line for .jsonl) with a text column.") from None


def _bad_json_line(path: Path) -> str | None:
    """", line N (what is wrong)" for the first line of a JSON-lines file that is no JSON object."""
    try:
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if line.strip():
                    try:
                        if not isinstance(json.loads(line), dict):
                            return f", line {number} (not a JSON object)"
                    except ValueError:
                        return f", line {number} (not valid JSON)"
    except (OSError, UnicodeDecodeError) as error:
        return f" ({type(error).__name__})"
    return None


def check_hub_dataset(source: str, timeout: float) -> None:
    """One bounded request for the dataset's Hub page before `datasets` starts its own, which it retries file by
    file for minutes when the endpoint does not answer. Offline, the local cache answers instead."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return
    try:
        HfApi().dataset_info(source, timeout=timeout)
    except RepositoryNotFoundError:
        raise GhostedError(f"There is no dataset {source!r} at {constants.ENDPOINT} (or it is private: log in with "
                           "`hf auth login`); pass --data PATH to train on a local file or folder.") from None
    except Exception as error:  # the HTTP client's own error types (timeouts, refused connections, HTTP statuses)
        raise GhostedError(f"Cannot open the Hub dataset {source!r}: {constants.ENDPOINT} could not be reached or did "
                           f"not answer within {timeout:g} s ({type(error).__name__}: {str(error)[:200]}); check the network, HF_ENDPOINT "
                           "and HF_HUB_OFFLINE, or pass --data PATH to train on a local file or folder.") from None


def _column(dataset: Any, text_column: str, source: str = "the dataset") -> Iterator[str]:
    names = dataset.column_names
    if names is not None and text_column not in names:
        raise GhostedError(f"The dataset has no {text_column!r} column (columns: {names}); pass --text-column NAME.")
    with reading(source):  # a streamed file is parsed while it is iterated
        rows = iter(dataset)
    for row in _rows(rows, source):
        text = row[text_column]
        if not isinstance(text, str):
            raise GhostedError(f"Column {text_column!r} holds {type(text).__name__} values, not text; name a text "
                               "column with --text-column.")
        if text.strip():
            yield text


def _rows(rows: Iterator[Any], source: str) -> Iterator[Any]:
    while True:
        with reading(source):
            row = next(rows, None)
        if row is None:
            return
        yield row


@dataclass
class Corpus:
    """Documents as a (possibly lazy) iterator, with a name for reports."""

    texts: Iterable[str]
    name: str


def read_corpus(source: Any, *, split: str | None = None, text_column: str = "text",
                streaming: bool = False, what: str = "Training data") -> Corpus:
    """Documents from any source `heal` accepts. A plain text file (one document per blank-line-separated block),
    a list of strings and an in-memory `datasets.Dataset` read as calibration text does; data files, folders and
    Hub ids go through `datasets` (streamed with `streaming`: read only as far as needed)."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        is_text = path.is_file() and path.suffix.lower() not in BUILDERS
        if is_text and (split is not None or text_column != "text"):
            raise GhostedError(f"{what} {path} is a text file (one document per blank-line-separated block): split "
                               "and text_column apply to datasets; leave them out.")
        if not is_text:
            dataset = open_dataset(str(source), split, streaming, what)
            return Corpus(_column(dataset, text_column, str(source)), str(source))
    if hasattr(source, "column_names") and not hasattr(source, "__len__"):  # an IterableDataset
        return Corpus(_column(source, text_column), type(source).__name__)
    texts, name = load_texts(source, text_column, what)
    return Corpus(NamedTexts(texts, name), name)


@dataclass
class TrainingSequences:
    """Packed token sequences of one length, as (sequences, seq_len) int32 rows: the training set (shuffled) and
    the held-out set (whole documents the training never sees), with what identifies them in the provenance. Rows
    of a tensor, not lists of Python ints: those cost about 36 bytes a token, these 4."""

    train: torch.Tensor
    held_out: torch.Tensor
    name: str
    text_sha256: str
    documents: int

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.text_sha256, "documents": self.documents,
                "sequence_length": self.train.shape[1], "train_sequences": len(self.train),
                "held_out_sequences": len(self.held_out)}


def pack_rows(token_lists: Iterable[list[int]], seq_len: int, max_rows: int | None, separator: int,
              prefix: int | None = None) -> torch.Tensor:
    """Documents joined by `separator` and cut into full rows of `seq_len` tokens, each starting with `prefix` when
    given (`data.leading_token`; the rest is dropped: every batch then holds as many tokens, however its rows are
    split over processes or micro-batches), at most `max_rows`. Reads `token_lists` only as far as those rows
    need; finished rows are moved out of Python lists in blocks."""
    blocks: list[torch.Tensor] = [torch.empty(0, seq_len, dtype=torch.int32)]
    stream: list[int] = []

    def move_full_rows() -> None:
        rows, used = cut_windows(stream, seq_len, prefix, partial=False)
        blocks.append(torch.tensor(rows, dtype=torch.int32).view(-1, seq_len))
        del stream[:used]

    rows = 0
    block = max(1, (1 << 20) // seq_len) * seq_len  # about a million tokens per block
    for index, tokens in enumerate(token_lists):
        if index:
            stream.append(separator)
        stream.extend(tokens)
        if len(stream) >= block:
            move_full_rows()
            rows += len(blocks[-1])
        if max_rows is not None and rows + len(stream) // seq_len >= max_rows:
            break
    move_full_rows()
    packed = torch.cat(blocks)
    return packed if max_rows is None else packed[:max_rows]


def _batches(texts: Iterable[str], largest: int = 64) -> Iterator[list[str]]:
    """Documents in batches that double up to `largest`: a fast tokenizer encodes a batch on every core, and a
    stream read only as far as it is needed is read at most about twice as far."""
    texts, size = iter(texts), 1
    while batch := list(itertools.islice(texts, size)):
        yield batch
        size = min(2 * size, largest)


def training_sequences(
    tokenizer: Any,
    corpus: Corpus,
    seq_len: int,
    *,
    held_out: int,
    held_out_corpus: Corpus | None = None,
    max_sequences: int | None = None,
    seed: int = 0,
) -> TrainingSequences:
    """Tokenize and pack `corpus` into sequences of `seq_len` tokens (documents joined by EOS). Without a
    `held_out_corpus`, the first documents up to `held_out` sequences are carved off as whole documents, so no
    document is in both sets. `max_sequences` bounds what is read (a streamed corpus is read only that far)."""
    digest, read = hashlib.sha256(), 0  # `data.text_hash` of the documents used, kept as they are used

    def tokens(texts: Iterable[str]) -> Iterator[list[int]]:
        nonlocal read
        for batch in _batches(texts):
            for text, ids in zip(batch, tokenizer(batch, add_special_tokens=True)["input_ids"]):
                add_to_text_hash(digest, text)
                read += 1
                yield ids

    eos, bos = tokenizer.eos_token_id, leading_token(tokenizer)
    documents = tokens(corpus.texts)  # one stream: the held-out documents are carved off its start
    if held_out_corpus is not None:
        held = pack_rows(tokens(held_out_corpus.texts), seq_len, held_out, eos, bos)
    elif held_out:  # whole documents until `held_out` sequences are filled
        carved: list[list[int]] = []
        length = 0
        for ids in documents:
            carved.append(ids)
            length += len(ids) + 1  # with the EOS that joins it to the next
            if length >= held_out * seq_len:
                break
        held = pack_rows(carved, seq_len, held_out, eos, bos)
    else:
        held = torch.empty(0, seq_len, dtype=torch.int32)
    train = pack_rows(documents, seq_len, max_sequences, eos, bos)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    return TrainingSequences(train[order], held, corpus.name, digest.hexdigest(), read)
