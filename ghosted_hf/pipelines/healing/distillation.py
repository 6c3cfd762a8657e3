"""Healing's losses without batch x sequence x vocabulary logits: the student's (and the teacher's) final hidden states
are taken once, and the logits, log-softmaxes, KL and next-token cross-entropy are computed (and recomputed in the
backward pass) a chunk of token positions at a time, so memory grows with chunk x vocabulary only."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from ...architectures import final_norm

Head = Callable[[torch.Tensor], torch.Tensor]  # an output layer: hidden states -> logits


def _chunk_terms(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor | None, labels: torch.Tensor,
                 student_head: Head, teacher_head: Head | None) -> torch.Tensor:
    """(sum of KL(teacher || student), sum of next-token cross-entropy) over one chunk of positions (no teacher: a KL
    of 0)."""
    predicted = student_head(student_hidden).float().log_softmax(-1)
    if teacher_hidden is None:
        kl = predicted.new_zeros(())
    else:
        with torch.no_grad():
            target = teacher_head(teacher_hidden).float().log_softmax(-1).to(predicted.device)
        kl = (target.exp() * (target - predicted)).sum()
    real = labels != -100
    ce = -predicted[real].gather(-1, labels[real].unsqueeze(-1)).sum()
    return torch.stack([kl, ce])


def chunked_kd_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor | None, labels: torch.Tensor,
                    student_head: Head, teacher_head: Head | None, *, kd_weight: float = 1.0,
                    chunk: int = 1024) -> torch.Tensor:
    """`kd_weight` x mean KL(teacher || student) over every position + (1 - `kd_weight`) x mean next-token
    cross-entropy over the positions whose `labels` (already shifted: the token each position predicts) are not
    -100 (no teacher: `kd_weight` 0, the next-token loss). Hidden states are (batch, length, channels) on their
    models' devices; each chunk of `chunk` positions is checkpointed, so only hidden states are kept for the backward
    pass, not logits."""
    flat_student = student_hidden.reshape(-1, student_hidden.shape[-1])
    flat_teacher = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]) if teacher_hidden is not None else None
    flat_labels = labels.reshape(-1).to(flat_student.device)
    sums = torch.zeros(2, device=flat_student.device)
    for start in range(0, flat_student.shape[0], chunk):
        part = slice(start, start + chunk)
        sums = sums + checkpoint(_chunk_terms, flat_student[part],
                                 flat_teacher[part] if flat_teacher is not None else None, flat_labels[part],
                                 student_head, teacher_head, use_reentrant=False)
    kl = sums[0] / flat_student.shape[0]
    if kd_weight == 1.0:
        return kl
    ce = sums[1] / (flat_labels != -100).sum().clamp(min=1)
    return kd_weight * kl + (1.0 - kd_weight) * ce


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """The token each position predicts (the next label), -100 at the last position: the causal-LM loss's shift."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


@contextlib.contextmanager
def final_hidden_states(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Capture the output of the decoder's final norm during a forward pass of `model` (which may be wrapped by
    PEFT or DDP: the forward must go through the wrapper for DDP to synchronise gradients)."""
    inner = model
    while not isinstance(inner, PreTrainedModel):
        if hasattr(inner, "get_base_model"):  # PEFT
            inner = inner.get_base_model()
        elif hasattr(inner, "module"):  # DDP and the like
            inner = inner.module
        else:
            break
    captured: list[torch.Tensor] = []
    handle = final_norm(inner).register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        yield captured
    finally:
        handle.remove()


def head_is_plain(model: nn.Module) -> bool:
    """Whether the model's logits are its output layer applied to the final norm's output, as the chunked KL
    computes them. A family that post-processes them (Gemma's soft-capping, Granite's and Cohere's scaling) is
    not: found by running its own forward, not by a list of families."""
    parameter = next(model.parameters())
    ids = torch.tensor([[1, 2, 3, 4]], device=parameter.device)
    with torch.no_grad(), final_hidden_states(model) as captured:
        logits = model(input_ids=ids).logits
    head = model.get_output_embeddings()
    return torch.allclose(head(captured[-1].to(parameter.dtype)).float(), logits.float(), rtol=1e-3, atol=1e-4)
