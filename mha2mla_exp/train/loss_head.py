"""The training loss from the decoder's last hidden states, chunk by chunk: the full `[tokens, vocab]` logits
(49,152 wide for SmolLM2, 200 MB per 1,024 tokens in fp32, three copies in the plain path: the slice, the
log-softmax, their gradient) never exist.

`train.fused_loss=true`: each chunk of scored positions is projected through the output layer, its objective
(`Objective.token_loss_sum`, the same definition as the plain path) and the gradient of that with respect to the
chunk's logits are taken at once, and the gradient is pushed through the output layer right away, into the
hidden states and the output weight. The backward then only scales those two gradients. The matmuls are the plain
path's three (logits, their input gradient, their weight gradient); what goes is the copies, the zero-filled
buffers and the passes over the full logits (the profile in results/bench/cpu_train/). The teacher's logits are
made per chunk too, from its own hidden states. Equal to the plain path within float rounding (tests/test_loss_head.py).
"""

from __future__ import annotations

import contextlib

import torch

from .objectives import Objective

# positions per chunk. Smaller chunks run the output layer's matmuls less efficiently (2-core AMD EPYC, fp32, the
# loss of 1,020 positions: 256-row chunks as slow as the plain path, 1,024 rows 10-16 % faster); a 1,024-row
# chunk of a 49,152-word vocabulary is 200 MB in fp32, and at 7B (32k words, 16k positions per micro-batch) it
# bounds the logits at 128 MB where the plain path holds 2 GB
CHUNK_ROWS = 1024


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, teacher_hidden, teacher_weight, objective, chunk_rows, logit_cap):
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start : start + chunk_rows]
            teacher = None
            if teacher_hidden is not None:  # the teacher's logits as the plain path makes them: never under autocast
                with torch.autocast(hidden.device.type, enabled=False):
                    teacher = soft_cap(teacher_hidden[start : start + chunk_rows] @ teacher_weight.t(), logit_cap)
            with torch.enable_grad():
                logits = (h @ weight.t()).detach().requires_grad_(True)
                loss = objective.token_loss_sum(
                    soft_cap(logits, logit_cap), targets[start : start + chunk_rows], teacher
                )
                (grad_logits,) = torch.autograd.grad(loss, logits)
            grad_logits = grad_logits.to(logits.dtype)
            grad_hidden[start : start + chunk_rows] = grad_logits @ weight.to(grad_logits.dtype)
            grad_weight += (grad_logits.t() @ h.to(grad_logits.dtype)).float()
            total += loss.detach().float()
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_total.to(grad_hidden.dtype),
            grad_weight * grad_total.to(grad_weight.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def chunked_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    objective: Objective,
    teacher_hidden: torch.Tensor | None = None,
    teacher_weight: torch.Tensor | None = None,
    chunk_rows: int = CHUNK_ROWS,
    logit_cap: float | None = None,
) -> torch.Tensor:
    """`objective.token_loss_sum` of `hidden` `[N, H]` through an output layer `weight` `[V, H]` (no bias: the
    Llama family's) predicting `targets` `[N]`, summed over the N positions; differentiable in `hidden` and
    `weight`. The teacher's logits are `teacher_hidden @ teacher_weight.T`, made one chunk at a time. `logit_cap`:
    the family's final soft cap (Gemma-2), applied to both as the model's own forward applies it."""
    return _ChunkedHeadLoss.apply(
        hidden, weight, targets, teacher_hidden, teacher_weight, objective, chunk_rows, logit_cap
    )


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """The final-logit soft cap some families apply after the output layer (`cap * tanh(logits / cap)`)."""
    return logits if not cap else torch.tanh(logits / cap) * cap


def logit_cap_of(model: torch.nn.Module) -> float | None:
    """The model's final-logit soft cap (Gemma-2's `final_logit_softcapping`), None where it has none."""
    return getattr(getattr(model, "config", None), "final_logit_softcapping", None) or None


@contextlib.contextmanager
def last_hidden_state_of(decoder: torch.nn.Module):
    """Capture the decoder's (e.g. LlamaModel's) output while a forward through its wrapper runs (a DDP or FSDP
    wrapper must run its own forward for its gradient hooks); yields a dict filled with `"hidden"`."""
    captured: dict[str, torch.Tensor] = {}

    def hook(module, args, output):
        captured["hidden"] = output.last_hidden_state

    handle = decoder.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


class LogitsLoss:
    """The plain path: the model's full logits, then the objective on them."""

    name = "logits"

    def teacher_outputs(self, teacher, batch):
        return teacher(input_ids=batch, use_cache=False).logits

    def __call__(self, model, batch, objective: Objective, teacher_outputs=None) -> torch.Tensor:
        return objective(model(input_ids=batch, use_cache=False).logits, batch, teacher_outputs)


class ChunkedLoss:
    """The fused path: the objective from the last hidden states, `chunk_rows` positions at a time. `decoder`
    and `head` are the trained model's own (unwrapped) decoder and output layer."""

    name = "chunked"

    def __init__(
        self,
        decoder: torch.nn.Module,
        head: torch.nn.Module,
        chunk_rows: int = CHUNK_ROWS,
        logit_cap: float | None = None,
    ):
        self.decoder, self.head, self.chunk_rows, self.logit_cap = decoder, head, chunk_rows, logit_cap

    def teacher_outputs(self, teacher, batch):
        hidden = teacher.model(input_ids=batch, use_cache=False).last_hidden_state
        return hidden[:, :-1].flatten(0, 1), teacher.lm_head.weight

    def __call__(self, model, batch, objective: Objective, teacher_outputs=None) -> torch.Tensor:
        """The per-token mean of `objective` on `batch` `[B, T]` (positions 0..T-2 predict 1..T-1), as
        `LogitsLoss` computes it; `model` is what the step calls (possibly a DDP or FSDP wrapper)."""
        with last_hidden_state_of(self.decoder) as captured:
            model(input_ids=batch, use_cache=False, logits_to_keep=1)  # one position's logits: a negligible matmul
        hidden = captured["hidden"][:, :-1].flatten(0, 1)
        targets = batch[:, 1:].flatten()
        teacher_hidden, teacher_weight = teacher_outputs if teacher_outputs is not None else (None, None)
        total = chunked_head_loss(
            hidden,
            self.head.weight,
            targets,
            objective,
            teacher_hidden,
            teacher_weight,
            self.chunk_rows,
            self.logit_cap,
        )
        return total / targets.numel()


def loss_head_for(model: torch.nn.Module, fused: bool, chunk_rows: int = CHUNK_ROWS):
    """The step's loss path for `model` (a transformers causal LM, unwrapped): `ChunkedLoss` where `fused` and the
    model has the layout it needs (a `.model` decoder and a bias-free `.lm_head`), else `LogitsLoss`."""
    if not fused:
        return LogitsLoss()
    head = getattr(model, "lm_head", None)
    if not (isinstance(head, torch.nn.Linear) and head.bias is None and hasattr(model, "model")):
        raise ValueError(
            f"train.fused_loss: {type(model).__name__} has no bias-free lm_head over a .model decoder; "
            "set train.fused_loss=false"
        )
    return ChunkedLoss(model.model, head, chunk_rows, logit_cap_of(model))
