"""The provenance record: one typed schema that writers fill and readers read; older records read unchanged and
fields a later version adds survive a round trip."""

from __future__ import annotations

import pytest
from tiny import build, char_tokenizer, texts

from ghosted_hf.errors import GhostedError
from ghosted_hf.model.provenance import Provenance
from ghosted_hf.pipelines.prune import ghost_prune


def test_what_prune_writes_reads_back_field_for_field() -> None:
    model = ghost_prune(build("llama"), char_tokenizer(), texts(), num_layers=2, num_sequences=8, seq_len=64)
    record = Provenance.of(model.config)
    assert record.operator == "ghost" and record.fitting == "single"  # one boundary: one fit, on the dense model
    assert record.calibration["documents"] > 0 and len(record.calibration["sha256"]) == 64
    assert record.parameters["dense"] > record.parameters["pruned"] and record.later == {}
    assert Provenance.of(model.config.to_dict()) == record  # config.json's dict reads the same
    assert record.to_dict() == model.config.ghost_provenance


def test_an_older_record_reads_and_a_later_ones_fields_are_kept() -> None:
    older = {"base_model": "org/model", "operator": "ghost", "fitting": "sequential",
             "calibration": {"name": "cal.txt", "sha256": "ab", "texts": 3}}  # 1.0 said texts, not documents
    record = Provenance.of({"ghost_provenance": older})
    assert record.healing is None and record.selection is None and record.evaluation == []
    assert record.to_dict() == older
    later = {**older, "quantization": {"bits": 4}}
    assert Provenance.of({"ghost_provenance": later}).with_changes(fitting="none").to_dict() == \
        {**later, "fitting": "none"}


@pytest.mark.parametrize(("record", "field"), [
    ({"parameters": {"dense": "many", "pruned": 1, "operators": 0}}, "parameters.dense"),
    ({"selection": {"subblocks": "3.mlp"}}, "selection.subblocks"),
    ({"stock_export": {"removed_layers": [1]}}, "stock_export.original_num_hidden_layers"),
    ({"healing": ["not", "an", "object"]}, "healing"),
])
def test_a_damaged_field_is_named(record, field) -> None:
    with pytest.raises(GhostedError, match=f"ghost_provenance.{field}"):
        Provenance.of({"ghost_provenance": record})
