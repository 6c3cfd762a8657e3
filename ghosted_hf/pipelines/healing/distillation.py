"""Healing's losses without batch x sequence x vocabulary logits: the student's (and the teacher's) final hidden states
are taken once, and the logits, log-softmaxes, KL and next-token cross-entropy are computed (and recomputed in the
backward pass) a chunk of token positions at a time, so memory grows with chunk x vocabulary only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from ...architectures import final_norm

Head = nn.Module  # an output layer: `weight` (vocabulary, channels) and an optional `bias`; None: the states are logits


class _HeadLoss(torch.autograd.Function):
    """The loss and, in the same chunked pass, its gradient with respect to the student's hidden states (and to the
    head's weight where it requires one): the backward pass only scales what the forward stored. One student-head
    product per chunk forward and one for the gradient, the teacher's head once, against three and two with
    checkpointed chunks, which recompute both in the backward pass (the teacher's logits included)."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                teacher: torch.Tensor | None, teacher_head: Head | None, labels: torch.Tensor, kd_weight: float,
                chunk: int) -> torch.Tensor:
        positions, real = student.shape[0], labels != -100
        kl_scale = kd_weight / positions if teacher is not None else 0.0
        ce_scale = (1.0 - kd_weight) / max(int(real.sum()), 1)
        grad = torch.empty_like(student)
        grad_weight = torch.zeros_like(weight) if weight is not None and weight.requires_grad else None
        grad_bias = torch.zeros_like(bias) if bias is not None and bias.requires_grad else None
        kl = student.new_zeros((), dtype=torch.float64)
        ce = student.new_zeros((), dtype=torch.float64)
        for start in range(0, positions, chunk):
            part = slice(start, start + chunk)
            hidden, rows = student[part], real[part]
            logits = nn.functional.linear(hidden, weight, bias) if weight is not None else hidden
            predicted = logits.float().log_softmax(-1)
            del logits
            scored, targets = rows.nonzero().squeeze(-1), labels[part][rows]
            if ce_scale:
                ce -= predicted[scored, targets].sum().double()
            # d/dz of KL(t || s) is softmax(z) - p_t; of the cross-entropy, softmax(z) - onehot(label).
            step = predicted.exp().mul_((kl_scale + ce_scale * rows.float()).unsqueeze(-1))
            if kl_scale:
                target = _head(teacher_head, teacher[part]).float().log_softmax(-1).to(predicted.device)
                probability = target.exp()
                kl += target.sub_(predicted).mul_(probability).sum().double()
                step.sub_(probability, alpha=kl_scale)
                del target, probability
            if ce_scale:
                step[scored, targets] -= ce_scale
            del predicted
            if weight is None:
                grad[part] = step.to(grad.dtype)
                continue
            grad[part] = (step.to(weight.dtype) @ weight).to(grad.dtype)
            if grad_weight is not None:
                grad_weight += step.to(weight.dtype).T @ hidden.to(weight.dtype)
            if grad_bias is not None:
                grad_bias += step.sum(0).to(bias.dtype)
        ctx.save_for_backward(grad, grad_weight, grad_bias)
        return kl * kl_scale + ce * ce_scale

    @staticmethod
    def backward(ctx, scale: torch.Tensor):
        grad, grad_weight, grad_bias = ctx.saved_tensors
        scaled = [None if g is None else g * scale.to(g.dtype) for g in (grad, grad_weight, grad_bias)]
        return *scaled, None, None, None, None, None


def _head(head: Head | None, hidden: torch.Tensor) -> torch.Tensor:
    return hidden if head is None else nn.functional.linear(hidden, head.weight, getattr(head, "bias", None))


def chunked_kd_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor | None, labels: torch.Tensor,
                    student_head: Head | None, teacher_head: Head | None, *, kd_weight: float = 1.0,
                    chunk: int = 1024) -> torch.Tensor:
    """`kd_weight` x mean KL(teacher || student) over every position + (1 - `kd_weight`) x mean next-token
    cross-entropy over the positions whose `labels` (already shifted: the token each position predicts) are not
    -100 (no teacher: `kd_weight` 0, the next-token loss). Hidden states are (batch, length, channels) on their
    models' devices, turned into logits by their heads (None: they are logits) `chunk` positions at a time; the
    gradient is formed in the same pass, so no logits are kept for the backward pass."""
    flat_student = student_hidden.reshape(-1, student_hidden.shape[-1])
    flat_teacher = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]) if teacher_hidden is not None else None
    flat_labels = labels.reshape(-1).to(flat_student.device)
    weight, bias = (None, None) if student_head is None else (student_head.weight, getattr(student_head, "bias", None))
    loss = _HeadLoss.apply(flat_student, weight, bias, flat_teacher, teacher_head, flat_labels, kd_weight, chunk)
    return loss.to(torch.float32)


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
