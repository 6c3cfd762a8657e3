"""Equal-budget comparison (issue #34): whole layers against attention and MLP sub-blocks, removed at a share of the
decoder's parameters and recovered in closed form, training-free.

    python benchmarks/subblocks.py --model smollm2-135m-instruct    # appends to benchmarks/results/subblocks.md
    python benchmarks/subblocks.py --model gemma3-270m

Rows per budget (12.5%, 25%, 37.5% of the decoder layers' parameters, net of the maps and operators added):
- layers / ghost: `ghost_prune(remove=b)`, its defaults (ghost-aware contiguous layers, ghost operator);
- layers / plain ShortGPT: the same number of layers chosen by ShortGPT, no recovery (the field's baseline);
- layers / plain LoRP, layers / LoRP + ghost: the same number chosen by `criterion="lorp"` (LoRP's steps as its
  abstract gives them), without recovery as in its paper, and with ghost operators fitted sequentially;
- sub-blocks / ghost-aware: what `ghost_prune(unit="subblock", remove=b)` chooses (measured damage per parameter
  saved; the damages are computed once per model, as ghost_prune computes them, and the chosen sub-blocks then
  fitted by `ghost_prune(unit="subblock", criterion="manual")`: sequential float64 fits);
- mixed / ghost-aware: what `ghost_prune(unit="mixed", remove=b)` chooses (whole layers are candidates too, from the
  same damages; a run of removed layers gets one ghost operator);
- sub-blocks / fit residual: the same maps and fits, the sub-blocks ranked by their own fit's relative residual
  (what the probe found misleading), for the criterion's sake.
Scored on held-out text of two sources: the packaged Wikipedia evaluation articles and gensim's news articles
(16 windows of 512 each), as the perplexity ratio to the dense model; LAMBADA (first 200 items); the KV-cache bytes
per token in bf16 (measured from a cache); parameters removed net of what was added; wall seconds of the prune. Calibration: 32
windows of 512 tokens of the Wikipedia calibration articles for every row (`--num-sequences`: another count, such as
ghost_prune's default 128).

With `--heal lm kd` each row is also healed with `heal`'s defaults on the same Wikipedia calibration articles (lm:
next-token loss, heal's default; kd: KL to the dense model's logits, `--teacher base`), merged and scored again on both
sources: the news articles are text of another source than the healing text, so the gain healing keeps there says
whether a healing default carries over. "gap closed" is (free - healed) / (free - 1) of the perplexity ratio.

With `--kv` the budgets are shares of the KV cache's bytes per token (`remove_kv`) and the rows are layers / ghost
(`ghost_prune(remove_kv=b)`), sub-blocks / ghost-aware (attention sub-blocks, the least damage per cache byte freed) and
mixed / ghost-aware (attention sub-blocks and whole layers); the criterion then scores only what frees cache. With
`--speed` each row also gets transformers' prefill (512 held-out tokens) and decode (64 greedy tokens with the cache)
tokens/s, the best of 3, on the threads given:

    python benchmarks/subblocks.py --model smollm2-135m-instruct --kv --budgets 25% 50% --speed \
        --rows "layers / ghost" "sub-blocks / ghost-aware" "mixed / ghost-aware" --output benchmarks/results/kv_budget.md

With `--joint-rounds 2 4` the sub-block, mixed and whole-layer choices are also made as `joint_rounds=2` and `4` make
them: the budget met in that many equal steps, each step's damages measured with the earlier steps' picks in place (the
first step's are the stored damages alone; the rows' names give the later steps' seconds), then fitted by
`criterion="manual"` as the other rows. "layers / measured damage" is the one-round choice among whole layers alone:
each layer's damage with its own ghost operator, the least first, as many layers as the layers / ghost row removes,
runs or not (the default criterion scores contiguous runs by their fit's residual); "layers / joint, 2 rounds" chooses
as many in two rounds:

    python benchmarks/subblocks.py --model smollm2-135m-instruct --budgets 25% --joint-rounds 2 4 \
        --rows "sub-blocks / ghost-aware" "sub-blocks / joint, 2 rounds" "sub-blocks / joint, 4 rounds" \
        --output benchmarks/results/joint_choice.md

With `--map-rank auto` (or a rank) the sub-block and mixed rows use maps of that rank (`map_rank`): the candidates'
maps and damages are measured at it and each priced net of its own map, as `ghost_prune` does; the chosen sub-blocks
are then fitted by `criterion="manual"` with the same `map_rank`, so an 'auto' rank is chosen again on the model patched
so far (where `ghost_prune` keeps the rank it priced).

    python benchmarks/subblocks.py --model smollm2-135m-instruct --budgets 25% --lambada 0 --heal lm kd \
        --rows "layers / ghost" "sub-blocks / ghost-aware" "mixed / ghost-aware" --output benchmarks/results/subblock_healing.md
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from common import CALIBRATION, criterion_fits, transformers_speed
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets, ghost_prune
from ghosted_hf.architectures import kv_per_token
from ghosted_hf.evaluate import lambada, perplexity
from ghosted_hf.fitting import subblocks as sb
from ghosted_hf.model.loading import NO_HUB_KERNELS
from ghosted_hf.options import budget_share
from ghosted_hf.pipelines.healing import heal, merge
from ghosted_hf.pipelines.prune import decoder_parameters
from ghosted_hf.text.tokens import tokenize_texts

WINDOWS = 16  # held-out windows of 512 tokens per source


def kv_bytes_per_token(model, tokenizer) -> int:
    """The KV-cache bytes one token adds in bf16, measured: a forward over a short text (within every sliding window)
    and the elements its cache holds, at 2 bytes each."""
    ids = tokenizer("The cache holds keys and values for every layer that still attends.", return_tensors="pt")
    with torch.no_grad():
        cache = model(**ids, use_cache=True).past_key_values
    total = sum(t.numel() * 2 for layer in cache.layers for t in (getattr(layer, "keys", None),
                                                                   getattr(layer, "values", None)) if t is not None)
    return total // ids["input_ids"].shape[1]


# The rows whose layers a layer criterion chooses: they need no sub-block criterion (its cache is computed otherwise).
LAYER_CRITERIA = ("layers / ghost", "layers / plain ShortGPT", "layers / plain LoRP", "layers / LoRP + ghost")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=assets.DEFAULT_MODEL)
    parser.add_argument("--budgets", nargs="+", default=["12.5%", "25%", "37.5%"])
    parser.add_argument("--lambada", type=int, default=200, help="LAMBADA items scored")
    parser.add_argument("--output", default="benchmarks/results/subblocks.md")
    parser.add_argument("--rows", nargs="+", help="only these rows (e.g. 'mixed / ghost-aware'); default: all")
    parser.add_argument("--heal", nargs="+", choices=("lm", "kd"), default=[],
                        help="also heal each row with heal's defaults: lm (next-token loss) and/or kd (dense teacher)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    parser.add_argument("--map-rank", default="full", help="map_rank of the sub-block and mixed rows (full, auto, r)")
    parser.add_argument("--kv", action="store_true", help="budgets are shares of the KV cache (remove_kv)")
    parser.add_argument("--speed", action="store_true", help="also transformers' prefill and decode tokens/s")
    parser.add_argument("--joint-rounds", type=int, nargs="*", default=[],
                        help="also the sub-block and mixed choices made in these numbers of rounds (joint_rounds)")
    parser.add_argument("--num-sequences", type=int, default=CALIBRATION["num_sequences"],
                        help="calibration sequences of 512 tokens for every row (ghost_prune's default: 128)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    calib = {**CALIBRATION, "num_sequences": args.num_sequences}
    folder = assets.resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def load():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **NO_HUB_KERNELS).eval()

    calibration = assets.wikipedia_split("calibration")
    held_out = {name: tokenize_texts(tokenizer, texts, 512, WINDOWS, batch_size=4).batches
                for name, texts in (("wiki", assets.wikipedia_split("evaluation")), ("news", assets.news_articles()))}
    dense = load()
    total = decoder_parameters(dense)
    width, depth = dense.config.hidden_size, dense.config.num_hidden_layers

    def score(model) -> dict[str, float]:
        return {**{name: perplexity(model, batches, progress=False) for name, batches in held_out.items()},
                "lambada": lambada(model, tokenizer, args.lambada, progress=False)["accuracy"] if args.lambada else float("nan"),
                "kv": kv_bytes_per_token(model, tokenizer)}

    reference = score(dense)
    prompt = held_out["wiki"][0]["input_ids"][0].tolist()  # 512 held-out tokens
    speed = " dense prefill / decode {:.0f} / {:.1f} t/s;".format(*transformers_speed(dense, prompt, 64)) if args.speed else ""
    # What ghost_prune(unit="subblock") computes before it chooses, once for every budget (the same for each): every
    # sub-block's map on the dense model, its relative residual, and its measured damage.
    started = time.perf_counter()
    rank = (("" if args.map_rank == "full" else f"-rank-{args.map_rank}") + ("-kv" if args.kv else "")
            + ("" if args.num_sequences == CALIBRATION["num_sequences"] else f"-{args.num_sequences}"))
    cache = Path("benchmark-cache") / f"subblock-criterion-{args.model}{rank}.json"  # reused by later runs on this model
    if cache.is_file():
        stored = json.loads(cache.read_text())
    elif args.rows and all(row in LAYER_CRITERIA for row in args.rows):  # (rows of a layer criterion need none)
        stored = {"residual": {}, "damage": {}, "seconds": None}
    else:
        candidates = [ref for ref in sb.all_subblocks(dense.config.num_hidden_layers, whole_layers=True)
                      if not (args.kv and ref.block == "mlp")]  # (what frees cache)
        fits, scored = criterion_fits(dense, tokenizer, calibration, candidates, calib, args.map_rank)
        stored = {"residual": {ref.name: fit.figures["relative_residual"] for ref, fit in fits.items()},
                  "map_parameters": {ref.name: fit.parameters for ref, fit in fits.items()},
                  "damage": {ref.name: value for ref, value in sb.damages(scored, fits).items()},
                  "seconds": time.perf_counter() - started}
        cache.parent.mkdir(exist_ok=True)
        cache.write_text(json.dumps(stored, indent=1))
        del scored, fits
    residual = {sb.parse_subblock(name, sb.CANDIDATE_KINDS): value for name, value in stored["residual"].items()}
    damage = {sb.parse_subblock(name, sb.CANDIDATE_KINDS): value for name, value in stored["damage"].items()}
    maps = {sb.parse_subblock(name, sb.CANDIDATE_KINDS): value
            for name, value in stored.get("map_parameters", {}).items()}  # (older caches: full maps)
    saved = {ref: sb.subblock_parameters(dense, ref) - maps.get(ref, width * width) for ref in residual}
    alone = {ref: value for ref, value in damage.items() if ref.block != sb.LAYER}  # what unit 'subblock' weighs
    whole = {ref: value for ref, value in damage.items() if ref.block == sb.LAYER}  # each layer with its operator
    per_layer = kv_per_token(dense.config)
    frees = {ref: per_layer[ref.layer] for ref in damage if ref.block != "mlp"}  # KV values per token a removal frees
    selection_seconds = stored["seconds"]
    del dense

    lines = [f"## {args.model} ({time.strftime('%Y-%m-%d')}): {total / 1e6:.1f} M decoder-layer parameters; dense "
             f"perplexity wiki {reference['wiki']:.2f}, news {reference['news']:.2f}, LAMBADA {reference['lambada']:.3f}, "
             f"KV {reference['kv']} B/token;{speed} the sub-block criterion's statistics, maps and damages: "
             + (f"{selection_seconds:.0f} s (not in the rows' seconds)" if selection_seconds is not None else
                "not needed") + f"; sub-block maps: {args.map_rank}", "",
             "| budget | unit / selection | removed (net) | wiki ppl ratio | news ppl ratio | LAMBADA | KV B/token | what | s |"
             + (" prefill / decode t/s |" if args.speed else "")
             + "".join(f" healed {h}: wiki / news ratio (gap closed) | {h} s |" for h in args.heal),
             "|---|---|---|---|---|---|---|---|---|" + "---|" * args.speed + "---|---|" * len(args.heal)]
    print("\n".join(lines), flush=True)
    joint_state: dict = {}

    def joint(rounds: int, blocks: set[str], budget: int, priced: dict | None = None):
        """The candidates of `blocks` (attention, mlp, layer) `joint_rounds=rounds` chooses (to `budget` of what
        `priced` counts, else parameters): the first round from the stored damages alone, the later ones measured as
        ghost_prune measures them (their seconds in `joint_state`)."""
        if "fits" not in joint_state:
            joint_state["fits"], joint_state["scored"] = criterion_fits(load(), tokenizer, calibration, sorted(damage),
                                                                        calib, args.map_rank)
        fits = {ref: fit for ref, fit in joint_state["fits"].items() if ref.block in blocks}
        started = time.perf_counter()
        chosen, _ = sb.choose_jointly(joint_state["scored"], fits, priced or saved, budget, rounds,
                                      alone={ref: damage[ref] for ref in fits})
        joint_state["seconds"] = time.perf_counter() - started
        return chosen

    def mixed(chosen):
        return ghost_prune(load(), tokenizer, calibration, unit="mixed", criterion="manual",
                           subblocks=[r.name for r in chosen if r.block != sb.LAYER], map_rank=args.map_rank,
                           layers=[r.layer for r in chosen if r.block == sb.LAYER], **calib)

    def layers(chosen):
        return ghost_prune(load(), tokenizer, calibration, criterion="manual", layers=[r.layer for r in chosen], **calib)

    for budget in args.budgets:
        target = round(budget_share(budget) * total)
        count = max(1, math.ceil((target + width * width) / (total / depth)))  # as many layers as ghost_prune's
        if args.kv:
            cached = round(budget_share(budget, "remove_kv") * sum(per_layer))
            runs = {
                "layers / ghost": lambda: ghost_prune(load(), tokenizer, calibration, remove_kv=budget, **calib),
                "sub-blocks / ghost-aware": lambda: ghost_prune(
                    load(), tokenizer, calibration, unit="subblock", criterion="manual", map_rank=args.map_rank,
                    subblocks=[r.name for r in sb.choose_to_budget(alone, frees, cached, "KV values")], **calib),
                "mixed / ghost-aware": lambda: mixed(sb.choose_to_budget(damage, frees, cached, "KV values")),
            }
        else:
            runs = {
                "layers / ghost": lambda: ghost_prune(load(), tokenizer, calibration, remove=budget, **calib),
                "layers / plain ShortGPT": lambda: ghost_prune(load(), tokenizer, calibration, remove=budget,
                                                                criterion="shortgpt", operator="none", **calib),
                "layers / plain LoRP": lambda: ghost_prune(load(), tokenizer, calibration, remove=budget,
                                                            criterion="lorp", operator="none", **calib),
                "layers / LoRP + ghost": lambda: ghost_prune(load(), tokenizer, calibration, remove=budget,
                                                              criterion="lorp", **calib),
                "sub-blocks / ghost-aware": lambda: ghost_prune(
                    load(), tokenizer, calibration, unit="subblock", criterion="manual",
                    subblocks=[r.name for r in sb.choose_to_budget(alone, saved, target)], map_rank=args.map_rank,
                    **calib),
                "mixed / ghost-aware": lambda: mixed(sb.choose_to_budget(damage, saved, target)),
                "layers / measured damage": lambda: layers(sorted(whole, key=whole.get)[:count]),
                **{f"sub-blocks / joint, {n} rounds": lambda n=n: ghost_prune(
                    load(), tokenizer, calibration, unit="subblock", criterion="manual", map_rank=args.map_rank,
                    subblocks=[r.name for r in joint(n, set(sb.SUBBLOCK_KINDS), target)], **calib)
                   for n in args.joint_rounds},
                **{f"mixed / joint, {n} rounds": lambda n=n: mixed(joint(n, {*sb.SUBBLOCK_KINDS, sb.LAYER}, target))
                   for n in args.joint_rounds},
                **{f"layers / joint, {n} rounds": lambda n=n: layers(joint(n, {sb.LAYER}, count, dict.fromkeys(whole, 1)))
                   for n in args.joint_rounds},
                "sub-blocks / fit residual": lambda: ghost_prune(
                    load(), tokenizer, calibration, unit="subblock", criterion="manual",
                    subblocks=[r.name for r in sb.choose_to_budget(
                        {r: v for r, v in residual.items() if r.block != sb.LAYER}, saved, target)],
                    map_rank=args.map_rank, **calib),
            }
        for name, run in runs.items():
            if args.rows and name not in args.rows:
                continue
            started = time.perf_counter()
            model = run().eval()
            seconds = time.perf_counter() - started
            if "joint" in name:
                name = f"{name} (+{joint_state.pop('seconds'):.0f} s of damages)"
            provenance = model.config.ghost_provenance  # a stock export (operator none) keeps it too
            removed_net = provenance["parameters"]["dense"] - provenance["parameters"]["pruned"] - \
                provenance["parameters"].get("operators", 0)
            picked = provenance["selection"]
            ranks = {f"{r['original_layer']}.{r['block']}": r.get("rank") for r in getattr(model.config, "ghost_subblocks", [])}
            what = ", ".join(([f"layers {picked['removed']}"] if picked["removed"] else [])
                             + [f"{n} (rank {ranks[n]})" if ranks.get(n) else n for n in picked.get("subblocks", [])])
            result = score(model)
            free = {source: result[source] / reference[source] for source in held_out}
            lines.append(f"| {budget} | {name} | {removed_net / 1e6:.2f} M ({removed_net / total:.1%}) | "
                         f"{free['wiki']:.3f} | {free['news']:.3f} | "
                         f"{result['lambada']:.3f} | {result['kv']} | {what} | {seconds:.0f} |")
            if args.speed:
                lines[-1] += " {:.0f} / {:.1f} |".format(*transformers_speed(model, prompt, 64))
            del model
            for loss in args.heal:
                teacher = load() if loss == "kd" else None
                started = time.perf_counter()
                model = merge(heal(run(), tokenizer, calibration, teacher=teacher, eval_sequences=0,
                                   progress=False)).eval()
                seconds = time.perf_counter() - started
                healed = {source: perplexity(model, batches, progress=False) / reference[source]
                          for source, batches in held_out.items()}
                lines[-1] += " " + " / ".join(f"{healed[s]:.3f}" for s in held_out) + " (" + " / ".join(
                    f"{(free[s] - healed[s]) / (free[s] - 1):.2f}" for s in held_out) + f") | {seconds:.0f} |"
                del model, teacher
            print(lines[-1], flush=True)
    with Path(args.output).open("a") as handle:
        rows = " --rows " + " ".join(f"'{r}'" for r in args.rows) if args.rows else ""
        rows += (f" --budgets {' '.join(args.budgets)} --lambada {args.lambada}"
                 + (f" --heal {' '.join(args.heal)}" if args.heal else "") + f" --threads {args.threads}"
                 + (f" --map-rank {args.map_rank}" if args.map_rank != "full" else "")
                 + (" --kv" if args.kv else "") + (" --speed" if args.speed else "")
                 + (f" --num-sequences {args.num_sequences}" if args.num_sequences != CALIBRATION["num_sequences"] else "")
                 + (f" --joint-rounds {' '.join(map(str, args.joint_rounds))}" if args.joint_rounds else ""))
        handle.write(f"\n`python benchmarks/subblocks.py --model {args.model}{rows}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
