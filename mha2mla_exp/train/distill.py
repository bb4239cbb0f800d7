"""Layer-wise distillation: each converted attention block learns to reproduce the original block's
output on the original model's own activations, one layer at a time.

Per token it runs one attention block forward and backward per layer, and never the MLPs or the
LM head, so it recovers a conversion for a fraction of an end-to-end fine-tune's compute.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn
from tqdm.auto import tqdm

log = logging.getLogger(__name__)


@torch.no_grad()
def capture_attention_io(teacher: nn.Module, batches: list[torch.Tensor]) -> list[list[dict]]:
    """Per batch and layer: the attention block's input, call kwargs and output in the teacher."""
    captured: list[list[dict]] = []
    current: list[dict] = []

    def pre_hook(module, args, kwargs):
        current.append(
            {
                "hidden_states": kwargs["hidden_states"].detach(),
                "position_embeddings": tuple(t.detach() for t in kwargs["position_embeddings"]),
                "attention_mask": kwargs.get("attention_mask"),
            }
        )

    def post_hook(module, args, kwargs, output):
        current[-1]["target"] = output[0].detach()

    layers = [layer.self_attn for layer in teacher.model.layers]
    hooks = [
        h
        for attn in layers
        for h in (
            attn.register_forward_pre_hook(pre_hook, with_kwargs=True),
            attn.register_forward_hook(post_hook, with_kwargs=True),
        )
    ]
    device = next(teacher.parameters()).device
    was_training = teacher.training
    teacher.eval()
    try:
        for ids in batches:
            current = []
            teacher(input_ids=ids.to(device), use_cache=False)
            captured.append(current)
    finally:
        for h in hooks:
            h.remove()
        teacher.train(was_training)
    return captured


def _rel_mse(attn: nn.Module, io: dict) -> torch.Tensor:
    out, _ = attn(
        hidden_states=io["hidden_states"],
        position_embeddings=io["position_embeddings"],
        attention_mask=io["attention_mask"],
    )
    return (out - io["target"]).pow(2).mean() / io["target"].pow(2).mean()


@torch.no_grad()
def _block_error(attn: nn.Module, captured: list[list[dict]], layer: int) -> float:
    return sum(_rel_mse(attn, batch[layer]).item() for batch in captured) / len(captured)


def distill_attention_layers(
    teacher: nn.Module,
    student: nn.Module,
    batches: list[torch.Tensor],
    *,
    epochs: int = 4,
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    on_log=None,
) -> dict:
    """Train each student attention block to match the teacher's block output (relative MSE) on the
    teacher's inputs. Only `student.model.layers[i].self_attn` parameters change. Returns stats."""
    started = time.perf_counter()
    captured = capture_attention_io(teacher, batches)
    tokens = sum(ids.numel() for ids in batches)
    student.train()
    per_layer = []
    n_layers = len(student.model.layers)
    for i in tqdm(range(n_layers), desc="distill", unit="layer"):
        attn = student.model.layers[i].self_attn
        params = [p for p in attn.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
        # linear warm-up over the first epoch: Adam's first full-size steps would wreck pretrained weights
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / len(captured)))
        before = _block_error(attn, captured, i)
        start_state = {k: v.detach().clone() for k, v in attn.state_dict().items()}
        for _ in range(epochs):
            for batch in captured:
                loss = _rel_mse(attn, batch[i])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                warmup.step()
        after = _block_error(attn, captured, i)
        kept = after < before
        if not kept:  # never leave a block worse on its own objective than the conversion made it
            attn.load_state_dict(start_state)
        per_layer.append({"layer": i, "rel_mse_before": before, "rel_mse_after": after, "kept": kept})
        if on_log:
            on_log({"layer": i, "distill/rel_mse_before": before, "distill/rel_mse_after": after})
    student.eval()
    seconds = time.perf_counter() - started
    return {
        "tokens": tokens,
        "epochs": epochs,
        "token_passes": tokens * epochs,  # tokens x epochs, each through one attention block per layer
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens * epochs / max(seconds, 1e-9), 1),
        "layers": per_layer,
    }
