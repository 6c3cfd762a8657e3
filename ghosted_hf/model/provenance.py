"""The provenance record (config.json's `ghost_provenance`): how a model was made, written and read through one
typed schema. A record of an earlier version reads unchanged (what it lacks is None); fields a later version adds
are kept as they are."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..utils.diskio import check_shape, optional

BOUNDARY = {"removed": [int], "target": str, "operator": str, "layer": optional(int), "original_layer": optional(int),
            "fit": optional(dict), "fused_into": optional(str)}
SUBBLOCK = {"layer": int, "original_layer": int, "block": str, "module": str, "fit": optional(dict), "rank": optional(int)}
# The shape of every field a reader uses: checked on reading, so a damaged field is named, not a crash.
SCHEMA = {
    "method": optional(str), "base_model": optional(str), "base_model_path": optional(str),
    "base_model_license": optional(str), "base_model_notice": optional(str), "operator": optional(str),
    "fitting": optional(str), "parameters": optional({"dense": int, "pruned": int, "operators": int}),
    "selection": optional({"criterion": optional(str), "better": optional(str), "scores": optional(dict),
                           "removed": optional([int]), "subblocks": optional([str])}),
    "calibration": optional(dict), "solver": optional(dict), "cost": optional(dict), "options": optional(dict),
    "versions": optional(dict), "refitted_from": optional(dict), "healing": optional(dict),
    "evaluation": optional([dict]),
    "stock_export": optional({"original_num_hidden_layers": int, "removed_layers": [int], "boundaries": [BOUNDARY],
                              "folded_operators": optional(int), "untied_embeddings": optional(bool)}),
}


@dataclass
class Provenance:
    """How a model was made. `selection`, `calibration`, `healing` and the other records are the JSON objects
    `SCHEMA` describes."""

    method: str | None = None
    base_model: str | None = None  # the Hub id where known, else the path it was loaded from
    base_model_path: str | None = None
    base_model_license: str | None = None
    base_model_notice: str | None = None  # the text a derivative must ship (Gemma's terms)
    selection: dict[str, Any] | None = None
    operator: str | None = None  # the recovery: an operator kind, or how sub-blocks were replaced
    fitting: str | None = None  # what the fits were: sequential, independent, single, none (not what was asked)
    solver: dict[str, Any] | None = None
    calibration: dict[str, Any] | None = None  # the data identity (name, sha256, documents) and tokens used
    cost: dict[str, Any] | None = None
    parameters: dict[str, int] | None = None
    options: dict[str, Any] | None = None
    versions: dict[str, str] | None = None
    refitted_from: dict[str, Any] | None = None  # export-stock: the ghosted model's own recovery
    stock_export: dict[str, Any] | None = None  # a stock checkpoint: the pruned layout it folds
    healing: dict[str, Any] | None = None
    evaluation: list[dict[str, Any]] = field(default_factory=list)
    later: dict[str, Any] = field(default_factory=dict)  # fields of a later version, kept as they are

    @classmethod
    def of(cls, config: Any) -> Provenance:
        """The record of a config object (or a config.json dict), checked against `SCHEMA`; empty when it has none."""
        raw = config.get("ghost_provenance") if isinstance(config, dict) else getattr(config, "ghost_provenance", None)
        raw = check_shape(raw or {}, SCHEMA, "config.json: ghost_provenance")
        known = {f.name for f in dataclasses.fields(cls)} - {"later"}
        return cls(**{k: v for k, v in raw.items() if k in known},
                   later={k: v for k, v in raw.items() if k not in known})

    def to_dict(self) -> dict[str, Any]:
        """The JSON object saved in config.json (fields never set are left out)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "later"}
        return {**{k: v for k, v in fields.items() if v is not None and v != []}, **self.later}

    def with_changes(self, **changes: Any) -> Provenance:
        return dataclasses.replace(self, **changes)

    def save_to(self, config: Any) -> None:
        """Write the record into a config (saved with it as `ghost_provenance`)."""
        config.ghost_provenance = self.to_dict()
