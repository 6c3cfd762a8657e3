"""Calibration text -> token batches, with the token count and a hash that identify the data in reports."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import GhostedError, MissingFileError

logger = logging.getLogger(__name__)

TextSource = str | os.PathLike | Iterable[str] | Any  # text file, list of strings, or a datasets.Dataset

@dataclass
class TokenBatches:
    """Calibration (or evaluation) tokens, packed into fixed-length sequences and batched."""

    batches: list[dict[str, torch.Tensor]]
    name: str
    text_sha256: str
    num_texts: int
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = int(sum(b["attention_mask"].sum() for b in self.batches))

    def token_sha256(self) -> str:
        """Hash of the batched token ids and masks: the same text, tokenizer, sequence length, number of
        sequences and batch size give the same hash (what statistics shards must agree on)."""
        digest = hashlib.sha256()
        for b in self.batches:
            for key in ("input_ids", "attention_mask"):
                tensor = b[key].to(torch.int64).contiguous()
                digest.update(str(tuple(tensor.shape)).encode())
                digest.update(tensor.numpy().tobytes())
        return digest.hexdigest()

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sha256": self.text_sha256,
            "texts": self.num_texts,
            "tokens": self.num_tokens,
            "sequences": sum(len(b["input_ids"]) for b in self.batches),
            "sequence_length": max(b["input_ids"].shape[1] for b in self.batches),
        }


class NamedTexts(list):
    """A list of documents that carries a display name into reports (e.g. the packaged corpus)."""

    def __init__(self, texts: Iterable[str], name: str) -> None:
        super().__init__(texts)
        self.name = name


def _read_text_file(path: Path, what: str = "Calibration") -> list[str]:
    if path.is_dir():
        raise MissingFileError(f"{what} path {path} is a folder; pass a text file (documents separated by blank "
                               "lines), a list of strings or a datasets.Dataset.")
    if path.exists() and not path.is_file():
        raise GhostedError(f"{what} file {path} is not a regular file (a FIFO or a device?); pass a text file.")
    if not path.is_file():
        raise MissingFileError(f"{what} file {path} does not exist (pass a text file, a list of strings or a Dataset).")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise GhostedError(f"{what} file {path} is not UTF-8 text ({error.reason} at byte {error.start}); "
                           "convert it to UTF-8.") from None
    return [b for b in (block.strip() for block in content.split("\n\n")) if b]


def load_texts(text: TextSource, text_column: str = "text", what: str = "Calibration") -> tuple[list[str], str]:
    """Texts and a display name from a text file (one document per blank-line-separated block), a list
    of strings, or a `datasets.Dataset` with a text column; `what` the text is for, in messages."""
    if isinstance(text, str) and ("\n" in text or len(text) > 255):  # longer than any file name
        raise GhostedError(
            f"The calibration text is one string of {len(text)} characters that is not a file path: pass a "
            "list of strings (e.g. [text]) for text, or the path of a text file."
        )
    if isinstance(text, (str, os.PathLike)):
        path = Path(text)
        return _read_text_file(path, what), path.name
    if isinstance(text, (bytes, Mapping)) or not isinstance(text, Iterable):
        raise GhostedError(
            f"Calibration text must be a list of strings, a text file path or a datasets.Dataset, got a "
            f"{type(text).__name__}" + (" (for a dict of columns, use datasets.Dataset.from_dict)." if isinstance(text, Mapping) else ".")
        )
    column_names = getattr(text, "column_names", None)
    if column_names is not None:
        if text_column not in column_names:
            raise GhostedError(f"The dataset has no {text_column!r} column (columns: {column_names}); pass text_column=.")
        name = getattr(getattr(text, "info", None), "dataset_name", None) or "datasets.Dataset"
        return [t for t in text[text_column] if t and t.strip()], name
    texts = list(text)
    bad = next((t for t in texts if not isinstance(t, str)), None)
    if bad is not None:
        raise GhostedError(f"Calibration texts must be strings, got a {type(bad).__name__}: {bad!r:.60}.")
    name = getattr(text, "name", None) or f"{len(texts)} texts given as a list of strings"
    return [t for t in texts if t.strip()], name


def check_not_empty(texts: list[str], name: str) -> None:
    """Refuse calibration text that holds no text at all."""
    if not texts:
        raise GhostedError(f"The calibration text ({name}) is empty: provide at least a few paragraphs of text.")


def add_to_text_hash(digest: Any, text: str) -> None:
    """One text more in a `text_hash` digest (for texts hashed as they are read)."""
    digest.update(text.encode("utf-8"))
    digest.update(b"\x00")


def text_hash(texts: list[str]) -> str:
    """sha256 of the texts joined by NUL bytes: identifies the calibration text in reports."""
    digest = hashlib.sha256()
    for text in texts:
        add_to_text_hash(digest, text)
    return digest.hexdigest()


def pad_token_id(tokenizer: Any) -> int:
    """A pad id for batching; tokenizers without one (Llama) pad with EOS, which the mask hides anyway."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


def leading_token(tokenizer: Any) -> int | None:
    """The token the tokenizer puts before every text (Gemma's and Llama 3's BOS), else None. Every window is
    made to start with it: the model was trained seeing it at position 0, and a window cut from the middle of a
    document would otherwise put an arbitrary token where the model keeps its attention sink."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


def cut_windows(stream: list[int], seq_len: int, prefix: int | None, partial: bool) -> tuple[list[list[int]], int]:
    """(windows of `seq_len` tokens cut from the start of `stream`, tokens of it consumed). Each window starts
    with `prefix` (added unless the window begins with it already, at a document's start); `partial`: the last,
    shorter window too."""
    windows, at = [], 0
    while at < len(stream):
        lead = [prefix] if prefix is not None and stream[at] != prefix else []
        take = seq_len - len(lead)
        if at + take > len(stream) and not partial:
            break
        windows.append(lead + stream[at : at + take])
        at = min(at + take, len(stream))
    return windows, at


def pack_tokens(
    token_lists: Iterable[list[int]],
    seq_len: int,
    max_sequences: int | None,
    separator: int | None,
    prefix: int | None = None,
) -> list[list[int]]:
    """Concatenate documents (separated by `separator`) and cut them into sequences of `seq_len`, each starting
    with `prefix` when given (`leading_token`); the last one may be shorter. Reads `token_lists` only as far as
    the sequences asked for need (it may be lazy)."""
    needed = None if max_sequences is None else max_sequences * seq_len
    stream: list[int] = []
    for index, tokens in enumerate(token_lists):
        if index and separator is not None:
            stream.append(separator)
        stream.extend(tokens)
        if needed is not None and len(stream) >= needed:
            break
    sequences, _ = cut_windows(stream, seq_len, prefix, partial=True)
    return sequences[:max_sequences] if max_sequences is not None else sequences


def batch_sequences(sequences: list[list[int]], batch_size: int, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """Right-padded batches with attention masks."""
    batches = []
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(len(s) for s in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, seq in enumerate(chunk):
            input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            attention_mask[row, : len(seq)] = 1
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask})
    return batches


def tokenize_texts(
    tokenizer: Any,
    text: TextSource,
    seq_len: int,
    num_sequences: int | None = None,
    batch_size: int = 4,
    text_column: str = "text",
    shuffle_seed: int | None = None,
) -> TokenBatches:
    """Tokenize, pack into `num_sequences` sequences of `seq_len` tokens (documents joined by EOS, every
    sequence starting with the tokenizer's BOS where it adds one) and batch them. Chat-formatted calibration is the caller's choice: render the texts with the tokenizer's chat
    template first. `shuffle_seed`: shuffle the sequences before batching (for training: packed in order, a batch would hold one
    document's consecutive windows, and a short run would see only the first documents)."""
    if seq_len < 2 or batch_size < 1:
        raise GhostedError(f"seq_len must be >= 2 and batch_size >= 1, got {seq_len} and {batch_size}.")
    texts, name = load_texts(text, text_column)
    check_not_empty(texts, name)
    # Tokenized lazily: packing stops reading once it has the sequences asked for.
    token_lists = (tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts)
    sequences = pack_tokens(token_lists, seq_len, num_sequences, tokenizer.eos_token_id, leading_token(tokenizer))
    if num_sequences is not None and len(sequences) < num_sequences:
        logger.warning("Only %d sequences of %d tokens in %s (asked for %d).", len(sequences), seq_len, name, num_sequences)
    if shuffle_seed is not None:
        order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(shuffle_seed))
        sequences = [sequences[i] for i in order]
    return TokenBatches(batch_sequences(sequences, batch_size, pad_token_id(tokenizer)), name, text_hash(texts), len(texts))
