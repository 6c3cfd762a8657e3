"""Host memory: what is available to this process, and the one refusal of a batch that cannot fit in it, said in
seconds instead of after the kernel's out-of-memory killer took this process (or someone else's)."""

from __future__ import annotations

import os
import resource
from typing import Any

from ..errors import GhostedError


def available_bytes() -> int | None:
    """Memory this process may still allocate: the system's available memory, bounded by its address-space limit
    (`ulimit -v`) less what it maps already; None where neither can be read."""
    bounds = []
    try:
        with open("/proc/meminfo") as handle:
            fields = dict(line.split(":", 1) for line in handle)
        bounds.append(int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm") as handle:
                mapped = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            mapped = 0
        bounds.append(max(0, limit - mapped))
    return min(bounds) if bounds else None


def over_half_available(needed: int) -> int | None:
    """The bytes available to this process where `needed` is more than half of them (the other half: the model, the
    statistics, the machine's other users), else None: where every refusal of a size that cannot fit draws the line."""
    available = available_bytes()
    return available if available is not None and needed > available // 2 else None


def batch_bytes(sequences: int, seq_len: int, config: Any) -> int:
    """A lower bound on the memory one forward of a batch takes in float32: its logits and their log-softmax, the
    attention mask (a row of `seq_len` per token) and a few hidden-width activations. Refusing on a lower bound
    refuses only batches that cannot fit (measured: 4,896 x 512 tokens of a tiny Llama peak at 11 GB, bound 10.3)."""
    vocab, hidden = getattr(config, "vocab_size", 0) or 0, getattr(config, "hidden_size", 0) or 0
    return sequences * seq_len * 4 * (2 * vocab + seq_len + 8 * hidden)


def check_batch_memory(sequences: int, seq_len: int, config: Any, flag: str) -> None:
    """Refuse a batch (`flag`, the option that sets its size) whose forward alone needs more than half the memory
    available to this process (the other half: the model, the statistics, the machine's other users)."""
    needed = batch_bytes(sequences, seq_len, config)
    available = over_half_available(needed)
    if available is not None:
        fits = max(1, sequences * (available // 2) // needed)
        raise GhostedError(f"{flag}: one forward of {sequences} sequences of {seq_len} tokens needs at least "
                           f"{needed / 2**30:.1f} GiB (logits and attention mask), more than half the "
                           f"{available / 2**30:.1f} GiB available to this process: lower {flag} (at most {fits} fits) or the sequence "
                           "length.")
