"""Ghosted Layers causal LM (arXiv 2605.15491): a pruned Llama / Qwen2 / Qwen3 / Mistral decoder whose
residual stream is mapped by a closed-form C x C operator at each pruning boundary.

This file is copied next to the weights and loaded with ``trust_remote_code=True``: it imports only torch,
transformers and the standard library, and only defines the model.

Weight layout (``model.safetensors``): the base decoder keeps its standard names
(``model.layers.{i}.self_attn.q_proj.weight``, ``model.norm.weight``, ``lm_head.weight``); each operator is
the tensor ``model.layers.{i}.ghost.operator`` (applied to the hidden state entering pruned-model layer
``i``) or ``model.norm.ghost.operator`` (applied before the final norm), of shape (C, C), used as
``x -> x @ operator``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoModel, GenerationMixin, LlamaForCausalLM, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_ghosted import LAYER_TARGET, OPERATOR_DTYPES, GhostedConfig

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

try:
    from transformers.utils import can_return_tuple
except ImportError:  # older releases: the same behaviour, here
    import functools

    def can_return_tuple(forward):
        """`return_dict=False` (argument or config) turns the ModelOutput into a tuple."""

        @functools.wraps(forward)
        def wrapper(self, *args, **kwargs):
            return_dict = kwargs.pop("return_dict", None)
            if return_dict is None:
                return_dict = getattr(self.config, "return_dict", True)
            output = forward(self, *args, **kwargs)
            return output if return_dict else output.to_tuple()

        return wrapper


GHOST_MODULE = "ghost"
GHOST_PARAM = "operator"

# How this transformers declares tied weights, read off its own Llama: a {tied: source} dict (5.x) or a list
# of tied names (4.x).
if isinstance(getattr(LlamaForCausalLM, "_tied_weights_keys", None), dict):
    TIED_WEIGHTS_KEYS: Any = {"lm_head.weight": "model.embed_tokens.weight"}
else:
    TIED_WEIGHTS_KEYS = ["lm_head.weight"]


def operator_sha256(operator: torch.Tensor, dtype: str) -> str:
    """Hex sha256 of an operator's raw bytes in its storage dtype `dtype` (CPU, C-contiguous; bf16 as bytes)."""
    import hashlib  # (standard library; imported here to keep this file's top-level imports to torch/transformers)

    tensor = operator.detach().to(device="cpu", dtype=getattr(torch, dtype)).contiguous()
    return hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).hexdigest()


def ghost_tensor_key(boundary: dict[str, Any]) -> str:
    """State-dict key of a boundary's operator."""
    if boundary["target"] == LAYER_TARGET:
        return f"model.layers.{boundary['layer']}.{GHOST_MODULE}.{GHOST_PARAM}"
    return f"model.norm.{GHOST_MODULE}.{GHOST_PARAM}"


def _mismatch_key(entry: Any) -> str:
    # `output_loading_info` lists a shape mismatch as (key, checkpoint shape, model shape) in 5.x, as the bare
    # key in 4.x.
    return entry if isinstance(entry, str) else entry[0]


def _describe_mismatch(entry: Any) -> str:
    if not isinstance(entry, str) and len(entry) == 3:
        key, saved, expected = entry
        return f"{key} (checkpoint {tuple(saved)}, config {tuple(expected)})"
    return f"{_mismatch_key(entry)} (checkpoint shape differs from the config's)"


class GhostOperator(nn.Module):
    """Maps the residual stream entering its parent module: ``x -> x @ operator``.

    Lives as a child of the layer (or final norm) it feeds, so the base weight names stay standard and
    device placement follows the parent. The product is computed in the operator's dtype (float32 by
    default) and cast back to the activation dtype.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.operator = nn.Parameter(torch.empty(hidden_size, hidden_size, dtype=dtype))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        operator = self.operator
        mapped = hidden_states.to(device=operator.device, dtype=operator.dtype) @ operator
        return mapped.to(device=hidden_states.device, dtype=hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{self.operator.shape[0]}, dtype={self.operator.dtype}"


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
        if isinstance(module, GhostOperator):
            nn.init.eye_(module.operator)
        else:
            super()._init_weights(module)


class GhostedForCausalLM(GhostedPreTrainedModel, GenerationMixin):
    _tied_weights_keys = TIED_WEIGHTS_KEYS

    def __init__(self, config: GhostedConfig) -> None:
        config.validate_ghost_layout()
        super().__init__(config)
        text_config = config.text_config
        self.model = AutoModel.from_config(text_config)
        self.vocab_size = text_config.vocab_size
        self.lm_head = nn.Linear(text_config.hidden_size, text_config.vocab_size, bias=False)
        operator_dtype = getattr(torch, config.operator_dtype)
        if operator_dtype == torch.float32:
            # from_pretrained(dtype=torch.bfloat16) must not round the operators.
            self._keep_in_fp32_modules_strict = [GHOST_MODULE]
        for boundary in config.ghost_boundaries:
            parent = self.model.layers[boundary["layer"]] if boundary["target"] == LAYER_TARGET else self.model.norm
            parent.add_module(GHOST_MODULE, GhostOperator(text_config.hidden_size, operator_dtype))
            parent.register_forward_pre_hook(apply_ghost_operator, with_kwargs=True)
        self.post_init()

    def ghost_operators(self) -> dict[str, nn.Parameter]:
        """The operator of every boundary, keyed by its state-dict name."""
        return {ghost_tensor_key(b): self.get_parameter(ghost_tensor_key(b)) for b in self.config.ghost_boundaries}

    def operator_value_problems(self) -> list[str]:
        """What is wrong with the operators' values: non-finite in the storage dtype, or not the bytes whose
        sha256 config.json records. Empty when they are sound."""
        problems = []
        storage = self.config.operator_dtype
        recorded = {ghost_tensor_key(b): b.get("sha256") for b in self.config.ghost_boundaries}
        for name, operator in self.ghost_operators().items():
            if operator.device.type == "meta":
                continue
            # In the storage dtype: a value finite in a wider checkpoint dtype (1e300) may not be once stored.
            stored = operator.detach().to(getattr(torch, storage))
            if not (torch.isfinite(operator).all() and torch.isfinite(stored).all()):
                problems.append(f"operator {name} holds NaN or Inf values (as {storage})")
            elif recorded.get(name) and operator_sha256(stored, storage) != recorded[name]:
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
        boundaries = []
        for boundary in self.config.ghost_boundaries:
            boundary = dict(boundary)
            operator = operators[ghost_tensor_key(boundary)]
            if operator.device.type == "meta":  # offloaded and not materialised: never keep a stale hash
                boundary.pop("sha256", None)
            else:
                boundary["sha256"] = operator_sha256(operator, self.config.operator_dtype)
            boundaries.append(boundary)
        self.config.ghost_boundaries = boundaries

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any):
        # Before the parent writes config.json: the operator dtype and hashes always match the saved tensors.
        self._refresh_ghost_integrity(kwargs.get("state_dict"))
        return super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        want_info = kwargs.pop("output_loading_info", False)
        ignore_mismatched = kwargs.pop("ignore_mismatched_sizes", False)
        # Let mismatches through so that the error below can name them; operators are never re-initialised.
        model, info = super().from_pretrained(
            *args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
        problems = []
        missing = sorted(k for k in info.get("missing_keys", ()) if f".{GHOST_MODULE}." in k)
        if missing:
            problems.append(f"operator tensors missing from the checkpoint: {missing}")
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
        problems += model.operator_value_problems()
        if problems:
            raise ValueError(
                "This ghosted checkpoint does not match its config.json: "
                + "; ".join(problems)
                + ". Re-export it with save_pretrained from the model that produced it; an operator is never "
                "replaced by identity or random values."
            )
        return (model, info) if want_info else model

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        # The KV cache and attention options travel in **kwargs, so this works whatever transformers names them.
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        extras = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
        return CausalLMOutputWithPast(loss=loss, logits=logits, **extras)


__all__ = ["GhostedForCausalLM", "GhostedPreTrainedModel", "GhostOperator"]
