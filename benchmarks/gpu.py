"""One command for a CUDA machine, at Llama-3-8B shape with random bf16 weights: the ghost-aware statistics pass
against one plain dense forward over the same tokens (tokens/s, seconds, peak GPU memory), the ghost-aware
selection and the fit of the removed span (seconds), prefill and decode of dense / plainly pruned / ghosted models
(models taking turns in every round), then LoRA healing throughput and peak memory with `ghosted_hf.heal`. Writes
OUTPUT.json after every stage (a run cut short keeps what it measured) and OUTPUT.md at the end.

    python benchmarks/gpu.py                    # cuda, Llama-3-8B shape, 64 and 128 x 512 calibration tokens
    python benchmarks/gpu.py --shape tiny --device cpu --sequences 8 --seq-len 32 --prefill-len 64 \
        --new-tokens 4 --batch-sizes 1 2 --heal-steps 3 --output /tmp/gpu   # smoke

Random weights and random token ids: the costs do not depend on the values (the operator fitted from them is
as dense as a real one).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from inference import decode, prefill, synchronize  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from ghosted_hf import heal, prune_layers  # noqa: E402
from ghosted_hf.fitting.operators import operator_kind  # noqa: E402
from ghosted_hf.fitting.selection import SelectionRequest, criterion  # noqa: E402
from ghosted_hf.statistics import CROSS, GRAM, collect_statistics  # noqa: E402

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024),
}


def random_model(shape: str, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(**SHAPES[shape])
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype).to_empty(device=device)  # in the target dtype from the start
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(device)  # computed, not weights
    return model.eval()


class RandomTokens:
    """A stand-in tokenizer: each "document" is `length` random ids (the cost of training does not depend on them)."""

    eos_token_id = 2

    def __init__(self, vocab: int, length: int) -> None:
        self.vocab, self.length = vocab, length

    def __call__(self, texts: str | list[str], add_special_tokens: bool = True) -> dict[str, list]:
        def ids(text: str) -> list[int]:
            generator = torch.Generator().manual_seed(int(text.split()[-1]))
            return torch.randint(10, self.vocab - 10, (self.length,), generator=generator).tolist()

        return {"input_ids": ids(texts) if isinstance(texts, str) else [ids(text) for text in texts]}


class StepClock(TrainerCallback):
    """Seconds of every optimizer step (the device synchronised at both ends)."""

    def __init__(self, device: str) -> None:
        self.device, self.seconds = device, []

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize(self.device)
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - self.started)


def healing_throughput(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, float | None]:
    """tokens/s (median over the steps after the first) and peak memory of `heal`'s defaults on `model`."""
    cuda = args.device.startswith("cuda")
    clock = StepClock(args.device)
    documents = [f"document {i}" for i in range(args.heal_steps * args.heal_batch_size + 1)]
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    heal(model, RandomTokens(model.config.vocab_size, args.seq_len - 1), documents, steps=args.heal_steps,
         seq_len=args.seq_len, batch_size=args.heal_batch_size, eval_sequences=0, progress=False,
         gradient_checkpointing=args.heal_gradient_checkpointing, callbacks=[clock])
    step = sorted(clock.seconds[1:])[len(clock.seconds[1:]) // 2]
    return {"tokens_per_second": args.heal_batch_size * args.seq_len / step, "seconds_per_step": step,
            "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "batch_size": args.heal_batch_size, "gradient_checkpointing": args.heal_gradient_checkpointing}


class Clock:
    """Seconds between enter and exit with the device synchronised at both ends, and the peak memory between."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.device = device

    def __enter__(self) -> "Clock":
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        synchronize(self.device)
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self.started
        self.peak_gib = torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None


def random_batches(count: int, batch_size: int, seq_len: int, vocab: int, seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(10, vocab - 10, (batch_size, seq_len), generator=generator),
             "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long)}
            for _ in range(max(1, count // batch_size))]


def dense_forward(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]], device: str) -> None:
    """The baseline the statistics pass is held to: the decoder run over the same tokens (no output layer, which
    the statistics pass does not run either)."""
    with torch.no_grad():
        for b in batches:
            model.get_decoder()(**{k: v.to(device) for k, v in b.items()}, use_cache=False)


def calibration(dense: torch.nn.Module, plan, sizes: list[int], args: argparse.Namespace) -> tuple[list[dict], object]:
    """The statistics pass against the dense forward for each number of sequences; the statistics of the last."""
    rows, stats = [], None
    warm = random_batches(args.batch_size, args.batch_size, args.seq_len, dense.config.vocab_size, seed=99)
    dense_forward(dense, warm, args.device)
    collect_statistics(dense, warm, plan, progress=False)  # kernels, allocator
    for n in sizes:
        batches = random_batches(n, args.batch_size, args.seq_len, dense.config.vocab_size, seed=n)
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        with Clock(args.device) as forward:
            dense_forward(dense, batches, args.device)
        stats = None
        with Clock(args.device) as gathering:
            stats = collect_statistics(dense, batches, plan, progress=False)
        rows.append({"sequences": n, "tokens": tokens, "seconds": gathering.seconds,
                     "tokens_per_second": tokens / gathering.seconds, "peak_gpu_memory_gib": gathering.peak_gib,
                     "dense_forward_seconds": forward.seconds, "dense_forward_tokens_per_second": tokens / forward.seconds,
                     "dense_forward_peak_gpu_memory_gib": forward.peak_gib,
                     "relative_to_dense_forward": forward.seconds / gathering.seconds})
        print(f"statistics pass, {tokens} tokens: {gathering.seconds:.2f} s ({rows[-1]['relative_to_dense_forward']:.2f}x "
              f"a dense forward's tokens/s)", flush=True)
    return rows, stats


def interleaved(models: dict[str, torch.nn.Module], ids: torch.Tensor, args: argparse.Namespace) -> dict[str, dict]:
    """Median prefill seconds (all of `ids`) and decode seconds per token (after all of `ids`), the models taking
    turns in every round so that machine noise hits all of them alike."""
    for model in models.values():  # warm-up
        prefill(model, ids[:, :64], args.device)
        decode(model, ids[:, :64], 3, args.device)
    times = {name: {"prefill": [], "decode": []} for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            times[name]["prefill"].append(prefill(model, ids, args.device))
            times[name]["decode"].append(decode(model, ids, args.new_tokens, args.device))
    return {name: {k: sorted(v)[len(v) // 2] for k, v in t.items()} for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--sequences", type=int, nargs="+", default=[64, 128],
                        help="calibration sequences, one statistics pass each; the last one's statistics are fitted")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="inference batch sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heal-steps", type=int, default=8, help="LoRA healing steps timed (the first warms up).")
    parser.add_argument("--heal-batch-size", type=int, default=4)
    parser.add_argument("--heal-gradient-checkpointing", action="store_true")
    parser.add_argument("--output", default="benchmarks/results/gpu", help="writes OUTPUT.json and OUTPUT.md")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run on a GPU machine, or smoke-test with --shape tiny --device cpu.")
    import transformers

    transformers.logging.set_verbosity_error()  # generate()'s notes on batched inputs without a mask
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "shape": args.shape, "dtype": args.dtype, "seq_len": args.seq_len,
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }

    def record(stage: str, value) -> None:
        results[stage] = value
        out.with_suffix(".json").write_text(json.dumps(results, indent=2))

    dense = random_model(args.shape, args.device, getattr(torch, args.dtype))
    depth = dense.config.num_hidden_layers
    request = SelectionRequest(depth=depth, num_layers=args.num_layers)
    plan = criterion("ghost-aware").statistics(request)
    rows, stats = calibration(dense, plan, args.sequences, args)
    record("calibration", {"grams": sum(e.statistic is GRAM for e in plan),
                           "pairs": sum(e.statistic is CROSS for e in plan), "passes": rows})

    with Clock(args.device) as selecting:
        selection = criterion("ghost-aware").select(stats, request)
    s, e = selection.removed[0], selection.removed[-1] + 1
    with Clock(args.device) as fitting:
        fit = operator_kind("ghost").fit(stats, s, e, 1e-6)
    del stats
    record("fit", {"tokens": rows[-1]["tokens"], "removed": selection.removed, "selection_seconds": selecting.seconds,
                   "operator_seconds": fitting.seconds, "seconds": selecting.seconds + fitting.seconds})
    print(f"ghost-aware selection and fit: {selecting.seconds + fitting.seconds:.2f} s", flush=True)

    models = {"dense": dense, "plainly pruned": prune_layers(dense, selection.removed).to(args.device),
              "ghosted": prune_layers(dense, selection.removed, {s: fit.operator.float()}).to(args.device)}
    generator = torch.Generator().manual_seed(1)
    inference = {}
    for batch in args.batch_sizes:
        ids = torch.randint(10, dense.config.vocab_size - 10, (batch, args.prefill_len), generator=generator)
        median = interleaved(models, ids.to(args.device), args)
        inference[str(batch)] = {
            "ms": {name: {"prefill": 1000 * m["prefill"], "decode_per_token": 1000 * m["decode"]}
                   for name, m in median.items()},
            "ghosted / plainly pruned": {k: median["ghosted"][k] / median["plainly pruned"][k] for k in ("prefill", "decode")},
            "plainly pruned / dense": {k: median["plainly pruned"][k] / median["dense"][k] for k in ("prefill", "decode")},
        }
        record("inference", {"prefill_len": args.prefill_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
                             "batches": inference})
        print(f"batch {batch}: ghosted / plainly pruned {inference[str(batch)]['ghosted / plainly pruned']}", flush=True)

    ghosted = models.pop("ghosted")
    del models, dense
    record("healing", healing_throughput(ghosted, args))
    out.with_suffix(".md").write_text(markdown(results) + "\n")
    print(markdown(results))


def markdown(r: dict) -> str:
    """The GPU tables of docs/benchmarks.md, with each target of the issue checked."""
    gib = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [f"{r['shape']} (random {r['dtype']} weights) on {r['device']}; torch {r['versions']['torch']} "
             f"(CUDA {r['versions']['cuda']}), transformers {r['versions']['transformers']}.", "",
             "| statistics pass | tokens | seconds | tokens/s | peak GPU GiB | dense forward tokens/s | "
             "ratio (target >= 0.9) |", "|---|---|---|---|---|---|---|"]
    for p in r["calibration"]["passes"]:
        lines.append(f"| {r['calibration']['grams']} Grams, {r['calibration']['pairs']} cross sums | {p['tokens']} | "
                     f"{p['seconds']:.2f} | {p['tokens_per_second']:.0f} | {gib(p['peak_gpu_memory_gib'])} | "
                     f"{p['dense_forward_tokens_per_second']:.0f} | {p['relative_to_dense_forward']:.2f} |")
    f = r["fit"]
    lines += ["", f"Ghost-aware selection of {len(f['removed'])} layers and the operator fit on {f['tokens']} tokens: "
              f"{f['selection_seconds']:.2f} + {f['operator_seconds']:.2f} = {f['seconds']:.2f} s (target <= 30 s); "
              f"layers {f['removed'][0]}-{f['removed'][-1]} removed.", "",
              f"| batch | model | prefill {r['inference']['prefill_len']} tokens (ms) | decode (ms/token) |",
              "|---|---|---|---|"]
    for batch, b in r["inference"]["batches"].items():
        for name, ms in b["ms"].items():
            lines.append(f"| {batch} | {name} | {ms['prefill']:.1f} | {ms['decode_per_token']:.2f} |")
        g = b["ghosted / plainly pruned"]
        lines.append(f"| {batch} | ghosted / plainly pruned | {g['prefill']:.3f} | {g['decode']:.3f} |")
    h = r["healing"]
    lines += ["", f"LoRA healing (batch {h['batch_size']} x {r['seq_len']} tokens, gradient checkpointing "
              f"{'on' if h['gradient_checkpointing'] else 'off'}): {h['tokens_per_second']:.0f} tokens/s, "
              f"{1 / h['seconds_per_step']:.2f} steps/s, peak GPU memory {gib(h['peak_gpu_memory_gib'])} GiB."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
