"""Export a converted model to stock DeepSeek-V3 format: transformers loads it without remote code and vLLM serves
it with its MLA latent cache (docs/SERVING.md). `python -m mha2mla_exp.export SRC OUT`.

- `plan.py`: what a converted config can be exported as, checked before any weight is read (refusals name why).
- `weights.py`: the DeepSeek-V3 config and weights from an MLA model (the mapping, one function each).
- `norm.py`: DeepSeek's latent RMSNorm made an identity by scale, measured on calibration tokens.
- `run.py`: load, map, save, verify the logits, write `export.json` beside the weights.

The export never imports vllm: the engine lives in its own environment (scripts/serve_bench.py).
"""

from .plan import ExportError, ExportPlan, plan_export
from .run import export

__all__ = ["ExportError", "ExportPlan", "export", "plan_export"]
