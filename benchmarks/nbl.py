"""NBL as a baseline (issue #51 item 3): Neural Block Linearization (arXiv 2505.21077) against ghosted_hf's attention
sub-blocks, training-free, on the packaged models and the equal-budget table's held-out texts.

NBL, written from its paper: each attention sub-block's input X (its norm's output) and output Y are collected on the
dense model; its selection bound is sum_i (1 - rho_i^2) over the canonical correlations rho_i of X and X + Y (the
residual stream after attention); the sub-blocks of lowest bound are replaced by the affine LMMSE map
``Y ~ X W + b``, ``W = C_xx^-1 C_xy``, ``b = E[Y] - E[X] W``, each fitted on the dense model. (The inverse is a linear
solve with ghosted_hf's ridge, 1e-6 of the mean diagonal, for numerical safety.)

Rows: two selections by three kinds of map at each budget. Selections: NBL's bound; ghosted_hf's choice (what
`ghost_prune(unit="subblock")` chooses: measured damage per unit saved, from the criterion cache `benchmarks/subblocks.py`
writes; without it, NBL's rows only, or with `--choose` the criterion's damages of the attention sub-blocks measured
here, once, for the KV budgets). Maps: NBL's affine maps fitted on the dense model (served in memory: the ghosted
format holds linear maps); linear maps fitted on the dense model (NBL's without its bias); ghosted_hf's maps, fitted
sequentially down the network (`ghost_prune(unit="subblock", criterion="manual")`, as the equal-budget table's sub-block
rows).
Budgets: shares of the KV cache (`--kv 25% 50%`: equal numbers of attention sub-blocks, since every attention sub-block
of these models caches as much) and of the decoder's parameters (`--parameters 12.5%`: NBL replaces attention only;
ghosted_hf chooses among attention and MLP sub-blocks), each net of the maps. Calibration as in benchmarks/subblocks.py
(32 windows of 512 tokens of the Wikipedia calibration articles).

    python benchmarks/subblocks.py --model smollm2-135m-instruct --budgets 25% --rows "layers / ghost"  # the cache
    python benchmarks/nbl.py --model smollm2-135m-instruct    # appends to benchmarks/results/nbl.md
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import CALIBRATION, add_model_argument, criterion_fits, held_out_sources, packaged_model

from ghosted_hf import assets, ghost_prune
from ghosted_hf.architectures import kv_per_token
from ghosted_hf.evaluate import perplexity
from ghosted_hf.fitting import subblocks as sb
from ghosted_hf.fitting.operators import ridge_solve
from ghosted_hf.options import PruneOptions, budget_share
from ghosted_hf.pipelines.prune import decoder_parameters
from ghosted_hf.text.tokens import tokenize_texts


def attention_sums(model, batches) -> dict[str, torch.Tensor]:
    """Float64 sums over the calibration tokens of every layer's attention input x and output y: sum x, sum y, X^T X,
    X^T Y, Y^T Y (stacked by layer), and the token count."""
    layers = model.model.layers
    depth, width = len(layers), model.config.hidden_size
    sums = {"x": torch.zeros(depth, width, dtype=torch.float64), "y": torch.zeros(depth, width, dtype=torch.float64),
            **{k: torch.zeros(depth, width, width, dtype=torch.float64) for k in ("xx", "xy", "yy")},
            "n": torch.zeros((), dtype=torch.float64)}
    inputs: dict[int, torch.Tensor] = {}
    mask: list[torch.Tensor] = []

    def norm_hook(i):
        def hook(module, args, output):
            inputs[i] = output.detach().reshape(-1, width)[mask[0]].double()
        return hook

    def attention_hook(i):
        def hook(module, args, kwargs, output):
            x, y = inputs.pop(i), output[0].detach().reshape(-1, width)[mask[0]].double()
            sums["x"][i] += x.sum(0)
            sums["y"][i] += y.sum(0)
            sums["xx"][i].addmm_(x.T, x)
            sums["xy"][i].addmm_(x.T, y)
            sums["yy"][i].addmm_(y.T, y)
        return hook

    handles = [h for i, layer in enumerate(layers) for h in (
        layer.input_layernorm.register_forward_hook(norm_hook(i)),
        layer.self_attn.register_forward_hook(attention_hook(i), with_kwargs=True))]
    try:
        with torch.no_grad():
            for batch in batches:
                mask[:] = [batch["attention_mask"].reshape(-1).bool()]
                sums["n"] += mask[0].sum()
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for handle in handles:
            handle.remove()
    return sums


def nbl_fit(sums: dict[str, torch.Tensor], i: int, ridge: float) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(NBL's bound, W, b, A) of layer i's attention: the canonical correlations of X and X + Y from the centered
    covariances, the affine LMMSE map, and the linear map without a bias (X A ~ Y, ghosted_hf's fit on the dense
    model)."""
    n = sums["n"]
    mx, my = sums["x"][i] / n, sums["y"][i] / n
    cxx = sums["xx"][i] / n - torch.outer(mx, mx)
    cxy = sums["xy"][i] / n - torch.outer(mx, my)
    cyy = sums["yy"][i] / n - torch.outer(my, my)
    czz, cxz = cxx + cxy + cxy.T + cyy, cxx + cxy  # z = x + y, the stream after attention (from the norm's output)

    def inverse_root(c: torch.Tensor) -> torch.Tensor:
        values, vectors = torch.linalg.eigh(c)
        return vectors @ torch.diag(values.clamp_min(values.max() * 1e-12).rsqrt()) @ vectors.T

    rho = torch.linalg.svdvals(inverse_root(cxx) @ cxz @ inverse_root(czz)).clamp(max=1.0)
    w, _ = ridge_solve(cxx, cxy, ridge)
    a, _ = ridge_solve(sums["xx"][i], sums["xy"][i], ridge)
    return float((1 - rho.square()).sum()), w, my - mx @ w, a


class AffineAttention(torch.nn.Module):
    """An attention sub-block replaced by ``x -> x W + b`` (NBL's map; b None: a linear map), returning what the
    attention returned."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        super().__init__()
        self.w, self.b = w.float(), None if b is None else b.float()

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        mapped = hidden_states @ self.w
        return (mapped if self.b is None else mapped + self.b), None


def with_dense_maps(model, chosen: list[sb.SubBlockRef], fits: dict[int, tuple], affine: bool) -> torch.nn.Module:
    """`model` with the attention of `chosen` replaced by maps fitted on the dense model: NBL's affine ones, or
    linear ones."""
    for ref in chosen:
        _, w, b, a = fits[ref.layer]
        model.model.layers[ref.layer].self_attn = AffineAttention(w, b) if affine else AffineAttention(a, None)
    return model


def to_budget(order: list[sb.SubBlockRef], saved: dict, budget: int) -> list[sb.SubBlockRef]:
    """The first of `order` whose savings reach `budget`."""
    picked, total = [], 0
    for ref in order:
        if total >= budget:
            break
        picked.append(ref)
        total += saved[ref]
    return sorted(picked)


def attention_damages(model, tokenizer, texts: list[str], attention: list[sb.SubBlockRef]) -> dict:
    """The criterion's damages of the attention sub-blocks, what `ghost_prune(unit="subblock", remove_kv=b)` weighs
    (each map fitted on the dense model, the loss's rise on the first damage_sequences): measured once for every KV
    budget."""
    fits, scored = criterion_fits(model, tokenizer, texts, attention, CALIBRATION)
    return sb.damages(scored, fits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser)
    parser.add_argument("--kv", nargs="*", default=["25%", "50%"], help="shares of the KV cache")
    parser.add_argument("--parameters", nargs="*", default=["12.5%"], help="shares of the decoder's parameters")
    parser.add_argument("--choose", action="store_true",
                        help="without a criterion cache, make the criterion's choice at the KV budgets here")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", default="benchmarks/results/nbl.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer, load = packaged_model(args.model)
    cache = Path("benchmark-cache") / f"subblock-criterion-{args.model}.json"  # (without it: NBL's selection only)
    damage = {sb.parse_subblock(k, sb.CANDIDATE_KINDS): v
              for k, v in (json.loads(cache.read_text())["damage"] if cache.is_file() else {}).items()}
    calibration = assets.wikipedia_split("calibration")
    held_out = held_out_sources(tokenizer)
    dense = load()
    reference = {source: perplexity(dense, batches, progress=False) for source, batches in held_out.items()}
    depth, width, total = dense.config.num_hidden_layers, dense.config.hidden_size, decoder_parameters(dense)
    started = time.perf_counter()
    sums = attention_sums(dense, tokenize_texts(tokenizer, calibration, **CALIBRATION).batches)
    fits = {i: nbl_fit(sums, i, PruneOptions().ridge) for i in range(depth)}
    nbl_seconds = time.perf_counter() - started
    attention = [sb.SubBlockRef(i, "attention") for i in range(depth)]
    nbl_order = sorted(attention, key=lambda ref: fits[ref.layer][0])
    per_layer = kv_per_token(dense.config)
    saved = {ref: sb.subblock_parameters(dense, ref) - width * width for ref in sb.all_subblocks(depth)}
    del dense

    lines = [f"## {args.model} ({time.strftime('%Y-%m-%d')}): dense perplexity wiki {reference['wiki']:.2f}, news "
             f"{reference['news']:.2f}; NBL's statistics, bounds and maps: {nbl_seconds:.0f} s; NBL's order (lowest "
             f"bound first): {[r.layer for r in nbl_order]}", "",
             "| budget | selection / maps | replaced | removed (net) | wiki ppl ratio | news ppl ratio |",
             "|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    budgets = [("KV", b) for b in args.kv] + [("parameters", b) for b in args.parameters]
    # A KV budget scores the attention sub-blocks only: their damages from the cache, or (--choose) measured here.
    kv_damage = ({r: damage[r] for r in attention} if damage else
                 attention_damages(load(), tokenizer, calibration, attention) if args.choose and args.kv else {})
    for kind, budget in budgets:
        if kind == "KV":
            frees = {ref: per_layer[ref.layer] for ref in attention}
            goal = round(budget_share(budget, "remove_kv") * sum(per_layer))
            selections = {"NBL": to_budget(nbl_order, frees, goal)}
            if kv_damage:
                selections["ghosted"] = sb.choose_to_budget(kv_damage, frees, goal, "KV values")
        else:
            goal = round(budget_share(budget) * total)
            selections = {"NBL": to_budget(nbl_order, saved, goal)}
            if damage:
                selections["ghosted"] = sb.choose_to_budget({r: v for r, v in damage.items() if r.block != sb.LAYER},
                                                            saved, goal)
        for selection, chosen in selections.items():
            for maps in ("NBL's affine maps (dense model)", "linear maps (dense model)", "ghosted maps (sequential)"):
                if "dense" in maps and any(r.block != "attention" for r in chosen):
                    continue  # NBL's maps are attention maps
                model = with_dense_maps(load(), chosen, fits, "affine" in maps) if "dense" in maps else ghost_prune(
                    load(), tokenizer, calibration, unit="subblock", criterion="manual",
                    subblocks=[r.name for r in chosen], **CALIBRATION)
                ratio = {s: perplexity(model, b, progress=False) / reference[s] for s, b in held_out.items()}
                net = sum(saved[r] - (width if "affine" in maps else 0) for r in chosen)  # (a bias: C more values)
                name = f"{selection} / {maps}"
                lines.append(f"| {budget} {kind} | {name} | {', '.join(r.name for r in chosen)} | "
                             f"{net / 1e6:.2f} M ({net / total:.1%}) | {ratio['wiki']:.3f} | {ratio['news']:.3f} |")
                print(lines[-1], flush=True)
                del model
    with Path(args.output).open("a") as handle:
        handle.write(f"\n`python benchmarks/nbl.py --model {args.model} --kv {' '.join(args.kv)} --parameters "
                     f"{' '.join(args.parameters)}{' --choose' * args.choose} --threads {args.threads}`\n\n"
                     + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
