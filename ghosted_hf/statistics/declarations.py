"""Every calibration statistic, declared once: its name, its indices, the hidden states it reads, its shape and how
one batch adds to it. Shards and processes combine by summation, so a declaration is all the engine needs; nothing
outside this module spells a statistic's name.

Index convention (dense numbering): `i` in 0..depth-1 is the hidden state entering decoder layer `i`, `i == depth`
the one entering the final norm; a boundary removing layers s..e-1 maps X_s to X_e. Hidden states are read by role:
`source(i)` (the stream a fit maps from; under sequential fitting, from the model pruned and patched so far),
`target(i)` (always the dense model), `mlp(j)` (the MLP output of layer j), `block_input(kind, j)` (what sub-block
`kind` of layer j reads: its norm's output) and `token_loss()` (each token's next-token loss and whether it has a next
token), all on the source side.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import GhostedError
from ..remote.modeling_ghosted import rms_normalized

# A hidden state a statistic reads: (role, index), role "source", "target" or "mlp".
Read = tuple[str, int]


def source(i: int) -> Read:
    """Read the hidden state entering layer i on the source side (patched under sequential fitting)."""
    return ("source", i)


def target(i: int) -> Read:
    """Read the hidden state entering layer i of the dense model."""
    return ("target", i)


def mlp(j: int) -> Read:
    """Read the MLP output of layer j (source side)."""
    return ("mlp", j)


SUBBLOCK_ROLES = ("attention_in", "attention_out", "mlp_in", "mlp")  # read inside layer j: ready at X_{j+1}
LOSS_ROLE = "loss"  # read off the logits: ready after the last layer


def block_input(kind: str, j: int) -> Read:
    """Read what sub-block `kind` ("attention" or "mlp") of layer j is given (source side)."""
    return (f"{kind}_in", j)


def block_output(kind: str, j: int) -> Read:
    """Read what sub-block `kind` of layer j returns (source side)."""
    return mlp(j) if kind == "mlp" else (f"{kind}_out", j)


def token_loss(depth: int) -> Read:
    """Read each real token's (next-token cross-entropy, 1) where a next token exists, else (0, 0), from the logits
    of a model of `depth` layers (source side)."""
    return (LOSS_ROLE, depth)


Inputs = Mapping[Read, torch.Tensor]  # (N, C) rows of the real tokens of one batch (float64, or the partial sums')
Update = Callable[[torch.Tensor, Inputs, tuple[int, ...], Mapping[str, torch.Tensor]], None]


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: each is declared once
class Statistic:
    """One kind of float64 sum over calibration tokens."""

    name: str  # tensor-name prefix in statistics files: "<name>.<index>..."
    arity: int  # number of indices
    vector: bool  # shape (C,) instead of (C, C); `scalar` below wins
    scalar: bool
    reads: Callable[..., tuple[Read, ...]]  # indices -> the hidden states it reads
    update: Update  # adds one batch in place: update(total, inputs, index, constants)
    valid: Callable[..., bool] = lambda *index: True
    what: str = ""

    def __call__(self, *index: int) -> Entry:
        if len(index) != self.arity or not all(isinstance(i, int) and i >= 0 for i in index):
            raise GhostedError(f"Statistic {self.name} takes {self.arity} non-negative layer index(es), got {index}.")
        if not self.valid(*index):
            raise GhostedError(f"Statistic {self.name}{index} does not exist ({self.what}).")
        return Entry(self, tuple(index))

    def shape(self, hidden_size: int) -> tuple[int, ...]:
        return (1,) if self.scalar else (hidden_size,) if self.vector else (hidden_size, hidden_size)


@dataclass(frozen=True)
class Entry:
    """One statistic at given indices, e.g. ``CROSS(3, 7)``: the unit a plan is made of and a store holds."""

    statistic: Statistic
    index: tuple[int, ...]

    @property
    def key(self) -> str:
        """Its tensor name, e.g. ``cross.3.7``."""
        return ".".join((self.statistic.name, *map(str, self.index)))

    @property
    def reads(self) -> tuple[Read, ...]:
        return self.statistic.reads(*self.index)

    @property
    def ready_at(self) -> int:
        """The hidden-state index by which all its reads exist in a forward pass (what a layer computes inside: its
        output, the next input; the loss: after the final norm's input)."""
        return max(i + 1 if role in SUBBLOCK_ROLES or role == LOSS_ROLE else i for role, i in self.reads)

    @property
    def first(self) -> int:
        """Its first index: the source of a pair, the layer input of a single-index statistic."""
        return self.index[0]

    def __repr__(self) -> str:
        return f"{self.statistic.name.upper()}{self.index}"

    def __lt__(self, other: Entry) -> bool:  # plans print and serialise in a stable order
        return (self.statistic.name, self.index) < (other.statistic.name, other.index)


# ---------------------------------------------------------------- the updates

# The rows a product reads, by name (n(X) = X / rms(X) row-wise: the normed term's input, `rms_normalized`).
_ROWS: dict[str, Callable[[Inputs, tuple[int, ...]], torch.Tensor]] = {
    "source": lambda x, index: x[source(index[0])],
    "target": lambda x, index: x[target(index[-1])],
    "mlp": lambda x, index: x[mlp(index[0] - 1)],
    "normed": lambda x, index: rms_normalized(x[source(index[0])]),
    **{f"{kind}_{end}": (lambda kind, read: lambda x, index: x[read(kind, index[0])])(kind, read)
       for kind in ("attention", "mlp") for end, read in (("in", block_input), ("out", block_output))},
}


def _product(left: str, right: str | None = None) -> Update:
    """Adds L^T R (default L^T L) of the named rows into the sum: by addmm_ (no (C, C) temporary) where the rows are
    in the sum's precision, else formed in theirs and added."""
    def update(total: torch.Tensor, x: Inputs, index: tuple[int, ...], _: Any) -> None:
        rows = _ROWS[left](x, index)
        other = rows if right is None else _ROWS[right](x, index)
        if rows.dtype == total.dtype:
            total.addmm_(rows.T, other)
        else:
            total.add_(rows.T @ other)
    return update


def _summed(per_token: Callable[[Inputs, tuple[int, ...], Mapping[str, torch.Tensor]], torch.Tensor]) -> Update:
    """Adds the sum over tokens of `per_token` (one value, or one vector, a token)."""
    def update(total: torch.Tensor, x: Inputs, index: tuple[int, ...], constants: Mapping[str, torch.Tensor]) -> None:
        total += per_token(x, index, constants).sum(dim=0)
    return update


def _cosines(x: Inputs, index: tuple[int, ...], _: Any = None) -> torch.Tensor:
    a, b = x[source(index[0])], x[target(index[1])]
    norms = (a.norm(dim=1) * b.norm(dim=1)).clamp_min(torch.finfo(a.dtype).tiny)
    return ((a * b).sum(dim=1) / norms).clamp(-1.0, 1.0)


_after_a_layer = dict(valid=lambda s, *rest: s >= 1, what="MLP terms need a layer before the source: s >= 1")

GRAM = Statistic("gram", 1, False, False, lambda i: (source(i),), _product("source"), what="X_i^T X_i")
CROSS = Statistic("cross", 2, False, False, lambda s, e: (source(s), target(e)), _product("source", "target"),
                  what="X_s^T X_e")
ENERGY = Statistic("energy", 2, False, True, lambda s, e: (target(e),),
                   _summed(lambda x, index, _: x[target(index[1])].square().sum(dim=1)), what="sum ||x_e||^2")
COSINE = Statistic("cos", 2, False, True, lambda s, e: (source(s), target(e)), _summed(_cosines),
                   what="sum cos(x_s, x_e)")
ANGULAR = Statistic("ang", 2, False, True, lambda s, e: (source(s), target(e)),
                    _summed(lambda *a: torch.arccos(_cosines(*a)) / math.pi), what="sum arccos(cos(x_s, x_e)) / pi")
ABS = Statistic("abs", 1, True, False, lambda i: (source(i),), _summed(lambda x, index, _: x[source(index[0])].abs()),
                what="sum |x_i| per channel")
ROTATED_ABS = Statistic("rabs", 1, True, False, lambda i: (source(i),),
                        _summed(lambda x, index, constants: (x[source(index[0])] @ constants["rotation"]).abs()),
                        what="sum |x_i H| per channel, H the Hadamard rotation")
MLP_GRAM = Statistic("mlp_gram", 1, False, False, lambda s: (mlp(s - 1),), _product("mlp"), **_after_a_layer)
MLP_SOURCE = Statistic("mlp_source", 1, False, False, lambda s: (mlp(s - 1), source(s)), _product("mlp", "source"),
                       **_after_a_layer)
MLP_TARGET = Statistic("mlp_target", 2, False, False, lambda s, e: (mlp(s - 1), target(e)), _product("mlp", "target"),
                       **_after_a_layer)

NORMED_GRAM = Statistic("ngram", 1, False, False, lambda i: (source(i),), _product("normed"), what="n(X_i)^T n(X_i)")
NORMED_SOURCE = Statistic("nsource", 1, False, False, lambda i: (source(i),), _product("normed", "source"),
                          what="n(X_i)^T X_i")
NORMED_CROSS = Statistic("ncross", 2, False, False, lambda s, e: (source(s), target(e)), _product("normed", "target"),
                         what="n(X_s)^T X_e")


def _subblock_sums(kind: str) -> tuple[Statistic, Statistic, Statistic]:
    """H^T H, H^T Y and sum ||y||^2 of sub-block `kind` of layer j, H what it reads and Y what it returns: the least
    squares fit H A ~ Y that replaces it, and its residual."""
    short = {"attention": "attn", "mlp": "mlp"}[kind]
    return (Statistic(f"{short}_in", 1, False, False, lambda j: (block_input(kind, j),), _product(f"{kind}_in"),
                      what=f"H^T H of the {kind} input"),
            Statistic(f"{short}_in_out", 1, False, False, lambda j: (block_input(kind, j), block_output(kind, j)),
                      _product(f"{kind}_in", f"{kind}_out"), what=f"H^T Y of the {kind} input and output"),
            Statistic(f"{short}_out", 1, False, True, lambda j: (block_output(kind, j),),
                      _summed(lambda x, index, _: x[block_output(kind, index[0])].square().sum(dim=1)),
                      what=f"sum ||y||^2 of the {kind} output"))


ATTENTION_IN, ATTENTION_IN_OUT, ATTENTION_OUT = _subblock_sums("attention")
MLP_IN, MLP_IN_OUT, MLP_OUT = _subblock_sums("mlp")
SUBBLOCK_SUMS = {"attention": (ATTENTION_IN, ATTENTION_IN_OUT, ATTENTION_OUT), "mlp": (MLP_IN, MLP_IN_OUT, MLP_OUT)}
# The next-token loss over the real tokens that have a next token, and how many they are (index: the depth).
LOSS = Statistic("loss", 1, False, True, lambda depth: (token_loss(depth),),
                 _summed(lambda x, index, _: x[token_loss(index[0])][:, 0]), what="sum of next-token losses")
LABELS = Statistic("labels", 1, False, True, lambda depth: (token_loss(depth),),
                   _summed(lambda x, index, _: x[token_loss(index[0])][:, 1]), what="tokens with a next token")

STATISTICS: dict[str, Statistic] = {s.name: s for s in list(globals().values()) if isinstance(s, Statistic)}


def parse_key(key: str) -> Entry:
    """The entry of a tensor name (``cross.3.7`` -> CROSS(3, 7)); a clear error for any other name."""
    name, *index = key.split(".")
    if name not in STATISTICS or not all(part.isdigit() for part in index):
        raise GhostedError(f"{key!r} is not a statistic ghosted_hf writes (known: {', '.join(STATISTICS)}).")
    return STATISTICS[name](*map(int, index))
