"""Healing's losses without batch x sequence x vocabulary logits: the student's (and the teacher's) hidden states are
taken once, and the logits, log-softmaxes, KL, next-token cross-entropy and their gradient are computed a chunk of
token positions at a time, through each model's own head, so memory grows with chunk x vocabulary only."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ...architectures import decoder_layers, final_norm
from ...statistics.capture import input_device, resumed
from ...statistics.patch import with_hidden

Head = Callable[[torch.Tensor], torch.Tensor]  # hidden states of some positions (positions, channels) -> their logits


class _HeadLoss(torch.autograd.Function):
    """The loss and, in the same chunked pass, its gradient with respect to the student's hidden states (and to the
    trained parameters the head uses): the backward pass only scales what the forward stored. Per chunk, one
    student-head product and one for its gradient, and the teacher's head once; checkpointed chunks recomputed both
    heads in the backward pass."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor | None, labels: torch.Tensor, student_head: Head,
                teacher_head: Head | None, kd_weight: float, chunk: int, differentiate: bool,
                *trained: torch.Tensor) -> torch.Tensor:
        positions, real = student.shape[0], labels != -100
        kl_scale = kd_weight / positions if teacher is not None else 0.0
        ce_scale = (1.0 - kd_weight) / max(int(real.sum()), 1)
        grad, totals = torch.empty_like(student), [torch.zeros_like(p) for p in trained]
        linear = isinstance(student_head, nn.Linear)
        kl = student.new_zeros((), dtype=torch.float64)
        ce = student.new_zeros((), dtype=torch.float64)
        for start in range(0, positions, chunk):
            part = slice(start, start + chunk)
            with torch.enable_grad():  # (a linear head's gradient is written out below)
                hidden = student[part].detach().requires_grad_(differentiate and not linear)
                logits = student_head(hidden)
            predicted = logits.detach().float().log_softmax(-1)
            rows = real[part]
            scored, targets = rows.nonzero().squeeze(-1), labels[part][rows]
            if ce_scale:
                ce -= predicted[scored, targets].sum().double()
            # d/dz of KL(t || s) is softmax(z) - p_t; of the cross-entropy, softmax(z) - onehot(label).
            step = predicted.exp().mul_((kl_scale + ce_scale * rows.float()).unsqueeze(-1))
            if kl_scale:
                target = teacher_head(teacher[part]).float().log_softmax(-1).to(predicted.device)
                probability = target.exp()
                kl += target.sub_(predicted).mul_(probability).sum().double()
                step.sub_(probability, alpha=kl_scale)
                del target, probability
            if ce_scale:
                step[scored, targets] -= ce_scale
            del predicted
            if not differentiate:
                continue
            if linear:  # written out: a weight FSDP gathered must not enter a graph (the backward pass would crash)
                weight = student_head.weight
                found = [step.to(weight.dtype) @ weight, *(step.to(weight.dtype).T @ hidden.to(weight.dtype)
                                                           if p is weight else step.sum(0).to(p.dtype) for p in trained)]
            else:
                found = torch.autograd.grad(logits, [hidden, *trained], step.to(logits.dtype), allow_unused=True)
            grad[part] = found[0]
            for total, piece in zip(totals, found[1:]):
                if piece is not None:
                    total += piece
        ctx.save_for_backward(grad, *totals)
        return kl * kl_scale + ce * ce_scale

    @staticmethod
    def backward(ctx, scale: torch.Tensor):
        grad, *totals = ctx.saved_tensors
        return grad * scale.to(grad.dtype), *[None] * 7, *(t * scale.to(t.dtype) for t in totals)


def chunked_kd_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor | None, labels: torch.Tensor,
                    student_head: Head, teacher_head: Head | None, *, kd_weight: float = 1.0, chunk: int = 1024,
                    trained: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
    """`kd_weight` x mean KL(teacher || student) over every position + (1 - `kd_weight`) x mean next-token
    cross-entropy over the positions whose `labels` (already shifted: the token each position predicts) are not
    -100 (no teacher: `kd_weight` 0, the next-token loss). Hidden states are (batch, length, channels) on their
    models' devices, turned into logits by their heads `chunk` positions at a time; the gradient is formed in the same
    pass, so no logits are kept for the backward pass. `trained`: the parameters requiring a gradient that the
    student's head may use (default: the head's own, where it is a module)."""
    flat_student = student_hidden.reshape(-1, student_hidden.shape[-1])
    flat_teacher = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]) if teacher_hidden is not None else None
    flat_labels = labels.reshape(-1).to(flat_student.device)
    if trained is None:
        trained = student_head.parameters() if isinstance(student_head, nn.Module) else ()
    trained = [p for p in trained if p.requires_grad]
    differentiate = torch.is_grad_enabled() and (flat_student.requires_grad or bool(trained))
    loss = _HeadLoss.apply(flat_student, flat_teacher, flat_labels, student_head, teacher_head, kd_weight, chunk,
                           differentiate, *trained)
    return loss.to(torch.float32)


def family_head(model: PreTrainedModel, output: Any, through: nn.Module | None = None) -> Head:
    """The family's own head (final norm, output layer, soft-capping, scaling, anything its forward does after the
    decoder layers) as a function of the last decoder layer's hidden states, `output` being what that layer returned
    (a tensor or a family's tuple): the model's forward with every decoder layer passing the given states on, called
    `through` a wrapper of `model` where one must gather its parameters (FSDP)."""
    depth = len(decoder_layers(model))

    def head(hidden: torch.Tensor) -> torch.Tensor:
        state = with_hidden(output, hidden.unsqueeze(0))
        ids = torch.zeros(hidden.shape[:1], dtype=torch.long, device=input_device(model)).unsqueeze(0)
        with resumed(model, depth, state):
            return (through or model)(input_ids=ids, use_cache=False).logits[0]

    return head


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """The token each position predicts (the next label), -100 at the last position: the causal-LM loss's shift."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model inside PEFT's and DDP's wrappers."""
    while not isinstance(model, PreTrainedModel):
        if hasattr(model, "get_base_model"):  # PEFT
            model = model.get_base_model()
        elif hasattr(model, "module"):  # DDP and the like
            model = model.module
        else:
            break
    return model


@contextlib.contextmanager
def final_hidden_states(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Capture the output of the decoder's final norm during a forward pass of `model` (which may be wrapped by
    PEFT or DDP: the forward must go through the wrapper for DDP to synchronise gradients)."""
    captured: list[torch.Tensor] = []
    handle = final_norm(unwrapped(model)).register_forward_hook(lambda module, args, output: captured.append(output))
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
