"""A KV budget per token and layer, split between the shared rope key and the latent by measurement.

Under `kv_elements` = B, layer i keeps K_i rotated pairs (one rope key of 2*K_i dims shared by every query
head, RoRoPE's layout) and a joint latent of B - 2*K_i dims: exactly B cached elements per token in every
layer, whatever the split. MHA2MLA's r / d_kv can only express K = n_kv*r and a latent of n_kv*d_kv
(SmolLM: 72 = 24 + 48 or 30 + 42); TransMLA's best points give the rope key more (32 + 40).

`rope_pairs` fixes K for every layer. Left null, each layer searches: for every K that `budget_pair_range`
allows (every other count, then the neighbours of the best) and every weighting the low-rank init offers, the
layer is built and run on the calibration inputs, and the candidate whose attention output (W_o included) is
closest to the ORIGINAL layer's (full RoPE, full rank) is kept. Dropping RoPE and dropping rank are paid in
the same currency, per layer; the converted config's `mla.budget_split` states what each layer chose and the
relative error it measured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import nn

from .calibration import Calibration
from .layouts import RotatedPairs
from .lowrank_init import LOWRANK_INITS, LayerProblem
from .rope import ROPE_STRATEGIES
from .spec import MLASpec, ModelShape, budget_pair_range

log = logging.getLogger(__name__)


@dataclass
class LayerSplit:
    """One layer's choice under the budget: its rope selection, the latent, and what was measured."""

    selection: RotatedPairs
    latent: object            # convert.Latent
    error: float              # squared output distance to the original layer, relative to its output energy

    def report(self) -> dict:
        return {"rope_pairs": len(self.selection.kept), "latent": self.latent.width,
                "init": self.latent.choice or None, "relative_error": round(self.error, 6)}


def split_budget(model: nn.Module, spec: MLASpec, calib: Calibration) -> list[LayerSplit]:
    """Every layer's split of `spec.kv_elements` (see the module docstring)."""
    from .convert import build_mla_config, latent_for  # convert imports this module

    shape = ModelShape.from_config(model.config)
    ranked = ROPE_STRATEGIES.get(spec.rope).ranked(shape, spec.score, calib)
    init = LOWRANK_INITS.get(spec.init)
    meter = OriginalMeter(model, calib)
    allowed = budget_pair_range(shape, spec.kv_elements)
    chosen = []
    for i, attn in enumerate(layer.self_attn for layer in model.model.layers):
        u, order = ranked[i]
        tried: dict[int, LayerSplit] = {}

        def best_at(k: int) -> LayerSplit:
            if k not in tried:
                selection = RotatedPairs(u, order[:k])
                split = selection.split(attn, shape)
                problem = LayerProblem(i, split, attn.v_proj.weight, attn.o_proj.weight, shape)
                width = spec.kv_elements - 2 * k
                config = build_mla_config(model, spec, [split] * shape.num_layers, [width] * shape.num_layers)
                weightings = init.weightings(problem, calib)
                options = [latent_for(problem, w, width, spec) for w in weightings]
                errors = [meter.error(i, config, split, latent, spec) for latent in options]
                best = errors.index(min(errors))
                latent = options[best] if len(options) == 1 else replace(options[best], choice=weightings[best].label)
                tried[k] = LayerSplit(selection, latent, errors[best])
            return tried[k]

        if spec.rope_pairs is not None:
            chosen.append(best_at(spec.rope_pairs))
        else:
            coarse = list(allowed[::2]) + ([allowed[-1]] if (len(allowed) - 1) % 2 else [])
            best = min(coarse, key=lambda k: best_at(k).error)
            for k in (best - 1, best + 1):
                if k in allowed:
                    best_at(k)
            chosen.append(min(tried.values(), key=lambda s: s.error))
        log.info("KV budget %d, layer %d/%d: %s (%d splits measured)", spec.kv_elements, i + 1,
                 shape.num_layers, chosen[-1].report(), len(tried))
    return chosen


class OriginalMeter:
    """Squared distance, summed over the calibration sample (`attention_inputs`), between a candidate MLA layer's
    attention output and the original layer's, divided by the original output's energy."""

    def __init__(self, model: nn.Module, calib: Calibration):
        self.inputs, self.rotary = calib.get("attention_inputs")
        self.sources = [layer.self_attn for layer in model.model.layers]
        self.references: dict[int, tuple[list[torch.Tensor], float]] = {}

    @torch.no_grad()
    def _run(self, attn: nn.Module, layer: int) -> list[torch.Tensor]:
        device, dtype = attn.o_proj.weight.device, attn.o_proj.weight.dtype
        outputs = []
        for x, (cos, sin) in zip(self.inputs[layer], self.rotary):
            t = x.shape[1]
            causal = torch.full((t, t), float("-inf"), device=device).triu(1)[None, None]
            out = attn(x.to(device=device, dtype=dtype), (cos.to(device), sin.to(device)), attention_mask=causal)[0]
            outputs.append(out.double())
        return outputs

    def error(self, layer: int, config, split, latent, spec: MLASpec) -> float:
        from .convert import attention_weights
        from .modeling import MLAAttention

        if layer not in self.references:
            reference = self._run(self.sources[layer], layer)
            self.references[layer] = reference, sum(float((r**2).sum()) for r in reference)
        reference, energy = self.references[layer]
        source = self.sources[layer]
        attn = MLAAttention(config, layer).to(device=source.q_proj.weight.device, dtype=source.q_proj.weight.dtype)
        attn.load_state_dict(attention_weights(source, split, spec, latent))
        attn.reset_buffers(source.q_proj.weight.device)
        distance = sum(float(((a - b) ** 2).sum()) for a, b in zip(self._run(attn, layer), reference))
        return distance / max(energy, 1e-30)
