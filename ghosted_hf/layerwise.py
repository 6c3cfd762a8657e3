"""Layer-by-layer calibration for models larger than memory (as GPTQ-style quantizers calibrate).

The model is never loaded whole: its skeleton lives on the meta device, the embeddings turn every
calibration batch into hidden states kept in host memory (or on disk) in the model's dtype, then one
decoder layer at a time is read from the safetensors files, run over every batch, and freed. The float64
sums are the ones `collect_statistics` accumulates; each is added as soon as the hidden states it reads
exist, and a source's rows are dropped once no later sum reads them. Sequential fitting runs a second
stream, the model pruned and patched so far, through the same layer reads.
"""

from __future__ import annotations

import json
import tempfile
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from .calibration import (CalibrationStatistics, NonFiniteError, StatisticsAccumulator, StatisticsPlan,
                          release_freed_memory, token_mask)
from .errors import GhostedError, MissingFileError


class _Stop(Exception):
    pass


class _Catcher(nn.Module):
    """Stands in for decoder layer `index` during the embedding pass: records the arguments the model gives
    that layer (its attention mask type, positions) and passes the hidden state through."""

    def __init__(self, index: int, last: bool, record: dict) -> None:
        super().__init__()
        self.index, self.last, self.record = index, last, record

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.index == 0:
            self.record["hidden"] = hidden_states
        self.record[self.index] = kwargs
        if self.last:
            raise _Stop
        return hidden_states


class _Store:
    """Per-batch hidden states, in host memory or (with a folder) in files read back memory-mapped."""

    def __init__(self, folder: Path | None, name: str) -> None:
        self.folder, self.name, self.items = folder, name, {}

    def put(self, b: int, tensor: torch.Tensor) -> None:
        if self.folder is None:
            self.items[b] = tensor
        else:
            path = self.folder / f"{self.name}-{b}.pt"
            torch.save(tensor.contiguous(), path)
            self.items[b] = path

    def get(self, b: int) -> torch.Tensor:
        item = self.items[b]
        return item if isinstance(item, torch.Tensor) else torch.load(item, mmap=True)


def _layer_of(name: str) -> int | None:
    """The decoder layer a weight name belongs to (``model.layers.<i>.``), else None."""
    parts = name.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] and len(parts) > 2 else None


def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name, from the index or the single weights file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    single = folder / "model.safetensors"
    if not single.is_file():
        raise MissingFileError(f"{folder} has no model.safetensors(.index.json): layer-by-layer calibration reads "
                               "safetensors weights only.")
    with safe_open(str(single), framework="pt") as handle:
        return {k: "model.safetensors" for k in handle.keys()}


class LayerwiseModel:
    """A Llama/Qwen causal LM that is calibrated one decoder layer at a time from its safetensors files.

    Stands in for the model in `collect_statistics`, `Calibrator` and `ghost_prune`; `load_model(removed)` reads
    what the build keeps, after the statistics are collected. `observer(i)` is called while layer
    `i` is the one in memory (tests count the resident parameters there).
    """

    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32, *,
                 offload_folder: str | Path | None = None) -> None:
        from transformers import AutoConfig

        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise MissingFileError(f"{self.folder} holds no config.json: layer-by-layer calibration needs a local model "
                                   "folder with safetensors weights.")
        self.config = AutoConfig.from_pretrained(self.folder)
        self.config._name_or_path = str(self.folder)
        self.dtype, self.offload_folder = dtype, offload_folder
        self.weights = weight_map(self.folder)
        self.observer: Callable[[int], None] | None = None
        self.training = False
        embedding = self.config.get_text_config().vocab_size, self.config.get_text_config().hidden_size
        self._embedding_shape = embedding

    # What the recipe reads from a model.
    def get_input_embeddings(self) -> nn.Module:
        return nn.Embedding(*self._embedding_shape, device="meta")

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        return iter(())

    def eval(self) -> LayerwiseModel:
        return self

    def train(self, mode: bool = True) -> LayerwiseModel:
        return self

    def load_model(self, removed: Iterable[int] = ()) -> nn.Module:
        """The dense model for the build, with the decoder layers in `removed` left on the meta device: their
        weights are never read, so the build holds at most the pruned model, not the dense one."""
        from transformers import GenerationConfig

        skip = {int(i) for i in removed}
        model = self._skeleton()
        wanted = [k for k in self.weights if _layer_of(k) not in skip]
        model.load_state_dict({k: self._tensor(k) for k in wanted}, strict=False, assign=True)
        model.tie_weights()
        missing = [n for n, p in model.named_parameters() if p.device.type == "meta" and _layer_of(n) not in skip]
        if missing:
            raise GhostedError(f"{self.folder} lacks {len(missing)} weights of the model (e.g. {missing[0]}); "
                               "re-download or re-save the checkpoint.")
        if (self.folder / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(self.folder)
        return model

    def patched(self, removed: list[int], operators: Mapping[int, torch.Tensor]) -> tuple[list[int], dict[int, torch.Tensor]]:
        """The model pruned of `removed` and patched with `operators` (keyed by each boundary's first removed
        layer), as the second stream of a sequential pass."""
        return sorted(removed), dict(operators)

    # ------------------------------------------------------------ the pass

    def _tensor(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise GhostedError(f"{self.folder} has no tensor {name}; layer-by-layer calibration expects standard "
                               "Llama/Qwen weight names.")
        with safe_open(str(self.folder / self.weights[name]), framework="pt") as handle:
            return handle.get_tensor(name).to(self.dtype)

    def _load(self, module: nn.Module, prefix: str) -> None:
        names = [k for k in self.weights if k.startswith(prefix)]
        module.load_state_dict({k[len(prefix):]: self._tensor(k) for k in names}, strict=True, assign=True)

    def _skeleton(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)
        inner = skeleton.model
        inner.rotary_emb = type(inner.rotary_emb)(config=inner.config)  # computed buffers, not weights
        return skeleton.eval()

    def layerwise_statistics(self, batches: list[Mapping[str, torch.Tensor]], plan: StatisticsPlan, *,
                             weighting: str = "none", skip_first_tokens: int = 0, device: Any = None,
                             source: tuple[tuple[list[int], dict[int, torch.Tensor]], Mapping[int, int]] | None = None,
                             progress: bool = True, description: str = "Layer-wise calibration",
                             allow_empty: bool = False) -> CalibrationStatistics:
        depth, hidden = self.config.num_hidden_layers, self.config.hidden_size
        accumulator = StatisticsAccumulator(plan, hidden, device if device is not None else "cpu", weighting)
        deepest = plan.deepest()
        source_side = plan.source_inputs() if source is not None else set()
        target_side = (plan.source_inputs() | plan.target_inputs()) - source_side
        removed, operators = (source[0] if source is not None else ([], {}))
        ends = {}  # first removed layer of a boundary -> the kept index where its operator applies
        for i in removed:
            start = i if i - 1 not in removed else next(s for s in ends if ends[s] == i)
            ends[start] = i + 1
        apply_at = {e: operators[s] for s, e in ends.items() if s in operators}
        # Each sum is added when its deepest input exists; rows of an index are kept until then.
        last_use: dict[Any, int] = {}
        for i in plan.grams | plan.abs_sums | plan.rotated_abs_sums:
            last_use[i] = max(last_use.get(i, -1), i)
        for s, e in plan.pairs | plan.cosines | plan.mlp_terms | plan.sums:
            last_use[s], last_use[e] = max(last_use.get(s, -1), e), max(last_use.get(e, -1), e)
        for s, e in plan.mlp_terms:
            last_use[("mlp", s - 1)] = max(last_use.get(("mlp", s - 1), -1), e)

        skeleton = self._skeleton()
        inner = skeleton.model
        originals = list(inner.layers)
        run = min(deepest, depth)  # decoder layers to run: 0..run-1
        temporary = tempfile.TemporaryDirectory(dir=self.offload_folder) if self.offload_folder is not None else None
        folder = Path(temporary.name) if temporary is not None else None
        dense, patched = _Store(folder, "dense"), (_Store(folder, "patched") if source is not None else None)
        keeps, kwargs, kept_rows = [], [], []
        try:
            self._load(inner.embed_tokens, "model.embed_tokens.")
            catchers = max(run, 1)
            for b, batch in enumerate(batches):
                record: dict = {}
                for i in range(catchers):
                    inner.layers[i] = _Catcher(i, i == catchers - 1, record)
                with torch.no_grad():
                    try:
                        skeleton.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                       use_cache=False)
                    except _Stop as stop:
                        traceback.clear_frames(stop.__traceback__)
                dense.put(b, record.pop("hidden"))
                if patched is not None:
                    patched.put(b, dense.get(b))
                kwargs.append(record)
                keep = token_mask(batch["attention_mask"], skip_first_tokens)
                keeps.append(keep)
                kept_rows.append({})
                accumulator.tokens += int(keep.sum())
            for i, layer in enumerate(originals):
                inner.layers[i] = layer
            inner.embed_tokens.to("meta")  # freed

            def rows(b: int, key: Any, value: torch.Tensor, where: str) -> None:
                kept = value[keeps[b]]
                if not torch.isfinite(kept).all():
                    raise NonFiniteError(f"Non-finite activations (NaN/Inf) first appear at {where} on calibration "
                                         f"data, in {value.dtype}. Load the model in float32 or bfloat16.")
                if key in last_use:
                    kept_rows[b][key] = kept

            def settle(b: int, i: int) -> None:
                """Add every sum whose deepest input is `i`; drop the rows no later sum reads."""
                if kept_rows[b]:
                    accumulator.update(kept_rows[b], ending_at=i)
                for key in [k for k in kept_rows[b] if last_use[k] <= i]:
                    del kept_rows[b][key]

            def capture(b: int, i: int) -> None:
                where = "the final norm's input" if i == depth else f"the input of layer {i}"
                if i in target_side or (source is None and i in source_side):
                    rows(b, i, dense.get(b), where)
                elif source is None:
                    rows(b, None, dense.get(b), where)
                if i in source_side:
                    rows(b, i, patched.get(b), where + " (pruned and patched model)")

            for b in range(len(batches)):
                capture(b, 0)
                settle(b, 0)
            bar = tqdm(range(run), desc=description, disable=not progress, leave=False)
            for i in bar:
                layer = originals[i]
                self._load(layer, f"model.layers.{i}.")
                if self.observer is not None:
                    self.observer(i)
                mlp_out: dict[int, torch.Tensor] = {}
                hook = None
                if i in plan.mlp_layers():
                    hook = layer.mlp.register_forward_hook(lambda m, a, out: mlp_out.__setitem__(0, out))
                try:
                    for b in range(len(batches)):
                        with torch.no_grad():
                            out = layer(dense.get(b), **kwargs[b][i])
                            if mlp_out:
                                rows(b, ("mlp", i), mlp_out.pop(0), f"the MLP output of layer {i}")
                            if patched is not None:
                                h = patched.get(b)
                                if i not in removed:
                                    h = layer(h, **kwargs[b][i])
                                if i + 1 in apply_at:
                                    w = apply_at[i + 1]
                                    h = (h.to(w.dtype) @ w.to(h.device)).to(h.dtype)
                                patched.put(b, h)
                        dense.put(b, out)
                        capture(b, i + 1)
                        settle(b, i + 1)
                finally:
                    if hook is not None:
                        hook.remove()
                    layer.to("meta")  # freed before the next layer is read
                    release_freed_memory()
        finally:
            if temporary is not None:
                temporary.cleanup()
        return accumulator.result(depth, skip_first_tokens, allow_empty)


def model_bytes(folder: str | Path, dtype: torch.dtype | None = None) -> int:
    """The weights' size in memory: the safetensors files' tensors, in `dtype` if given."""
    total = 0
    folder = Path(folder)
    for file in sorted(set(weight_map(folder).values())):
        with safe_open(str(folder / file), framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                count = 1
                for n in piece.get_shape():
                    count *= n
                size = (torch.empty((), dtype=dtype).element_size() if dtype is not None
                        else _DTYPE_BYTES.get(piece.get_dtype(), 4))
                total += count * size
    return total


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}


def parse_memory(text: str) -> int:
    """'8GiB', '500MB', '12GB', or a number of bytes -> bytes."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    raw = str(text).strip().upper()
    for unit, scale in units.items():
        if raw.endswith(unit):
            number = raw[: -len(unit)].strip()
            break
    else:
        number, scale = raw, 1
    try:
        value = float(number)
    except ValueError:
        raise GhostedError(f"max_memory {text!r} is not a size: write e.g. 8GiB, 500MB or 12GB.") from None
    if value <= 0:
        raise GhostedError(f"max_memory must be positive, got {text!r}.")
    return int(value * scale)
