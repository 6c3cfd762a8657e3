"""The KV cache of a layer whose attention is gone (a replaced sub-block, a DeciLM linear or no-op attention): it
keeps the cache's length right, so that the positions and masks transformers reads from any layer stay right, and
holds no bytes. Copied next to the weights with the model code; imports only torch and transformers."""

from __future__ import annotations

from typing import Any

import torch

try:  # transformers >= 4.56: a cache is a list of layers
    from transformers.cache_utils import DynamicLayer
except ImportError:  # pragma: no cover
    DynamicLayer = None


if DynamicLayer is not None:
    class _PositionOnlyLayer(DynamicLayer):
        """A KV-cache layer of an attention-free layer: it is given zero-width keys and values, so it holds no bytes,
        and reads its length off their shape (the parent counts elements, which are none): masks and positions
        that transformers reads from this layer stay right."""

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            keys = getattr(self, "keys", None)
            return int(keys.shape[-2]) if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0


def track_positions(hidden_states: torch.Tensor, kwargs: dict[str, Any], layer_idx: int) -> None:
    """Count `hidden_states`' tokens in cache layer `layer_idx` (the cache among an attention module's `kwargs`)
    without storing keys or values."""
    # the KV cache, by this transformers' name for it (5.25 renamed past_key_values to cache)
    cache = next((kwargs[k] for k in ("cache", "past_key_values", "past_key_value") if kwargs.get(k) is not None),
                 None)
    layers = getattr(cache, "layers", None)
    if cache is None or not callable(getattr(cache, "update", None)):
        return
    if layers is not None and layer_idx < len(layers) and not callable(getattr(layers[layer_idx], "update", None)):
        # a linear-attention layer (transformers >= 5.25): no state to keep, only the length it reports
        length = getattr(layers[layer_idx], "cumulative_length_linear", None)
        if isinstance(length, torch.Tensor):
            length.add_(hidden_states.shape[1])
        return
    empty = hidden_states.new_zeros((hidden_states.shape[0], 0, hidden_states.shape[1], 0))
    cache.update(empty, empty, layer_idx, {"cache_position": kwargs.get("cache_position")})
    if DynamicLayer is not None and layers is not None and type(layers[layer_idx]) is DynamicLayer:
        layers[layer_idx].__class__ = _PositionOnlyLayer
