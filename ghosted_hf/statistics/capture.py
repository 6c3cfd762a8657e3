"""Hidden states out of one truncated forward pass (hooks that stop the model after the deepest state needed), a pass
resumed at a stored layer input, and next-token losses whose logits are made a chunk of positions at a time."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import inspect
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..architectures import decoder_layers, final_norm
from ..errors import GhostedError, NonFiniteError
from .declarations import LOSS_ROLE, SUBBLOCK_ROLES, token_loss
from .patch import hidden_of, subblock_slot


class _Resumed(nn.Module):
    """Stands in for a decoder layer before the one a pass resumes at: returns `state`, the stored input of the layer
    resumed at (masks and positions stay the model's own), or what the real last layer returned, as it returned it
    (a tensor, or a family's tuple); each stand-in returns it, so the last one does whatever the loop does between
    layers. Reads any other attribute off the layer it stands for (a hybrid's decoder asks its layers their type)."""

    def __init__(self, state: Any, layer: nn.Module) -> None:
        super().__init__()
        self.state = state
        object.__setattr__(self, "_layer", layer)  # (not a submodule: its weights are not this module's)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return self.state.to(hidden_states.device) if isinstance(self.state, torch.Tensor) else self.state


@contextlib.contextmanager
def resumed(model: nn.Module, start: int, state: torch.Tensor | None) -> Iterator[None]:
    """Within the context, `model` skips its first `start` decoder layers and feeds layer `start` with `state`."""
    layers = decoder_layers(model)
    saved = [layers[j] for j in range(start)]
    try:
        for j in range(start):
            layers[j] = _Resumed(state, saved[j])
        yield
    finally:
        for j, layer in enumerate(saved):
            layers[j] = layer


class StopForward(Exception):
    """Raised from a hook on the deepest hidden state a pass needs: the rest of the model is not run."""


@contextlib.contextmanager
def stopped_forward() -> Iterator[None]:
    """Ends a forward pass stopped by `StopForward`. The traceback's frames hold the batch's activations in reference
    cycles (the hook closures and transformers' wrappers) that only the cyclic GC frees, seldom: cleared here."""
    try:
        yield
    except StopForward as stop:
        traceback.clear_frames(stop.__traceback__)


def input_device(model: nn.Module) -> torch.device:
    """Where the model's inputs go (its embedding's device; the CPU for a meta skeleton)."""
    weight = model.get_input_embeddings().weight
    return torch.device("cpu") if weight.device.type == "meta" else weight.device


def subblock_place(read: tuple[str, int]) -> str:
    """Where a sub-block read sits, in words (for the non-finite error)."""
    role, j = read
    return f"the {role.removesuffix('_in').removesuffix('_out')} {'input' if role.endswith('_in') else 'output'} of layer {j}"


def watch_subblocks(model: nn.Module, reads: Iterable[tuple[str, int]],
                    record: Callable[[tuple[str, int], torch.Tensor], None],
                    outputs: dict[tuple[int, str], int] | None = None) -> list[Any]:
    """Hooks (their handles) that give `record(read, value)` what each sub-block read among `reads` sees: the hidden
    state a sub-block is given, or the first value it returns (the module at its slot now: a bypass if installed);
    `outputs[(layer, kind)]` is set to how many values it returned (0: a bare tensor)."""
    handles = []
    for role, j in sorted(r for r in reads if r[0] in SUBBLOCK_ROLES):
        kind, reading = role.removesuffix("_in").removesuffix("_out"), role.endswith("_in")
        module = getattr(*subblock_slot(model, j, kind))

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any = None, read=(role, j), reading=reading,
                 kind=kind):
            value = (args[0] if args else kwargs["hidden_states"]) if reading else output
            if outputs is not None and not reading:
                outputs[(read[1], kind)] = len(output) if isinstance(output, (tuple, list)) else 0
            record(read, hidden_of(value))
        register = module.register_forward_pre_hook if reading else module.register_forward_hook
        handles.append(register(hook, with_kwargs=True))
    return handles


def finite_rows(hidden: torch.Tensor, keep: torch.Tensor, where: str) -> torch.Tensor:
    """The kept tokens' rows (N, C) of a hidden state, refused where one is not finite, naming `where` it appears."""
    kept = hidden[keep.to(hidden.device)]
    if not torch.isfinite(kept).all():
        raise NonFiniteError(
            f"Non-finite activations (NaN/Inf) first appear at {where} on calibration data, in {hidden.dtype}. "
            "Load the model in float32 or bfloat16 (float16 overflows in many LLMs) and check its weights."
        )
    return kept


def capture_hidden_states(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    reads: set[tuple[str, int]],
    keep: torch.Tensor,
    device: torch.device,
) -> dict[tuple[str, int], torch.Tensor]:
    """Run `model` on `batch` as far as `reads` need; return the kept tokens (N, C) of each: ("input", i) the input
    of layer i (i == the layer count: the final norm's), (role, j) for a sub-block role of `declarations` what sub-block
    j reads or returns, ("loss", depth) each token's (next-token loss, has a next token). Every hidden state on the
    way is checked to be finite."""
    layers, norm = decoder_layers(model), final_norm(model)
    depth = len(layers)
    loss = any(role == LOSS_ROLE for role, _ in reads)
    deepest = depth if loss else max(i if role == "input" else i + 1 for role, i in reads)
    captured: dict[tuple[str, int], torch.Tensor] = {}

    def rows(hidden: torch.Tensor, where: str) -> torch.Tensor:
        return finite_rows(hidden, keep, where)

    def pre_hook(i: int):
        # On every layer up to the deepest, so that a NaN is reported where it first appears.
        where = ("the input of the final norm" if i == depth else f"the input of layer {i}") + (
            f" (the output of layer {i - 1})" if i else "")

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            kept = rows(args[0] if args else kwargs["hidden_states"], where)
            if ("input", i) in reads:
                captured[("input", i)] = kept.to(device)
            if i == deepest and not loss:
                raise StopForward
        return hook

    def record(read: tuple[str, int], value: torch.Tensor) -> None:  # (Llama 4's MoE returns its tokens flattened)
        captured[read] = rows(value.reshape(*keep.shape, value.shape[-1]), subblock_place(read)).to(device)

    handles = []
    chunked = loss and head_takes_positions(model)  # (the forward then makes one position's logits)
    try:
        # Registered after any patch's hooks: what is captured is what the next module receives.
        for i in range(deepest + 1):
            handles.append((layers[i] if i < depth else norm).register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles += watch_subblocks(model, reads, record)
        first = input_device(model)
        with torch.no_grad(), last_layer_output(model) as last:
            output = None
            with stopped_forward():
                output = model(**{k: v.to(first) for k, v in batch.items()}, use_cache=False,
                               **({"logits_to_keep": last_position(batch)} if chunked else {}))
    finally:
        for handle in handles:
            handle.remove()
    if loss:
        if chunked and whole_sequence(last["output"], batch):
            losses = token_losses(model, batch, last_output=last["output"])
        else:  # (a family that gave its last layer fewer positions: the whole logits, one more forward)
            losses = token_losses(model, batch, logits=output.logits if not chunked else whole_logits(model, batch))
        captured[token_loss(depth)] = losses[keep.to(losses.device)].to(device)
    return captured


LOGITS_BYTES = 256 * 2**20  # the float32 logits one chunk of a loss may hold


def head_takes_positions(model: nn.Module) -> bool:
    """Whether `model`'s forward computes logits for given positions only (transformers' `logits_to_keep`) and its
    decoder layers are known: then its losses are computed a chunk of positions at a time."""
    if "logits_to_keep" not in inspect.signature(model.forward).parameters or model.get_output_embeddings() is None:
        return False
    try:
        decoder_layers(model)
    except GhostedError:
        return False
    return True


def token_losses(model: nn.Module, batch: Mapping[str, torch.Tensor], *, logits: torch.Tensor | None = None,
                 last_output: Any = None, logits_bytes: int = LOGITS_BYTES) -> torch.Tensor:
    """(B, T, 2) float64: (cross-entropy of the next token, 1) where the next token is real, else (0, 0); a mean loss
    is the first column's sum over the second's. From whole `logits` where a forward made them, else from
    `last_output` (what the last decoder layer returned) through the model's own forward with every decoder layer
    passing it on (its final norm, output layer, soft-capping and scaling), a chunk of positions at a time whose
    float32 logits hold at most `logits_bytes`: no [batch, sequence, vocabulary] tensor exists at once (where the
    family's head takes positions)."""
    device = logits.device if logits is not None else input_device(model)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    rows, length = ids.shape
    labeled = torch.zeros_like(mask, dtype=torch.bool)
    labeled[:, :-1] = mask[:, 1:].bool() & mask[:, :-1].bool()
    losses = torch.zeros(ids.shape, dtype=torch.float64, device=device)

    def put(start: int, end: int, chunk: torch.Tensor) -> None:  # (cross-entropy in float32, as the logits)
        targets = ids[:, start + 1:end + 1].flatten().to(chunk.device)
        losses[:, start:end] = nn.functional.cross_entropy(chunk.float().flatten(0, 1), targets,
                                                           reduction="none").view(rows, -1).to(device)

    if logits is not None:
        put(0, length - 1, logits[:, :-1])
        return torch.stack([losses * labeled, labeled.double()], dim=-1)
    with torch.no_grad(), resumed(model, len(decoder_layers(model)), last_output):
        if not head_takes_positions(model):  # (a family whose head makes every position's logits)
            put(0, length - 1, model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1])
        else:
            step = max(1, logits_bytes // (4 * rows * model.get_output_embeddings().weight.shape[0]))
            for start in range(0, length - 1, step):
                end = min(start + step, length - 1)
                put(start, end, model(input_ids=ids, attention_mask=mask, use_cache=False,
                                      logits_to_keep=torch.arange(start, end, device=device)).logits)
    return torch.stack([losses * labeled, labeled.double()], dim=-1)


def forward_token_losses(model: nn.Module, batch: Mapping[str, torch.Tensor],
                         logits_bytes: int = LOGITS_BYTES) -> torch.Tensor:
    """`token_losses` of one forward of `model` over `batch`: chunked where the model's head takes positions (the
    forward then makes the logits of one position), else from its whole logits."""
    if head_takes_positions(model):
        inputs = {k: v.to(input_device(model)) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
        with torch.no_grad(), last_layer_output(model) as last:
            model(**inputs, use_cache=False, logits_to_keep=last_position(batch))
        if whole_sequence(last["output"], batch):
            return token_losses(model, batch, last_output=last["output"], logits_bytes=logits_bytes)
    return token_losses(model, batch, logits=whole_logits(model, batch))


def whole_logits(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The logits of every position of one forward over `batch`."""
    inputs = {k: v.to(input_device(model)) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def last_position(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """`logits_to_keep` for one forward whose logits are not used: the last position, as positions (an integer would
    let a family skip positions in its last layers, Gemma 4's shared-KV layers)."""
    return torch.tensor([batch["input_ids"].shape[1] - 1])


def whole_sequence(output: Any, batch: Mapping[str, torch.Tensor]) -> bool:
    """Whether a decoder layer's `output` (a tensor, or a tuple that starts with one) covers every position of
    `batch`, as the chunked losses need it."""
    hidden = hidden_of(output)
    return isinstance(hidden, torch.Tensor) and tuple(hidden.shape[:2]) == tuple(batch["input_ids"].shape)


@contextlib.contextmanager
def last_layer_output(model: nn.Module) -> Iterator[dict[str, Any]]:
    """Within the context, `found["output"]` is what the last decoder layer of `model` last returned."""
    found: dict[str, Any] = {}
    handle = decoder_layers(model)[-1].register_forward_hook(lambda module, args, output: found.update(output=output))
    try:
        yield found
    finally:
        handle.remove()


try:
    _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc
    _TRIM = None


def release_freed_memory() -> None:
    """Give the pages of freed blocks back to the OS (glibc). A batch's activations are freed between blocks
    that stay allocated, so without this the heap fragments and peak memory creeps up batch after batch."""
    if _TRIM is not None:
        _TRIM(0)
