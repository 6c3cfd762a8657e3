"""`ghosted eval`."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from .. import assets
from ..errors import GhostedError
from ..options import from_namespace, option
from .common import LoadArgs


@dataclass(kw_only=True)
class EvalArgs(LoadArgs):
    """Arguments of `ghosted eval`."""

    folder: str | None = option(None, "Saved model folder or Hub id (None: the packaged model).", positional=True)
    text: str | None = option(None, "Held-out text file (None: the packaged evaluation articles).")
    seq_len: int = option(512, "Perplexity window length.")
    windows: int = option(16, "Number of non-overlapping windows.")
    tasks: list[str] | None = option(None, "Zero-shot tasks (arc_easy arc_challenge hellaswag piqa winogrande boolq "
                                           "openbookqa).")
    limit: int | None = option(None, "First N validation examples of each zero-shot task (None: 100; needs --tasks).")
    lambada: int | None = option(None, "Also score the first N LAMBADA (OpenAI) items: last-word accuracy and "
                                       "perplexity (5153: all).")


def cmd_eval(args: argparse.Namespace) -> int:
    """`ghosted eval`: held-out perplexity and, optionally, zero-shot tasks."""
    from ..evaluate import check_zero_shot, lambada, lambada_items, perplexity, zero_shot
    from ..text.tokens import tokenize_texts

    run = from_namespace(EvalArgs, args)
    if run.limit is not None and not run.tasks:
        raise GhostedError("--limit applies to zero-shot tasks: pass --tasks too.")
    if run.tasks:
        check_zero_shot(run.tasks)  # before the perplexity run, not after it
    if run.lambada:
        lambada_items(1)
    model, tokenizer = run.load(run.folder)
    text = run.text if run.text is not None else assets.wikipedia_split("evaluation")
    held_out = tokenize_texts(tokenizer, text, run.seq_len, run.windows, batch_size=4, what="Evaluation text")
    results: dict = {"perplexity": perplexity(model, held_out.batches), "perplexity_tokens": held_out.num_tokens}
    if run.tasks:
        results["zero_shot"] = zero_shot(model, tokenizer, run.tasks, limit=100 if run.limit is None else run.limit)
    if run.lambada:
        results["lambada"] = lambada(model, tokenizer, limit=run.lambada)
    print(json.dumps(results, indent=2))
    return 0
