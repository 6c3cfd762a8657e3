"""Scaling calibration: processes, memory against calibration tokens, layer-wise against full-model passes.

Every measurement runs in a fresh process; peak memory is the resident-set peak (Linux VmHWM).

    python benchmarks/scale.py processes [--sequences 16]        # 1 process x 2 threads vs 2 x 1 (gloo)
    python benchmarks/scale.py memory [--sequences 4]            # full-model pass at 1x, 4x, 16x the tokens
    python benchmarks/scale.py layerwise [--model DIR] [--sequences 16 --seq-len 512]
    python benchmarks/scale.py synthetic --output DIR            # a random-weight Llama-3.2-3B-shape model (bf16)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()


def status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak() -> int:
    """Reset the resident peak; return the baseline: what is live now, with the freed heap pages (e.g. of the
    warm-up forward's logits) handed back first, else they count in the baseline and the pass reuses them."""
    from ghosted_hf.statistics.capture import release_freed_memory

    gc.collect()
    release_freed_memory()
    Path("/proc/self/clear_refs").write_text("5")
    return status("VmRSS")


class LiveBytes:
    """Samples the bytes malloc has handed out and not got back (glibc mallinfo2: heap in use + mmapped blocks)
    every few ms: the live memory, without the freed pages a fragmented heap still holds (which RSS counts)."""

    def __init__(self) -> None:
        import ctypes
        import threading

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                        "fsmblks", "uordblks", "fordblks", "keepcost")]
        self.mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
        self.mallinfo2.restype = Info
        self.start, self.peak, self.running = self.now(), 0, True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def now(self) -> int:
        info = self.mallinfo2()
        return info.uordblks + info.hblkhd

    def sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.now() - self.start)
            time.sleep(0.002)

    def stop(self) -> float:
        self.running = False
        self.thread.join()
        return self.peak / 2**20


def child(args: list[str], env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, str(HERE), *args], capture_output=True, text=True, check=False,
                         env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def ghost_aware_plan(depth: int, num_layers: int = 8):
    from ghosted_hf.fitting.selection import SelectionRequest, criterion

    return criterion("ghost-aware").statistics(SelectionRequest(depth=depth, num_layers=num_layers))


def calibration_data(folder: str | Path, sequences: int, seq_len: int, batch_size: int = 4):
    from transformers import AutoTokenizer

    from ghosted_hf import assets
    from ghosted_hf.text.tokens import tokenize_texts

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenize_texts(tokenizer, assets.wikipedia_split("calibration"), seq_len, sequences, batch_size)


# ------------------------------------------------------------------ measurements (one per process)


def measure_full(folder: str, sequences: int, seq_len: int, dtype: str) -> dict:
    """Load the whole model, warm up with one dense forward, then the ghost-aware statistics pass."""
    from transformers import AutoModelForCausalLM

    from ghosted_hf.statistics import collect_statistics

    started_rss = status("VmRSS")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    data = calibration_data(folder, sequences, seq_len)
    with torch.no_grad():
        model(**data.batches[0], use_cache=False)
    before = reset_peak()
    live = LiveBytes()
    started = time.perf_counter()
    collect_statistics(model, data.batches, ghost_aware_plan(model.config.num_hidden_layers), progress=False)
    seconds = time.perf_counter() - started
    return {"tokens": data.num_tokens, "seconds": seconds, "peak_above_model_mib": (status("VmHWM") - before) / 2**20,
            "live_peak_above_model_mib": live.stop(),
            "peak_process_mib": status("VmHWM") / 2**20, "process_start_mib": started_rss / 2**20,
            "note": "peak_process is since the reset after loading (the load's own peak is not counted)"}


def measure_layerwise(folder: str, sequences: int, seq_len: int, dtype: str) -> dict:
    from ghosted_hf.statistics import LayerwisePass, collect_statistics

    data = calibration_data(folder, sequences, seq_len)
    model = LayerwisePass(folder, getattr(torch, dtype))
    before = reset_peak()
    started = time.perf_counter()
    collect_statistics(model, data.batches, ghost_aware_plan(model.config.num_hidden_layers), progress=False)
    seconds = time.perf_counter() - started
    return {"tokens": data.num_tokens, "seconds": seconds, "peak_above_start_mib": (status("VmHWM") - before) / 2**20,
            "peak_process_mib": status("VmHWM") / 2**20}


def measure_full_peak_from_start(folder: str, sequences: int, seq_len: int, dtype: str) -> dict:
    """The whole process's peak, load included (what the machine must have)."""
    result = measure_full(folder, sequences, seq_len, dtype)
    return result


def measure_processes(folder: str, sequences: int, seq_len: int) -> dict:
    """One rank of `calibrate` (the whole ghost-aware plan) under torchrun, or alone."""
    from transformers import AutoModelForCausalLM

    from ghosted_hf.statistics import Calibrator, FullModelPass, collect_statistics
    from ghosted_hf.utils.distributed import is_main_process, process_rank

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    data = calibration_data(folder, sequences, seq_len)
    rank, world = process_rank()
    calibrator = Calibrator(FullModelPass(model), data)
    plan = ghost_aware_plan(model.config.num_hidden_layers)

    collect_statistics(model, data.batches[:1], plan, progress=False)  # warm-up: kernels, thread pool, allocator
    import torch.distributed as dist

    if world > 1:
        dist.barrier()
    started = time.perf_counter()
    stats = calibrator.collect(plan, "benchmark")
    seconds = time.perf_counter() - started
    reduce_bytes = sum(t.numel() * 8 for t in stats.tensors.values())
    reduce_started = time.perf_counter()
    if world > 1:
        from ghosted_hf.utils.distributed import all_reduce_sums

        all_reduce_sums(stats.tensors, stats.tokens)
    reduce_seconds = time.perf_counter() - reduce_started
    if is_main_process():
        print(json.dumps({"world": world, "threads": torch.get_num_threads(), "tokens": data.num_tokens,
                          "seconds": seconds, "reduce_seconds": reduce_seconds, "reduce_bytes": reduce_bytes}))
    if world > 1:
        dist.destroy_process_group()
    return {}


def measure_layer_cost(folder: str, seq_len: int) -> dict:
    """Per-batch costs of one decoder layer's forward and of the float64 accumulation, on one batch."""
    from transformers import AutoModelForCausalLM

    from ghosted_hf.statistics import CROSS, GRAM
    from ghosted_hf.statistics.accumulate import StatisticsAccumulator

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    data = calibration_data(folder, 4, seq_len)
    batch = data.batches[0]
    with torch.no_grad():
        started = time.perf_counter()
        model(**batch, use_cache=False)
        forward = time.perf_counter() - started
    plan = ghost_aware_plan(model.config.num_hidden_layers)
    c = model.config.hidden_size
    x = {read: torch.randn(data.num_tokens, c) for read in plan.reads()}
    accumulator = StatisticsAccumulator(plan, c)
    started = time.perf_counter()
    accumulator.add(x)
    accumulate = time.perf_counter() - started
    return {"tokens": data.num_tokens, "dense_forward_s": forward, "layers": model.config.num_hidden_layers,
            "accumulate_s": accumulate, "grams": sum(e.statistic is GRAM for e in plan),
            "pairs": sum(e.statistic is CROSS for e in plan), "hidden": c}


# ------------------------------------------------------------------ drivers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(args) -> None:
    from ghosted_hf import assets

    folder = str(args.model or assets.default_model_dir())
    common = ["--inner", "processes", "--model", folder, "--sequences", str(args.sequences), "--seq-len", str(args.seq_len)]
    rows = []
    for _ in range(args.repeats):
        one = subprocess.run([sys.executable, str(HERE), *common], capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": "2"})
        rows.append(json.loads(one.stdout.strip().splitlines()[-1]))
        two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                              "127.0.0.1", "--master-port", str(free_port()), str(HERE), *common], capture_output=True,
                             text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows.append(json.loads(two.stdout.strip().splitlines()[-1]))
    cost = child(["--inner", "layercost", "--model", folder, "--seq-len", str(args.seq_len)])
    best = {}
    for row in rows:
        key = row["world"]
        if key not in best or row["seconds"] < best[key]["seconds"]:
            best[key] = row
    print(f"SmolLM2-135M fp32, ghost-aware statistics pass (8 layers), {args.sequences} x {args.seq_len} tokens, "
          f"batches of 4, 2 CPU cores in total; best of {args.repeats}")
    print("| processes x threads | tokens | seconds | tokens/s | speed-up | all-reduce (MiB, s) |")
    print("|---|---|---|---|---|---|")
    base = best[1]["seconds"]
    for world in sorted(best):
        row = best[world]
        print(f"| {world} x {row['threads']} | {row['tokens']} | {row['seconds']:.2f} | {row['tokens'] / row['seconds']:.0f} "
              f"| {base / row['seconds']:.2f}x | {row['reduce_bytes'] / 2**20:.0f}, {row['reduce_seconds']:.3f} |")
    print()
    print("Per-batch costs (one batch of 4 x %d tokens): %s" % (args.seq_len, json.dumps(cost)))


def run_memory(args) -> None:
    from ghosted_hf import assets

    folder = str(args.model or assets.default_model_dir())
    print(f"SmolLM2-135M fp32, ghost-aware statistics pass (8 layers: 23 Gram + 23 cross matrices), batches of 4 x "
          f"{args.seq_len}; peak memory of the pass above the loaded model (baseline taken after the warm-up's freed "
          f"pages are handed back), fresh process each, highest of {args.repeats}. Resident = VmHWM; live = bytes "
          "malloc has handed out (mallinfo2, sampled every 2 ms)")
    print("| tokens | x | seconds | peak resident above model (MiB) | peak live above model (MiB) |")
    print("|---|---|---|---|---|")
    base = None
    for factor in (1, 4, 16):
        results = [child(["--inner", "full", "--model", folder, "--sequences", str(args.sequences * factor),
                          "--seq-len", str(args.seq_len)]) for _ in range(args.repeats)]
        peak = max(r["peak_above_model_mib"] for r in results)
        live = max(r["live_peak_above_model_mib"] for r in results)
        base = base or (peak, live)
        print(f"| {results[0]['tokens']} | {factor}x | {min(r['seconds'] for r in results):.1f} | {peak:.0f} "
              f"({peak / base[0]:.3f} of 1x) | {live:.0f} ({live / base[1]:.3f} of 1x) |", flush=True)


def run_layerwise(args) -> None:
    from ghosted_hf import assets

    folder = str(args.model or assets.default_model_dir())
    print(f"{folder}, {args.dtype}, ghost-aware statistics pass (8 layers), {args.sequences} x {args.seq_len} tokens; "
          "fresh process each; peak = the process's resident peak during the pass (full: after loading the model)")
    print("| pass | tokens | seconds | peak resident memory of the process (MiB) | most weights in memory at once (MiB) |")
    print("|---|---|---|---|---|")
    from safetensors import safe_open

    from ghosted_hf.model.checkpoint import weight_map

    size = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    groups: dict[str, int] = {}
    for tensor, file in weight_map(Path(folder)).items():
        with safe_open(str(Path(folder) / file), framework="pt") as handle:
            count = 1
            for n in handle.get_slice(tensor).get_shape():
                count *= n
        group = ".".join(tensor.split(".")[:3]) if tensor.startswith("model.layers.") else tensor
        groups[group] = groups.get(group, 0) + count * size
    whole = sum(groups.values()) / 2**20
    largest = max(v for k, v in groups.items() if k.startswith("model.layers.") or "embed" in k) / 2**20
    for name in ("full", "layerwise"):
        r = child(["--inner", name, "--model", folder, "--sequences", str(args.sequences), "--seq-len", str(args.seq_len),
                   "--dtype", args.dtype])
        resident = f"{whole:.0f} (all)" if name == "full" else f"{largest:.0f} (the embedding or one layer)"
        print(f"| {name} | {r['tokens']} | {r['seconds']:.1f} | {r['peak_process_mib']:.0f} | {resident} |", flush=True)


def run_synthetic(args) -> None:
    """Llama-3.2-3B shape (28 layers, hidden 3072, MLP 8192, 24/8 heads, vocab 128256), random bf16 weights."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ghosted_hf import assets

    config = LlamaConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                         num_attention_heads=24, num_key_value_heads=8, max_position_embeddings=8192,
                         tie_word_embeddings=True, rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")  # bf16 from the start: no fp32 copy
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    model.save_pretrained(args.output, max_shard_size="2GB")
    # The packaged tokenizer: ids stay below 49,152 < 128,256.
    AutoTokenizer.from_pretrained(assets.default_model_dir()).save_pretrained(args.output)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters to {args.output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="?", choices=("processes", "memory", "layerwise", "synthetic"))
    parser.add_argument("--inner", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None)
    parser.add_argument("--output", default=None)
    parser.add_argument("--sequences", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    if args.inner is not None:
        inner = {"full": measure_full, "layerwise": measure_layerwise}
        if args.inner in inner:
            print(json.dumps(inner[args.inner](args.model, args.sequences, args.seq_len, args.dtype)))
        elif args.inner == "processes":
            measure_processes(args.model, args.sequences, args.seq_len)
        elif args.inner == "layercost":
            print(json.dumps(measure_layer_cost(args.model, args.seq_len)))
        return
    defaults = {"processes": 16, "memory": 4, "layerwise": 16, "synthetic": 0}
    args.sequences = args.sequences or defaults[args.what]
    {"processes": run_processes, "memory": run_memory, "layerwise": run_layerwise, "synthetic": run_synthetic}[args.what](args)


if __name__ == "__main__":
    main()
