"""One command for a CUDA machine: calibration throughput and peak GPU memory of the ghost-aware statistics
pass, ghosted / plainly pruned inference ratios (prefill and decode), then LoRA healing throughput (tokens/s,
peak memory) of the ghosted model with `ghosted_hf.heal`, at Llama-3-8B shape with random bf16 weights;
writes the results as JSON and a Markdown table.

    python benchmarks/gpu.py                                   # cuda, Llama-3-8B shape, 64 x 512 tokens
    python benchmarks/gpu.py --shape tiny --device cpu --sequences 4 --seq-len 32 --heal-steps 3 --output /tmp/gpu  # smoke

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
from inference import interleaved_medians, synchronize  # noqa: E402

from transformers import TrainerCallback  # noqa: E402

from ghosted_hf import heal, prune_layers  # noqa: E402
from ghosted_hf.statistics import CROSS, GRAM, collect_statistics  # noqa: E402
from ghosted_hf.operators import operator_kind  # noqa: E402
from ghosted_hf.selection import SelectionRequest, criterion  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--heal-steps", type=int, default=8, help="LoRA healing steps timed (the first warms up).")
    parser.add_argument("--heal-batch-size", type=int, default=4)
    parser.add_argument("--heal-gradient-checkpointing", action="store_true")
    parser.add_argument("--output", default="benchmarks/results/gpu", help="writes OUTPUT.json and OUTPUT.md")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: run on a GPU machine, or smoke-test with --shape tiny --device cpu.")

    dense = random_model(args.shape, args.device, getattr(torch, args.dtype))
    depth, vocab = dense.config.num_hidden_layers, dense.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(10, vocab - 10, (args.batch_size, args.seq_len), generator=generator),
                "attention_mask": torch.ones(args.batch_size, args.seq_len, dtype=torch.long)}
               for _ in range(max(1, args.sequences // args.batch_size))]
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)

    # Calibration: the ghost-aware statistics of every candidate span (float64 sums on the model's device).
    request = SelectionRequest(depth=depth, num_layers=args.num_layers)
    plan = criterion("ghost-aware").statistics(request)
    collect_statistics(dense, batches[:1], plan, progress=False)  # warm-up (kernels, allocator)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    synchronize(args.device)
    started = time.perf_counter()
    stats = collect_statistics(dense, batches, plan, progress=False)
    synchronize(args.device)
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() if cuda else None
    selection = criterion("ghost-aware").select(stats, request)
    s, e = selection.removed[0], selection.removed[-1] + 1
    fit = operator_kind("ghost").fit(stats, s, e, 1e-6)
    del stats

    plain = prune_layers(dense, selection.removed)
    ghosted = prune_layers(dense, selection.removed, {s: fit.operator.float()})
    ids = torch.randint(10, vocab - 10, (1, args.seq_len), generator=generator).to(args.device)
    models = {"plainly pruned": plain.to(args.device), "ghosted": ghosted.to(args.device)}
    median = interleaved_medians(models, ids, args.new_tokens, args.repeats, args.device)

    del models, plain
    healing = healing_throughput(ghosted, args)
    results = {
        "shape": args.shape, "dtype": args.dtype, "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
        "calibration": {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
                        "peak_gpu_memory_gib": peak / 2**30 if peak is not None else None,
                        "grams": sum(e.statistic is GRAM for e in plan), "pairs": sum(e.statistic is CROSS for e in plan)},
        "removed": selection.removed,
        "inference": {name: {"prefill_ms": 1000 * m["prefill"], "decode_ms_per_token": 1000 * m["decode"]}
                      for name, m in median.items()},
        "ratios": {k: median["ghosted"][k] / median["plainly pruned"][k] for k in ("prefill", "decode")},
        "healing": healing,
        "versions": {"torch": torch.__version__},
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    c = results["calibration"]
    table = "\n".join([
        f"{args.shape} (random {args.dtype} weights) on {results['device']}; ghost-aware statistics of "
        f"{args.num_layers}-layer spans over {tokens} tokens; layers {s}-{e - 1} removed; medians of {args.repeats}.",
        "",
        "| calibration tokens/s | peak GPU memory (GiB) | prefill ghosted/pruned | decode ghosted/pruned | "
        "healing tokens/s | healing peak GPU memory (GiB) |",
        "|---|---|---|---|---|---|",
        f"| {c['tokens_per_second']:.0f} | {c['peak_gpu_memory_gib'] if peak is None else round(c['peak_gpu_memory_gib'], 2)} "
        f"| {results['ratios']['prefill']:.3f} | {results['ratios']['decode']:.3f} | {healing['tokens_per_second']:.0f} "
        f"| {healing['peak_gpu_memory_gib'] if healing['peak_gpu_memory_gib'] is None else round(healing['peak_gpu_memory_gib'], 2)} |",
    ])
    out.with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
