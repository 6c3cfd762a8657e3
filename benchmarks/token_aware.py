"""Token-aware fits (issue #34, item 4): how much of each boundary's normal equations the first position of every
window and other "sink" tokens (massive activations) carry, and whether fitting the operator without them - they
pass the identity at inference - or giving them their own map beats one shared map.

    python benchmarks/token_aware.py --model smollm2-135m-instruct --layers 4 8
    python benchmarks/token_aware.py --model gemma3-270m --layers 2 4
    # appends its table to benchmarks/results/token_aware.md

Each depth's layers are chosen by ghost_prune's defaults (ghost-aware); every variant is fitted from the same dense
statistics, boundary by boundary (independent fits), so they differ only in which tokens feed which map. A sink is
a token whose stream norm at the boundary is above SINK_RATIO times the median norm there (the same test at
inference, where it reads the stream that reaches the boundary). Held-out perplexity on the packaged evaluation
articles (16 windows of 512)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets, ghost_prune, prune_layers
from ghosted_hf.architectures import decoder_layers, final_norm
from ghosted_hf.evaluate import perplexity
from ghosted_hf.fitting.operators import solve_ghost
from ghosted_hf.model.loading import NO_HUB_KERNELS
from ghosted_hf.options import PruneOptions
from ghosted_hf.remote.format_ghosted import expected_boundaries
from ghosted_hf.text.tokens import tokenize_texts

SINK_RATIO = 20.0  # massive activations sit two to three decades above the median; 20x separates them
GROUPS = ("first", "sink", "rest")


def capture(dense, batches, spans: list[tuple[int, int]]) -> tuple[dict, float]:
    """Per span and token group: float64 Gram X_s^T X_s and cross X_s^T X_e; and the median stream norm per s."""
    depth = len(decoder_layers(dense))
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    wanted = {i for span in spans for i in span}
    for i in wanted:
        module = decoder_layers(dense)[i] if i < depth else final_norm(dense)
        hooks.append(module.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: seen.__setitem__(i, (args[0] if args else kwargs["hidden_states"]).detach()),
            with_kwargs=True))
    sums = {span: {g: [0, 0, 0] for g in GROUPS} for span in spans}  # [gram, cross, tokens]
    norms = {s: [] for s, _ in spans}
    streams = []
    try:
        with torch.no_grad():
            for batch in batches:
                seen.clear()
                dense(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
                streams.append({i: seen[i].double() for i in wanted})
    finally:
        for hook in hooks:
            hook.remove()
    for s, _ in spans:
        norms[s] = torch.cat([b[s].norm(dim=-1)[:, 1:].flatten() for b in streams]).median()
    for (s, e) in spans:
        for b in streams:
            x, y = b[s], b[e]
            group = token_groups(x, float(norms[s]))
            for g in GROUPS:
                xs, ys = x[group == GROUPS.index(g)], y[group == GROUPS.index(g)]
                acc = sums[(s, e)][g]
                acc[0] = acc[0] + xs.T @ xs
                acc[1] = acc[1] + xs.T @ ys
                acc[2] += xs.shape[0]
    return sums, {s: float(n) for s, n in norms.items()}


def token_groups(x: torch.Tensor, median_norm: float) -> torch.Tensor:
    """0 for each window's first position, 1 for a sink (norm above SINK_RATIO x the median), 2 for the rest."""
    group = torch.full(x.shape[:2], 2, dtype=torch.long, device=x.device)
    group[x.norm(dim=-1) > SINK_RATIO * median_norm] = 1
    group[:, 0] = 0
    return group


def fit(groups: list[dict], ridge: float) -> torch.Tensor:
    gram = sum(g[0] for g in groups if g[2])
    cross = sum(g[1] for g in groups if g[2])
    m, _ = solve_ghost(gram, cross, ridge)
    return m + torch.eye(m.shape[0], dtype=m.dtype)


def variant_maps(sums: dict, ridge: float) -> dict[str, dict[str, torch.Tensor | None]]:
    """Per variant: the map of each token group (None: identity)."""
    f, s, r = sums["first"], sums["sink"], sums["rest"]
    shared = fit([f, s, r], ridge)
    rest = fit([r], ridge)
    return {
        "one map (default)": {"first": shared, "sink": shared, "rest": shared},
        "first: identity": {"first": None, "sink": fit([s, r], ridge), "rest": fit([s, r], ridge)},
        "first + sinks: identity": {"first": None, "sink": None, "rest": rest},
        "first: own map": {"first": fit([f], ridge), "sink": fit([s, r], ridge), "rest": fit([s, r], ridge)},
        "first + sinks: own map": {"first": fit([f, s], ridge), "sink": fit([f, s], ridge), "rest": rest},
    }


def install(model, boundaries: list[dict], depth: int, maps: dict, medians: dict) -> list:
    """Pre-hooks applying each token group's map to the stream a boundary feeds, on the plainly pruned model."""
    hooks = []
    for boundary in boundaries:
        s = boundary["removed"][0]
        fed = boundary["pruned_fed"]  # the first kept layer's index in the pruned model, or its depth: the final norm
        pruned_target = decoder_layers(model)[fed] if fed < depth else final_norm(model)
        per_group = [maps[s][g] for g in GROUPS]

        def hook(module, args, kwargs, per_group=per_group, median=medians[s]):
            x = args[0] if args else kwargs["hidden_states"]
            group = token_groups(x.double(), median)
            out = x.double().clone()
            for index, w in enumerate(per_group):
                if w is not None:
                    chosen = group == index
                    out[chosen] = x.double()[chosen] @ w
            out = out.to(x.dtype)
            return ((out, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": out})
        hooks.append(pruned_target.register_forward_pre_hook(hook, with_kwargs=True))
    return hooks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=assets.DEFAULT_MODEL)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--output", default="benchmarks/results/token_aware.md")
    args = parser.parse_args()
    folder = assets.resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    load = lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **NO_HUB_KERNELS).eval()  # noqa: E731
    options = PruneOptions()
    calibration = assets.wikipedia_split("calibration")
    batches = tokenize_texts(tokenizer, calibration, options.seq_len, options.num_sequences, batch_size=4).batches
    held_out = tokenize_texts(tokenizer, assets.wikipedia_split("evaluation"), 512, 16, batch_size=4).batches
    dense = load()
    depth = len(decoder_layers(dense))
    lines = [f"\n## {args.model} ({depth} layers), {sum(int(b['attention_mask'].sum()) for b in batches)} "
             f"calibration tokens; dense perplexity {perplexity(dense, held_out, progress=False):.2f}\n",
             "| removed | share of tokens / of the Gram trace, per boundary | variant | perplexity |", "|---|---|---|---|"]
    for k in args.layers:
        started = time.time()
        default = ghost_prune(load(), tokenizer, calibration, num_layers=k)
        removed = default.config.removed_layers
        boundaries = expected_boundaries(depth, removed)
        for b in boundaries:
            b["pruned_fed"] = b["removed"][-1] + 1 - len([r for r in removed if r <= b["removed"][-1]])
        spans = [(b["removed"][0], b["removed"][-1] + 1) for b in boundaries]
        sums, medians = capture(dense, batches, spans)
        shares = []
        for span in spans:
            total = sum(sums[span][g][2] for g in GROUPS)
            trace = sum(float(torch.trace(sums[span][g][0])) for g in GROUPS if sums[span][g][2])
            share = {g: (sums[span][g][2] / total, float(torch.trace(sums[span][g][0])) / trace if sums[span][g][2]
                         else 0.0) for g in GROUPS}
            shares.append(f"{span[0]} -> {span[1]}: first {share['first'][0]:.2%} / {share['first'][1]:.1%}, "
                          f"sinks {share['sink'][0]:.2%} / {share['sink'][1]:.1%}")
        results = {"library default (sequential)": perplexity(default, held_out, progress=False)}
        per_span = {span: variant_maps(sums[span], options.ridge) for span in spans}
        for variant in per_span[spans[0]]:
            pruned = prune_layers(load(), removed)
            hooks = install(pruned, boundaries, depth - len(removed),
                            {s: per_span[(s, e)][variant] for s, e in spans}, medians)
            results[variant] = perplexity(pruned, held_out, progress=False)
            for hook in hooks:
                hook.remove()
        for index, (variant, value) in enumerate(results.items()):
            cells = [f"{k}: {removed}", "; ".join(shares)] if index == 0 else ["", ""]
            lines.append(f"| {cells[0]} | {cells[1]} | {variant} | {value:.2f} |")
        print("\n".join(lines[-len(results):]), f"({time.time() - started:.0f} s)", flush=True)
    out = Path(args.output)
    with out.open("a") as handle:
        handle.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
