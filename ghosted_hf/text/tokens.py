"""Documents -> tokens: calibration and evaluation windows (`TokenBatches`) and training rows (`TrainingSequences`),
each recording the identity of the documents it read."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from ..errors import GhostedError
from ..utils.hashing import DataIdentity, batches_sha256
from .documents import Documents, TextSource, empty_text, read_documents

logger = logging.getLogger(__name__)

__all__ = ["TextSource", "TokenBatches", "TrainingSequences", "tokenize_texts", "training_sequences"]


@dataclass
class TokenBatches:
    """Calibration (or evaluation) tokens, packed into fixed-length sequences and batched."""

    batches: list[dict[str, torch.Tensor]]
    name: str
    text_sha256: str  # the `text.DataIdentity` of the documents read
    documents: int
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_tokens = int(sum(b["attention_mask"].sum() for b in self.batches))

    def token_sha256(self) -> str:
        """Hash of the batched token ids and masks: the same text, tokenizer, sequence length, number of
        sequences and batch size give the same hash (what statistics shards must agree on)."""
        return batches_sha256(self.batches, ("input_ids", "attention_mask"))

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sha256": self.text_sha256,
            "documents": self.documents,
            "tokens": self.num_tokens,
            "sequences": sum(len(b["input_ids"]) for b in self.batches),
            "sequence_length": max(b["input_ids"].shape[1] for b in self.batches),
        }


def text_tokenizer(tokenizer: Any) -> Any:
    """The tokenizer inside a multimodal model's processor (which reads text and images), or `tokenizer` itself: the
    text passes of ghosted_hf read text only."""
    return getattr(tokenizer, "tokenizer", tokenizer)


def pad_token_id(tokenizer: Any) -> int:
    """A pad id for batching; tokenizers without one (Llama) pad with EOS, which the mask hides anyway."""
    tokenizer = text_tokenizer(tokenizer)
    candidates = (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id)
    return next((int(c) for c in candidates if c is not None), 0)


def leading_token(tokenizer: Any) -> int | None:
    """The token the tokenizer puts before every text (Gemma's and Llama 3's BOS), else None. Every window is
    made to start with it: the model was trained seeing it at position 0, and a window cut from the middle of a
    document would otherwise put an arbitrary token where the model keeps its attention sink."""
    tokenizer = text_tokenizer(tokenizer)
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = tokenizer("a", add_special_tokens=True)["input_ids"] if bos is not None else []
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
    stream: list[int] = []
    for index, tokens in enumerate(token_lists):
        if index and separator is not None:
            stream.append(separator)
        stream.extend(tokens)
        if max_sequences is not None and len(stream) >= max_sequences * seq_len:
            break
    return cut_windows(stream, seq_len, prefix, partial=True)[0][:max_sequences]


def check_positions(config: Any, seq_len: int) -> None:
    """Refuse windows longer than the model has positions for (calibration and healing alike)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config  # the language decoder's
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and seq_len > positions:
        raise GhostedError(f"seq_len {seq_len} is beyond the model's {positions} positions (max_position_embeddings); "
                           "use at most that.")


def batch_sequences(sequences: list[list[int]], batch_size: int, pad_id: int) -> list[dict[str, torch.Tensor]]:
    """Right-padded batches with attention masks."""
    batches = []
    for start in range(0, len(sequences), batch_size):
        chunk = [torch.tensor(s, dtype=torch.long) for s in sequences[start : start + batch_size]]
        batches.append({"input_ids": pad_sequence(chunk, batch_first=True, padding_value=pad_id),
                        "attention_mask": pad_sequence([torch.ones_like(s) for s in chunk], batch_first=True)})
    return batches


def tokenize_texts(tokenizer: Any, text: TextSource, seq_len: int, num_sequences: int | None = None, batch_size: int = 4,
                   text_column: str = "text", *, split: str | None = None,
                   streaming: bool = False, what: str = "Calibration text") -> TokenBatches:
    """Tokenize, pack into `num_sequences` sequences of `seq_len` tokens (documents joined by EOS, every sequence
    starting with the tokenizer's BOS where it adds one) and batch them; for chat-formatted calibration, render the
    texts with the tokenizer's chat template first."""
    if seq_len < 2 or batch_size < 1:
        raise GhostedError(f"seq_len must be >= 2 and batch_size >= 1, got {seq_len} and {batch_size}.")
    tokenizer = text_tokenizer(tokenizer)
    documents, identity = read_documents(text, split=split, text_column=text_column, streaming=streaming,
                                         what=what), DataIdentity()
    name = documents.name
    # Read and tokenized lazily: packing stops reading once it has the sequences asked for.
    token_lists = (tokenizer(t, add_special_tokens=True)["input_ids"] for t in identity.read(documents.texts))
    sequences = pack_tokens(token_lists, seq_len, num_sequences, tokenizer.eos_token_id, leading_token(tokenizer))
    if not identity.documents:
        raise empty_text(what, name)
    if num_sequences is not None and len(sequences) < num_sequences:
        logger.warning("Only %d sequences of %d tokens in %s (asked for %d).", len(sequences), seq_len, name, num_sequences)
    return TokenBatches(batch_sequences(sequences, batch_size, pad_token_id(tokenizer)), name, identity.sha256,
                        identity.documents)


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
    """Documents joined by `separator` and cut into at most `max_rows` full rows of `seq_len` tokens, each starting
    with `prefix` when given (the rest is dropped: every batch then holds as many tokens, however its rows are split
    over processes or micro-batches). Reads `token_lists` only as far as those rows need, in blocks of rows."""
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
    return torch.cat(blocks)[:max_rows]


def _batches(texts: Iterable[str], largest: int = 64) -> Iterator[list[str]]:
    """Documents in batches that double up to `largest`: a fast tokenizer encodes a batch on every core, and a
    stream read only as far as it is needed is read at most about twice as far."""
    texts, size = iter(texts), 1
    while batch := list(itertools.islice(texts, size)):
        yield batch
        size = min(2 * size, largest)


def training_sequences(
    tokenizer: Any,
    corpus: Documents,
    seq_len: int,
    *,
    held_out: int,
    held_out_corpus: Documents | None = None,
    max_sequences: int | None = None,
    seed: int = 0,
) -> TrainingSequences:
    """Tokenize and pack `corpus` into sequences of `seq_len` tokens (documents joined by EOS). Without a
    `held_out_corpus`, the first documents up to `held_out` sequences are carved off as whole documents, so no
    document is in both sets. `max_sequences` bounds what is read (a streamed corpus is read only that far)."""
    identity, tokenizer = DataIdentity(), text_tokenizer(tokenizer)  # (identity: of the documents used, as read)

    def tokens(texts: Iterable[str]) -> Iterator[list[int]]:
        for batch in _batches(texts):  # a document counts once its tokens are taken
            ids = tokenizer(batch, add_special_tokens=True)["input_ids"]
            yield from (tokens for _, tokens in zip(identity.read(batch), ids))

    eos, bos = tokenizer.eos_token_id, leading_token(tokenizer)
    documents = tokens(corpus.texts)  # one stream: the held-out documents are carved off its start
    if held_out_corpus is not None:
        held = pack_rows(tokens(held_out_corpus.texts), seq_len, held_out, eos, bos)
    else:  # whole documents until `held_out` sequences are filled
        carved: list[list[int]] = []
        length = 0
        while length < held_out * seq_len and (ids := next(documents, None)) is not None:
            carved.append(ids)
            length += len(ids) + 1  # with the EOS that joins it to the next
        held = pack_rows(carved, seq_len, held_out, eos, bos)
    train = pack_rows(documents, seq_len, max_sequences, eos, bos)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    return TrainingSequences(train[order], held, corpus.name, identity.sha256, identity.documents)
