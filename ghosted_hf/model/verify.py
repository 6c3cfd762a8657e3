"""A derived layout verified on the spot: a family with no registry entry is pruned only once a small random instance
of its config class, pruned by the derived layout, equals its dense self with the change made by hooks (the
definition of a pruned, ghosted model) and generates the same tokens with the cache as without."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ..architectures import (ARCHITECTURES, Verdict, architecture, decoder_layers, language_config, quiet_transformers,
                             removal_problem, small_configs, stream_width)
from ..errors import GhostedError, one_line
from ..remote.format_ghosted import expected_boundaries
from ..statistics.patch import apply_matrix, input_hook, output_hook, with_hidden

Prune = Callable[..., PreTrainedModel]  # `surgery.prune_layers`, which the check prunes with (and which asks for it)

_TWIN_DEPTH, _TWIN_PARAMETERS = 6, 50_000_000
_VERDICTS: dict[tuple[str, str], str | None] = {}  # (model type, unit) -> None (the check passed) or why it failed


def check_derived_layout(config: Any, prune: Prune, subblocks: bool = False) -> None:
    """Use a derived layout only once a small random instance of the same config class, pruned by it, equals the
    dense instance with the change made by hooks, and generates the same tokens with the cache as without: for whole
    layers, a removal in the middle and one of the last layer with random operators (the layers skipped); with
    `subblocks`, the first layer's attention and the last layer's MLP replaced by random maps (their outputs replaced).
    Checked once per model type, unit and process; a failure is refused in one line naming what failed. A multimodal
    model's language decoder is checked."""
    config = language_config(config)
    key = (config.model_type, "sub-blocks" if subblocks else "whole layers")
    if not architecture(config).derived or _VERDICTS.get(key, "") is None:
        return
    if key not in _VERDICTS:
        _VERDICTS[key] = "being checked"  # the check's own prune_layers passes through here
        try:
            # seeded instances, the caller's random state untouched; transformers' warnings about the probe off
            with torch.random.fork_rng(devices=[]), quiet_transformers():
                _compare_with_skip_reference(_small_twin(config), prune, subblocks)
            _VERDICTS[key] = None
            if subblocks:
                _LAST_TWIN.clear()  # (the sub-block check comes last)
        except Exception as error:  # whatever the family's code raises on its small instance
            reason = " ".join(str(error).split()).split(" Report it")[0].rstrip(".")  # (the check's own advice follows)
            _VERDICTS[key] = reason[:300] or type(error).__name__
    if _VERDICTS[key] not in (None, "being checked"):
        raise GhostedError(f"{key[0]!r} has no entry in ghosted_hf's architecture registry, and the layout derived for "
                           f"it failed its check on a small instance ({key[1]}): {_VERDICTS[key]}. Report it with the "
                           "model's config.json (docs/architectures.md says how to add an entry).")


def derivation_verdicts(types: Iterable[str], prune: Prune) -> dict[str, Verdict]:
    """Each type of `types` with no registry entry: its derived layout and why whole layers, then sub-blocks, are
    refused (None: the check passed), as `check_derived_layout` decides (the docs' table of derived families)."""
    from transformers import AutoConfig

    verdicts: dict[str, Verdict] = {}
    for model_type in (t for t in types if t not in ARCHITECTURES):
        try:
            config = AutoConfig.for_model(model_type)
        except Exception as error:  # the family's own defaults do not build: nothing to derive from
            verdicts[model_type] = (None, f"its default config cannot be built ({type(error).__name__})", None)
            continue
        layout, whole, sub = None, None, None
        try:
            layout = architecture(config).layout
            check_derived_layout(config, prune)
        except GhostedError as error:
            whole = _VERDICTS.get((model_type, "whole layers")) or str(error)  # (the check's reason, where it ran)
        if whole is None:
            try:
                check_derived_layout(config, prune, subblocks=True)
            except GhostedError:
                sub = _VERDICTS[model_type, "sub-blocks"]
        verdicts[model_type] = (layout, whole, sub)
    return verdicts


_LAST_TWIN: dict[str, PreTrainedModel] = {}  # the last small instance built, by model type (its two checks share it)


def _small_twin(config: Any) -> PreTrainedModel:
    """A random float32 instance of `config`'s class, a few layers deep and a few dozen wide where the family accepts
    that (`small_configs`), whose dense forward runs. The checks leave it as it was (pruning shares its tensors and
    changes none), so the sub-block check reuses the whole-layer check's."""
    if config.model_type not in _LAST_TWIN:
        _LAST_TWIN.clear()
        _LAST_TWIN[config.model_type] = _build_twin(config)
    return _LAST_TWIN[config.model_type]


def _build_twin(config: Any) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    problems = []
    for small, problem in small_configs(config, _TWIN_DEPTH):
        if small is None:
            problems.append(problem)
            continue
        try:
            with torch.device("meta"):
                count = sum(p.numel() for p in AutoModelForCausalLM.from_config(small).parameters())
            if count > _TWIN_PARAMETERS:
                problems.append(f"{count:,} parameters at its own widths")
                continue
            torch.manual_seed(0)
            twin = AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval()
            with torch.no_grad():
                twin(**_twin_inputs(twin))
            return twin
        except Exception as error:  # the family's model on these sizes: try the next
            problems.append(f"{type(error).__name__}: {one_line(error, 120)}")
    raise GhostedError(f"no small instance of its config could be built and run ({'; '.join(problems)})")


def _twin_inputs(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, max(4, min(vocab, 100)), (2, 9), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _compare_with_skip_reference(twin: PreTrainedModel, prune: Prune, subblocks: bool = False) -> None:
    """Prune `twin` (whole layers, or with `subblocks` two sub-blocks) and compare it with its dense self with the
    removed layers skipped, or the sub-blocks' outputs replaced, by hooks (the definition)."""
    depth, width = twin.config.num_hidden_layers, stream_width(twin)
    removed = [] if subblocks else next(sorted(set(r)) for r in ([1, depth - 1], [depth - 1], [1])  # middle, last
                                        if len(set(r)) < depth and removal_problem(twin.config, r) is None)
    generator = torch.Generator().manual_seed(1)
    operators = {b["removed"][0]: torch.eye(width) + 0.05 * torch.randn(width, width, generator=generator)
                 for b in expected_boundaries(depth, removed)}
    inputs = _twin_inputs(twin)
    layers = decoder_layers(twin)
    hooks = [layers[i].register_forward_hook(_passed_through, with_kwargs=True) for i in removed]
    # Each operator on the fed layer's input; after the last layer, on the output of the last one kept (found without
    # the layout's final norm, which this checks).
    for b in expected_boundaries(depth, removed):
        fed, apply = b["removed"][-1] + 1, apply_matrix(operators[b["removed"][0]])
        hooks.append(layers[fed].register_forward_pre_hook(input_hook(apply), with_kwargs=True) if fed < depth else
                     layers[b["removed"][0] - 1].register_forward_hook(output_hook(apply)))
    maps, outputs = {}, {}
    if subblocks:
        family = architecture(twin)
        for layer, block in ((0, "attention"), (depth - 1, "mlp")):
            hidden = language_config(twin.config).hidden_size  # (what a sub-block reads: one stream's width)
            maps[layer, block] = 0.5 * torch.randn(hidden, hidden, generator=generator)
            module = getattr(family, block).module(layers[layer])
            hooks.append(module.register_forward_hook(_replaced(maps[layer, block], outputs, (layer, block)),
                                                      with_kwargs=True))
    try:
        with torch.no_grad():
            expected = twin(**inputs, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    pruned = prune(twin, removed, operators, operator_kind="ghost",
                          subblocks={key: (value, outputs[key]) for key, value in maps.items()} or None)
    with torch.no_grad():
        got = pruned(**inputs, use_cache=False).logits
    gap = float((got - expected).abs().max())
    if not gap <= 1e-4 * max(1.0, float(expected.abs().max())):
        raise GhostedError(f"{'replacing sub-blocks' if subblocks else f'removing layers {removed}'} gives logits "
                           f"{gap:.3g} away from the dense instance with those layers skipped")
    prompt = inputs["input_ids"][:1]
    # (two new tokens: the second is the first computed from the cache)
    cached = pruned.generate(input_ids=prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    if not torch.equal(cached, pruned.generate(input_ids=prompt, max_new_tokens=2, do_sample=False, pad_token_id=0,
                                               use_cache=False)):
        raise GhostedError("its generation with the KV cache differs from generation without it")


def _passed_through(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    return with_hidden(output, args[0] if args else kwargs["hidden_states"])


def _replaced(matrix: torch.Tensor, outputs: dict, key: tuple) -> Callable:
    """A forward hook giving the module's output as `matrix` applied to its input (and recording how many values
    the module returns, as a replaced sub-block records it)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        mapped = apply_matrix(matrix)(args[0] if args else kwargs["hidden_states"])
        outputs[key] = len(output) if isinstance(output, tuple) else 0
        return (mapped, *([None] * (len(output) - 1))) if isinstance(output, tuple) else mapped
    return hook
