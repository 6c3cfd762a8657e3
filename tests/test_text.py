"""Text from every place people keep it (one reader for every command), packed into sequences, with a held-out set
the training never sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import char_tokenizer, texts

from ghosted_hf.errors import GhostedError
from ghosted_hf.text.documents import Documents, read_documents
from ghosted_hf.text.tokens import pack_rows, training_sequences

TESTS = Path(__file__).parent


def documents(count: int = 12) -> list[str]:
    return [f"document {i}: " + text for i, text in enumerate(texts(count, words=40))]


def write(tmp_path: Path, fmt: str, docs: list[str], column: str = "text") -> Path:
    """`docs` saved as a `fmt` file or folder, as people have them."""
    import datasets

    dataset = datasets.Dataset.from_dict({column: docs, "id": list(range(len(docs)))})
    path = tmp_path / f"data.{fmt}"
    if fmt == "txt":
        path.write_text("\n\n".join(docs))
    elif fmt == "jsonl":
        path.write_text("\n".join(json.dumps({column: d}) for d in docs))
    elif fmt == "parquet":
        dataset.to_parquet(str(path))
    elif fmt == "csv":
        dataset.to_csv(str(path), index=False)
    elif fmt == "arrow":  # a datasets folder's data file
        dataset.save_to_disk(str(tmp_path / "saved"))
        path = next((tmp_path / "saved").glob("*.arrow"))
    elif fmt == "saved":
        path = tmp_path / "saved-dict"
        datasets.DatasetDict({"train": dataset, "test": dataset.select(range(2))}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet", "csv", "arrow", "saved"])
def test_every_format_reads_the_same_documents(tmp_path: Path, fmt: str) -> None:
    docs = documents()
    corpus = read_documents(write(tmp_path, fmt, docs), split="train" if fmt == "saved" else None)
    assert list(corpus.texts) == docs


def test_a_folder_of_splits_needs_a_split_and_a_missing_column_is_named(tmp_path: Path) -> None:
    folder = write(tmp_path, "saved", documents())
    with pytest.raises(GhostedError, match=r"splits \['train', 'test'\] and no split was named: pass --split"):
        read_documents(folder)
    assert len(list(read_documents(folder, split="test").texts)) == 2
    with pytest.raises(GhostedError, match=r"no 'body' column \(columns: \['text', 'id'\]\); pass --text-column"):
        list(read_documents(folder, split="train", text_column="body").texts)
    with pytest.raises(GhostedError, match="holds int values, not text"):
        list(read_documents(folder, split="train", text_column="id").texts)
    with pytest.raises(GhostedError, match=r"does not exist"):
        read_documents(tmp_path / "nowhere.jsonl")


def test_held_out_documents_are_whole_and_never_trained_on() -> None:
    tokenizer = char_tokenizer()
    docs = documents(12)
    sequences = training_sequences(tokenizer, Documents(docs, "docs"), 64, held_out=4, seed=0)
    assert sequences.held_out.shape == (4, 64) and sequences.train.shape[1] == 64
    assert sequences.train.dtype == sequences.held_out.dtype == torch.int32
    train_text = {tokenizer.decode(s.tolist()) for s in sequences.train}
    held_text = " ".join(tokenizer.decode(s.tolist()) for s in sequences.held_out)
    held_docs = [d for d in docs if d.split(":")[0] + ":" in held_text]
    assert held_docs == docs[:len(held_docs)] and 0 < len(held_docs) < len(docs)  # the first documents, whole
    assert not any(d.split(":")[0] + ":" in t for d in held_docs for t in train_text)  # none of them in training
    again = training_sequences(tokenizer, Documents(docs, "docs"), 64, held_out=4, seed=0)
    other = training_sequences(tokenizer, Documents(docs, "docs"), 64, held_out=4, seed=1)
    assert torch.equal(again.train, sequences.train) and not torch.equal(other.train, sequences.train)
    assert sorted(other.train.tolist()) == sorted(again.train.tolist())  # the same rows, shuffled otherwise


def test_a_streamed_corpus_is_read_only_as_far_as_needed() -> None:
    read = []

    def lazy():
        for i, doc in enumerate(documents(1000)):
            read.append(i)
            yield doc

    sequences = training_sequences(char_tokenizer(), Documents(lazy(), "stream"), 64, held_out=2, max_sequences=5)
    assert len(sequences.train) == 5 and len(read) < 20


@pytest.mark.parametrize("max_rows", [None, 1000, 9000])
def test_packed_rows_are_the_documents_joined_and_cut_into_full_rows(max_rows: int | None) -> None:
    """Rows are moved out of Python lists in blocks of about a million tokens: across those blocks, and when only
    `max_rows` are read, the rows are the joined token stream cut into full rows, as one list would give."""
    generator = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, 50_000, (int(n),), generator=generator).tolist()
            for n in torch.randint(1, 4000, (1500,), generator=generator)]
    read = []

    def lazy():
        for doc in docs:
            read.append(doc)
            yield doc

    rows = pack_rows(lazy(), 256, max_rows, separator=2)
    stream = [t for i, doc in enumerate(read) for t in ([2] if i else []) + doc]
    full = len(stream) // 256
    expected = torch.tensor(stream[:full * 256], dtype=torch.int32).view(-1, 256)[:max_rows]
    assert len(stream) > 2 << 20 or max_rows is not None  # more than one block when all is read
    assert torch.equal(rows, expected) and len(rows) == (max_rows or full)
    assert max_rows is None or len(read) < len(docs)  # read only as far as the rows need


def test_every_window_starts_with_the_bos_of_a_tokenizer_that_adds_one() -> None:
    """Calibration, evaluation and training windows cut from the middle of a document start with the BOS the model
    always saw at position 0 (Gemma, Llama 3); one already there (a document's start) is not doubled; a tokenizer
    without a BOS (SmolLM2) gets the plain cut, as before."""
    from ghosted_hf.text.tokens import cut_windows, leading_token, pack_tokens

    stream = [2, 5, 6, 7, 1, 2, 8, 9, 10, 11, 12]
    assert cut_windows(stream, 4, 2, partial=True) == ([[2, 5, 6, 7], [2, 1, 2, 8], [2, 9, 10, 11], [2, 12]], 11)
    assert cut_windows(stream, 4, 2, partial=False) == ([[2, 5, 6, 7], [2, 1, 2, 8], [2, 9, 10, 11]], 10)
    assert cut_windows(stream, 4, None, partial=False) == ([stream[0:4], stream[4:8]], 8)
    docs = [[2, *range(10, 10 + n)] for n in (7, 30, 3, 12)]
    rows = pack_rows(docs, 8, None, separator=1, prefix=2)
    assert rows.shape[1] == 8 and bool((rows[:, 0] == 2).all()) and not bool((rows[:, 1] == 2).any())
    assert all(s[0] == 2 and len(s) <= 8 for s in pack_tokens(docs, 8, None, 1, prefix=2))
    assert leading_token(char_tokenizer()) is None


def test_a_hub_dataset_id_reads_offline_from_the_local_cache(tmp_path: Path) -> None:
    """The real `datasets.load_dataset(id)` path, with HF_HUB_OFFLINE=1 and what a download leaves in the cache."""
    from fake_hub import cache_hub_dataset

    cache_hub_dataset(tmp_path / "cache", "someone/texts", [{"content": d} for d in documents(6)])
    script = ("import sys; sys.path.insert(0, 'tests'); from ghosted_hf.text.documents import read_documents\n"
              "for streaming in (False, True):\n"
              "    print(len(list(read_documents('someone/texts', text_column='content', streaming=streaming).texts)))\n"
              "read_documents('someone/other')\n")
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script], cwd=TESTS.parent, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.split() == ["6", "6"], run.stderr[-2000:]
    assert "GhostedError: Could not open the dataset 'someone/other'" in run.stderr


def test_a_hub_dataset_on_an_endpoint_that_never_answers_ends_with_one_line(monkeypatch) -> None:
    """An endpoint that accepts connections and never answers: one bounded request, then a line naming the id,
    the endpoint and the local alternative (`datasets` alone retried file after file for minutes)."""
    import socket
    import time

    import huggingface_hub.constants

    import ghosted_hf.text.documents

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # the kernel accepts the connections; nobody ever answers them
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
        monkeypatch.setattr(ghosted_hf.text.documents, "HUB_TIMEOUT_S", 1.0)
        start = time.monotonic()
        with pytest.raises(GhostedError) as raised:
            read_documents("org/name")
    message = str(raised.value)
    assert time.monotonic() - start < 30, "the wait was not bounded"
    assert message.startswith(f"Cannot open the Hub dataset 'org/name': {endpoint} could not be reached or did not "
                              "answer within 1 s")
    assert "give a local file or folder instead" in message and "\n" not in message


def test_prune_and_heal_read_one_jsonl_file_as_the_same_documents_with_one_identity(dense_folder: Path,
                                                                                    tmp_path: Path) -> None:
    """`prune --calibration x.jsonl` calibrates on the JSON lines' text column (it used to read the raw JSON as text)
    and records the same data identity as `heal --data x.jsonl`: the sha256 of the documents read, and their count."""
    from ghosted_hf.cli import main
    from ghosted_hf.utils.hashing import text_hash

    docs = documents(30)
    data = str(write(tmp_path, "jsonl", docs))
    assert main(["prune", str(dense_folder), "--calibration", data, "--num-layers", "2", "--seq-len", "48",
                 "--num-sequences", "1000", "--output", str(tmp_path / "pruned")]) == 0  # more than the file holds
    provenance = json.loads((tmp_path / "pruned" / "config.json").read_text())["ghost_provenance"]
    assert main(["heal", str(tmp_path / "pruned"), "--data", data, "--max-steps", "1", "--seq-len", "48",
                 "--output", str(tmp_path / "healed")]) == 0
    healing = json.loads((tmp_path / "healed" / "config.json").read_text())["ghost_provenance"]["healing"]["data"]
    calibration = provenance["calibration"]
    assert calibration["sha256"] == healing["sha256"] == text_hash(docs)
    assert calibration["documents"] == healing["documents"] == len(docs)
    assert calibration["name"] == healing["name"] == data


def test_calibration_reads_only_the_documents_it_needs_and_its_identity_says_which() -> None:
    from ghosted_hf.text.tokens import tokenize_texts
    from ghosted_hf.utils.hashing import text_hash

    docs = documents(12)
    batches = tokenize_texts(char_tokenizer(), docs, 48, 4)
    assert 0 < batches.documents < len(docs)
    assert batches.text_sha256 == text_hash(docs[:batches.documents])
