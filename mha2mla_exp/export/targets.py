"""Where an export can be served: each target's MLA backends and the cache widths they accept, checked from the
export plan before anything is written (issue 54).

vLLM serves DeepSeek's MLA with one cached row per token and layer of kv_lora_rank + qk_rope_head_dim elements
(the backends' "head size"). What vLLM 0.32.0 accepts (its source):
- CPU: CPU_MLA (v1/attention/backends/mla/cpu_mla.py, `get_supported_head_sizes` -> [576]: "the CPU decode kernel
  only supports head_dim=576, v_head_dim=512") and AMX_MLA (amx_mla.py, [576]): kv_lora_rank 512 + rope 64 only.
  Other widths start the engine and die at the first request ("Head dimension 36 is not supported by MLA").
- GPU (v1/attention/backends/mla/): FlashMLA (flashmla.py) and FlashInfer MLA (flashinfer_mla.py) take
  MLACommonBackend's list (model_executor/layers/attention/mla_attention.py: [320, 512, 576]), FlashInfer MLA
  only with qk_nope_head_dim in {64, 128, 192}; CUTLASS MLA's kernel asserts latent 512 and rope 64
  (cutlass_mla.py); FlashAttention MLA takes [576] (flashattn_mla.py); Triton MLA lists none, so takes any width
  (triton_mla.py, `get_supported_head_sizes` -> []). So 512 + 64 fits every GPU backend, any other width only
  some (always Triton MLA): a warning, not a refusal.
- transformers: its DeepseekV3 attention takes any widths.
"""

from __future__ import annotations

from .plan import ExportError, ExportPlan

TARGETS = ("vllm-cpu", "vllm-gpu", "transformers")
# the widths every vLLM MLA backend takes, CPU and GPU: DeepSeek-V2/V3's own
SERVED_LATENT, SERVED_ROPE = 512, 64
GPU_COMMON_WIDTHS = (320, 512, 576)  # MLACommonBackend.get_supported_head_sizes (FlashMLA, FlashInfer MLA)
FLASHINFER_NOPE_DIMS = (64, 128, 192)


def _widths(plan: ExportPlan) -> str:
    return f"kv_lora_rank {plan.latent} + qk_rope_head_dim {plan.rope_dim} = {plan.latent + plan.rope_dim}"


def _nearest(config) -> str:
    return f"the nearest servable widths: {SERVED_LATENT} + {SERVED_ROPE}; {servable_conversion(config)}"


def gpu_backends(plan: ExportPlan) -> list[str]:
    """The vLLM GPU MLA backends that accept the plan's widths (see the module's docstring for the sources)."""
    width = plan.latent + plan.rope_dim
    backends = ["TRITON_MLA"]
    if width in GPU_COMMON_WIDTHS:
        backends.append("FLASHMLA")
        if plan.nope_dim in FLASHINFER_NOPE_DIMS:
            backends.append("FLASHINFER_MLA")
    if (plan.latent, plan.rope_dim) == (SERVED_LATENT, SERVED_ROPE):
        backends += ["CUTLASS_MLA", "FLASH_ATTN_MLA"]
    return sorted(backends)


def fitting_targets(plan: ExportPlan) -> list[str]:
    """The targets every one of whose MLA backends serves the plan's widths."""
    if (plan.latent, plan.rope_dim) == (SERVED_LATENT, SERVED_ROPE):
        return ["transformers", "vllm-cpu", "vllm-gpu"]
    return ["transformers"]


def servable_conversion(config) -> str:
    """The conversion of this source model that reaches kv_lora_rank 512 + rope 64, or why none does.

    rope=rorope-geometric keeps n_kv * r frequency pairs (rope key 2 n_kv r), distinct frequencies of a d_h-dim head
    (at most d_h / 2); svd joint/split keeps a latent of n_kv * d_kv."""
    n_kv, d_h = config.num_key_value_heads, config.head_dim
    pairs = SERVED_ROPE // 2
    why = []
    if pairs % n_kv or SERVED_LATENT % n_kv:
        why.append(f"{n_kv} KV heads do not divide {pairs} rope pairs and a {SERVED_LATENT} latent")
    if d_h // 2 < pairs:
        why.append(f"head_dim {d_h} has {d_h // 2} rope frequencies, a {SERVED_ROPE}-dim rope key needs {pairs}")
    if why:
        return f"no conversion of this model reaches {SERVED_LATENT} + {SERVED_ROPE}: {'; '.join(why)}"
    r, d_kv = pairs // n_kv, SERVED_LATENT // n_kv
    cell = " (the cell conf/cells/conversion/serve576.yaml)" if (r, d_kv) == (1, 16) else ""
    return f"convert with rope=rorope-geometric rope.r={r} svd=joint svd.d_kv={d_kv}{cell}"


def check_target(plan: ExportPlan, config, target: str) -> list[str]:
    """ExportError when `target` cannot serve the plan's widths (naming the widths it needs and the conversion of
    this model that reaches them); the warnings where only some of its backends can."""
    if target not in TARGETS:
        raise ExportError(f"target {target!r}: one of {', '.join(TARGETS)}")
    if target == "vllm-cpu" and (plan.latent, plan.rope_dim) != (SERVED_LATENT, SERVED_ROPE):
        raise ExportError(
            f"vllm-cpu serves MLA with kv_lora_rank {SERVED_LATENT} + qk_rope_head_dim {SERVED_ROPE} only "
            f"(vLLM's CPU_MLA / AMX_MLA); this export has {_widths(plan)}: {_nearest(config)}"
        )
    if target == "vllm-gpu" and (plan.latent, plan.rope_dim) != (SERVED_LATENT, SERVED_ROPE):
        return [f"vllm-gpu: {_widths(plan)} runs on {', '.join(gpu_backends(plan))} only; {_nearest(config)}"]
    return []
