"""The main job on the packaged default model and corpus: prune, recover, save, and compare
dense / plainly pruned / ghosted on held-out text."""

from __future__ import annotations

import copy
import itertools
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from .. import assets
from ..evaluate import perplexity
from ..io.card import save_with_card
from ..model import loading
from ..model.folding import to_stock_model
from ..model.surgery import count_parameters, prune_layers
from ..options import PruneOptions
from ..text.tokens import tokenize_texts
from .prune import ghost_prune

logger = logging.getLogger(__name__)

PROMPT = "The history of the city began"
OUTPUT_ROOT = "ghosted-demo-output"  # .gitignore covers it


def demo_output(model: str | None) -> str:
    """Where `ghosted demo` saves by default: ghosted-demo-output/<model name>-ghosted."""
    name = Path(model or assets.DEFAULT_MODEL).name.replace("-instruct", "")
    return f"{OUTPUT_ROOT}/{name.lower()}-ghosted"


@dataclass
class Row:
    """One line of the demo table."""

    name: str
    perplexity: float
    parameters: int
    prefill_seconds: float
    sample: str


def prefill_seconds(models: list[torch.nn.Module], input_ids: torch.Tensor, rounds: int = 5) -> list[float]:
    """Median wall time of one forward pass (prompt processing) per model, the models taking turns in
    every round so that machine noise hits all of them alike."""
    times: list[list[float]] = [[] for _ in models]
    with torch.no_grad():
        for model in models:
            model(input_ids=input_ids[:, :8], use_cache=False)
        for _ in tqdm(range(rounds), desc="Timing prefill (models take turns)", leave=False):
            for i, model in enumerate(models):
                started = time.perf_counter()
                model(input_ids=input_ids, use_cache=False)
                times[i].append(time.perf_counter() - started)
    return [statistics.median(t) for t in times]


def sample(model: torch.nn.Module, tokenizer, max_new_tokens: int = 24) -> str:
    """A short greedy continuation of the demo prompt (the side-by-side samples)."""
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def sharing_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model`'s modules that holds the same parameter and buffer tensors: the plainly pruned model beside the
    dense one without a second copy of their weights (pruning removes modules of the copy, never a tensor's values)."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    return copy.deepcopy(model, shared)


def run_demo(output: str | Path, options: PruneOptions | None = None, model: str | None = None,
             eval_windows: int = 16, eval_seq_len: int = 512) -> list[Row]:
    """Prune `model` (a packaged model's name, a folder or Hub id; default: SmolLM2-135M) with `options` (default: the
    packaged model's demo removal), save it to `output`, and measure dense, plainly pruned and ghosted models on the
    held-out Wikipedia articles."""
    folder = loading.resolve(model)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)

    def load():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=False,
                                                    **loading.NO_HUB_KERNELS).eval()

    held_out = tokenize_texts(tokenizer, assets.wikipedia_split("evaluation"), eval_seq_len, eval_windows, batch_size=4)
    if options is None and assets.demo_layers(model):
        options = PruneOptions(num_layers=assets.demo_layers(model))
    ghosted = ghost_prune(load(), tokenizer, assets.wikipedia_split("calibration"), options)
    save_with_card(ghosted, output, tokenizer)
    # The plainly pruned model as the stock checkpoint `--operator none` saves (no identity operators counted), made of
    # the dense model's own tensors: three models in the memory of two.
    dense = load()
    plain = to_stock_model(prune_layers(sharing_copy(dense), ghosted.config.removed_layers))
    models = {"dense": dense, "plainly pruned": plain, "ghosted": ghosted}
    seconds = prefill_seconds(list(models.values()), held_out.batches[0]["input_ids"][:1])
    return [Row(name, perplexity(m, held_out.batches, description=f"Perplexity ({name})"), count_parameters(m),
                s, sample(m, tokenizer)) for (name, m), s in zip(models.items(), seconds)]


def format_rows(rows: list[Row], removed: list[int], eval_tokens: str) -> str:
    """The demo table as aligned text."""
    dense = rows[0]
    lines = [
        f"Removed layers {removed}; perplexity on held-out Wikipedia articles ({eval_tokens}); "
        "prefill time of one 512-token sequence, median of 5 interleaved runs.",
        "",
        "| model | perplexity | parameters | prefill (s) | speed-up |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row.name} | {row.perplexity:.2f} | {row.parameters / 1e6:.1f} M | {row.prefill_seconds:.3f} | "
                     f"{dense.prefill_seconds / row.prefill_seconds:.2f}x |")
    lines += ["", f'Greedy continuations of "{PROMPT}":', *(f"  {row.name:>15}: {row.sample!r}" for row in rows)]
    return "\n".join(lines)
