"""Inference cost of the operators: prefill and decode latency of dense, plainly pruned and ghosted models,
measured interleaved in one run (so machine noise hits all three alike); ratios are medians.

Default: the packaged SmolLM2-135M in fp32 on CPU with layers 12-19 removed. `--shape llama3-8b` builds a
random Llama-3-8B-shaped model instead (7 of 32 layers removed; meant for a GPU, e.g. `--device cuda
--dtype bfloat16`); operator values do not change the cost, so random operators are used there.

    python benchmarks/inference.py [--repeats 5] [--prompt-len 512] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from ghosted_hf import assets, ghost_prune, prune_layers, to_stock_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prefill(model, ids: torch.Tensor, device: str) -> float:
    synchronize(device)
    started = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    synchronize(device)
    return time.perf_counter() - started


def decode(model, ids: torch.Tensor, new_tokens: int, device: str) -> float:
    """Seconds per generated token with the KV cache (prompt processing excluded)."""
    with torch.no_grad():
        synchronize(device)
        started = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        synchronize(device)
        first = time.perf_counter() - started
        started = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        synchronize(device)
        return (time.perf_counter() - started - first) / (new_tokens - 1)


def interleaved_medians(models: dict, ids: torch.Tensor, new_tokens: int, repeats: int,
                        device: str) -> dict[str, dict[str, float]]:
    """Median prefill (all of `ids`) and per-token decode (after its first 64 tokens) seconds per model, the
    models taking turns in every round so that machine noise hits all of them alike."""
    short = ids[:, :64]
    for model in models.values():  # warm-up
        prefill(model, ids[:, :32], device)
        decode(model, short[:, :8], 3, device)
    times = {name: {"prefill": [], "decode": []} for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            times[name]["prefill"].append(prefill(model, ids, device))
            times[name]["decode"].append(decode(model, short, new_tokens, device))
    return {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}


def build_models(args):
    if args.shape == "smollm2":
        folder = assets.default_model_dir()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        load = lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype]).eval()  # noqa: E731
        removed = list(range(12, 20))
        calibration = assets.wikipedia_split("calibration")
        ghosted = ghost_prune(load(), tokenizer, calibration, criterion="manual", layers=removed, num_sequences=8)
        folded = ghost_prune(load(), tokenizer, calibration, criterion="manual", layers=removed, num_sequences=8,
                             operator="folded")
        return ({"dense": load(), "plainly pruned": prune_layers(load(), removed), "ghosted": ghosted,
                 "folded (stock)": folded}, f"SmolLM2-135M, layers {removed[0]}-{removed[-1]} removed")
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
    with torch.device(args.device):
        torch.manual_seed(0)
        dense = LlamaForCausalLM(config).to(DTYPES[args.dtype]).eval()
    removed = list(range(22, 29))
    c = config.hidden_size
    operator = torch.eye(c) + 0.01 * torch.randn(c, c)
    rotation, _ = torch.linalg.qr(torch.randn(c, c, dtype=torch.float64))
    plain = prune_layers(dense, removed)
    ghosted = prune_layers(dense, removed, {removed[0]: operator})
    folded = to_stock_model(prune_layers(dense, removed, {removed[0]: (1.1 * rotation).float()}))
    return ({"dense": dense, "plainly pruned": plain, "ghosted": ghosted, "folded (stock)": folded},
            "Llama-3-8B shape (random weights), layers 22-28 removed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=["smollm2", "llama3-8b"], default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    models, title = build_models(args)
    models = {name: model.to(args.device) for name, model in models.items()}
    dense = models["dense"]
    generator = torch.Generator().manual_seed(0)
    vocab = dense.config.vocab_size
    ids = torch.randint(10, vocab - 10, (1, args.prompt_len), generator=generator).to(args.device)
    median = interleaved_medians(models, ids, args.new_tokens, args.repeats, args.device)
    print(f"{title}; {args.dtype} on {args.device}; prefill of {args.prompt_len} tokens, decode of {args.new_tokens} "
          f"tokens after a 64-token prompt; medians of {args.repeats} interleaved runs.\n")
    print("| model | prefill (ms) | decode (ms/token) | prefill vs pruned | decode vs pruned |")
    print("|---|---|---|---|---|")
    base = median["plainly pruned"]
    for name, m in median.items():
        print(f"| {name} | {1000 * m['prefill']:.1f} | {1000 * m['decode']:.2f} | "
              f"{m['prefill'] / base['prefill']:.3f} | {m['decode'] / base['decode']:.3f} |")


if __name__ == "__main__":
    main()
