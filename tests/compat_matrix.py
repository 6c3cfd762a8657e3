"""Remote-code compatibility matrix: do folders saved by the current code load and run on other transformers?

    python tests/compat_matrix.py [--versions 4.57.6 5.0.0 ...] [--cache DIR] [--table FILE]

1. builds (or reuses) one venv per transformers version under --cache (default $GHOSTED_COMPAT_CACHE or
   ~/.cache/ghosted_hf/compat); see compat_venvs.py;
2. with the current code, in this process, saves tiny random Llama, Qwen2 (mixed sliding-window layers) and
   Qwen3 (tied embeddings) ghosted models, each with a boundary feeding layer 0, one in the middle and one
   feeding the final norm (removed layers 0, 2, 3, 5 of 6; Qwen2's first and last also with a normed term,
   format 1.1; Llama's and Qwen2's with replaced sub-blocks, format 1.2), plus reference logits, greedy tokens
   (generated with the KV cache) and loss;
3. per version, runs compat_child.py once in that venv, without ghosted_hf and offline;
4. prints a markdown table versions x checks and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))  # the checkout's ghosted_hf, before any installed copy

from compat_child import CHECKS  # noqa: E402
from compat_venvs import PINNED, default_cache, python_for  # noqa: E402

VOCAB, HIDDEN, LAYERS, PAD, EOS = 128, 32, 6, 0, 1
REMOVED = [0, 2, 3, 5]
FAMILIES, FAMILY_CHECK = "families", "family_logits"  # every family of the registry, one check each
FAMILY_REMOVED = [1, 2, 5]  # boundaries: -> layer 0, [2, 3] -> layer 1 (dense 4), [5] -> final norm
NEW_TOKENS = 8


def tiny_dense(arch: str, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
    torch.manual_seed(seed)
    # Rotary settings other than the defaults (SmolLM2's theta; a scaled rope): transformers 5 saves them as
    # `rope_parameters`, which 4.x does not read.
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "default", "rope_theta": 100000.0}))
    elif arch == "qwen2":
        config = Qwen2Config(**common, use_sliding_window=True, sliding_window=4, max_window_layers=2,
                             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0})
        assert len(set(config.layer_types)) == 2, config.layer_types
        model = Qwen2ForCausalLM(config)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8, tie_word_embeddings=True))
    with torch.no_grad():  # larger weights make every layer matter
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(8.0)
    return model.eval()


def char_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "</s>": EOS, "<unk>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   padding_side="left")


def save_fixtures(out: Path) -> dict:
    """Save the three ghosted folders and their reference outputs with the current code; return the models spec."""
    import torch
    from safetensors.torch import save_file

    import ghosted_hf
    from ghosted_hf import prune_layers
    from ghosted_hf.io.card import name_tokenizer_class_for_every_reader

    if not Path(ghosted_hf.__file__).resolve().is_relative_to(ROOT):
        raise RuntimeError(f"imported ghosted_hf from {ghosted_hf.__file__}, not from this checkout {ROOT}")
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (3, 12), generator=g)
    attention_mask = torch.ones_like(input_ids)
    input_ids[0, :4], attention_mask[0, :4] = PAD, 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    models = {}
    for index, name in enumerate(("llama", "qwen2", "qwen3")):
        dense = tiny_dense(name, seed=index)
        operators = {s: torch.eye(HIDDEN) + 0.2 * torch.randn(HIDDEN, HIDDEN, generator=g) for s in (0, 2, 5)}
        # qwen2 also carries normed terms (format 1.1) at two of its boundaries.
        normed = ({s: 0.1 * torch.randn(HIDDEN, HIDDEN, generator=g) for s in (0, 5)} if name == "qwen2" else None)
        # llama and qwen2 also replace sub-blocks (format 1.2): the attention of the first kept layer (where the
        # cache's length is read) or of a sliding-window layer, and an MLP, llama's by a rank-4 map (format 1.4).
        subblocks = {"llama": {(1, "attention"): 2, (4, "mlp"): 0}, "qwen2": {(4, "attention"): 2}}.get(name, {})
        subblocks = {key: ((0.3 * torch.randn(HIDDEN, 4, generator=g), 0.3 * torch.randn(4, HIDDEN, generator=g))
                           if key == (4, "mlp") else 0.1 * torch.randn(HIDDEN, HIDDEN, generator=g), outputs)
                     for key, outputs in subblocks.items()}
        model = prune_layers(dense, REMOVED, operators, operator_kind="ghost", normed=normed, subblocks=subblocks).eval()
        folder = out / name
        model.save_pretrained(folder)
        char_tokenizer().save_pretrained(folder)
        # 5.x writes the generic fast tokenizer as "TokenizersBackend", a class 4.x lacks: save_with_card names
        # its old alias, which loads on every version (the pipeline check proves it).
        name_tokenizer_class_for_every_reader(folder)
        missing = [f for f in ("configuration_ghosted.py", "modeling_ghosted.py") if not (folder / f).exists()]
        if missing:
            raise RuntimeError(f"save_pretrained did not copy the remote code {missing} into {folder}")
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                                       do_sample=False, pad_token_id=PAD)
        reference = out / f"{name}-reference.safetensors"
        save_file({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, "logits": logits,
                   "loss": loss, "generated": generated}, str(reference))
        text = model.config.text_config
        tensors = list(model.ghost_operators())
        models[name] = {
            "folder": str(folder),
            "reference": str(reference),
            "meta": {
                "config": {"hidden_size": text.hidden_size, "num_hidden_layers": text.num_hidden_layers,
                           "vocab_size": text.vocab_size},
                "kept": text.num_hidden_layers,
                "operators": tensors,
                "format_version": model.config.ghost_format_version,
                "new_tokens": NEW_TOKENS,
                "pad": PAD,
            },
        }
    return models


def save_families(out: Path) -> dict:
    """Every family of the architecture registry: a tiny dense model, its ghosted model (removals [1, 2, 5] of 6,
    random operators) and the ghosted model's logits, saved with the current code; the operators too, for the
    child's own skip-reference."""
    import torch
    from safetensors.torch import save_file
    from tiny import batch, random_operator, tiny_family

    from ghosted_hf import prune_layers
    from ghosted_hf.architectures import ARCHITECTURES

    inputs, operators = batch(), {1: random_operator(1), 5: random_operator(5)}
    families = {}
    for model_type in sorted(ARCHITECTURES):
        dense = tiny_family(model_type)
        dense.save_pretrained(out / model_type / "dense")
        model = prune_layers(dense, FAMILY_REMOVED, operators)
        model.save_pretrained(out / model_type / "ghosted")
        with torch.no_grad():
            logits = model(**inputs).logits
        save_file({**inputs, "logits": logits, **{f"operator.{k}": v for k, v in operators.items()}},
                  str(out / model_type / "reference.safetensors"))
        families[model_type] = {"folder": str(out / model_type), "removed": FAMILY_REMOVED,
                                "boundaries": [[1, 3], [5, 6]]}  # (operator, layer it feeds; 6 = the final norm)
    return families


def run_version(version: str, python: Path, models: dict, work: Path, timeout: int = 600) -> list[dict]:
    """One subprocess per version; every (model, check) gets a result, failures included."""
    spec = work / f"spec-{version}.json"
    spec.write_text(json.dumps({"models": {k: v for k, v in models.items() if k != FAMILIES},
                                "families": models.get(FAMILIES, {}), "work": str(work / f"broken-{version}")}))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(work / f"hf_modules-{version}"),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)  # the child must not see this checkout
    start = time.monotonic()
    try:
        done = subprocess.run([str(python), str(HERE / "compat_child.py"), str(spec)], cwd=work, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, rc = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        stdout, stderr, rc = exc.stdout or "", f"timed out after {timeout}s", -1
    results, seen, found, absent = [], set(), None, []
    for line in stdout.splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "transformers" in row:
            found = row["transformers"]
        elif row.get("absent"):
            absent.append(row["family"])
        elif "dense_fails" in row:
            absent.append(f"{row['family']} (its dense checkpoint does not load here either: {row['dense_fails']})")
        elif "check" in row:
            results.append({"version": version, **row})
            seen.add((row["model"], row["check"]))
    crash = (stderr.strip().splitlines() or [f"exit code {rc}"])[-1][:300]
    if found is not None and found != version:
        results = [{**r, "ok": False, "error": f"child imported transformers {found}, not {version}"} for r in results]
    for family in models.get(FAMILIES, {}):
        if (family, FAMILY_CHECK) not in seen and not any(a.split()[0] == family for a in absent):
            results.append({"version": version, "model": family, "check": FAMILY_CHECK, "ok": False,
                            "error": f"no result (child exit {rc}): {crash}"})
    for model in (m for m in models if m != FAMILIES):
        for check in CHECKS:
            if (model, check) not in seen:
                results.append({"version": version, "model": model, "check": check, "ok": False,
                                "error": f"no result (child exit {rc}): {crash}"})
    for row in results:
        print(json.dumps(row), flush=True)
    print(f"[compat] transformers {version}: {sum(r['ok'] for r in results)}/{len(results)} passed "
          f"in {time.monotonic() - start:.1f}s; families it does not have: {', '.join(absent) or 'none'}",
          file=sys.stderr, flush=True)
    return results


def table(versions: list[str], results: list[dict]) -> str:
    def cell(version: str, check: str) -> str:
        bad = [r for r in results if r["version"] == version and r["check"] == check and not r["ok"]]
        if not bad:
            return "✓"
        models = ",".join(r["model"] for r in bad)
        error = bad[0]["error"].replace("|", "\\|")
        return f"✗ {models}: {error}"

    def families(version: str) -> str:
        rows = [r for r in results if r["version"] == version and r["check"] == FAMILY_CHECK]
        bad = [r for r in rows if not r["ok"]]
        if bad:
            return f"✗ {','.join(r['model'] for r in bad)}: {bad[0]['error']}".replace("|", "\\|")
        notes: dict[str, list[str]] = {}
        for r in rows:
            if r["error"]:
                notes.setdefault(r["error"], []).append(r["model"])
        return f"✓ {len(rows)}" + "".join(f" ({', '.join(names)}: {note})" for note, names in notes.items())

    lines = ["| transformers | " + " | ".join(CHECKS) + " | families (logits) |", "|---" * (len(CHECKS) + 2) + "|"]
    for version in versions:
        lines.append(f"| {version} | " + " | ".join(cell(version, c) for c in CHECKS) + f" | {families(version)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", nargs="+", default=list(PINNED), help="transformers versions (default: pinned)")
    parser.add_argument("--cache", type=Path, default=default_cache(), help="where the venvs are kept")
    parser.add_argument("--table", type=Path, help="also write the markdown table to this file")
    parser.add_argument("--jobs", type=int, default=2, help="versions checked at once (default 2)")
    args = parser.parse_args(argv)

    start = time.monotonic()
    log = lambda message: print(message, file=sys.stderr, flush=True)  # noqa: E731
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        venvs = pool.map(lambda v: python_for(v, args.cache.expanduser(), log), args.versions)
        with tempfile.TemporaryDirectory(prefix="ghosted-compat-") as tmp:
            work = Path(tmp)
            models = {**save_fixtures(work / "saved"), FAMILIES: save_families(work / "families")}
            pythons = dict(zip(args.versions, venvs))  # waits for the venvs
            log(f"[compat] venvs and fixtures ready in {time.monotonic() - start:.1f}s")
            runs = pool.map(lambda v: run_version(v, pythons[v], models, work), args.versions)
            results = [row for rows in runs for row in rows]
    markdown = table(args.versions, results)
    print(markdown)
    if args.table:
        args.table.write_text(markdown + "\n")
    failed = sum(not r["ok"] for r in results)
    log(f"[compat] {len(results) - failed}/{len(results)} checks passed in {time.monotonic() - start:.1f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
