"""A ghosted model in llama.cpp: each normed boundary (``x + n(x) A``) as one DeciLM "linear attention" block.

llama.cpp's `deci` architecture (DeciLM / Nemotron-NAS) has per-layer head counts and FFN widths, and a layer with
attention heads but no KV heads that adds ``(RMSNorm(x) * g) Wo`` to the stream: a `normed` boundary is exactly that
layer, with g = 1 and Wo = A^T. llama.cpp's own converter writes the pruned base (and the tokenizer metadata it writes
for the base model); that GGUF is rewritten as `deci` with one such layer inserted where each boundary was.

A replaced sub-block (format 1.2) is the same block: an attention that is a map ``h A`` of ``h = RMSNorm(x) * g``
makes its layer a linear-attention layer (its own gain g, Wo = A^T, no KV cache, its FFN kept); an MLP that is a map
follows its layer's attention as an inserted linear-attention layer with the MLP's norm gain.

In deci's graph a layer of FFN width 0 drops its attention output, so each inserted layer (and a layer whose MLP is
replaced) carries an all-zero FFN of width `FFN_WIDTH` (the smallest that every llama.cpp quantization type accepts by
falling back): it adds nothing to the stream and costs ~1% of a layer.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..architectures import ARCHITECTURES, architecture, layer_prefix
from ..errors import GhostedError
from ..model.checkpoint import made_as
from ..model.provenance import Provenance
from ..model.surgery import adopt_tensors
from ..remote.format_ghosted import GHOST_NORMED, LAYER_TARGET, NORMED_EPS, ghost_tensor_key, ghost_tensor_keys
from ..remote.modeling_ghosted import GhostedForCausalLM
from ..remote.staging_ghosted import scratch_folder
from ..utils.diskio import atomic_write
from ..utils.network import check_timeout

logger = logging.getLogger(__name__)

FFN_WIDTH = 32
OUTTYPES = ("f32", "f16")  # quantize the result with llama-quantize


def llama_cpp_families() -> str:
    """The registry's families export-gguf writes (their GGUF layout is one the DeciLM rewrite maps)."""
    return ", ".join(sorted(t for t, a in ARCHITECTURES.items() if a.gguf_architecture))


def normed_blocks(model: GhostedForCausalLM) -> dict[int, torch.Tensor]:
    """{pruned position the block goes before (the depth: before the final norm): A} for every boundary; a
    boundary whose operator is not the identity (a `ghost` or `ghost-normed` fit) has no llama.cpp form."""
    blocks = {}
    for boundary in model.config.ghost_boundaries:
        operator = model.get_parameter(ghost_tensor_key(boundary)).detach()
        if not torch.equal(operator, torch.eye(operator.shape[0], dtype=operator.dtype, device=operator.device)):
            provenance = Provenance.of(model.config)
            trained = bool((provenance.healing or {}).get("trained_operators"))  # --train-operators moved W
            mixed = (provenance.options or {}).get("unit") == "mixed"
            remedy = ("It was trained away from the identity (heal with --train-operators): heal the pruned folder "
                      "without --train-operators to export it" if trained else
                      "Prune with --unit subblock (every map a DeciLM block)" if mixed else
                      "Prune with --operator normed (x + n(x) A, which llama.cpp runs as a DeciLM linear-attention "
                      "block)")
            raise GhostedError(
                f"The boundary after removed layers {boundary['removed']} is a {boundary.get('operator')!r} operator "
                f"whose x @ W is not the identity: llama.cpp has no block for it. {remedy}, or use export-stock for a "
                "folded stock checkpoint."
            )
        if boundary.get("normed"):
            at = boundary["layer"] if boundary["target"] == LAYER_TARGET else model.config.text_config.num_hidden_layers
            blocks[at] = model.get_parameter(ghost_tensor_key(boundary, GHOST_NORMED)).detach().float().cpu()
    return blocks


@dataclass
class SubBlockMaps:
    """The replaced sub-blocks of a model, by pruned layer: each map A (h -> h A)."""

    attention: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    mlp: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)


def subblock_maps(model: GhostedForCausalLM) -> SubBlockMaps:
    """Every replaced sub-block's map, read from the model (a rank-r map multiplied out: llama.cpp's linear attention
    is one C x C matrix)."""
    maps = SubBlockMaps()
    for record in model.config.ghost_subblocks:
        tensors = [model.get_parameter(key).detach().double().cpu() for key in ghost_tensor_keys(record).values()]
        getattr(maps, record["block"])[record["layer"]] = functools.reduce(torch.matmul, tensors).float()
    return maps


def pruned_base(model: GhostedForCausalLM) -> PreTrainedModel:
    """The pruned base decoder as a stock model, without its ghost modules (shares the tensors); a replaced sub-block
    is a zero placeholder of the family's module (the converter writes it, the rewrite replaces it)."""
    with torch.device("meta"):
        stock = AutoModelForCausalLM.from_config(copy.deepcopy(model.config.text_config))
    placeholders = tuple(f"{layer_prefix(r['layer'])}{r['module']}." for r in model.config.ghost_subblocks)
    for prefix in placeholders:
        module = stock.get_submodule(prefix[:-1]).to_empty(device="cpu")
        for tensor in module.parameters():
            tensor.data.zero_()
    adopt_tensors(stock, model, lambda name: name, skip=placeholders)
    stock.generation_config = copy.deepcopy(model.generation_config)
    return stock.eval()


def converter_files(llama_cpp: str | Path) -> tuple[Path, ...]:
    """What of a llama.cpp folder its converter reads: the script (first) and the packages it imports."""
    return tuple(Path(llama_cpp) / part for part in ("convert_hf_to_gguf.py", "gguf-py", "conversion"))


def convert(folder: Path, llama_cpp: Path, outfile: Path, outtype: str, timeout: float) -> None:
    """llama.cpp's own converter on a stock folder (a bounded wait: it is killed after `timeout` seconds)."""
    script = converter_files(llama_cpp)[0]
    if not script.is_file():
        raise GhostedError(f"{llama_cpp} has no convert_hf_to_gguf.py: pass the llama.cpp source folder (e.g. a clone "
                           "of ggml-org/llama.cpp, or vendor/llama.cpp of the llama-cpp-python sdist).")
    command = [sys.executable, str(script), str(folder), "--outfile", str(outfile), "--outtype", outtype]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise GhostedError(f"llama.cpp's converter did not finish in {timeout:.0f} s; raise the timeout.") from None
    if done.returncode < 0:  # killed by a signal: the out-of-memory killer, a user, a time limit
        raise GhostedError(f"llama.cpp's converter was killed by signal {-done.returncode} while converting the pruned "
                           "base (out of memory?); free memory or convert a smaller outtype, then export again.")
    if done.returncode != 0:
        raise GhostedError(f"llama.cpp's converter failed on the pruned base: {converter_failure(done.stderr or done.stdout)}")


def converter_failure(output: str) -> str:
    """What the converter's last lines say, and the fix for the failures it has (not always its requirements)."""
    tail = " | ".join(output.strip().splitlines()[-3:])[:500]
    if "No space left on device" in output:
        return f"the disk is full ({tail}); free space beside the output, then export again."
    if "BPE pre-tokenizer was not recognized" in output:
        return (f"this llama.cpp does not know the model's tokenizer ({tail}); use a llama.cpp whose converter lists "
                "it, or add it to its convert_hf_to_gguf_update.py.")
    if "ModuleNotFoundError" in output or "No module named" in output:
        return f"{tail}. It needs its own requirements (pip install gguf sentencepiece)."
    return f"{tail}."


def field_value(field: Any) -> tuple[Any, Any, Any]:
    """(value, type, array item type) of a GGUF reader field."""
    import gguf

    kind = field.types[0]
    sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
    return field.contents(), kind, sub


def layer_order(depth: int, blocks: dict[int, torch.Tensor], mlp_maps: Iterable[int] = ()) -> list[tuple[str, int]]:
    """The new layers in order: ("block", position) before each position of `blocks`, ("layer", i) for base layer i,
    ("mlp", i) after base layer i whose MLP is a map."""
    mlp, order = set(mlp_maps), []
    for i in range(depth + 1):
        if i in blocks:
            order.append(("block", i))
        if i < depth:
            order.append(("layer", i))
            if i in mlp:
                order.append(("mlp", i))
    return order


def write_deci_metadata(writer: Any, fields: dict[str, Any], order: list[tuple[str, int]],
                        maps: SubBlockMaps | None = None) -> None:
    """Every key of the base GGUF's `fields` under `deci.`, the per-layer lists saying which layer is a block."""
    maps = maps or SubBlockMaps()
    prefix = field_value(fields["general.architecture"])[0] + "."
    value = lambda key: int(field_value(fields[prefix + key])[0])  # noqa: E731
    heads, kv_heads, ffn = value("attention.head_count"), value("attention.head_count_kv"), value("feed_forward_length")
    per_layer = {"block_count", "attention.head_count", "attention.head_count_kv", "feed_forward_length",
                 "attention.key_length", "attention.value_length"}  # (written below)
    for name, field in fields.items():
        key = name.removeprefix(prefix)
        if not (name.startswith("GGUF.") or name == "general.architecture" or (key != name and key in per_layer)):
            content, kind, sub = field_value(field)
            writer.add_key_value(name if key == name else "deci." + key, content, kind, sub_type=sub)
    writer.add_block_count(len(order))
    writer.add_head_count([heads for _ in order])
    writer.add_head_count_kv([kv_heads if what == "layer" and i not in maps.attention else 0 for what, i in order])
    writer.add_feed_forward_length([ffn if what == "layer" and i not in maps.mlp else FFN_WIDTH for what, i in order])
    # The base's head size where its converter wrote one (a config with head_dim != hidden / heads), else the
    # hidden size over the heads, as llama.cpp assumes for a llama file without it.
    head = lambda key: value(key) if prefix + key in fields else value("embedding_length") // heads  # noqa: E731
    writer.add_key_length(head("attention.key_length"))
    writer.add_value_length(head("attention.value_length"))


class _DeciLayers:
    """Writes the deci layers: base layers carried over (a replaced sub-block's tensors left out) and linear-attention
    layers x + (RMSNorm(x) * g) A (Wo = A^T; llama.cpp's eps is the model's) over zero FFNs."""

    ATTENTION = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
    FFN = ("ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")

    def __init__(self, writer: Any, base_layers: dict[int, list[Any]], hidden: int, dtype: Any) -> None:
        self.writer, self.base_layers, self.dtype = writer, base_layers, dtype
        self.ones, self.zeros = np.ones(hidden, dtype=np.float32), np.zeros((FFN_WIDTH, hidden), dtype=dtype)

    def base(self, new: int, i: int, dropped: tuple[str, ...] = ()) -> None:
        for tensor in self.base_layers[i]:
            suffix = tensor.name.split(".", 2)[2]
            if suffix not in dropped:
                self.writer.add_tensor(f"blk.{new}.{suffix}", np.asarray(tensor.data), raw_dtype=tensor.tensor_type)

    def output(self, new: int, a: torch.Tensor) -> None:
        self.writer.add_tensor(f"blk.{new}.attn_output.weight", np.ascontiguousarray(a.numpy().T.astype(self.dtype)))

    def linear_attention(self, new: int, gain: Any, a: torch.Tensor) -> None:
        """A layer adding (RMSNorm(x) * gain) A (gain: a base tensor, or None for 1) over a zero FFN."""
        self.writer.add_tensor(f"blk.{new}.attn_norm.weight", self.ones if gain is None else np.asarray(gain.data),
                               raw_dtype=None if gain is None else gain.tensor_type)
        self.output(new, a)
        self.zero_ffn(new)

    def zero_ffn(self, new: int) -> None:
        for name, value in zip(self.FFN, (self.ones, self.zeros, self.zeros, np.ascontiguousarray(self.zeros.T))):
            self.writer.add_tensor(f"blk.{new}.{name}", value)


def rewrite_as_deci(base: Path, output: Path, blocks: dict[int, torch.Tensor], outtype: str,
                    maps: SubBlockMaps | None = None) -> int:
    """Write `output`: the llama GGUF `base` as a `deci` GGUF with a linear-attention layer inserted before each
    position of `blocks`, and the replaced sub-blocks of `maps` as linear-attention layers (an attention map in its
    layer, an MLP map as a layer after it). Returns the new layer count."""
    maps = maps or SubBlockMaps()
    import gguf

    try:
        reader = gguf.GGUFReader(str(base))
        architecture = reader.fields["general.architecture"].contents()
    except Exception as error:  # gguf's reader on a damaged file: its own errors (ValueError, KeyError, struct, ...)
        raise GhostedError(f"llama.cpp's converter exited without an error but wrote no readable GGUF ({type(error).__name__}"
                           f": {' '.join(str(error).split())[:200]}): check the converter's version and the disk, then "
                           "export again.") from None
    layouts = {a.gguf_architecture for a in ARCHITECTURES.values() if a.gguf_architecture}  # what the rewrite reads
    if architecture not in layouts:
        raise GhostedError(f"llama.cpp converts this base model as {architecture!r}; the deci block maps only onto "
                           f"the {' / '.join(sorted(layouts))} layout ({llama_cpp_families()}). Use export-stock "
                           "for a folded checkpoint.")
    order = layer_order(int(reader.fields[f"{architecture}.block_count"].contents()), blocks, maps.mlp)
    writer = gguf.GGUFWriter(str(output), arch="deci")
    write_deci_metadata(writer, reader.fields, order, maps)
    base_layers: dict[int, list[Any]] = {}
    for tensor in reader.tensors:
        if tensor.name.startswith("blk."):
            base_layers.setdefault(int(tensor.name.split(".")[1]), []).append(tensor)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    layers = _DeciLayers(writer, base_layers, int(reader.fields[f"{architecture}.embedding_length"].contents()),
                         np.float16 if outtype == "f16" else np.float32)
    for new, (what, i) in enumerate(order):
        if what == "block":  # a normed boundary: x + n(x) A, gain 1 (the format's eps is 1e-6)
            layers.linear_attention(new, None, blocks[i])
        elif what == "mlp":  # layer i's MLP as a map of its normed input, after the layer's attention
            gain = next(t for t in base_layers[i] if t.name == f"blk.{i}.ffn_norm.weight")
            layers.linear_attention(new, gain, maps.mlp[i])
        else:
            layers.base(new, i, (layers.ATTENTION if i in maps.attention else ()) + (layers.FFN if i in maps.mlp else ()))
            if i in maps.attention:  # its own norm gain stays: linear attention
                layers.output(new, maps.attention[i])
            if i in maps.mlp:
                layers.zero_ffn(new)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(order)


def export_gguf(model: GhostedForCausalLM, tokenizer: Any, output: str | Path, llama_cpp: str | Path,
                outtype: str = "f16", timeout: float = 3600.0) -> Path:
    """Write `model` (every boundary `normed`, or plain) as one llama.cpp GGUF file `output`, through
    llama.cpp's converter at `llama_cpp`. Written beside `output` and moved into place when complete."""
    if outtype not in OUTTYPES:
        raise GhostedError(f"outtype must be one of {OUTTYPES}, got {outtype!r} (quantize with llama-quantize).")
    check_timeout(timeout)
    if made_as(model.config) != "ghosted":
        raise GhostedError("export-gguf takes a ghosted model; convert a stock checkpoint with llama.cpp's converter.")
    family = architecture(model)
    if family.gguf_architecture is None:
        raise GhostedError(f"export-gguf writes llama.cpp's DeciLM blocks into a Llama-layout GGUF, which a pruned "
                           f"{model.config.text_config.model_type} model is not (llama.cpp families: "
                           f"{llama_cpp_families()}). Serve it with "
                           "transformers (trust_remote_code=True).")
    blocks, maps = normed_blocks(model), subblock_maps(model)
    eps = getattr(model.config.text_config, "rms_norm_eps", NORMED_EPS)
    if eps != NORMED_EPS:
        logger.info("llama.cpp normalises the inserted blocks with the model's eps %g, not the format's %g: n(x) "
                    "changes by a factor of about 1 + %.0e / (2 mean(x^2)), negligible unless the stream's mean square "
                    "is that small.", eps, NORMED_EPS, eps - NORMED_EPS)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    scratch = scratch_folder(output.parent, f".{output.name}.converting-")  # removes what a killed export left
    try:
        folder = scratch / "base"
        try:
            pruned_base(model).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        except (OSError, SafetensorError) as error:  # a full disk, a read-only folder
            reason = getattr(error, "strerror", None) or " ".join(str(error).split())[:200]
            raise GhostedError(f"Cannot write the pruned base beside {output} ({reason}); free disk space there or "
                               "write the GGUF elsewhere.") from None
        from ..io.card import name_tokenizer_class_for_every_reader

        name_tokenizer_class_for_every_reader(folder)
        convert(folder, Path(llama_cpp), scratch / "base.gguf", outtype, timeout)
        atomic_write(output, lambda staged: rewrite_as_deci(scratch / "base.gguf", staged, blocks, outtype, maps))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    logger.info("Wrote %s: %d layers, %d of them linear-attention blocks.", output,
                len(layer_order(model.config.text_config.num_hidden_layers, blocks, maps.mlp)),
                len(blocks) + len(maps.attention) + len(maps.mlp))
    return output
