"""Every hash ghosted_hf records, defined once: of strings, JSON values, tensors, named tensors, token batches and
files. The remote code keeps its own copy of the tensor hash (`operator_sha256`: it imports nothing of ghosted_hf);
a test checks that both give the same digest."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass
class DataIdentity:
    """What every record says about the data it used: the sha256 of the documents read (each UTF-8, NUL-terminated,
    in order) and how many; computed as they are read, so a stream is hashed only as far as it was used."""

    documents: int = 0
    digest: Any = field(default_factory=hashlib.sha256, repr=False)

    def read(self, texts: Iterable[str]) -> Iterator[str]:
        """`texts`, each added to the identity as it is taken."""
        for text in texts:
            self.digest.update(text.encode("utf-8"))
            self.digest.update(b"\x00")
            self.documents += 1
            yield text

    @property
    def sha256(self) -> str:
        return self.digest.hexdigest()


def text_hash(texts: Iterable[str]) -> str:
    """The `DataIdentity` sha256 of `texts`, all read."""
    identity = DataIdentity()
    for _ in identity.read(texts):
        pass
    return identity.sha256


def string_sha256(text: str) -> str:
    """Hex sha256 of `text` in UTF-8."""
    return hashlib.sha256(text.encode()).hexdigest()


def json_sha256(value: Any) -> str:
    """Hex sha256 of `value` as JSON with sorted keys (anything JSON cannot hold written as its str)."""
    return string_sha256(json.dumps(value, sort_keys=True, default=str))


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's raw bytes in its own dtype (CPU, contiguous; bf16 as bytes)."""
    return tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """Hex sha256 of a tensor's raw bytes."""
    return hashlib.sha256(tensor_bytes(tensor)).hexdigest()


def tensors_sha256(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """One hash of named tensors (names, dtypes, shapes and values, in name order): the same weights give the same
    hash however their files were written (shards, header order, metadata)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        digest.update(json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode())
        digest.update(tensor_bytes(tensor))
    return digest.hexdigest()


def batches_sha256(batches: Iterable[Mapping[str, torch.Tensor]], keys: tuple[str, ...]) -> str:
    """Hash of the `keys` tensors of every batch as int64, shapes included."""
    digest = hashlib.sha256()
    for batch in batches:
        for key in keys:
            tensor = batch[key].to(torch.int64).contiguous()
            digest.update(str(tuple(tensor.shape)).encode())
            digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def file_sha256(*paths: Path) -> str:
    """Hex sha256 of the concatenated bytes of `paths`, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
