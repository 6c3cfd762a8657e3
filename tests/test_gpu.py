"""What only an accelerator runs: every family of the architecture registry against its skip reference in bf16,
and FSDP2 healing through `ghosted heal` on one CUDA process (NCCL, DTensor shards on the GPU: the code path
the CPU runs of tests/test_healing_runs.py cannot reach). Collected only where CUDA is available (or where
GHOSTED_GPU_TESTS_DEVICE names another device, to check the checks): `pytest -m gpu` on a GPU machine."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_architectures import FAMILIES, REMOVALS, recovery, skipped_reference_logits
from test_healing_runs import ENV, SHARDED, free_port
from tiny import batch, tiny_family

from ghosted_hf import prune_layers

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("GHOSTED_GPU_TESTS_DEVICE", "cuda")


def on(tensors: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in tensors.items()}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_equals_the_skipped_reference_in_bf16(model_type: str) -> None:
    """bf16 rounds every product, so the pruned model is held to the error of the reference itself computed in
    bf16 on the device (both against the float32 reference): at most twice it, plus 1% of the logits' scale."""
    for removed in REMOVALS:
        dense = tiny_family(model_type)
        operators, normed = recovery(removed)
        exact = skipped_reference_logits(dense, removed, operators, normed, batch())
        low = copy.deepcopy(dense).to(DEVICE, torch.bfloat16)
        reference = skipped_reference_logits(low, removed, on(operators, DEVICE), on(normed, DEVICE),
                                             on(batch(), DEVICE)).float().cpu()
        pruned = prune_layers(low, removed, operators, normed=normed, operator_kind="ghost")
        with torch.no_grad():
            got = pruned(**on(batch(), DEVICE)).logits.float().cpu()
        scale = float(exact.abs().max())
        reference_error, error = float((reference - exact).abs().max()), float((got - exact).abs().max())
        assert torch.isfinite(got).all() and error <= 2 * reference_error + 0.01 * scale, \
            (model_type, removed, error, reference_error, scale)


@pytest.mark.slow
def test_fsdp2_healing_on_one_cuda_process_gives_the_model_of_plain_healing(dense_folder: Path,
                                                                             tmp_path: Path) -> None:
    """One process under accelerate's FSDP2 config shards nothing across peers but runs every FSDP2 step on the
    GPU (fully_shard, DTensor parameters, the full-state-dict gather before the merge): its model equals the one
    plain healing gives in fp32, and a bf16 run distilling from the dense model completes."""
    from ghosted_hf.cli import main

    cal = tmp_path / "cal.txt"
    assert main(["prune", str(dense_folder), "--calibration", str(cal), "--num-layers", "2", "--seq-len", "48",
                 "--num-sequences", "16", "--output", str(tmp_path / "pruned")]) == 0
    flags = ["heal", tmp_path / "pruned", "--data", cal, "--max-steps", "4", "--seq-len", "32", "--eval-sequences", "2",
             "--per-device-train-batch-size", "4"]
    heal = [sys.executable, "-m", "ghosted_hf.cli", *map(str, flags)]
    one = subprocess.run([*heal, "--precision", "fp32", "--output", str(tmp_path / "one")], capture_output=True,
                         text=True, timeout=300, env=ENV)
    assert one.returncode == 0, one.stderr[-3000:]
    config, only_sharded_writes = SHARDED["fsdp"]
    (tmp_path / "accelerate.yaml").write_text(config.replace("num_processes: 2", "num_processes: 1"))

    def fsdp(name: str, *more: str) -> dict[str, torch.Tensor]:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "accelerate.yaml"),
                  "--main_process_port", str(free_port())]
        run = subprocess.run([*launch, "-m", "ghosted_hf.cli", *map(str, flags), "--save-steps", "2",
                              "--checkpoints", str(tmp_path / f"{name}.checkpoints"), "--output", str(tmp_path / name),
                              *more], capture_output=True, text=True, timeout=300, env=ENV)
        assert run.returncode == 0, (name, run.stderr[-3000:])
        assert "which accelerate applies on GPUs" not in run.stderr, run.stderr[-3000:]  # FSDP was applied
        assert (tmp_path / f"{name}.checkpoints" / "checkpoint-2" / only_sharded_writes).exists(), name  # sharded
        return load_file(tmp_path / name / "model.safetensors")

    healed = fsdp("fp32", "--precision", "fp32")
    reference = load_file(tmp_path / "one" / "model.safetensors")
    assert healed.keys() == reference.keys() and reference
    worst = max(float((healed[k].float() - reference[k].float()).abs().max()) for k in reference)
    assert worst <= 1e-4, worst
    distilled = fsdp("bf16", "--precision", "bf16", "--teacher", str(dense_folder), "--kd-weight", "0.5")
    assert all(torch.isfinite(t.float()).all() for t in distilled.values())
    assert any(not torch.equal(distilled[k], reference[k]) for k in reference)
