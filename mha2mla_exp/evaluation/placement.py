"""Where and in what precision an evaluated model runs: one decision for every row of a table.

Whatever made the model (loaded as it is, converted, fine-tuned under DDP or FSDP, a kept model reused), the
runner evaluates it through one `EvalPlacement`: the device (this process's: every rank evaluates its share),
the weights' dtype for each stage and whether fp32 matmuls may use TF32. So every row is scored alike:

- `weights` stage (held-out perplexity, the KV measurement): the weights as loaded, fp32 unless `model.dtype`
  names another. The untouched original is loaded in fp32 too (its checkpoint's bf16 values upcast exactly),
  so its perplexity is measured in the same precision as a converted row's.
- `suites` stage (lm-eval): `eval.dtype`. On CUDA the cast keeps the rotary `inv_freq` buffers in fp32, as
  transformers keeps them when it loads a model in bf16: rounding them to bf16 moves RoPE phases by up to
  0.37 % (0.37 rad at distance 2,047), a long-context bias. On CPU they are cast with the weights, as the
  committed CPU records (bf16 suites: cpu10x_table1, headline, recovery_study, teacher_recovery) were made,
  so that those reproduce; every row on one device is cast the same way either way.
- TF32 for fp32 matmuls on CUDA (perplexity, calibration, the fp32 parts of training): on for the whole
  process, decided once per run; never on CPU.

The decision lands in the run record (`record["placement"]`), not in the run's identity.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..models import DTYPES

ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")  # transformers' rotary embeddings (Llama, Mistral, Qwen2, MLA)
STAGES = ("weights", "suites")


def _dtype(value) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise ValueError(f"unknown dtype {value!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[value]


def _name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class EvalPlacement:
    device: torch.device
    weights_dtype: torch.dtype  # as loaded: held-out perplexity and the KV measurement
    suites_dtype: torch.dtype | None  # lm-eval suites; None: the weights' own
    tf32: bool  # fp32 matmuls may use TF32 (CUDA only)
    rotary_fp32: bool  # a cast keeps the rotary inv_freq buffers in fp32

    @classmethod
    def decide(cls, device, *, suites_dtype=None, model_dtype="auto") -> "EvalPlacement":
        """The placement of any model evaluated on `device`; `model_dtype`: the config's `model.dtype`
        ('auto': fp32), `suites_dtype`: the resolved `eval.dtype`."""
        device = torch.device(device)
        on_cuda = device.type == "cuda"
        weights = torch.float32 if model_dtype in (None, "auto") else _dtype(model_dtype)
        return cls(
            device=device, weights_dtype=weights, suites_dtype=_dtype(suites_dtype), tf32=on_cuda, rotary_fp32=on_cuda
        )

    def dtype_for(self, stage: str) -> torch.dtype:
        if stage not in STAGES:
            raise ValueError(f"unknown evaluation stage {stage!r}; expected one of {STAGES}")
        return (self.suites_dtype or self.weights_dtype) if stage == "suites" else self.weights_dtype

    def place(self, model, stage: str = "weights"):
        """`model` on this placement's device in `stage`'s dtype, in place (rotary buffers as decided)."""
        model.to(self.device)
        cast_keeping_rotary(model, self.dtype_for(stage), keep_rotary_fp32=self.rotary_fp32)
        return model

    def apply_matmul_precision(self) -> None:
        """TF32 for fp32 matmuls and convolutions on CUDA; nothing on CPU (its fp32 stays full fp32)."""
        if not self.tf32:
            return
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True

    @staticmethod
    @contextlib.contextmanager
    def full_fp32():
        """fp32 matmuls in full fp32 inside (TF32 off), the previous setting back after: the conversion's
        calibration statistics and SVD, so that an fp32 conversion on a GPU is the CPU's."""
        matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(matmul)
            torch.backends.cudnn.allow_tf32 = cudnn

    def to_record(self) -> dict:
        return {
            "device": str(self.device),
            "dtype": {
                "weights": _name(self.weights_dtype),
                "perplexity": _name(self.weights_dtype),
                "kv_measure": _name(self.weights_dtype),
                "suites": _name(self.dtype_for("suites")),
            },
            "rotary_inv_freq": "float32" if self.rotary_fp32 else "cast with the weights",
            "tf32": self.tf32,
        }


def cast_keeping_rotary(model, dtype: torch.dtype, *, keep_rotary_fp32: bool):
    """`model.to(dtype)` in place; with `keep_rotary_fp32` its rotary buffers keep their fp32 values (taken
    before the cast, so nothing is rounded and restored)."""
    kept = []
    if keep_rotary_fp32:
        for module in model.modules():
            for name in ROTARY_BUFFERS:
                buffer = module._buffers.get(name)
                if buffer is not None and buffer.dtype == torch.float32:
                    kept.append((module, name, buffer))
    if any(p.dtype != dtype for p in model.parameters()):  # as before: a model already in dtype is left as it is
        model.to(dtype)
    for module, name, buffer in kept:
        module._buffers[name] = buffer
    return model
