"""The benchmarked model shapes and how to build each model: random weights from shape facts (the
MHA original and its MLA form), or a real offline model (SmolLM2-135M, Gemma-3 270M) converted with `convert_to_mla`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ..confutil import CONF_DIR
from ..mla import MLAConfig, MLAForCausalLM, MLASpec, ModelShape, convert_to_mla, fixed_pairs

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    """Llama-architecture shape facts plus the MLA recipe benchmarked at that shape."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie: bool
    r: int  # RoPE pairs kept per KV head (paper default d_h/16)
    d_kv: int  # latent width per KV head

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=65536,
            tie_word_embeddings=self.tie,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )


# METHOD.md's table; r = d_h/16; d_kv: 32 at d_h=64 (31.25% of the MHA cache), 16 at d_h=128 (12.5%)
SHAPES = {
    "smollm-135m": Shape(30, 576, 1536, 9, 3, 64, 49152, True, r=4, d_kv=32),
    "smollm-1.7b": Shape(24, 2048, 8192, 32, 32, 64, 49152, True, r=4, d_kv=32),
    "llama2-7b": Shape(32, 4096, 11008, 32, 32, 128, 32000, False, r=8, d_kv=16),
    "tiny": Shape(2, 64, 96, 4, 2, 16, 97, False, r=2, d_kv=4),  # for tests
}


@dataclass(frozen=True)
class RealModel:
    """A real offline model (conf/model/NAME.yaml) and the conversion benchmarked on it: speed and bytes do not depend
    on which pairs are kept, so a strategy that needs no calibration stands for all."""

    model_conf: str
    r: int
    d_kv: int
    rope: str = "uniform"


REAL_MODELS = {
    "real-smollm2": RealModel("smollm2_135m", r=4, d_kv=32),
    # Gemma-3 270M: r = d_h/16 = 16 and the paper's -81.25 % width; 15 of its 18 layers keep a 512-token window
    "real-gemma3": RealModel("gemma3_270m", r=16, d_kv=64),
}
REAL = "real-smollm2"  # the default real model of a GPU run


def build_mha(name: str, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """The original Llama (MHA/GQA) of a shape, random weights."""
    with torch.device(device):
        return LlamaForCausalLM(SHAPES[name].llama_config()).to(dtype).eval()


def build_mla(name: str, device: torch.device, dtype: torch.dtype) -> MLAForCausalLM:
    """An MLA model of the same shape with random weights: speed and bytes do not depend on the
    values, so no SVD is run."""
    shape = SHAPES[name]
    llama = shape.llama_config()
    spec = MLASpec.create(
        ModelShape(shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim),
        rope="uniform",
        r=shape.r,
        svd="joint",
        d_kv=shape.d_kv,
    )
    pairs = [[fixed_pairs("uniform", shape.r, shape.head_dim)] * shape.num_kv_heads] * shape.num_layers
    fields = llama.to_dict()
    for key in ("architectures", "model_type", "transformers_version", "dtype"):
        fields.pop(key, None)
    config = MLAConfig(**fields, mla=spec.to_dict(), rope_pairs=pairs)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return MLAForCausalLM(config).to(dtype).eval()


def build_real(name: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, MLAForCausalLM]:
    """A real offline model (REAL_MODELS[name]) and its MLA conversion (kept on the CPU until its turn); raises if
    the weights cannot be had here."""
    import yaml

    from ..confutil import typed_section
    from ..models import load_model
    from ..schema.sections import ModelConfig

    real = REAL_MODELS[name]
    conf = yaml.safe_load((CONF_DIR / "model" / f"{real.model_conf}.yaml").read_text())
    original, _ = load_model(typed_section(ModelConfig, conf, "model"), device=device, dtype=dtype)
    mla = convert_to_mla(original, rope=real.rope, r=real.r, svd="joint", d_kv=real.d_kv)
    return original.eval(), mla.to(device="cpu", dtype=dtype).eval()


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct parameters and buffers (tied embeddings counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
