"""The chunked distillation loss equals the loss computed on the full logits, in value and gradient."""

from __future__ import annotations

import pytest
import torch
from tiny import build
from torch import nn

from ghosted_hf.pipelines.healing.distillation import chunked_kd_loss, final_hidden_states, shifted_labels


def full_logits_loss(student_hidden, teacher_hidden, labels, student_head, teacher_head, kd_weight):
    predicted = student_head(student_hidden).float().log_softmax(-1)
    target = teacher_head(teacher_hidden).float().log_softmax(-1)
    kl = (target.exp() * (target - predicted)).sum(-1).mean()
    shifted = shifted_labels(labels)
    ce = nn.functional.cross_entropy(predicted.reshape(-1, predicted.shape[-1]), shifted.reshape(-1), ignore_index=-100)
    return kd_weight * kl + (1 - kd_weight) * ce


@pytest.mark.parametrize("kd_weight, chunk", [(1.0, 7), (0.3, 7), (0.3, 1000), (0.0, 5)])
def test_chunked_kd_loss_equals_the_full_logits_loss(kd_weight: float, chunk: int) -> None:
    """Value and gradients (the hidden states', and the head's weight and bias where they require one, as the
    forward pass forms them chunk by chunk) equal autograd's through whole logits."""
    torch.manual_seed(0)
    student_head, teacher_head = nn.Linear(16, 50, bias=True), nn.Linear(16, 50, bias=False)
    teacher_hidden = torch.randn(3, 11, 16)
    labels = torch.randint(0, 50, (3, 11))
    labels[1, 5:] = -100  # positions that must not count in the next-token term
    grads = []
    for chunked in (True, False):
        student_head.zero_grad()
        student_hidden = torch.randn(3, 11, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        if chunked:
            loss = chunked_kd_loss(student_hidden, teacher_hidden, shifted_labels(labels), student_head, teacher_head,
                                   kd_weight=kd_weight, chunk=chunk)
        else:
            loss = full_logits_loss(student_hidden, teacher_hidden, labels, student_head, teacher_head, kd_weight)
        (2.5 * loss).backward()
        grads.append((loss.detach(), student_hidden.grad, student_head.weight.grad.clone(),
                      student_head.bias.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-6)
    for chunked, full in zip(grads[0][1:], grads[1][1:]):
        torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-7)


def test_the_kd_loss_of_a_model_against_itself_is_zero_and_hidden_states_are_the_heads_input() -> None:
    model = build("llama").eval()
    ids = torch.randint(2, 100, (2, 9))
    with torch.no_grad(), final_hidden_states(model) as captured:
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(model.lm_head(captured[0]), logits)
    loss = chunked_kd_loss(captured[0], captured[0], shifted_labels(ids), model.lm_head, model.lm_head, chunk=5)
    assert abs(float(loss)) < 1e-6


def test_the_chunked_next_token_loss_equals_the_models_own_loss_and_gradient() -> None:
    """Healing without a teacher: the next-token loss a few positions at a time, from the final hidden states, is the
    model's own loss (transformers' shifted cross-entropy over whole logits), in value and gradient."""
    model = build("llama")
    ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[1, 8:] = -100
    weight = model.model.layers[-1].mlp.down_proj.weight
    results = []
    for chunked in (True, False):
        model.zero_grad()
        if chunked:
            with final_hidden_states(model) as captured:
                model(input_ids=ids, logits_to_keep=1)
            loss = chunked_kd_loss(captured[-1], None, shifted_labels(labels), model.get_output_embeddings(), None,
                                   kd_weight=0.0, chunk=5)
        else:
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach(), weight.grad.clone()))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("arch", ["gemma2", "granite", "cohere", "bloom"])
def test_a_family_head_chunked_loss_is_the_models_own_loss_and_gradient(arch: str) -> None:
    """A head that is more than an output layer (Gemma 2's soft-capping, Granite's and Cohere's logit scaling) is run
    as the family's forward after the last decoder layer, a few positions at a time (BLOOM: layers that return
    tuples): the next-token loss, the KL to a teacher of the same family and their gradients (a decoder weight's,
    and the final norm's, which only the head uses) are those of the whole logits."""
    from tiny import tiny_family

    from ghosted_hf.architectures import decoder_layers, final_norm
    from ghosted_hf.pipelines.healing.distillation import family_head, head_is_plain
    from ghosted_hf.statistics.capture import last_layer_output

    model, teacher = tiny_family(arch).train(), tiny_family(arch, seed=1)
    assert head_is_plain(model) == (arch == "bloom")
    ids = torch.randint(3, 100, (2, 13), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[1, 8:] = -100
    checked = [next(p for p in decoder_layers(model)[-1].parameters() if p.ndim == 2), final_norm(model).weight]
    for kd_weight in (0.0, 0.4):
        results = []
        for chunked in (True, False):
            model.zero_grad()
            if chunked:
                with last_layer_output(model) as last:
                    model(input_ids=ids, logits_to_keep=1)
                with torch.no_grad(), last_layer_output(teacher) as teacher_last:
                    teacher(input_ids=ids, logits_to_keep=1)
                states = [o[0] if isinstance(o, tuple) else o for o in (last["output"], teacher_last["output"])]
                loss = chunked_kd_loss(*states, shifted_labels(labels),
                                       family_head(model, last["output"]), family_head(teacher, teacher_last["output"]),
                                       kd_weight=kd_weight, chunk=5, trained=model.parameters())
            else:
                logits = model(input_ids=ids).logits.float()
                with torch.no_grad():
                    target = teacher(input_ids=ids).logits.float().log_softmax(-1)
                kl = (target.exp() * (target - logits.log_softmax(-1))).sum(-1).mean()
                ce = nn.functional.cross_entropy(logits.flatten(0, 1), shifted_labels(labels).flatten(), ignore_index=-100)
                loss = kd_weight * kl + (1 - kd_weight) * ce
            loss.backward()
            results.append((loss.detach(), *(w.grad.clone() for w in checked)))
        for chunked, full in zip(*results):
            torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
