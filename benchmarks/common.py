"""Setup shared by the benchmarks: the packaged model, its tokenizer, and the held-out windows."""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets
from ghosted_hf.evaluate import perplexity
from ghosted_hf.fitting import subblocks as sb
from ghosted_hf.model.loading import NO_HUB_KERNELS
from ghosted_hf.options import PruneOptions
from ghosted_hf.statistics import Calibrator, FullModelPass
from ghosted_hf.text.tokens import TokenBatches, tokenize_texts

# The equal-budget tables' calibration (issues #34, #51): 32 windows of 512 tokens of the Wikipedia calibration articles.
CALIBRATION = dict(seq_len=512, num_sequences=32, batch_size=4)


def packaged_model(name: str = assets.DEFAULT_MODEL) -> tuple[object, Callable[[], torch.nn.Module]]:
    """A packaged model's tokenizer and a loader of fresh fp32 copies (ghost_prune consumes one), with the model's own
    code only (no Hub kernels), as ghosted_hf loads models."""
    folder = assets.packaged_model_dir(name)
    return AutoTokenizer.from_pretrained(folder), lambda: AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, **NO_HUB_KERNELS).eval()


def held_out_windows(tokenizer, windows: int) -> TokenBatches:
    """The first `windows` non-overlapping 512-token windows of the held-out articles, in batches of 4."""
    return tokenize_texts(tokenizer, assets.wikipedia_split("evaluation"), 512, windows, 4)


def held_out_sources(tokenizer, windows: int = 16) -> dict[str, list]:
    """The equal-budget tables' two held-out sources, as batches of 4 windows of 512 tokens: the packaged Wikipedia
    evaluation articles ("wiki") and gensim's news articles ("news"), each window starting with BOS where the
    tokenizer adds one (Gemma, as it was trained)."""
    return {source: tokenize_texts(tokenizer, texts, 512, windows, batch_size=4).batches
            for source, texts in (("wiki", assets.wikipedia_split("evaluation")), ("news", assets.news_articles()))}


def criterion_fits(model: torch.nn.Module, tokenizer, texts: list[str], candidates: list[sb.SubBlockRef],
                   calibration: dict[str, int], map_rank: str = "full") -> tuple[dict, Calibrator]:
    """Each candidate's map fitted on the dense model, and the calibration's first damage_sequences on which the
    sub-block criterion measures their damages (`sb.damages`): the steps `ghost_prune(unit="subblock")` takes."""
    options = PruneOptions(**calibration)
    calibrator = Calibrator(FullModelPass(model), tokenize_texts(tokenizer, texts, **calibration))
    fits = sb.candidate_fits(calibrator, candidates, options.ridge, sb.parse_map_rank(map_rank))
    return fits, calibrator.first_batches(max(1, -(-options.damage_sequences // options.batch_size)))


def layer_ranges(layers: list[int]) -> str:
    """Removed layers as runs, e.g. [12, 13, 14, 25] -> "12-14,25"."""
    runs, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ",".join(runs)


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=assets.DEFAULT_MODEL, choices=list(assets.PACKAGED_MODELS),
                        help="The packaged model to measure on.")


def model_title(load: Callable[[], torch.nn.Module], name: str) -> tuple[str, Any]:
    """("<name> (<depth> layers, dequantized GGUF)", config) for the tables' headers."""
    config = load().config
    return f"{name} ({config.num_hidden_layers} layers; dequantized GGUF)", config


def add_setup_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--num-sequences", type=int, default=PruneOptions().num_sequences)


@dataclasses.dataclass
class Setup:
    """What a lever benchmark compares on: the packaged model, calibration text and its default tokenization,
    held-out windows, and the dense perplexity."""

    tokenizer: object
    load: Callable[[], torch.nn.Module]
    calibration: list[str]
    held_out: list[dict[str, torch.Tensor]]
    options: PruneOptions
    data: TokenBatches
    dense: float


def benchmark_setup(args: argparse.Namespace) -> Setup:
    tokenizer, load = packaged_model(args.model)
    calibration = assets.wikipedia_split("calibration")
    options = PruneOptions(num_sequences=args.num_sequences)
    data = tokenize_texts(tokenizer, calibration, options.seq_len, options.num_sequences, options.batch_size)
    held_out = held_out_windows(tokenizer, args.eval_windows).batches
    return Setup(tokenizer, load, calibration, held_out, options, data, perplexity(load(), held_out, progress=False))


def transformers_speed(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s), the best of 3."""
    ids = torch.tensor([prompt])
    prefill = decode = 0.0
    for _ in range(3):
        with torch.no_grad():
            start = time.perf_counter()
            out = model(ids, use_cache=True)
            middle = time.perf_counter()
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(new_tokens):
                out = model(token, past_key_values=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            end = time.perf_counter()
        prefill, decode = max(prefill, len(prompt) / (middle - start)), max(decode, new_tokens / (end - middle))
    return prefill, decode
