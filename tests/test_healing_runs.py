"""Healing runs as people run them: killed and resumed, and data-parallel under torchrun and accelerate launch
(gloo on CPU), each equal to one uninterrupted single-process run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_distributed import LAUNCHERS, free_port, rank_messages

from ghosted_hf.errors import GhostedError
from ghosted_hf.pipelines.healing import CHECKPOINT_RECORD, check_same_run, resume_point, verified_checkpoint

TESTS = Path(__file__).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def failure(stderr: str) -> str:
    """What a failed launch printed that says why: every line naming an error, an abort or a C++ exception (a
    crashing rank prints them long before the launcher's summary), then the end of the output."""
    why = [line for line in stderr.splitlines() if re.search(r"Error|error:|terminate|abort|what\(\)|Signal", line)]
    return "\n".join(why[-40:]) + "\n...\n" + stderr[-2000:]


# One process: prune the tiny model, then heal it, killing itself (SIGKILL) after `kill_at` steps if asked.
RUN = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from safetensors.torch import save_file
from transformers import TrainerCallback
from ghosted_hf import ghost_prune
from ghosted_hf.pipelines.healing import heal
from tiny import build, char_tokenizer, texts

class Kill(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)

model = ghost_prune(build("llama"), char_tokenizer(), texts(), criterion="manual", layers=[2, 3], seq_len=48,
                    num_sequences=24)
healed = heal(model, char_tokenizer(), texts(), max_steps=7, save_steps=2, seq_len=48, eval_sequences=2, eval_steps=3,
              checkpoints={checkpoints!r}, resume={resume!r}, callbacks=[Kill()], progress=False)
save_file({{n: p.detach().contiguous() for n, p in healed.model.named_parameters() if "lora_" in n}}, {out!r})
"""


def run(tmp_path: Path, name: str, kill_at: int = -1, resume: str | None = None) -> subprocess.CompletedProcess:
    script = RUN.format(tests=str(TESTS), kill_at=kill_at, checkpoints=str(tmp_path / f"{name}-checkpoints"),
                        resume=resume, out=str(tmp_path / f"{name}.safetensors"))
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=ENV)


@pytest.mark.slow
def test_killed_and_resumed_healing_ends_with_the_adapters_of_an_uninterrupted_run(tmp_path: Path) -> None:
    assert run(tmp_path, "whole").returncode == 0
    killed = run(tmp_path, "resumed", kill_at=5)
    assert killed.returncode == -9 and not (tmp_path / "resumed.safetensors").exists()
    checkpoints = tmp_path / "resumed-checkpoints"
    assert sorted(p.name for p in checkpoints.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    resumed = run(tmp_path, "resumed", resume="last")  # from checkpoint-4: steps 5-7 again
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole, again = load_file(tmp_path / "whole.safetensors"), load_file(tmp_path / "resumed.safetensors")
    assert whole.keys() == again.keys() and len(whole) == 4 * 7 * 2
    assert all(torch.equal(whole[k], again[k]) for k in whole)  # same seed, same data order: the same run


def test_resume_takes_the_newest_complete_checkpoint_and_checks_its_files(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"weights %d" % step)
    import hashlib
    import json

    for step in (2, 4):  # checkpoint-6 was being written when the run was killed: it has no record
        folder = tmp_path / f"checkpoint-{step}"
        files = {"adapter_model.safetensors": hashlib.sha256(b"weights %d" % step).hexdigest()}
        (folder / CHECKPOINT_RECORD).write_text(json.dumps({"step": step, "seconds_spent": 1.0, "run": {},
                                                                  "files": files}))
    assert resume_point(tmp_path, "last") == tmp_path / "checkpoint-4"
    assert verified_checkpoint(tmp_path / "checkpoint-4")["step"] == 4
    with pytest.raises(GhostedError, match="checkpoint-6 is incomplete"):
        verified_checkpoint(tmp_path / "checkpoint-6")
    (tmp_path / "checkpoint-4" / "adapter_model.safetensors").write_bytes(b"weights 5")
    with pytest.raises(GhostedError, match="adapter_model.safetensors is missing or not what the checkpoint recorded"):
        verified_checkpoint(tmp_path / "checkpoint-4")
    with pytest.raises(GhostedError, match="No complete checkpoint under"):
        resume_point(tmp_path / "checkpoint-2", "last")


def test_resume_refuses_a_checkpoint_of_another_run() -> None:
    run = {"options": {"learning_rate": 2e-3, "seq_len": 256}, "data_sha256": "aa", "processes": 1}
    check_same_run({"run": run}, run, Path("checkpoint-4"))
    other = {**run, "options": {"learning_rate": 1e-3, "seq_len": 256}, "processes": 2}
    with pytest.raises(GhostedError, match=r"checkpoint-4 was written by another run \(learning_rate 0.002 then, 0.001 now, "
                                           r"processes 1 then, 2 now\)"):
        check_same_run({"run": run}, other, Path("checkpoint-4"))


def test_resume_refuses_a_checkpoint_written_while_healing_another_model(tmp_path: Path) -> None:
    """Same shapes, options and data, other weights: the checkpoint's adapters belong to the other model."""
    from tiny import build, char_tokenizer, texts

    from ghosted_hf import ghost_prune
    from ghosted_hf.pipelines.healing import heal

    def model(seed: int):
        return ghost_prune(build("llama", seed=seed), char_tokenizer(), texts(), criterion="manual", layers=[2, 3],
                           seq_len=48, num_sequences=24)

    options = dict(max_steps=2, save_steps=1, seq_len=48, checkpoints=tmp_path / "checkpoints", progress=False)
    heal(model(0), char_tokenizer(), texts(), **options)
    heal(model(0), char_tokenizer(), texts(), resume="last", **options)  # the same model resumes
    with pytest.raises(GhostedError, match=r"checkpoint-\d was written by another run \(.*model_weights_sha256 .* then"):
        heal(model(1), char_tokenizer(), texts(), resume="last", **options)


def test_a_checkpoints_folder_belongs_to_one_run_and_never_to_a_model(tmp_path: Path) -> None:
    """Rotation deletes the oldest checkpoints of the folder: a second run there (or a run while another uses it)
    is refused, and checkpoints are never written into a model folder."""
    from tiny import build, char_tokenizer, texts

    from ghosted_hf import ghost_prune, save_with_card
    from ghosted_hf.cli import main
    from ghosted_hf.pipelines.healing import RUN_RECORD, heal

    def model():  # heal wraps the model it trains: each run gets a fresh one
        return ghost_prune(build("llama"), char_tokenizer(), texts(), criterion="manual", layers=[2, 3], seq_len=48,
                           num_sequences=24)

    options = dict(max_steps=2, save_steps=1, seq_len=48, eval_sequences=0, checkpoints=tmp_path / "ck", progress=False)
    heal(model(), char_tokenizer(), texts(), **options)
    with pytest.raises(GhostedError, match=r"ck already holds checkpoints: continue that run with --resume last"):
        heal(model(), char_tokenizer(), texts(), **{**options, "learning_rate": 1e-3})
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        (tmp_path / "ck" / RUN_RECORD).write_text(json.dumps({"process": f"{socket.gethostname()}~{sleeper.pid}"}))
        with pytest.raises(GhostedError, match=rf"ck is in use by a running heal \(process .*~{sleeper.pid}\)"):
            heal(model(), char_tokenizer(), texts(), resume="last", **options)
    finally:
        sleeper.kill()
        sleeper.wait()
    heal(model(), char_tokenizer(), texts(), resume="last", **options)  # its process is gone: the folder is free
    folder = save_with_card(model(), tmp_path / "model", char_tokenizer())
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(folder)
    saved = sorted(p.name for p in folder.iterdir())
    with pytest.raises(GhostedError, match=r"lies inside the model folder"):
        heal(loaded, char_tokenizer(), texts(), **{**options, "checkpoints": folder / "ck"})
    assert sorted(p.name for p in folder.iterdir()) == saved
    (tmp_path / "cal.txt").write_text("\n\n".join(texts()))
    for checkpoints in (tmp_path / "out" / "ck", folder / "ck"):
        code = main(["heal", str(folder), "--data", str(tmp_path / "cal.txt"), "--output", str(tmp_path / "out"),
                     "--checkpoints", str(checkpoints), "--save-steps", "1", "--max-steps", "1"])
        assert code == 2 and not checkpoints.exists()


@pytest.mark.distributed
def test_heal_under_torchrun_and_accelerate_launch_gives_the_adapters_of_one_process(dense_folder: Path,
                                                                                     tmp_path: Path) -> None:
    """2 processes of 2 sequences a step train as 1 process of 4: DDP averages the two halves' gradients, which
    equals the full batch's mean gradient because every sequence has as many tokens. Only the order of float
    additions differs (the all-reduce), so the adapters agree to 1e-5 after 4 AdamW steps, not bit for bit."""
    from ghosted_hf.cli import main

    cal = tmp_path / "cal.txt"
    assert main(["prune", str(dense_folder), "--calibration", str(cal), "--num-layers", "2", "--seq-len", "48",
                 "--num-sequences", "16", "--output", str(tmp_path / "pruned")]) == 0
    flags = ["heal", tmp_path / "pruned", "--data", cal, "--max-steps", "4", "--seq-len", "32", "--precision", "fp32",
             "--eval-sequences", "2", "--adapter-only"]
    one = subprocess.run([sys.executable, "-m", "ghosted_hf.cli", *map(str, flags), "--per-device-train-batch-size",
                          "4", "--output", tmp_path / "one"], capture_output=True, text=True, timeout=300, env=ENV)
    assert one.returncode == 0, one.stderr[-3000:]
    reference = load_file(tmp_path / "one" / "adapter_model.safetensors")
    for launcher, command in LAUNCHERS.items():
        two = subprocess.run([sys.executable, *command(free_port()), "-m", "ghosted_hf.cli", *map(str, flags),
                              "--per-device-train-batch-size", "2", "--output", tmp_path / launcher],
                             capture_output=True, text=True, timeout=300, env=ENV)
        assert two.returncode == 0, (launcher, failure(two.stderr))
        assert two.stdout.count("Saved the adapter") == 1, launcher  # only rank 0 reports and writes
        adapters = load_file(tmp_path / launcher / "adapter_model.safetensors")
        assert adapters.keys() == reference.keys() and reference
        worst = max(float((adapters[k] - reference[k]).abs().max()) for k in reference)
        assert worst <= 1e-5, (launcher, worst)


# Configs of the two sharded trainings accelerate runs, each writing a file only it writes in its checkpoints.
SHARDED = {
    "fsdp": ("""distributed_type: FSDP
num_processes: 2
mixed_precision: 'no'
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_reshard_after_forward: true
""", "pytorch_model_fsdp.bin"),
    # ZeRO-3 keeps parameters under its persistence threshold whole: 0 partitions even the tiny model's
    "deepspeed": ("""distributed_type: DEEPSPEED
num_processes: 2
deepspeed_config:
  deepspeed_config_file: {folder}/zero3.json
  zero3_init_flag: false
""", "global_step2"),
}
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                               "stage3_gather_16bit_weights_on_model_save": True},
         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
         "gradient_clipping": "auto"}


@pytest.mark.distributed
@pytest.mark.parametrize("sharding", SHARDED)
def test_sharded_healing_gives_the_model_of_one_process_and_resumes(sharding: str, dense_folder: Path,
                                                                    tmp_path: Path) -> None:
    """FSDP2 and DeepSpeed ZeRO-3 over 2 gloo processes (`tests/fsdp_on_cpu` lets accelerate apply FSDP on CPUs),
    distilling from the dense model with the next-token loss mixed in: each process holds a shard of every
    parameter (the student's output layer too, which the chunked KL calls outside the model's forward), so the
    healed model is gathered from both before rank 0 merges and writes it. It equals the model of 1 process at the
    same global batch to 1e-5 (the gradient reduction adds the halves in another order), and a run resumed from its
    step-2 checkpoint ends with the same model bit for bit."""
    from ghosted_hf.cli import main

    cal = tmp_path / "cal.txt"
    assert main(["prune", str(dense_folder), "--calibration", str(cal), "--num-layers", "2", "--seq-len", "48",
                 "--num-sequences", "16", "--output", str(tmp_path / "pruned")]) == 0
    flags = ["heal", tmp_path / "pruned", "--data", cal, "--max-steps", "4", "--seq-len", "32", "--precision", "fp32",
             "--eval-sequences", "2", "--teacher", dense_folder, "--kd-weight", "0.5", "--kl-chunk", "16"]
    one = subprocess.run([sys.executable, "-m", "ghosted_hf.cli", *map(str, flags), "--per-device-train-batch-size",
                          "4", "--output", tmp_path / "one"], capture_output=True, text=True, timeout=300, env=ENV)
    assert one.returncode == 0, one.stderr[-3000:]
    config, only_sharded_writes = SHARDED[sharding]
    (tmp_path / "accelerate.yaml").write_text(config.format(folder=tmp_path))
    (tmp_path / "zero3.json").write_text(json.dumps(ZERO3))
    # DeepSpeed JIT-compiles its kernels under a file lock in ~/.cache/torch_extensions, which a run killed while
    # compiling leaves behind for every later run to wait on forever: whatever it compiles (fsdp_on_cpu spares it the
    # shared-memory kernel), it compiles in this test's own folder
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(TESTS / "fsdp_on_cpu"), os.environ.get("PYTHONPATH", "")]),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}

    def sharded(name: str, *more: str) -> dict[str, torch.Tensor]:
        launch = ["-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "accelerate.yaml"),
                  "--main_process_port", str(free_port())]
        two = subprocess.run([sys.executable, *launch, "-m", "ghosted_hf.cli", *map(str, flags),
                              "--per-device-train-batch-size", "2", "--save-steps", "2", "--checkpoints", str(tmp_path / f"{name}.checkpoints"),
                              "--output", str(tmp_path / name), *more], capture_output=True, text=True, timeout=300,
                             env=env)
        assert two.returncode == 0, (name, failure(two.stderr))
        assert two.stdout.count("Saved the merged model") == 1, name  # only rank 0 writes
        return load_file(tmp_path / name / "model.safetensors")

    healed = sharded("sharded")
    assert (tmp_path / "sharded.checkpoints" / "checkpoint-2" / only_sharded_writes).exists()  # it ran sharded
    reference = load_file(tmp_path / "one" / "model.safetensors")
    assert healed.keys() == reference.keys()
    assert max(float((healed[k] - reference[k]).abs().max()) for k in reference) <= 1e-5
    (tmp_path / "resumed.checkpoints").mkdir()
    os.rename(tmp_path / "sharded.checkpoints" / "checkpoint-2", tmp_path / "resumed.checkpoints" / "checkpoint-2")
    resumed = sharded("resumed", "--resume", "last")
    assert all(torch.equal(resumed[k], healed[k]) for k in healed)


# The CLI, writing to rows-RANK.txt beside itself the most logit rows any forward of a Gemma 2 model (the student's or
# the teacher's) has made (after each forward: a rank the launcher ends at once runs no exit handler).
COUNTING_LOGITS = """
import os, sys
import transformers.models.gemma2.modeling_gemma2 as gemma2
most, forward = [0], gemma2.Gemma2ForCausalLM.forward
record = os.path.join(os.path.dirname(__file__), "rows-" + os.environ.get("RANK", "one") + ".txt")
def counted(self, *args, **kwargs):
    output = forward(self, *args, **kwargs)
    if output.logits.shape[:-1].numel() > most[0]:
        most[0] = output.logits.shape[:-1].numel()
        with open(record, "w") as file:
            file.write(str(most[0]))
    return output
gemma2.Gemma2ForCausalLM.forward = counted
from ghosted_hf.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.distributed
@pytest.mark.parametrize("sharding, train_final", [("fsdp", False), ("deepspeed", False), ("deepspeed", True)])
def test_sharded_healing_runs_a_soft_capped_head_in_chunks(sharding: str, train_final: bool, tmp_path: Path) -> None:
    """Gemma 2 (soft-capped logits: its head is more than its output layer) distilled under FSDP2 and ZeRO-3 over 2
    gloo processes: the family's head runs a chunk of positions at a time, its parameters gathered through the sharded
    model, so no forward of the student or the teacher makes more than --kl-chunk rows of logits; the healed model is
    the one process's to 1e-5. The one exception, ZeRO-3 training the operator before the final norm (the last layer
    removed, --train-operators), trains it through whole logits (ZeRO-3 partitions it again before the backward
    pass): the same model too."""
    from tiny import char_tokenizer, texts, tiny_family

    from ghosted_hf.cli import main

    tiny_family("gemma2").save_pretrained(tmp_path / "dense")
    char_tokenizer().save_pretrained(tmp_path / "dense")
    (tmp_path / "cal.txt").write_text("\n\n".join(texts()))
    removal = ["--criterion", "manual", "--layers", "5"] if train_final else ["--num-layers", "1"]
    assert main(["prune", str(tmp_path / "dense"), "--calibration", str(tmp_path / "cal.txt"), *removal,
                 "--seq-len", "48", "--num-sequences", "16", "--output", str(tmp_path / "pruned")]) == 0
    (tmp_path / "counting.py").write_text(COUNTING_LOGITS)
    flags = [tmp_path / "counting.py", "heal", tmp_path / "pruned", "--data", tmp_path / "cal.txt", "--max-steps", "3",
             "--seq-len", "32", "--precision", "fp32", "--eval-sequences", "2", "--teacher", tmp_path / "dense",
             "--kd-weight", "0.5", "--kl-chunk", "16", *(["--train-operators"] if train_final else [])]
    one = subprocess.run([sys.executable, *map(str, flags), "--per-device-train-batch-size", "4", "--output",
                          str(tmp_path / "one")], capture_output=True, text=True, timeout=300, env=ENV)
    assert one.returncode == 0, failure(one.stderr)
    config, only_sharded_writes = SHARDED[sharding]
    (tmp_path / "accelerate.yaml").write_text(config.format(folder=tmp_path))
    (tmp_path / "zero3.json").write_text(json.dumps(ZERO3))
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(TESTS / "fsdp_on_cpu"), os.environ.get("PYTHONPATH", "")]),
           "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions")}
    launch = ["-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "accelerate.yaml"),
              "--main_process_port", str(free_port())]
    two = subprocess.run([sys.executable, *launch, *map(str, flags), "--per-device-train-batch-size", "2",
                          "--save-steps", "2", "--checkpoints", str(tmp_path / "checkpoints"), "--output",
                          str(tmp_path / "sharded")], capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, failure(two.stderr)
    assert (tmp_path / "checkpoints" / "checkpoint-2" / only_sharded_writes).exists()  # it ran sharded
    rows = [int((tmp_path / f"rows-{rank}.txt").read_text()) for rank in ("one", 0, 1)]
    assert rows[0] <= 16, rows
    assert (max(rows[1:]) > 16) == train_final, rows
    healed, reference = (load_file(tmp_path / name / "model.safetensors") for name in ("sharded", "one"))
    assert healed.keys() == reference.keys()
    pruned = load_file(tmp_path / "pruned" / "model.safetensors")
    assert not train_final or not torch.equal(healed["model.norm.ghost.operator"], pruned["model.norm.ghost.operator"])
    assert max(float((healed[k] - reference[k]).abs().max()) for k in reference) <= 1e-5


@pytest.mark.distributed
def test_an_fsdp_config_on_cpu_processes_warns_that_they_train_data_parallel(dense_folder: Path, tmp_path: Path) -> None:
    """Without the gate lifted accelerate trains CPU processes with DDP whatever the config asks: `heal` says so."""
    from ghosted_hf.cli import main

    cal = tmp_path / "cal.txt"
    assert main(["prune", str(dense_folder), "--calibration", str(cal), "--num-layers", "2", "--seq-len", "48",
                 "--num-sequences", "16", "--output", str(tmp_path / "pruned")]) == 0
    (tmp_path / "fsdp.yaml").write_text(SHARDED["fsdp"][0])
    launch = ["-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "fsdp.yaml"), "--main_process_port",
              str(free_port())]
    two = subprocess.run([sys.executable, *launch, "-m", "ghosted_hf.cli", "heal", str(tmp_path / "pruned"), "--data",
                          str(cal), "--max-steps", "1", "--seq-len", "32", "--per-device-train-batch-size", "2",
                          "--eval-sequences", "0", "--adapter-only", "--output", str(tmp_path / "out")], capture_output=True, text=True,
                         timeout=300, env=ENV)
    assert two.returncode == 0, failure(two.stderr)
    assert two.stderr.count("these 2 CPU processes train data-parallel") == 1, two.stderr[-3000:]


def run_disagreeing_healer(rank: int, world: int, port: int, out: str, differs: str) -> None:
    """Rank 1 heals with another option, other data or another model than rank 0 (each on its own CPU process)."""
    torch.set_num_threads(1)
    from tiny import build, char_tokenizer, texts

    from ghosted_hf import ghost_prune
    from ghosted_hf.pipelines.healing import heal

    other = rank == 1
    dense = build("llama", seed=int(other and differs == "model weights"),
                  **({"num_hidden_layers": 5} if other and differs == "model config" else {}))
    model = ghost_prune(dense, char_tokenizer(), texts(), criterion="manual", layers=[2], seq_len=32, num_sequences=8)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), GHOSTED_DISTRIBUTED_TIMEOUT="60")  # after pruning: one process each
    options = dict(max_steps=2 + int(other and differs == "max_steps"),
                   learning_rate=1e-3 * (1 + int(other and differs == "learning_rate")),
                   seq_len=32, per_device_train_batch_size=2, eval_sequences=0, progress=False)
    try:
        heal(model, char_tokenizer(), texts(seed=int(other and differs == "training data")), **options)
        message = "no error"
    except GhostedError as error:
        message = str(error)
    Path(out, f"rank{rank}.txt").write_text(message)


@pytest.mark.distributed
@pytest.mark.parametrize("differs", ["learning_rate", "max_steps", "model config"])  # data and weights: test_distributed.py
def test_a_healing_rank_that_differs_fails_every_rank_before_the_first_step(differs: str, tmp_path: Path) -> None:
    """Other options would train diverging replicas, other steps hang in a collective, another depth fails inside
    DDP: every process checks the run identity of every other first, and each ends with one line."""
    for rank, message in enumerate(rank_messages(run_disagreeing_healer, tmp_path, differs, timeout=240)):
        named = message.removeprefix("Process 1 of 2 has another ").partition(" than process 0")[0].split(", ")
        assert message.startswith("Process 1 of 2 has another") and differs in named, (rank, message)
