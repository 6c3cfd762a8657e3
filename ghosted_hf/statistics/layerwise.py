"""Layer-by-layer calibration for models larger than memory (as GPTQ-style quantizers calibrate): the model is
never loaded whole. Every batch's hidden states are kept in host memory (or on disk) in the model's dtype while one
decoder layer at a time is read from the safetensors files, run over every batch, and freed; each float64 sum (the
full-model pass's) is added as soon as its reads exist, and rows are dropped once no later sum reads them.
"""

from __future__ import annotations

import contextlib
import math
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from ..architectures import architecture, decoder, decoder_layers, final_norm, layer_of
from ..errors import GhostedError, MissingFileError
from ..model.checkpoint import check_folder, weight_map
from .accumulate import DEFAULT_PARTIAL_SUMS, StatisticsAccumulator, sums_width
from .capture import (StopForward, finite_rows, release_freed_memory, stopped_forward, subblock_place, token_losses,
                      watch_subblocks)
from .declarations import SUBBLOCK_ROLES, Read, source, target, token_loss
from .patch import Patch, bypassed, served_operator
from .origin import model_fingerprint
from .passes import Batch, CalibrationPass
from .plan import StatisticsPlan
from .store import CalibrationStatistics


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
            raise StopForward
        return hidden_states


class _Store:
    """Per-batch hidden states, in host memory or (with a folder) in files read back memory-mapped."""

    def __init__(self, folder: str | None, name: str) -> None:
        self.folder, self.name, self.items = folder, name, {}

    def put(self, b: int, tensor: torch.Tensor) -> None:
        self.items[b] = tensor if self.folder is None else Path(self.folder) / f"{self.name}-{b}.pt"
        if self.folder is not None:
            torch.save(tensor.contiguous(), self.items[b])

    def get(self, b: int) -> torch.Tensor:
        item = self.items[b]
        return item if isinstance(item, torch.Tensor) else torch.load(item, mmap=True)


def computed_buffers(model: nn.Module, module: nn.Module, recurse: bool = True) -> None:
    """Give the buffers of `module` (and its submodules) that a meta-device build left without values (rotary
    frequencies, embedding scales: computed, never saved) their values, through the family's own `_init_weights`.
    Their modules' parameters are left empty: load them afterwards."""
    for sub in module.modules() if recurse else (module,):
        if any(b.device.type == "meta" for b in sub.buffers(recurse=False)):
            sub.to_empty(device="cpu", recurse=False)
            model._init_weights(sub)


class LayerwisePass(CalibrationPass):
    """Calibration of a causal LM one decoder layer at a time, from its safetensors folder. `observer(i)` is called
    while layer `i` is the one in memory (tests count the resident parameters there)."""

    def __init__(self, folder: str | Path, dtype: torch.dtype = torch.float32, *,
                 offload_folder: str | Path | None = None) -> None:
        from transformers import AutoConfig

        self.folder = Path(folder)
        if not (self.folder / "config.json").is_file():
            raise MissingFileError(f"{self.folder} holds no config.json: layer-by-layer calibration needs a local model "
                                   "folder with safetensors weights.")
        check_folder(self.folder)  # the config describes the weights: nothing of another size is built
        self.config = AutoConfig.from_pretrained(self.folder, trust_remote_code=False)
        self.config._name_or_path = str(self.folder)
        layout = architecture(self.config).layout
        if not layout.is_default:
            raise GhostedError(f"Layer-by-layer calibration reads decoders laid out as Llama's (model.layers); "
                               f"{self.config.model_type} keeps its layers at {layout.layers}. Calibrate with the "
                               "full-model pass (leave out --layerwise and --max-memory).")
        self.dtype, self.offload_folder = dtype, offload_folder
        self.weights = weight_map(self.folder)
        self.observer: Callable[[int], None] | None = None
        self.outputs: dict[tuple[int, str], int] = {}  # (layer, kind) -> values its sub-block returned, once read
        # Refuse a checkpoint whose decoder tensors are not stored under the names the model holds them by (the
        # experts of mixture-of-experts families: transformers fuses them while it loads a whole model), which a
        # layer-by-layer load, tensor by tensor, cannot read.
        expected = {k for k in self._skeleton().state_dict() if layer_of(k) is not None}
        stored = {k for k in self.weights if layer_of(k) is not None}
        if expected - stored and stored - expected:  # (only missing tensors: a damaged file, named when loaded)
            raise GhostedError(
                f"{self.folder} stores decoder tensors under other names or layouts than the "
                f"{self.config.model_type} model holds them (e.g. {min(stored - expected)} for "
                f"{min(expected - stored)}; transformers converts them when it loads the whole model, as it does for "
                "the experts of mixture-of-experts families): layer-by-layer calibration cannot read it. Calibrate "
                "with the full-model pass (leave out --layerwise; set --max-memory to what the model needs)."
            )

    @property
    def vocab_size(self) -> int:
        return self.config.get_text_config().vocab_size

    def fingerprint(self) -> dict[str, Any]:
        return model_fingerprint(config=self.config, folder=self.folder)

    def model_for_build(self, removed: Iterable[int] = ()) -> nn.Module:
        """The dense model for the build, with the decoder layers in `removed` left on the meta device: their
        weights are never read, so the build holds at most the pruned model, not the dense one."""
        from transformers import GenerationConfig

        skip = {int(i) for i in removed}
        model = self._skeleton()
        for i, layer in enumerate(decoder_layers(model)):
            if i not in skip:
                computed_buffers(model, layer)
        wanted = [k for k in self.weights if layer_of(k) not in skip]
        model.load_state_dict({k: self._tensor(k) for k in wanted}, strict=False, assign=True)
        model.tie_weights()
        missing = [n for n, p in model.named_parameters() if p.device.type == "meta" and layer_of(n) not in skip]
        if missing:
            raise GhostedError(f"{self.folder} lacks {len(missing)} weights of the model (e.g. {missing[0]}); "
                               "re-download or re-save the checkpoint.")
        if (self.folder / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(self.folder)
        return model

    def subblock_outputs(self, keys: Iterable[tuple[int, str]], batch: Batch) -> dict[tuple[int, str], int]:
        """As recorded by the passes that read these sub-blocks' outputs (the statistics of each fit read them)."""
        missing = [f"{j}.{kind}" for j, kind in keys if (j, kind) not in self.outputs]
        if missing:
            raise GhostedError(f"No layer-by-layer pass has read the outputs of sub-blocks {missing} yet, so their "
                               "replacements cannot be shaped: collect their statistics first.")
        return {key: self.outputs[key] for key in keys}

    # ------------------------------------------------------------ the pass

    def _tensor(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise GhostedError(f"{self.folder} has no tensor {name}; layer-by-layer calibration expects standard "
                               "transformers weight names.")
        file = self.folder / self.weights[name]
        try:
            with safe_open(str(file), framework="pt") as handle:
                return handle.get_tensor(name).to(self.dtype)
        except Exception as error:  # safetensors' own error types: a missing, truncated or damaged file
            raise GhostedError(f"{file} cannot be read for tensor {name} ({type(error).__name__}: {error}): the "
                               "checkpoint is damaged or incomplete; re-download or re-save it.") from None

    def _load(self, module: nn.Module, model: nn.Module) -> None:
        """Load `module` of `model` (a skeleton) from the files: the tensors under its name in the model."""
        computed_buffers(model, module)
        prefix = next(name for name, sub in model.named_modules() if sub is module) + "."
        names = [k for k in self.weights if k.startswith(prefix)]
        try:
            module.load_state_dict({k[len(prefix):]: self._tensor(k) for k in names}, strict=True, assign=True)
        except RuntimeError as error:  # missing, unexpected or misshapen tensors of this module
            raise GhostedError(f"The weights of {prefix.rstrip('.')} in {self.folder} do not fit its config: "
                               f"{' '.join(str(error).split())}") from None

    def _skeleton(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)
        layers = set(decoder_layers(skeleton).modules())
        for module in skeleton.modules():
            if module not in layers:
                computed_buffers(skeleton, module, recurse=False)  # rotary modules, embedding scales
        return skeleton.eval()

    def collect(self, batches: Iterable[Batch], plan: StatisticsPlan, *, patch: Patch | None = None,
                device: str | torch.device | None = None, description: str = "Layer-wise calibration",
                progress: bool = True, partial: str = DEFAULT_PARTIAL_SUMS) -> CalibrationStatistics:
        batches = list(batches)
        depth, hidden = self.config.num_hidden_layers, sums_width(plan, self.config)
        reads = plan.reads()
        if patch is not None and patch.transforms:
            raise GhostedError("Layer-wise calibration cannot refit an operator kind that transforms an MLP output "
                               "sequentially (MLP outputs are not streamed layer by layer): pass fitting='independent'.")
        accumulator = StatisticsAccumulator(plan, hidden, device if device is not None else "cpu", partial)
        # Each sum is added when its deepest read exists; the rows of a read are kept until then.
        last_use = {read: max(e.ready_at for e in plan if read in e.reads) for read in reads}
        run = min(plan.deepest(), depth)  # decoder layers to run: 0..run-1
        offload = self.offload_folder
        with tempfile.TemporaryDirectory(dir=offload) if offload is not None else contextlib.nullcontext() as folder:
            stream = _Streams(self, batches, patch, run, depth, folder,
                              dense_runs=patch is None or any(role == "target" for role, _ in reads))
            accumulator.tokens = sum(int(batch["attention_mask"].bool().sum()) for batch in batches)
            kept_rows: list[dict[Read, torch.Tensor]] = [{} for _ in batches]

            def rows(b: int, read: Read, value: torch.Tensor, where: str) -> None:
                kept = finite_rows(value, batches[b]["attention_mask"].bool(), where)
                if read in last_use:
                    kept_rows[b][read] = kept

            def capture(b: int, i: int) -> None:
                """Keep the rows of what enters `i`, add every sum whose deepest read is at `i`, drop the rows no
                later sum reads."""
                where = "the final norm's input" if i == depth else f"the input of layer {i}"
                if stream.dense_runs:
                    rows(b, target(i), stream.dense.get(b), where)
                if patch is None:
                    rows(b, source(i), stream.dense.get(b), where)
                else:
                    rows(b, source(i), stream.patched.get(b), where + " (pruned and patched model)")
                if kept_rows[b]:
                    accumulator.add(kept_rows[b], ready=i)
                kept_rows[b] = {read: kept for read, kept in kept_rows[b].items() if last_use[read] > i}

            for b in range(len(batches)):
                capture(b, 0)
            for i in tqdm(range(run), desc=description, disable=not progress, leave=False):
                for b, inside in stream.advance(i, {read for read in last_use if read[0] in SUBBLOCK_ROLES and read[1] == i}):
                    for read, value in inside.items():  # (Llama 4's MoE returns its tokens flattened)
                        rows(b, read, value.reshape(*batches[b]["attention_mask"].shape, value.shape[-1]),
                             subblock_place(read))
                    capture(b, i + 1)
            if token_loss(depth) in last_use:  # the logits of the stream after the last layer
                for b, losses in stream.token_losses():
                    accumulator.add({token_loss(depth): losses}, ready=depth + 1)
        return accumulator.result(depth, self.config)


class _Streams:
    """The dense stream of every batch (unless `dense_runs` is off: a patched pass that reads no target) and, with a
    patch, the pruned and patched one, advanced one decoder layer at a time: the layer is read from disk, run over
    every batch, and freed."""

    def __init__(self, owner: LayerwisePass, batches: list[Batch], patch: Patch | None, run: int, depth: int,
                 folder: str | None, dense_runs: bool = True) -> None:
        self.owner, self.batches, self.dense_runs = owner, batches, dense_runs
        self.skeleton = owner._skeleton()
        inner = decoder(self.skeleton)
        self.layers = list(inner.layers)
        self.dense, self.patched = _Store(folder, "dense"), (_Store(folder, "patched") if patch is not None else None)
        self.removed = set(patch.removed) if patch is not None else set()
        self.subblocks = patch.subblocks if patch is not None else {}
        # The served module of each boundary (its operator, and its normed term), at the index it feeds.
        self.apply_at = ({fed: served_operator(patch.operators[first], patch.normed.get(first))
                          for first, fed in patch.fed(depth).items() if first in patch.operators}
                         if patch is not None else {})
        self.kwargs: list[dict] = []
        embeddings = self.skeleton.get_input_embeddings()
        owner._load(embeddings, self.skeleton)
        catchers = max(run, 1)
        for b, batch in enumerate(batches):
            record: dict = {}
            for i in range(catchers):
                inner.layers[i] = _Catcher(i, i == catchers - 1, record)
            with torch.no_grad():
                with stopped_forward():
                    inner(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
            self.dense.put(b, record.pop("hidden"))
            if self.patched is not None:
                self.patched.put(b, self.dense.get(b))
            self.kwargs.append(record)
        for i, layer in enumerate(self.layers):
            inner.layers[i] = layer
        embeddings.to("meta")  # freed

    def advance(self, i: int, reads: set[Read]) -> Iterable[tuple[int, dict[Read, torch.Tensor]]]:
        """Run layer `i` over every batch; yields (batch, the sub-block `reads` of layer i on the source side: the
        patched stream, with this layer's replaced sub-blocks installed, or the dense one) once both streams moved."""
        layer = self.layers[i]
        self.owner._load(layer, self.skeleton)
        if self.owner.observer is not None:
            self.owner.observer(i)
        replaced = {key: value for key, value in self.subblocks.items() if key[0] == i}
        try:
            for b, kwargs in enumerate(self.kwargs):
                inside: dict[Read, torch.Tensor] = {}
                with torch.no_grad():
                    if self.dense_runs:
                        with self._watching(reads if self.patched is None else set(), inside):
                            self.dense.put(b, layer(self.dense.get(b), **kwargs[i]))
                    if self.patched is not None:
                        h = self.patched.get(b)
                        if i not in self.removed:
                            with bypassed(self.skeleton, replaced), self._watching(reads, inside):
                                h = layer(h, **kwargs[i])
                        if i + 1 in self.apply_at:
                            h = self.apply_at[i + 1](h)
                        self.patched.put(b, h)
                yield b, inside
        finally:
            layer.to("meta")  # freed before the next layer is read
            release_freed_memory()

    @contextlib.contextmanager
    def _watching(self, reads: set[Read], into: dict[Read, torch.Tensor]) -> Iterator[None]:
        handles = watch_subblocks(self.skeleton, reads, into.__setitem__, self.owner.outputs)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def token_losses(self) -> Iterable[tuple[int, torch.Tensor]]:
        """(batch, its `token_loss` rows) from the source-side stream after the last layer: the model's own forward
        (embeddings, final norm, output layer, any logit scaling) with every decoder layer passing the stored stream."""
        skeleton, owner = self.skeleton, self.owner
        parts = [skeleton.get_input_embeddings(), final_norm(skeleton)]
        head = skeleton.get_output_embeddings()
        tied = not any(head is module and f"{name}.weight" in owner.weights for name, module in skeleton.named_modules())
        for part in parts if tied else [*parts, head]:
            owner._load(part, skeleton)
        if tied:
            skeleton.tie_weights()
        stream = self.patched if self.patched is not None else self.dense
        try:
            for b, batch in enumerate(self.batches):
                yield b, token_losses(skeleton, batch, last_output=stream.get(b))[batch["attention_mask"].bool()]
        finally:
            for part in (*parts, head):
                part.to("meta")
            release_freed_memory()


def model_bytes(folder: str | Path, dtype: torch.dtype | None = None) -> int:
    """The weights' size in memory: the safetensors files' tensors, in `dtype` if given."""
    total = 0
    folder = Path(folder)
    size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    for file in sorted(set(weight_map(folder).values())):
        with safe_open(str(folder / file), framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                total += math.prod(piece.get_shape()) * (size or _DTYPE_BYTES.get(piece.get_dtype(), 4))
    return total


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}


def parse_memory(text: str) -> int:
    """'8GiB', '500MB', '12GB', or a number of bytes -> bytes."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12}
    number, unit = re.fullmatch(r"(.*?)\s*([KMGT]I?B|B)?", str(text).strip().upper(), re.DOTALL).groups()
    try:
        value = float(number) * units.get(unit, 1)
    except ValueError:
        raise GhostedError(f"max_memory {text!r} is not a size: write e.g. 8GiB, 500MB or 12GB.") from None
    if not 0 < value < float("inf"):  # NaN fails too
        raise GhostedError(f"max_memory must be a positive, finite size, got {text!r}.")
    return int(value)
