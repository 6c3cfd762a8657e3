"""What one calibration pass accumulates: a set of statistic entries, combined with ``|``.

Operator kinds and criteria declare their needs as plans; the engine knows statistics, not kinds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .declarations import (ANGULAR, COSINE, CROSS, ENERGY, GRAM, LABELS, LOSS, MLP_GRAM, MLP_SOURCE, MLP_TARGET,
                           NORMED_CROSS, NORMED_GRAM, NORMED_SOURCE, SUBBLOCK_SUMS, Entry, Read, parse_key)


@dataclass(frozen=True)
class StatisticsPlan:
    """A set of statistic entries (dense numbering)."""

    entries: frozenset[Entry] = frozenset()

    @classmethod
    def of(cls, *entries: Entry) -> StatisticsPlan:
        return cls(frozenset(entries))

    @classmethod
    def union(cls, plans: Iterable[StatisticsPlan]) -> StatisticsPlan:
        return cls(frozenset().union(*(p.entries for p in plans)))

    def __or__(self, other: StatisticsPlan) -> StatisticsPlan:
        return StatisticsPlan(self.entries | other.entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(sorted(self.entries))

    def __len__(self) -> int:
        return len(self.entries)

    def missing_from(self, held: Iterable[str]) -> StatisticsPlan:
        """The entries whose tensors are not among the keys `held` (empty when nothing is missing)."""
        held = set(held)
        return StatisticsPlan(frozenset(e for e in self.entries if e.key not in held))

    def split_at(self, s: int) -> tuple[StatisticsPlan, StatisticsPlan]:
        """(entries whose first index is s, the rest): sequential fitting takes the first part with its source
        from the model pruned and patched before boundary s, the rest (e.g. a target's own abs sum) from the
        dense model."""
        first = frozenset(e for e in self.entries if e.first == s)
        return StatisticsPlan(first), StatisticsPlan(self.entries - first)

    def reads(self) -> set[Read]:
        """Every hidden state the plan reads, by role."""
        return {r for e in self.entries for r in e.reads}

    def deepest(self) -> int:
        """Index of the deepest hidden state the plan reads (a forward pass can stop there)."""
        return max(e.ready_at for e in self.entries)

    def to_json(self) -> str:
        """A canonical text form, recorded in statistics files so that merge can compare plans."""
        return json.dumps([e.key for e in self], separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StatisticsPlan:
        return cls(frozenset(parse_key(k) for k in json.loads(text)))

    def __repr__(self) -> str:
        return f"StatisticsPlan({', '.join(map(repr, self))})"


# ---------------------------------------------------------------- the groups fits and criteria ask for


def least_squares(s: int, e: int) -> StatisticsPlan:
    """What a least-squares fit X_s -> X_e and its residual read: X_s^T X_s, X_s^T X_e, ||X_e||^2."""
    return StatisticsPlan.of(GRAM(s), CROSS(s, e), ENERGY(s, e))


def mlp_terms(s: int, e: int) -> StatisticsPlan:
    """M^T M, M^T X_s, M^T X_e for the MLP output M of layer s-1 (a transform of M folds into the weights that write M)."""
    return StatisticsPlan.of(MLP_GRAM(s), MLP_SOURCE(s), MLP_TARGET(s, e))


def normed_terms(s: int, e: int) -> StatisticsPlan:
    """n(X_s)^T n(X_s), n(X_s)^T X_s, n(X_s)^T X_e: what a least-squares fit from the normalised stream n(X_s) reads
    (with `least_squares` for the joint fit with X_s and for the residuals)."""
    return StatisticsPlan.of(NORMED_GRAM(s), NORMED_SOURCE(s), NORMED_CROSS(s, e))


def similarity(s: int, e: int) -> StatisticsPlan:
    """Sums of the cosine and the angular distance between x_s and x_e."""
    return StatisticsPlan.of(COSINE(s, e), ANGULAR(s, e))


def subblock_terms(kind: str, j: int) -> StatisticsPlan:
    """H^T H, H^T Y, ||Y||^2 of sub-block `kind` ("attention" or "mlp") of layer j: its least-squares map and residual."""
    return StatisticsPlan.of(*(statistic(j) for statistic in SUBBLOCK_SUMS[kind]))


def next_token_loss(depth: int) -> StatisticsPlan:
    """The summed next-token loss of a model of `depth` layers over the calibration tokens, and their count."""
    return StatisticsPlan.of(LOSS(depth), LABELS(depth))
