"""Layer-wise distillation brings the converted blocks back towards the original, touching only attention."""

from __future__ import annotations

import torch
from conftest import tiny_causal_lm

from mha2mla_exp.mla import convert_to_mla
from mha2mla_exp.train.distill import capture_attention_io, distill_attention_layers


def test_distillation_reduces_block_error_and_only_touches_attention():
    torch.manual_seed(0)
    teacher = tiny_causal_lm("gqa")
    batches = [torch.randint(0, 97, (4, 32)) for _ in range(3)]
    student = convert_to_mla(teacher, rope="high", r=2, svd="joint", d_kv=4)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    ids = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        gap_before = (student(ids).logits - teacher(ids).logits).pow(2).mean().item()

    stats = distill_attention_layers(teacher, student, batches, epochs=30, lr=3e-3)
    assert len(stats["layers"]) == 2

    for layer in stats["layers"]:
        assert layer["kept"] and layer["rel_mse_after"] < 0.8 * layer["rel_mse_before"], layer
    for name, value in student.state_dict().items():
        changed = not torch.equal(value, before[name])
        assert changed == (".self_attn." in name and not name.endswith("rope_index")), name
    with torch.no_grad():
        gap_after = (student(ids).logits - teacher(ids).logits).pow(2).mean().item()
    assert gap_after < gap_before
    assert stats["tokens"] == 3 * 4 * 32 and stats["token_passes"] == stats["tokens"] * 30


def test_captured_targets_are_the_teachers_block_outputs():
    teacher = tiny_causal_lm("qwen2")
    ids = torch.randint(0, 97, (2, 16))
    (layers,) = capture_attention_io(teacher, [ids])
    assert len(layers) == 2
    io = layers[1]
    with torch.no_grad():
        out, _ = teacher.model.layers[1].self_attn(
            hidden_states=io["hidden_states"],
            position_embeddings=io["position_embeddings"],
            attention_mask=io["attention_mask"],
        )
    assert torch.allclose(out, io["target"])


def test_a_block_made_worse_is_restored():
    """With a destructive learning rate the block's error grows; the converted weights must come back."""
    teacher = tiny_causal_lm("gqa")
    student = convert_to_mla(teacher, rope="full", svd="joint", d_kv=16)  # exact: nothing to gain
    before = {k: v.clone() for k, v in student.state_dict().items()}
    stats = distill_attention_layers(teacher, student, [torch.randint(0, 97, (2, 16))], epochs=3, lr=10.0)
    assert not any(layer["kept"] for layer in stats["layers"])
    for name, value in student.state_dict().items():
        assert torch.equal(value, before[name]), name
