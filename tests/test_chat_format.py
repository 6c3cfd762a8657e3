"""Calibration text packing: plain (documents joined by EOS) and in the tokenizer's chat template
(calibration_format="chat")."""

from __future__ import annotations

import random

import pytest

from ghosted_hf import ghost_prune
from ghosted_hf.data import CHAT_PROMPT, chat_turn_tokens, pack_tokens, tokenize_texts
from ghosted_hf.errors import GhostedError
from ghosted_hf.summary import render_text, summarize
from tiny import build, char_tokenizer, texts

CHATML = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
          "{% endfor %}")


def chat_tokenizer():
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHATML
    return tokenizer


def test_every_sequence_is_whole_conversations_in_the_template() -> None:
    tokenizer = chat_tokenizer()
    documents = ["a" * 60, "b" * 10, "c" * 400]
    data = tokenize_texts(tokenizer, documents, 160, batch_size=2, text_format="chat")
    before, after = chat_turn_tokens(tokenizer)
    prefix = f"<|user|>{CHAT_PROMPT}<|end|><|assistant|>"
    assert tokenizer.decode(before) == prefix and tokenizer.decode(after) == "<|end|>"
    rows = [ids[mask.bool()].tolist() for b in data.batches for ids, mask in zip(b["input_ids"], b["attention_mask"])]
    # full sequences, except where too little room was left for another conversation (and the last one)
    overhead = len(before) + len(after)
    assert all(160 - overhead <= len(row) <= 160 for row in rows[:-1]) and sum(len(row) == 160 for row in rows) >= 3
    decoded = [tokenizer.decode(row) for row in rows]
    for text in decoded:  # each sequence starts a conversation and ends one: nothing is cut
        assert text.startswith(prefix) and text.endswith("<|end|>")
    # the documents, in order and complete, once the template is taken out
    content = "".join(text.replace(prefix, "").replace("<|end|>", "") for text in decoded)
    assert content == "".join(documents)
    # a short document shares its sequence with the start of the next one, both in whole conversations
    assert any(text.count(prefix) == 2 for text in decoded)
    assert data.describe()["format"] == "chat"


def test_plain_format_is_unchanged_and_chat_differs() -> None:
    tokenizer = chat_tokenizer()
    plain = tokenize_texts(tokenizer, texts(4), 96)
    assert plain.describe()["format"] == "plain"
    assert "<|assistant|>" not in tokenizer.decode(plain.batches[0]["input_ids"][0])
    chat = tokenize_texts(tokenizer, texts(4), 96, text_format="chat")
    assert chat.token_sha256() != plain.token_sha256() and chat.text_sha256 == plain.text_sha256


def test_chat_format_errors_clearly() -> None:
    with pytest.raises(GhostedError, match="The tokenizer has no chat template"):
        tokenize_texts(char_tokenizer(), texts(2), 48, text_format="chat")
    with pytest.raises(GhostedError, match="leaves no room for text inside the chat template"):
        tokenize_texts(chat_tokenizer(), texts(2), 20, text_format="chat")
    with pytest.raises(GhostedError, match="Unknown text format 'html'"):
        tokenize_texts(chat_tokenizer(), texts(2), 48, text_format="html")
    with pytest.raises(GhostedError, match="Unknown calibration_format 'html'; choose one of: plain, chat"):
        ghost_prune(build("llama"), chat_tokenizer(), texts(2), calibration_format="html")


def test_ghost_prune_records_the_chat_format() -> None:
    ghosted = ghost_prune(build("qwen3"), chat_tokenizer(), texts(), num_layers=2, calibration_format="chat",
                          seq_len=64, num_sequences=8, batch_size=4)
    provenance = ghosted.config.ghost_provenance
    assert provenance["calibration"]["format"] == "chat" and provenance["options"]["calibration_format"] == "chat"
    assert ", chat format, sha256" in render_text(summarize(ghosted.config))


@pytest.mark.parametrize("max_sequences", [None, 1, 3, 5, 40])
def test_plain_packing_reads_only_what_it_needs(max_sequences: int | None) -> None:
    """Documents joined by the separator and cut into sequences; a lazy source is read only as far as needed."""
    rng = random.Random(max_sequences)
    docs = [[rng.randrange(1, 50) for _ in range(rng.choice([0, 3, 7, 12]))] for _ in range(20)]
    stream = [t for i, d in enumerate(docs) for t in ([99] if i else []) + d]
    expected = [stream[i:i + 8] for i in range(0, len(stream), 8)][:max_sequences]
    read = []

    def lazy():
        for d in docs:
            read.append(d)
            yield d

    assert pack_tokens(lazy(), 8, max_sequences, 99) == expected
    if max_sequences is not None and max_sequences * 8 < len(stream):
        assert len(read) < len(docs)  # stopped early


def test_shuffled_batches_hold_the_same_sequences_in_a_seeded_order() -> None:
    """Training shuffles the packed sequences: the same windows, from several documents per batch, the order set by
    the seed."""
    documents = [letter * 200 for letter in "abcdefgh"]  # 8 documents of 5 windows of 40 (with separators)
    ordered = tokenize_texts(char_tokenizer(), documents, 40, batch_size=4)
    first, again, other = (tokenize_texts(char_tokenizer(), documents, 40, batch_size=4, shuffle_seed=seed)
                           for seed in (0, 0, 1))

    def rows(data):
        return [tuple(row[mask.bool()].tolist()) for b in data.batches
                for row, mask in zip(b["input_ids"], b["attention_mask"])]  # without the padding

    assert sorted(rows(first)) == sorted(rows(ordered)) and rows(first) != rows(ordered)
    assert rows(first) == rows(again) and rows(first) != rows(other)
    assert len({row[5] for row in rows(ordered)[:4]}) == 1  # in order, a batch is one document's windows
    assert len({row[5] for row in rows(first)[:4]}) > 1
