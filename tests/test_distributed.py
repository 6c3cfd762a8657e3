"""Data-parallel calibration on torch.distributed (gloo on CPU): 2 processes give what 1 process gives."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tiny import build, char_tokenizer, texts, tiny_family

from ghosted_hf.statistics import CalibrationStatistics

pytestmark = pytest.mark.distributed


OPTIONS = dict(num_layers=2, seq_len=32, num_sequences=14, batch_size=2)  # 7 batches: shares of 4 and 3
CASES = {"ghost-aware": dict(OPTIONS), "shortgpt-sequential": dict(OPTIONS, criterion="shortgpt", num_layers=3,
                                                                     fitting="sequential")}
MIXED = dict(unit="mixed", remove="30%", seq_len=32, num_sequences=14, batch_size=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dispatched(model: torch.nn.Module) -> torch.nn.Module:
    """`model` dispatched by accelerate with a per-module device_map: every decoder layer gets its own hook."""
    from accelerate import dispatch_model

    names = ["model.embed_tokens", "model.rotary_emb", "model.norm", "lm_head"]
    device_map = {name: "cpu" for name in names + [f"model.layers.{i}" for i in range(len(model.model.layers))]}
    model = dispatch_model(model, device_map, force_hooks=True)
    assert all(hasattr(layer, "_hf_hook") for layer in model.model.layers)
    return model


def outcome(ghosted: torch.nn.Module) -> tuple:
    """(removed layers and replaced sub-blocks, every operator and map, the batches of each pass)."""
    from ghosted_hf.architectures import decoder_layers

    maps = {f"{r['original_layer']}.{r['block']}": decoder_layers(ghosted)[r["layer"]].get_submodule(r["module"])
            for r in getattr(ghosted.config, "ghost_subblocks", [])}
    return ((ghosted.config.removed_layers, sorted(maps)),
            {**{k: v.detach().clone() for k, v in ghosted.ghost_operators().items()},
             **{k: m.ghost.operator.detach().clone() for k, m in maps.items()}},
            [p["batches"] for p in ghosted.config.ghost_provenance["cost"]["passes"]])


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    """What a user script under torchrun does: no distributed code of its own."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from ghosted_hf.pipelines.prune import calibrate, ghost_prune
    from ghosted_hf.utils.distributed import is_main_process

    stats = calibrate(build("llama"), char_tokenizer(), texts(), **OPTIONS)
    results = {}
    for name, options in CASES.items():
        ghosted = ghost_prune(build("llama"), char_tokenizer(), texts(), **options)
        results[name] = outcome(ghosted)
    # A model dispatched with a device_map inside the rank (accelerate hooks on every layer) changes nothing.
    results["ghost-aware-dispatched"] = outcome(ghost_prune(dispatched(build("llama")), char_tokenizer(), texts(),
                                                            **CASES["ghost-aware"]))
    # Sub-blocks and whole layers chosen by their measured damage and fitted down the network: the same choice and maps.
    results["mixed"] = outcome(ghost_prune(build("llama"), char_tokenizer(), texts(), **MIXED))
    from ghosted_hf.architectures import ARCHITECTURES

    for model_type in sorted(ARCHITECTURES):  # every family of the registry, a normed fit included
        results[model_type] = outcome(ghost_prune(tiny_family(model_type), char_tokenizer(), texts(),
                                                  **OPTIONS, operator="ghost-normed"))
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
    # The dispatched model, in 1 and in 2 processes, gives what the plain model gives in 1 process; so does every
    # family of the architecture registry.
    families = [name for name in single if name not in CASES and name not in ("ghost-aware-dispatched", "mixed")]
    assert len(families) >= 39
    for name, reference in [*((n, n) for n in [*CASES, *families]), ("ghost-aware-dispatched", "ghost-aware")]:
        removed, operators, batches = single[reference]
        for rank, result in enumerate([single] + ranks):
            assert result[name][0] == removed, (name, rank)
            assert set(result[name][1]) == set(operators)
            for key, operator in operators.items():
                assert float((result[name][1][key] - operator).abs().max()) <= 1e-6, (name, rank, key)
        assert [b for b in ranks[0][name][2]] == [4] * len(batches) and ranks[1][name][2] == [3] * len(batches)
    assert len(single["shortgpt-sequential"][2]) >= 2  # the sequential passes were reduced too
    (removed, replaced), maps, _ = single["mixed"]
    assert replaced and maps
    for rank, result in enumerate(ranks):
        assert result["mixed"][0] == (removed, replaced), rank
        for key, value in maps.items():
            assert float((result["mixed"][1][key] - value).abs().max()) <= 1e-6, (rank, key)


def test_statistics_of_a_model_loaded_with_a_device_map(tmp_path: Path) -> None:
    """from_pretrained(device_map=...) with layers split over "cpu" and "disk" (accelerate hooks that move or
    load each layer's weights on every call): the same statistics as the plain model."""
    from tiny import LAYERS, PAD, sequences
    from transformers import AutoModelForCausalLM

    from ghosted_hf.statistics import collect_statistics, least_squares, mlp_terms, similarity
    from ghosted_hf.text.tokens import batch_sequences

    build("llama").save_pretrained(tmp_path / "model")
    plan = least_squares(0, 3) | least_squares(2, LAYERS) | similarity(1, 4) | mlp_terms(2, 4)
    batches = batch_sequences(sequences(), 4, PAD)
    plain = collect_statistics(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), batches, plan, progress=False)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "disk" if i in (1, 3) else "cpu" for i in range(LAYERS)}}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                 offload_folder=str(tmp_path / "offload"))
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}
    assert model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # loaded by its hook on each call
    stats = collect_statistics(model, batches, plan, progress=False)
    assert stats.tokens == plain.tokens and set(stats.tensors) == set(plain.tensors)
    for key, expected in plain.tensors.items():
        torch.testing.assert_close(stats.tensors[key], expected, rtol=1e-10, atol=1e-10 * float(expected.abs().max()),
                                   msg=key)


def mpi_rank(rank: int, world: int, port: int, out: str) -> None:
    """A process as mpirun starts it (accelerate launch --cpu --num_processes N --mpirun_hostfile ...)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(name, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMPI_COMM_WORLD_RANK=str(rank),
                      OMPI_COMM_WORLD_SIZE=str(world), OMPI_COMM_WORLD_LOCAL_RANK=str(rank))
    import torch.distributed as dist

    from ghosted_hf.utils.distributed import process_rank

    joined = process_rank()
    summed = torch.tensor([rank + 1.0])
    if joined[1] > 1:
        dist.all_reduce(summed)
        dist.destroy_process_group()
    torch.save((joined, float(summed)), f"{out}/mpi{rank}.pt")


def test_launcher_environments(tmp_path: Path) -> None:
    from ghosted_hf.utils.distributed import launcher_process

    assert launcher_process({}) == (0, 1, 0)
    assert launcher_process({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == (3, 4, 1)  # torchrun
    assert launcher_process({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "0"}) == (2, 3, 0)  # Open MPI
    assert launcher_process({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}) == (1, 2, 1)  # MPICH, Intel MPI
    # Two processes described the way mpirun describes them join one gloo group.
    context = mp.start_processes(mpi_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn",
                                 join=False)
    for process in context.processes:
        process.join(timeout=120)
    assert all(p.exitcode == 0 for p in context.processes), [p.exitcode for p in context.processes]
    assert [torch.load(tmp_path / f"mpi{r}.pt") for r in range(2)] == [((0, 2), 3.0), ((1, 2), 3.0)]


LAUNCHERS = {
    "torchrun": lambda port: ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                              "--master-port", str(port)],
    # On a machine without GPUs, accelerate's --multi_gpu launcher is torchrun underneath and our processes use
    # gloo; its --cpu launcher starts one process (or N under mpirun), see test_launcher_environments.
    "accelerate": lambda port: ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                                "--main_process_port", str(port)],
}


def test_prune_under_torchrun_and_accelerate_launch_writes_once_and_matches_one_process(tmp_path: Path) -> None:
    build("llama").save_pretrained(tmp_path / "dense")
    char_tokenizer().save_pretrained(tmp_path / "dense")
    (tmp_path / "cal.txt").write_text("\n\n".join(texts()))
    flags = ["prune", tmp_path / "dense", "--calibration", tmp_path / "cal.txt", "--num-layers", "2", "--seq-len", "32",
             "--num-sequences", "14", "--batch-size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "ghosted_hf.cli", *map(str, flags), "--output", tmp_path / "one"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr
    import json

    from safetensors.torch import load_file

    a = load_file(tmp_path / "one" / "model.safetensors")
    for launcher, command in LAUNCHERS.items():
        two = subprocess.run([sys.executable, *command(free_port()), "-m", "ghosted_hf.cli", *map(str, flags),
                              "--output", tmp_path / launcher], capture_output=True, text=True, timeout=300, env=env)
        assert two.returncode == 0, (launcher, two.stderr[-3000:])
        assert two.stdout.count("Saved to") == 1, launcher  # only rank 0 reports and writes
        b = load_file(tmp_path / launcher / "model.safetensors")
        assert set(a) == set(b)
        ghosts = [k for k in a if ".ghost." in k]
        assert ghosts and all(float((a[k] - b[k]).abs().max()) <= 1e-6 for k in ghosts), launcher
        assert all(torch.equal(a[k], b[k]) for k in a if k not in ghosts), launcher
        config = json.loads((tmp_path / launcher / "config.json").read_text())
        assert config["removed_layers"] == json.loads((tmp_path / "one" / "config.json").read_text())["removed_layers"]
        assert config["ghost_provenance"]["calibration"]["processes"] == 2, launcher
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["cal.txt", "dense", "one", *LAUNCHERS])


def run_disagreeing_rank(rank: int, world: int, port: int, out: str, differs: str) -> None:
    """Rank 1 is given other calibration text, or a model of the same shape with other weights, than rank 0."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from ghosted_hf.errors import GhostedError
    from ghosted_hf.pipelines.prune import ghost_prune

    if differs == "--output":  # only rank 0 writes: rank 1's other --output must not be ignored without a word
        import contextlib
        import io

        from ghosted_hf.cli import main

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = main(["prune", str(Path(out, "dense")), "--calibration", str(Path(out, "cal.txt")), "--num-layers",
                           "2", "--seq-len", "32", "--num-sequences", "8", "--output", str(Path(out, f"out{rank}"))])
        lines = [line for line in err.getvalue().splitlines() if "error:" in line]
        Path(out, f"rank{rank}.txt").write_text(lines[-1].split("error: ", 1)[1] if status == 2 else "no error")
        return
    text_seed, model_seed = (rank, 0) if differs == "calibration data" else (0, rank)
    try:
        ghost_prune(build("llama", seed=model_seed), char_tokenizer(), texts(seed=text_seed), **OPTIONS)
        message = "no error"
    except GhostedError as error:
        message = str(error)
    Path(out, f"rank{rank}.txt").write_text(message)


def rank_messages(run, tmp_path: Path, differs: str, timeout: float = 300) -> list[str]:
    """What each of 2 spawned processes running `run(rank, world, port, out, differs)` wrote to out/rank<r>.txt."""
    context = mp.start_processes(run, args=(2, free_port(), str(tmp_path), differs), nprocs=2, start_method="spawn",
                                 join=False)
    for process in context.processes:
        process.join(timeout=timeout)
    return [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]


@pytest.mark.parametrize("differs", ["calibration data", "model", "--output"])
def test_a_rank_that_differs_fails_every_rank_before_any_pass(differs: str, tmp_path: Path) -> None:
    if differs == "--output":
        build("llama").save_pretrained(tmp_path / "dense")
        char_tokenizer().save_pretrained(tmp_path / "dense")
        (tmp_path / "cal.txt").write_text("\n\n".join(texts()))
    for rank, message in enumerate(rank_messages(run_disagreeing_rank, tmp_path, differs)):
        assert message.startswith(f"Process 1 of 2 has another {differs} than process 0"), (rank, message)


@pytest.mark.parametrize("command", ["prune", "heal"])
def test_a_process_whose_peers_never_start_stops_with_one_line(command: str, dense_folder: Path) -> None:
    """Within GHOSTED_DISTRIBUTED_TIMEOUT, calibration and healing alike (accelerate alone would wait torch's default
    30 minutes on CPU processes)."""
    calibration = dense_folder.parent / "cal.txt"
    if command == "heal":
        from tiny import char_tokenizer, texts

        from ghosted_hf import ghost_prune

        ghost_prune(build("llama"), char_tokenizer(), texts(), num_layers=2, seq_len=32,
                    num_sequences=8).save_pretrained(dense_folder.parent / "pruned")
        char_tokenizer().save_pretrained(dense_folder.parent / "pruned")
        arguments = ["heal", str(dense_folder.parent / "pruned"), "--data", str(calibration), "--steps", "2",
                     "--seq-len", "32", "--output", str(dense_folder.parent / "healed")]
    else:
        arguments = ["prune", str(dense_folder), "--calibration", str(calibration), "--num-layers", "2", "--seq-len",
                     "32", "--num-sequences", "8", "--dry-run"]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "2",
           "LOCAL_RANK": "0", "GHOSTED_DISTRIBUTED_TIMEOUT": "3"}
    done = subprocess.run([sys.executable, "-m", "ghosted_hf.cli", *arguments], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert "Process 0 of 2 found no peers at 127.0.0.1" in last and "within 3 s" in last, last
    # while it waits, it says for what and for how long (after half the timeout, here 1.5 s)
    assert "Process 0 of 2: waiting for the other processes at 127.0.0.1" in done.stderr and "up to 3 s" in done.stderr


def run_leaving_rank(rank: int, world: int, port: int, out: str, case: str) -> None:
    """Rank 0 writes for 2 s before the command ends on both (completed, or failed on `case`'s ranks); rank 1
    reports whether the write was there when it left the group, and what it logged."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), GHOSTED_DISTRIBUTED_TIMEOUT="60")
    import logging

    from ghosted_hf.utils.distributed import init_distributed, leave_process_group

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("ghosted_hf").addHandler(handler)
    assert init_distributed()
    written = Path(out, "written")
    if rank == 0:
        time.sleep(2)
        written.write_text("model")
    failed = {"completed": (), "both failed": (0, 1), "main failed": (0,)}[case]
    leave_process_group(completed=rank not in failed)
    Path(out, f"rank{rank}.txt").write_text(f"saw the write: {written.exists()}; logged: {records}")


@pytest.mark.parametrize("case", ["completed", "both failed", "main failed"])
def test_after_a_command_processes_leave_once_the_main_one_has_written(case: str, tmp_path: Path) -> None:
    """A peer leaving early (and crashing in its teardown) would have its launcher end the main process mid-write.
    After a failure nobody waits (peers may never come), and a process whose peer failed says so in one line."""
    started = time.monotonic()
    saw = rank_messages(run_leaving_rank, tmp_path, case, timeout=120)[1]
    assert time.monotonic() - started < 100
    assert saw.startswith(f"saw the write: {case != 'both failed'}; logged: "), saw
    assert ("Process 1 of 2 finished, but its peers did not" in saw) == (case == "main failed"), saw
