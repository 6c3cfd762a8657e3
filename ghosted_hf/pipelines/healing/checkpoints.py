"""Resumable checkpoints: which run a checkpoints folder belongs to, the record that makes a checkpoint complete and
hashed, and where a resume starts."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from ...errors import GhostedError, MissingFileError
from ...utils.inputs import note_read, relation
from ...remote.staging_ghosted import process_gone, process_tag, scratch_folder
from ...statistics.origin import config_sha256, model_fingerprint
from ...text.tokens import TrainingSequences
from ...utils.diskio import atomic_write_text, read_json_object
from ...utils.hashing import file_sha256, tensor_sha256
from .options import HealOptions

CHECKPOINT_RECORD = "ghosted_checkpoint.json"  # written last: a checkpoint without it is incomplete
RUN_RECORD = "ghosted_run.json"  # which run (and process) a checkpoints folder belongs to
# What may change when a run is resumed: how often it saves and evaluates, and where it reports.
RESUMABLE_CHANGES = ("save_steps", "eval_steps", "report_to")


def run_identity(options: HealOptions, sequences: TrainingSequences, processes: int,
                 model: nn.Module) -> dict[str, Any]:
    """What a resumed run shares with the run that wrote its checkpoint: options, data, processes, model healed."""
    config = {k: v for k, v in model.config.to_dict().items() if k != "ghost_provenance"}  # (holds timings)
    return {"options": {k: v for k, v in options.to_dict().items() if k not in RESUMABLE_CHANGES},
            "data_sha256": sequences.text_sha256, "processes": processes, "model_config_sha256": config_sha256(config),
            "model_weights_sha256": json.dumps(model_fingerprint(model)["weights_sha256"], sort_keys=True)}


def agreement_claims(options: HealOptions, sequences: TrainingSequences, run: dict[str, Any],
                     teacher: nn.Module | None) -> dict[str, str]:
    """What every process of a data-parallel run must share (`distributed.check_agreement`): every option (the
    ones a resume may change too: each process saves and evaluates in the same steps), the token sequences each
    process draws its share from, the model healed and the teacher."""
    claims = {name: repr(value) for name, value in options.to_dict().items()}
    claims.update({"training data": tensor_sha256(sequences.train), "held-out data": tensor_sha256(sequences.held_out),
                   "model config": run["model_config_sha256"], "model weights": run["model_weights_sha256"]})
    if teacher is not None:
        claims["teacher"] = json.dumps(model_fingerprint(teacher), sort_keys=True)
    return claims


def check_same_run(record: dict[str, Any], run: dict[str, Any], folder: Path) -> None:
    """Refuse to resume a checkpoint with other options, data or process count than the run that wrote it."""
    def flat(identity: dict[str, Any]) -> dict[str, Any]:
        options = identity.get("options")
        return {**(options if isinstance(options, dict) else {"options": options}),
                **{k: v for k, v in identity.items() if k != "options"}}

    then, now = flat(record["run"]), flat(run)
    changed = sorted(k for k in then.keys() | now.keys() if then.get(k) != now.get(k))
    if changed:
        details = ", ".join(f"{k} {then.get(k)!r} then, {now.get(k)!r} now" for k in changed)
        raise GhostedError(f"Checkpoint {folder} was written by another run ({details}): resume with the options and "
                           "data of that run, or start a new one.")


def claim_checkpoint_folder(folder: Path, model: nn.Module, resuming: bool) -> None:
    """Make `folder` this run's: refuse one inside the healed model's own folder, one a running heal uses, and,
    unless resuming, one that holds checkpoints (rotation would delete another run's, or this run's would be mixed
    with them; a resumed run is checked against its checkpoint's record). Records this process in RUN_RECORD."""
    source = getattr(model.config, "_name_or_path", "") or ""
    if source and Path(source).is_dir() and relation(folder, source) in ("is", "lies inside"):
        raise GhostedError(f"The checkpoints folder {folder} lies inside the model folder {source}: checkpoints would "
                           "be written into the model; name a folder outside it.")
    folder.mkdir(parents=True, exist_ok=True)
    record_path = folder / RUN_RECORD
    if record_path.exists():
        owner = read_json_object(record_path, "the checkpoints folder's run record", {"process": str})["process"]
        if owner != process_tag() and not process_gone(owner):
            raise GhostedError(f"The checkpoints folder {folder} is in use by a running heal (process {owner}): "
                               "give each run its own folder.")
    if not resuming and any(folder.glob("checkpoint-*")):
        raise GhostedError(f"The checkpoints folder {folder} already holds checkpoints: continue that run with "
                           "--resume last (resume=\"last\"), or name an empty folder.")
    atomic_write_text(record_path, json.dumps({"process": process_tag()}))  # a resumed run checks its checkpoint's


def verified_checkpoint(folder: Path) -> dict[str, Any]:
    """The record of a complete checkpoint whose every file still has the recorded sha256."""
    path = folder / CHECKPOINT_RECORD
    if not folder.is_dir():
        raise MissingFileError(f"Checkpoint {folder} does not exist (or is not a folder): name a checkpoint-N folder "
                               "of the run, or resume='last'.")
    if not path.is_file():
        raise GhostedError(f"Checkpoint {folder} is incomplete (no {CHECKPOINT_RECORD}: the run was stopped while it "
                           "was written); resume from an earlier one.")
    record = read_json_object(path, "checkpoint record", {"step": int, "seconds_spent": (int, float), "run": dict,
                                                          "files": dict})
    for name, digest in record["files"].items():
        inside = not Path(name).is_absolute() and ".." not in Path(name).parts
        if not inside or not (folder / name).is_file() or file_sha256(folder / name) != digest:
            raise GhostedError(f"Checkpoint file {folder / name} is missing or not what the checkpoint recorded; "
                               "resume from another checkpoint.")
    return record


def resume_point(checkpoints: Path, resume: str | os.PathLike) -> Path:
    """`resume` as a checkpoint folder: "last" is the newest complete one under `checkpoints`."""
    if str(resume) != "last":
        note_read(resume, "checkpoint resumed from")
        return Path(resume)
    found = sorted((p for p in checkpoints.glob("checkpoint-*") if (p / CHECKPOINT_RECORD).is_file()),
                   key=lambda p: int(p.name.split("-")[-1]))
    if not found:
        raise MissingFileError(f"No complete checkpoint under {checkpoints} to resume from; start without resume.")
    note_read(found[-1], "checkpoint resumed from")
    return found[-1]


@contextlib.contextmanager
def checkpoint_folder(checkpoints: str | os.PathLike | None) -> Iterator[Path]:
    """The Trainer's output folder: the user's checkpoints folder, or a scratch folder in the temp folder (removed
    afterwards; one that a killed run left is removed by the next run)."""
    if checkpoints is not None:
        yield Path(checkpoints)
        return
    scratch = scratch_folder(Path(tempfile.gettempdir()), "ghosted-heal-")
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
