"""Ghosted Layers causal LM (arXiv 2605.15491): a pruned decoder-only causal LM (any family transformers ships) whose
residual stream is mapped by a closed-form C x C operator at each pruning boundary.

This file is copied next to the weights and loaded with ``trust_remote_code=True``: it imports only torch,
transformers and the standard library, and only defines the model.

Weight layout (``model.safetensors``): the base decoder keeps its standard names
(``model.layers.{i}.self_attn.q_proj.weight``, ``model.norm.weight``, ``lm_head.weight``); each operator is
the tensor ``model.layers.{i}.ghost.operator`` (applied to the hidden state entering pruned-model layer
``i``) or ``model.norm.ghost.operator`` (applied before the final norm), of shape (C, C), used as
``x -> x @ operator``. A boundary marked `normed` (format 1.1) also has ``....ghost.normed`` and maps
``x -> x @ operator + n(x) @ normed``, n(x) = x / sqrt(mean(x^2) + NORMED_EPS). A replaced sub-block (format 1.2)
is the tensor ``model.layers.{i}.{module}.ghost.operator`` (e.g. ``model.layers.3.self_attn.ghost.operator``): the
module returns ``h @ operator`` for the input ``h`` it was given, and an attention-free layer stores no keys or values
in the KV cache. config.json records each tensor's sha256 and the format version (docs/reference/format.md).
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import hashlib
import inspect
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, GenerationMixin, LlamaForCausalLM,
                          PreTrainedModel)

from .configuration_ghosted import (LAYER_TARGET, NORMED_EPS, OPERATOR_DTYPES, GhostedConfig, check_sizes_against_weights,
                                    decoder_paths, required_format_version)

try:  # transformers >= 4.56: a cache is a list of layers
    from transformers.cache_utils import DynamicLayer
except ImportError:  # pragma: no cover
    DynamicLayer = None

logger = logging.getLogger(__name__)

# Oldest transformers this file is tested on. Support is decided by the features below, never by the version.
MIN_TRANSFORMERS = "4.57"
_lacking = [
    name
    for name, present in (
        ("PreTrainedModel.loss_function", hasattr(PreTrainedModel, "loss_function")),
        # keeps float32 operators float32 under from_pretrained(dtype=torch.bfloat16)
        ("PreTrainedModel._keep_in_fp32_modules_strict", hasattr(PreTrainedModel, "_keep_in_fp32_modules_strict")),
    )
    if not present
]
if _lacking:
    import transformers as _transformers

    raise ImportError(
        f"ghosted remote code needs transformers >= {MIN_TRANSFORMERS}; found {_transformers.__version__} "
        f"(no {', '.join(_lacking)}): pip install -U transformers"
    )

GHOST_MODULE = "ghost"
GHOST_PARAM = "operator"
GHOST_NORMED = "normed"

# How this transformers declares tied weights, read off its own Llama: a {tied: source} dict (5.x) or a list
# of tied names (4.x).
if isinstance(getattr(LlamaForCausalLM, "_tied_weights_keys", None), dict):
    TIED_WEIGHTS_KEYS: Any = {"lm_head.weight": "model.embed_tokens.weight"}
else:
    TIED_WEIGHTS_KEYS = ["lm_head.weight"]


def operator_sha256(operator: torch.Tensor, dtype: str) -> str:
    """Hex sha256 of an operator's raw bytes in its storage dtype `dtype` (CPU, C-contiguous; bf16 as bytes)."""
    tensor = operator.detach().to(device="cpu", dtype=getattr(torch, dtype)).contiguous()
    return hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).hexdigest()


def ghost_tensor_key(boundary: dict[str, Any], param: str = GHOST_PARAM, paths: dict[str, str] | None = None) -> str:
    """State-dict key of a boundary's operator (or of its other tensor `param`), or of a replaced sub-block's map,
    in a model whose decoder layers and final norm sit at `paths` (`decoder_paths`; Llama's by default)."""
    paths = paths or decoder_paths({})
    layers, norm = paths["layers"], paths["norm"]
    if "block" in boundary:
        return f"{layers}.{boundary['layer']}.{boundary['module']}.{GHOST_MODULE}.{param}"
    if boundary["target"] == LAYER_TARGET:
        return f"{layers}.{boundary['layer']}.{GHOST_MODULE}.{param}"
    return f"{norm}.{GHOST_MODULE}.{param}"


def ghost_tensor_keys(boundary: dict[str, Any], paths: dict[str, str] | None = None) -> dict[str, str]:
    """{the config field holding its sha256: state-dict key} of every tensor of a boundary."""
    keys = {"sha256": ghost_tensor_key(boundary, paths=paths)}
    if boundary.get("normed"):
        keys["normed_sha256"] = ghost_tensor_key(boundary, GHOST_NORMED, paths)
    return keys


def ghost_records(config: GhostedConfig) -> list[dict[str, Any]]:
    """Every record that owns ghost tensors: the boundaries, then the replaced sub-blocks."""
    return [*config.ghost_boundaries, *getattr(config, "ghost_subblocks", [])]


# What `save_pretrained` writes; files of an earlier save matching these never survive into a new one.
MODEL_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "config.json",
               "generation_config.json", "*.py")


def process_tag() -> str:
    """Who made a scratch path: the host and process, so that a later write can tell a leftover of a killed process
    from the work of a running one."""
    return f"{socket.gethostname()}~{os.getpid()}"


def process_gone(owner: str) -> bool:
    """Whether the process a `process_tag` names has ended (only ever true for a process of this host)."""
    host, _, pid = owner.rpartition("~")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another machine's (a shared disk), or not ours: never touched
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False


def scratch_folder(parent: Path, stem: str) -> Path:
    """A new folder `parent/<stem><host>~<pid>-XXXX`, readable as any folder the caller makes (the umask's
    permissions, not mkdtemp's 0700: the folder becomes the saved model). Leftovers of `stem` whose process is
    gone are removed first."""
    parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(parent, stem)
    path = Path(tempfile.mkdtemp(dir=parent, prefix=f"{stem}{process_tag()}-"))
    os.chmod(path, 0o777 & ~_umask())
    return path


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def readable_as_made(folder: Path) -> None:
    """Give what a save wrote the permissions a file the caller makes gets (safetensors writes its files 0600 and
    mkdtemp makes 0700 folders; a serving container or another user must be able to read a saved model)."""
    umask = _umask()
    for root, folders, files in os.walk(folder):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o666 & ~umask)


def remove_leftovers(parent: Path, stem: str, restore_to: Path | None = None) -> None:
    """Remove what a killed process left under `parent` with `stem` (its owner tag names a process of this host that
    is gone), and say so. With `restore_to` missing, a leftover is the previous folder a kill caught between its two
    renames: it is moved back instead of removed."""
    for entry in sorted(parent.glob(glob.escape(stem) + "*")):
        if not process_gone(entry.name[len(stem):].rpartition("-")[0]):
            continue
        if restore_to is not None and not os.path.lexists(restore_to):
            os.rename(entry, restore_to)
            logger.warning("Restored %s from %s, which a killed save left.", restore_to, entry.name)
            continue
        # with the scratch paths of a save into it (a model saved into a staging folder stages beside it)
        for item in (entry, *parent.glob(f".{glob.escape(entry.name)}.*")):
            if item.is_dir() and not item.is_symlink():
                shutil.rmtree(item, ignore_errors=True)
            else:
                item.unlink(missing_ok=True)
            logger.warning("Removed %s, left by a killed process.", item)


def replace_folder(staging: Path, target: Path) -> None:
    """Move the complete folder `staging` to `target`. The previous `target` is renamed aside first and removed
    only once the new folder is in place, so it is never partly overwritten."""
    backup = None
    if target.exists():
        backup = scratch_folder(target.parent, f".{target.name}.previous-")
        os.rmdir(backup)
        os.rename(target, backup)
    try:
        os.rename(staging, target)
    except BaseException:
        if backup is not None:
            os.rename(backup, target)
        raise
    if backup is not None:
        shutil.rmtree(backup, ignore_errors=True)


@contextlib.contextmanager
def staged_folder(target: Path) -> Iterator[Path]:
    """Yield an empty sibling folder of `target` to write a whole folder into; on success it replaces `target`, on
    any error it is removed and `target` is left as it was. A symlinked `target` is written where it points (the
    link keeps naming the saved folder); leftovers of killed saves to `target` are cleaned up first."""
    target = target.resolve() if target.is_symlink() else target
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(target.parent, f".{target.name}.previous-", restore_to=target)
    staging = scratch_folder(target.parent, f".{target.name}.saving-")
    try:
        yield staging
        readable_as_made(staging)
        replace_folder(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _carry_over(folder: Path, staging: Path) -> None:
    """Copy the files of `folder` that a model save does not write (tokenizer, card, ...) into `staging`."""
    for item in folder.iterdir():
        if any(fnmatch.fnmatch(item.name, pattern) for pattern in MODEL_FILES):
            continue
        if item.is_dir():
            shutil.copytree(item, staging / item.name)
        else:
            shutil.copy2(item, staging / item.name)


def _mismatch_key(entry: Any) -> str:
    # `output_loading_info` lists a shape mismatch as (key, checkpoint shape, model shape) in 5.x, as the bare
    # key in 4.x.
    return entry if isinstance(entry, str) else entry[0]


def _describe_mismatch(entry: Any) -> str:
    if not isinstance(entry, str) and len(entry) == 3:
        key, saved, expected = entry
        return f"{key} (checkpoint {tuple(saved)}, config {tuple(expected)})"
    return f"{_mismatch_key(entry)} (checkpoint shape differs from the config's)"


def rms_normalized(x: torch.Tensor) -> torch.Tensor:
    """n(x) = x / sqrt(mean(x^2) + NORMED_EPS) over the channels: the normed term's input (an RMSNorm without
    a weight; the weight is part of `normed`)."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + NORMED_EPS)


class GhostOperator(nn.Module):
    """Maps the residual stream entering its parent module: ``x -> x @ operator`` (``+ n(x) @ normed`` with a
    normed term).

    Lives as a child of the layer (or final norm) it feeds, so the base weight names stay standard and
    device placement follows the parent. The products are computed in the operator's dtype (float32 by
    default) and cast back to the activation dtype.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32, normed: bool = False) -> None:
        super().__init__()
        self.operator = nn.Parameter(torch.empty(hidden_size, hidden_size, dtype=dtype))
        self.normed = nn.Parameter(torch.empty(hidden_size, hidden_size, dtype=dtype)) if normed else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        operator = self.operator
        x = hidden_states.to(device=operator.device, dtype=operator.dtype)
        mapped = x @ operator
        if self.normed is not None:
            mapped = mapped + rms_normalized(x) @ self.normed
        return mapped.to(device=hidden_states.device, dtype=hidden_states.dtype)

    def extra_repr(self) -> str:
        normed = ", normed" if self.normed is not None else ""
        return f"{self.operator.shape[0]}, dtype={self.operator.dtype}{normed}"


class GhostMap(GhostOperator):
    """The map that stands in for a removed sub-block (a freshly built one is zero: the sub-block removed)."""


if DynamicLayer is not None:
    class _PositionOnlyLayer(DynamicLayer):
        """A KV-cache layer of an attention-free layer: it is given zero-width keys and values, so it holds no bytes,
        and reads its length off their shape (the parent counts elements, which are none): masks and positions
        that transformers reads from this layer stay right."""

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            keys = getattr(self, "keys", None)
            return int(keys.shape[-2]) if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0


class SubBlockBypass(nn.Module):
    """A removed attention or MLP sub-block: returns ``h @ A`` for the input ``h`` it is given (its norm's output, or
    the stream in post-norm families), shaped as the sub-block's output was (`outputs` values, the rest None).

    The map is the child `ghost` (its tensor ``....ghost.operator``). In place of attention it gives the KV cache
    zero-width keys and values, so the cache's length (positions, masks) stays right and holds no bytes for it."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, block: str, layer_idx: int, outputs: int) -> None:
        super().__init__()
        self.ghost = GhostMap(hidden_size, dtype)
        self.block, self.layer_idx, self.outputs = block, layer_idx, outputs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden_states = args[0] if args else kwargs["hidden_states"]
        if self.block == "attention":
            self._track_positions(hidden_states, kwargs)
        mapped = self.ghost(hidden_states)
        return (mapped, *([None] * (self.outputs - 1))) if self.outputs else mapped

    def _track_positions(self, hidden_states: torch.Tensor, kwargs: dict[str, Any]) -> None:
        # the KV cache, by this transformers' name for it (5.25 renamed past_key_values to cache)
        cache = next((kwargs[k] for k in ("cache", "past_key_values", "past_key_value") if kwargs.get(k) is not None),
                     None)
        layers = getattr(cache, "layers", None)
        if cache is None or not callable(getattr(cache, "update", None)):
            return
        if layers is not None and self.layer_idx < len(layers) and not callable(getattr(layers[self.layer_idx], "update", None)):
            # a linear-attention layer (transformers >= 5.25): no state to keep, only the length it reports
            length = getattr(layers[self.layer_idx], "cumulative_length_linear", None)
            if isinstance(length, torch.Tensor):
                length.add_(hidden_states.shape[1])
            return
        empty = hidden_states.new_zeros((hidden_states.shape[0], 0, hidden_states.shape[1], 0))
        cache.update(empty, empty, self.layer_idx, {"cache_position": kwargs.get("cache_position")})
        if DynamicLayer is not None and layers is not None and type(layers[self.layer_idx]) is DynamicLayer:
            layers[self.layer_idx].__class__ = _PositionOnlyLayer

    def extra_repr(self) -> str:
        return f"{self.block} replaced by a linear map"


def _offloaded_value(model: nn.Module, name: str) -> torch.Tensor | None:
    """The value of the offloaded ghost tensor `name`, through the weights map accelerate's hook on its module
    reads from (None when there is no such map)."""
    module_name, _, param = name.rpartition(".")
    weights = getattr(getattr(model.get_submodule(module_name), "_hf_hook", None), "weights_map", None)
    try:
        return weights[param] if weights is not None else None
    except KeyError:
        return None


def apply_ghost_operator(parent: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a layer (or the final norm): map its input hidden state with its `ghost` child.

    The child is looked up at call time, so a wrapper put in its place (e.g. PEFT's `modules_to_save`)
    is the one applied.
    """
    ghost = getattr(parent, GHOST_MODULE)
    if args:
        return (ghost(args[0]), *args[1:]), kwargs
    kwargs["hidden_states"] = ghost(kwargs["hidden_states"])
    return args, kwargs


class GhostedPreTrainedModel(PreTrainedModel):
    """Loading, saving and integrity checks shared by the ghosted model classes."""

    config_class = GhostedConfig
    config: GhostedConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        # A freshly built model is the plainly pruned one. Loading never relies on this: `from_pretrained`
        # refuses checkpoints whose operators are missing.
        if isinstance(module, GhostMap):
            nn.init.zeros_(module.operator)
        elif isinstance(module, GhostOperator):
            nn.init.eye_(module.operator)
            if module.normed is not None:
                nn.init.zeros_(module.normed)
        else:
            super()._init_weights(module)

    def _install_operators(self, config: GhostedConfig) -> None:
        """An operator before every boundary and a bypass in every replaced sub-block of the pruned base decoder this
        model holds under the family's own module names (`ghost_layout`, Llama's by default)."""
        text_config = config.text_config  # the language decoder's (a multimodal base's text config)
        paths = decoder_paths(config)
        layers = _submodule(self, paths["layers"])
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"This {text_config.model_type} model has no decoder layers at `{paths['layers']}` "
                             "(ghost_layout): the config does not match this model family.")
        operator_dtype = getattr(torch, config.operator_dtype)
        if operator_dtype == torch.float32:
            # from_pretrained(dtype=torch.bfloat16) must not round the operators.
            self._keep_in_fp32_modules_strict = [GHOST_MODULE]
        for boundary in config.ghost_boundaries:
            parent = layers[boundary["layer"]] if boundary["target"] == LAYER_TARGET else _submodule(self, paths["norm"])
            if parent is None:
                raise ValueError(f"This {text_config.model_type} model has no `{paths['norm']}`, which the boundary "
                                 f"after removed layers {boundary['removed']} feeds (ghost_layout): load it with the "
                                 "class of its config's auto_map that has it (AutoModelForCausalLM).")
            parent.add_module(GHOST_MODULE, GhostOperator(text_config.hidden_size, operator_dtype,
                                                          normed=bool(boundary.get("normed"))))
            parent.register_forward_pre_hook(apply_ghost_operator, with_kwargs=True)
        for record in config.ghost_subblocks:
            layer = layers[record["layer"]]
            if not isinstance(getattr(layer, record["module"], None), nn.Module):
                raise ValueError(f"Layer {record['layer']} ({type(layer).__name__}) has no sub-block "
                                 f"{record['module']!r} to replace: the config does not match this model family.")
            setattr(layer, record["module"], SubBlockBypass(text_config.hidden_size, operator_dtype, record["block"],
                                                            record["layer"], record.get("outputs", 0)))

    def ghost_operators(self) -> dict[str, nn.Parameter]:
        """Every ghost tensor (each boundary's operator and its normed term where it has one, each replaced
        sub-block's map), keyed by its state-dict name."""
        paths = decoder_paths(self.config)
        return {key: self.get_parameter(key) for b in ghost_records(self.config)
                for key in ghost_tensor_keys(b, paths).values()}

    def operator_value_problems(self, require_hashes: bool = False) -> list[str]:
        """What is wrong with the operators' values: non-finite in the storage dtype, not the bytes whose
        sha256 config.json records, or (with `require_hashes`, as for a loaded checkpoint) no sha256 recorded
        at all. Empty when they are sound."""
        problems = []
        storage = self.config.operator_dtype
        paths = decoder_paths(self.config)
        recorded = {key: b.get(field) for b in ghost_records(self.config)
                    for field, key in ghost_tensor_keys(b, paths).items()}
        for name, operator in self.ghost_operators().items():
            if operator.device.type == "meta":  # offloaded (device_map with disk or CPU offload): read it back
                operator = _offloaded_value(self, name)
                if operator is None:
                    problems.append(f"operator {name} is offloaded where it cannot be read back to verify it")
                    continue
            # In the storage dtype: a value finite in a wider checkpoint dtype (1e300) may not be once stored.
            stored = operator.detach().to(getattr(torch, storage))
            if not (torch.isfinite(operator).all() and torch.isfinite(stored).all()):
                problems.append(f"operator {name} holds NaN or Inf values (as {storage})")
            elif not recorded.get(name):
                if require_hashes:
                    problems.append(f"operator {name} has no sha256 in config.json, so it cannot be verified "
                                    "(re-save the model with save_pretrained, or pass verify_operator_hashes=False "
                                    "to load it unverified)")
            elif operator_sha256(stored, storage) != recorded[name]:
                problems.append(
                    f"operator {name} does not match the sha256 recorded for it in config.json "
                    "(the tensor was altered, or config.json comes from another save)"
                )
        return problems

    def _refresh_ghost_integrity(self, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Make `config.operator_dtype` and each boundary's `sha256` describe the tensors about to be saved."""
        operators = self.ghost_operators()
        if state_dict is not None:
            operators = {name: state_dict.get(name, operator) for name, operator in operators.items()}
        dtypes = {str(op.dtype).removeprefix("torch.") for op in operators.values()}
        if len(dtypes) > 1 or not dtypes <= set(OPERATOR_DTYPES):
            found = ", ".join(f"{name}: {str(op.dtype).removeprefix('torch.')}" for name, op in operators.items())
            raise ValueError(
                f"Cannot save ghost operators as {found}: they must all be one of {', '.join(OPERATOR_DTYPES)}. "
                "Cast them back first, e.g. `for op in model.ghost_operators().values(): op.data = op.data.float()`."
            )
        if dtypes:
            self.config.operator_dtype = dtypes.pop()
        def hashed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
            records = [dict(record) for record in records]
            for record in records:
                for field, name in ghost_tensor_keys(record, decoder_paths(self.config)).items():
                    operator = operators[name]
                    if operator.device.type == "meta":  # offloaded: hash the value its hook reads back
                        operator = _offloaded_value(self, name)
                        if operator is None:
                            raise ValueError(f"Cannot save {name}: it is offloaded where it cannot be read back. "
                                             "Load the model without offloading the operators to save it.")
                    record[field] = operator_sha256(operator, self.config.operator_dtype)
            return records

        self.config.ghost_boundaries = hashed(self.config.ghost_boundaries)
        self.config.ghost_subblocks = hashed(self.config.ghost_subblocks)
        self.config.ghost_format_version = required_format_version(self.config.ghost_boundaries,
                                                                   self.config.ghost_subblocks, self.config.ghost_layout)

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any):
        """`PreTrainedModel.save_pretrained`, all or nothing: the files are written into a sibling folder that then
        replaces `save_directory`. Files of an earlier save that this one does not write again (a single weights
        file beside new shards, an old index) are gone; files a model save never writes (tokenizer, card) stay."""
        # Before the parent writes config.json: the operator dtype and hashes always match the saved tensors.
        self._refresh_ghost_integrity(kwargs.get("state_dict"))
        multimodal = self.config.base_config is not None
        if self._auto_class is not None:  # the parent adds this class's own entry (and the config's) to auto_map
            module = type(self).__module__.rsplit(".", 1)[-1]
            entries = {"AutoModel": f"{module}.GhostedModel"}
            if multimodal:  # loads whole with either auto class
                entries.update(AutoModelForCausalLM=f"{module}.{GhostedForConditionalGeneration.__name__}",
                               AutoModelForImageTextToText=f"{module}.{GhostedForConditionalGeneration.__name__}")
            self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **entries}
        if multimodal and _SAVES_ORIGINAL_FORMAT:
            # Tensors under the module names (format 1.3's ghost_layout names them), not renamed to the family's
            # original checkpoint layout, which this transformers applies to a nested model in another way.
            kwargs.setdefault("save_original_format", False)
        target = Path(save_directory)
        if kwargs.get("push_to_hub") or not kwargs.get("is_main_process", True) or target.is_file():
            return super().save_pretrained(save_directory, *args, **kwargs)
        with staged_folder(target) as staging:
            if target.is_dir():
                _carry_over(target, staging)
            return super().save_pretrained(staging, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        if args and isinstance(args[0], (str, os.PathLike)):
            check_sizes_against_weights(str(args[0]), kwargs)  # before a model of the claimed depth is built
        want_info = kwargs.pop("output_loading_info", False)
        verify = kwargs.pop("verify_operator_hashes", True)
        ignore_mismatched = kwargs.pop("ignore_mismatched_sizes", False)
        # Let mismatches through so that the error below can name them; operators are never re-initialised.
        model, info = super().from_pretrained(
            *args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
        problems = []
        missing = sorted(info.get("missing_keys", ()))  # a base weight too: it would be left randomly initialised
        if [k for k in missing if f".{GHOST_MODULE}." in k]:
            problems.append(f"operator tensors missing from the checkpoint: {[k for k in missing if f'.{GHOST_MODULE}.' in k]}")
        if [k for k in missing if f".{GHOST_MODULE}." not in k]:
            problems.append(f"weights missing from the checkpoint: {[k for k in missing if f'.{GHOST_MODULE}.' not in k]}")
        unexpected = sorted(k for k in info.get("unexpected_keys", ()) if f".{GHOST_MODULE}." in k)
        if unexpected:
            problems.append(f"operator tensors in the checkpoint that the config has no boundary for: {unexpected}")
        mismatched = [
            _describe_mismatch(entry)
            for entry in info.get("mismatched_keys", ())
            if f".{GHOST_MODULE}." in _mismatch_key(entry) or not ignore_mismatched
        ]
        if mismatched:
            problems.append(f"tensors of the wrong shape: {mismatched}")
        problems += model.operator_value_problems(require_hashes=verify)
        if problems:
            base_missing = [k for k in missing if f".{GHOST_MODULE}." not in k]
            stored = info.get("unexpected_keys", ())
            # The same layers stored in another layout (experts one by one where the model fuses them, other
            # module names): a conversion this transformers applies to the family's own models, not to a nested one.
            relayout = bool(base_missing) and all(
                any(u.startswith(".".join(k.split(".")[:3]) + ".") for u in stored) for k in base_missing)
            raise ValueError(
                "This ghosted checkpoint does not match its config.json: "
                + "; ".join(problems)
                + (". The checkpoint holds these modules in the layout the family's checkpoints use, which this "
                   "transformers converts for the family's own models only: load it with a transformers that "
                   "converts nested models too (4.57, or 5.10 and later)" if relayout else
                   ". Re-export it with save_pretrained from the model that produced it; an operator is never "
                   "replaced by identity or random values.")
            )
        return (model, info) if want_info else model


class GhostedModel(GhostedPreTrainedModel):
    """The pruned decoder with its operators and no LM head (`AutoModel`): hidden states for embeddings or
    feature extraction. Loads from the same checkpoint as `GhostedForCausalLM` (the head's weight is unused)."""

    def __init__(self, config: GhostedConfig) -> None:
        super().__init__(config)
        config.validate_ghost_layout()
        # The family's base model, under the name its causal LM gives it (`model`, `transformer`, `backbone`, ...).
        self.base_model_prefix = decoder_paths(config)["layers"].split(".")[0]
        setattr(self, self.base_model_prefix, AutoModel.from_config(_base(config)))
        self._install_operators(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return getattr(self, self.base_model_prefix).get_input_embeddings()

    def forward(self, *args: Any, **kwargs: Any):
        return getattr(self, self.base_model_prefix)(*args, **kwargs)


class GhostedForCausalLM(GhostedPreTrainedModel, GenerationMixin):
    """A pruned causal LM of any decoder family transformers ships, with a Ghosted Layers operator at every pruning
    boundary: a drop-in transformers model (`generate`, `pipeline`, PEFT, lm-eval) whose `from_pretrained` refuses
    a checkpoint whose operators are missing, misshapen, non-finite or not the recorded bytes.

    The head, the logits' post-processing (soft-capping, scaling), the loss (a router's auxiliary loss included) and
    the generation hooks are the base family's own: its causal-LM class is built from `text_config`, its modules
    (`model` and `lm_head`, `transformer`, ...) and the attributes its methods read are taken over under their own
    names, and the instance becomes one of a subclass of both this class and the family's (same name), so that the
    family's methods (`forward` first) run on it as written.
    """

    _tied_weights_keys = TIED_WEIGHTS_KEYS

    def __init__(self, config: GhostedConfig) -> None:
        super().__init__(config)
        config.validate_ghost_layout()
        multimodal = config.base_config is not None
        base = (AutoModelForImageTextToText if multimodal else AutoModelForCausalLM).from_config(_base(config))
        for name, value in vars(base).items():  # what the family's forward reads (vocab_size, logit_scale, ...)
            if not name.startswith("_") and name != "training" and not hasattr(self, name):
                setattr(self, name, value)
        for name, module in base.named_children():
            self.add_module(name, module)
        self.__class__ = _with_family(type(self), type(base))
        tied = getattr(base, "_tied_weights_keys", None)  # ({} where the family ties nothing)
        self._tied_weights_keys = TIED_WEIGHTS_KEYS if tied is None else tied
        self._install_operators(config)
        self.post_init()


class GhostedForConditionalGeneration(GhostedForCausalLM):
    """A pruned multimodal model (`AutoModelForImageTextToText`: Gemma 3, Llama 4, Qwen3.5, ...) whose language
    decoder has Ghosted Layers operators; its vision tower and projector are the dense model's, untouched. Built,
    loaded and checked as `GhostedForCausalLM`, from the family's image-text-to-text class."""


_SAVES_ORIGINAL_FORMAT = "save_original_format" in inspect.signature(PreTrainedModel.save_pretrained).parameters
_FAMILY_CLASSES: dict[tuple[type, type], type] = {}


def _base(config: GhostedConfig) -> Any:
    """The config the base model is built from: a multimodal base's (holding the language decoder's), or the decoder's."""
    return config.base_config if config.base_config is not None else config.text_config


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _with_family(cls: type, family: type) -> type:
    """`cls` (a ghosted class) joined with a family's causal-LM class: the ghosted class's own methods first, then
    the family's (its forward, generation hooks, weight init; `super()` inside them holds), then the rest."""
    if family in cls.__mro__:
        return cls
    if (cls, family) not in _FAMILY_CLASSES:
        _FAMILY_CLASSES[cls, family] = type(cls.__name__, (cls, family), {"__module__": cls.__module__,
                                                                          "__qualname__": cls.__qualname__,
                                                                          "base_model_prefix": family.base_model_prefix})
    return _FAMILY_CLASSES[cls, family]


__all__ = ["GhostedForCausalLM", "GhostedForConditionalGeneration", "GhostedModel", "GhostedPreTrainedModel", "GhostOperator", "SubBlockBypass"]
