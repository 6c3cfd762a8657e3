"""Text the way people have it -> documents: one reader for calibration, evaluation, healing and export (a text
file of blank-line-separated documents, .jsonl / .json / .parquet / .arrow / .csv, a `datasets` folder, a Hub dataset
id, or texts given in Python), and one data identity: the sha256 of the documents read, in order, and their count."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import GhostedError, MissingDependencyError, MissingFileError
from ..utils.inputs import note_read
from ..utils.network import HUB_TIMEOUT_S, bounded_network

# file suffix -> the `datasets` builder that reads it; any other file is plain text
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
TEXT_SUFFIXES = (".txt", ".text", ".md")  # a missing file of these is named as missing, not looked up on the Hub
TextSource = str | os.PathLike | Iterable[str] | Any  # a path or Hub id, a list of strings, or a datasets.Dataset


@dataclass
class Documents:
    """Documents as a (possibly lazy) iterable, with a name for reports."""

    texts: Iterable[str]
    name: str


class NamedTexts(list):
    """A list of documents that carries a display name into reports (e.g. the packaged corpus)."""

    def __init__(self, texts: Iterable[str], name: str) -> None:
        super().__init__(texts)
        self.name = name


def read_documents(source: TextSource, *, split: str | None = None, text_column: str = "text",
                   streaming: bool = False, what: str = "Calibration text") -> Documents:
    """Documents from any source: a plain text file (one document per blank-line-separated block), a data file by its
    suffix, a datasets folder or a Hub id through `datasets` (streamed with `streaming`: read only as far as needed), a
    list of strings or a `datasets.Dataset`. `what` the text is for, in messages."""
    if isinstance(source, str) and ("\n" in source or len(source) > 255):  # longer than any file name
        raise GhostedError(f"{what} is one string of {len(source)} characters that is not a file path: pass a list of "
                           "strings (e.g. [text]), or the path of a file.")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        note_read(path, what.lower())
        if path.is_file() and path.suffix.lower() not in BUILDERS:
            if split is not None or text_column != "text":
                raise GhostedError(f"{what} {path} is a text file (one document per blank-line-separated block): "
                                   "split and text_column apply to datasets; leave them out.")
            try:
                content = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise GhostedError(f"{what} file {path} is not UTF-8 text ({error.reason} at byte {error.start}); "
                                   "convert it to UTF-8.") from None
            texts = [b for b in (block.strip() for block in content.split("\n\n")) if b]
            return Documents(NamedTexts(texts, path.name), path.name)
        if not path.exists() and path.suffix.lower() in TEXT_SUFFIXES:
            raise MissingFileError(f"{what} file {path} does not exist (give a text file, a data file, a datasets "
                                   "folder or a Hub dataset id).")
        dataset = open_dataset(str(source), split, streaming, what)
        return Documents(_column(dataset, text_column, str(source)), str(source))
    if hasattr(source, "column_names") and not hasattr(source, "__len__"):  # an IterableDataset
        return Documents(_column(source, text_column), type(source).__name__)
    texts, name = _in_memory(source, text_column, what)
    return Documents(NamedTexts(texts, name), name)


def empty_text(what: str, name: str) -> GhostedError:
    """The one refusal of text that holds no document (`what` it is for, `name` where it came from)."""
    return GhostedError(f"The {what.lower()} ({name}) is empty: provide at least a few paragraphs of text.")


def _in_memory(text: Any, text_column: str, what: str) -> tuple[list[str], str]:
    """Texts and a display name from a list of strings or an in-memory `datasets.Dataset` with a text column."""
    if isinstance(text, (bytes, Mapping)) or not isinstance(text, Iterable):
        raise GhostedError(
            f"{what} must be a list of strings, a path, a Hub dataset id or a datasets.Dataset, got a "
            f"{type(text).__name__}" + (" (for a dict of columns, use datasets.Dataset.from_dict)."
                                        if isinstance(text, Mapping) else ".")
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
        raise GhostedError(f"{what}: every document must be a string, got a {type(bad).__name__}: {bad!r:.60}.")
    name = getattr(text, "name", None) or f"{len(texts)} texts given as a list of strings"
    return [t for t in texts if t.strip()], name


def _one_split(loaded: Any, split: str | None, where: str) -> Any:
    """A `DatasetDict` narrowed to `split` (or to its only split); a single dataset as it is."""
    if not hasattr(loaded, "keys"):
        return loaded
    names = list(loaded.keys())
    if split is None and len(names) == 1:
        split = names[0]
    if split not in names:
        wanted = "no split was named" if split is None else f"it has no split {split!r}"
        raise GhostedError(f"{where} has the splits {names} and {wanted}: pass --split NAME (split=).")
    return loaded[split]


def open_dataset(source: str, split: str | None = None, streaming: bool = False, what: str = "Training data") -> Any:
    """A `datasets` dataset from a data file, a folder (saved with `save_to_disk`, or of data files) or a Hub id;
    `split` defaults to "train" for data files and Hub ids."""
    try:
        import datasets
    except ImportError:
        raise MissingDependencyError("Reading .jsonl/.parquet/.arrow files, datasets folders and Hub datasets needs "
                                     "the `datasets` package: pip install datasets.") from None
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
            if not any(p.suffix.lower() in BUILDERS for p in path.rglob("*") if p.is_file()):
                raise GhostedError(f"{what} {path} is a folder that holds neither a saved dataset (save_to_disk) nor "
                                   f"data files ({', '.join(BUILDERS)}): give a text file, a data file or such a folder.")
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
                           "`hf auth login`); give a local file or folder instead.") from None
    except Exception as error:  # the HTTP client's own error types (timeouts, refused connections, HTTP statuses)
        raise GhostedError(f"Cannot open the Hub dataset {source!r}: {constants.ENDPOINT} could not be reached or did "
                           f"not answer within {timeout:g} s ({type(error).__name__}: {str(error)[:200]}); check the "
                           "network, HF_ENDPOINT and HF_HUB_OFFLINE, or give a local file or folder instead.") from None


def _column(dataset: Any, text_column: str, source: str = "the dataset") -> Iterator[str]:
    names = dataset.column_names
    if names is not None and text_column not in names:
        raise GhostedError(f"The dataset has no {text_column!r} column (columns: {names}); pass --text-column NAME.")
    with reading(source):  # a streamed file is parsed while it is iterated
        rows = iter(dataset)
    while True:
        with reading(source):
            row = next(rows, None)
        if row is None:
            return
        text = row[text_column]
        if not isinstance(text, str):
            raise GhostedError(f"Column {text_column!r} holds {type(text).__name__} values, not text; name a text "
                               "column with --text-column.")
        if text.strip():
            yield text
