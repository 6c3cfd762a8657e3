"""Data-parallel calibration on torch.distributed (gloo on CPU): 2 processes give what 1 process gives."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ghosted_hf.calibration import CalibrationStatistics
from tiny import build, char_tokenizer, texts

OPTIONS = dict(num_layers=2, seq_len=32, num_sequences=14, batch_size=2)  # 7 batches: shares of 4 and 3
CASES = {"ghost-aware": dict(OPTIONS), "shortgpt-sequential": dict(OPTIONS, criterion="shortgpt", num_layers=3,
                                                                     fitting="sequential")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    """What a user script under torchrun does: no distributed code of its own."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from ghosted_hf.calibration import is_main_process
    from ghosted_hf.recipe import calibrate, ghost_prune

    stats = calibrate(build("llama"), char_tokenizer(), texts(), **OPTIONS)
    results = {}
    for name, options in CASES.items():
        ghosted = ghost_prune(build("llama"), char_tokenizer(), texts(), **options)
        results[name] = (ghosted.config.removed_layers, {k: v.detach().clone() for k, v in ghosted.ghost_operators().items()},
                         [p["batches"] for p in ghosted.config.ghost_provenance["cost"]["passes"]])
    torch.save(results, f"{out}/rank{rank}.pt")  # every rank reports, to compare them
    if is_main_process():
        stats.save(f"{out}/stats.safetensors")
    import torch.distributed as dist

    if world > 1:
        dist.destroy_process_group()


def run(world: int, out: Path) -> None:
    out.mkdir()
    if world == 1:
        run_rank(0, 1, 0, str(out))
        return
    context = mp.start_processes(run_rank, args=(world, free_port(), str(out)), nprocs=world, start_method="spawn",
                                 join=False)
    for process in context.processes:
        process.join(timeout=300)
    assert all(p.exitcode == 0 for p in context.processes), [p.exitcode for p in context.processes]


def test_two_gloo_processes_equal_one(tmp_path: Path) -> None:
    run(1, tmp_path / "one")
    run(2, tmp_path / "two")
    one = CalibrationStatistics.load(tmp_path / "one" / "stats.safetensors")
    two = CalibrationStatistics.load(tmp_path / "two" / "stats.safetensors")
    assert two.tokens == one.tokens and set(two.tensors) == set(one.tensors)
    for key, expected in one.tensors.items():
        torch.testing.assert_close(two.tensors[key], expected, rtol=1e-10, atol=1e-10 * float(expected.abs().max()))
    single = torch.load(tmp_path / "one" / "rank0.pt")
    ranks = [torch.load(tmp_path / "two" / f"rank{r}.pt") for r in range(2)]
    for name in CASES:
        removed, operators, batches = single[name]
        for rank, result in enumerate(ranks):
            assert result[name][0] == removed, (name, rank)
            assert set(result[name][1]) == set(operators)
            for key, operator in operators.items():
                assert float((result[name][1][key] - operator).abs().max()) <= 1e-6, (name, rank, key)
        assert [b for b in ranks[0][name][2]] == [4] * len(batches) and ranks[1][name][2] == [3] * len(batches)
    assert len(single["shortgpt-sequential"][2]) >= 2  # the sequential passes were reduced too


def test_prune_under_torchrun_writes_once_and_matches_one_process(tmp_path: Path) -> None:
    build("llama").save_pretrained(tmp_path / "dense")
    char_tokenizer().save_pretrained(tmp_path / "dense")
    (tmp_path / "cal.txt").write_text("\n\n".join(texts()))
    flags = ["prune", tmp_path / "dense", "--calibration", tmp_path / "cal.txt", "--num-layers", "2", "--seq-len", "32",
             "--num-sequences", "14", "--batch-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "ghosted_hf.cli", *map(str, flags), "--output", tmp_path / "one"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(free_port()), "-m", "ghosted_hf.cli", *map(str, flags),
                          "--output", tmp_path / "two"], capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("Saved to") == 1  # only rank 0 reports and writes
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert set(a) == set(b)
    ghosts = [k for k in a if ".ghost." in k]
    assert ghosts and all(float((a[k] - b[k]).abs().max()) <= 1e-6 for k in ghosts)
    assert all(torch.equal(a[k], b[k]) for k in a if k not in ghosts)
    import json

    config = json.loads((tmp_path / "two" / "config.json").read_text())
    assert config["removed_layers"] == json.loads((tmp_path / "one" / "config.json").read_text())["removed_layers"]
    assert config["ghost_provenance"]["calibration"]["processes"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal.txt", "dense", "one", "two"]
