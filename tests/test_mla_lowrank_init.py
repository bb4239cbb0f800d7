"""Low-rank inits (weight, activation, bkv, output) and per-layer rank allocation: exact at full rank, each
optimal on the objective it minimises (computed here from first principles, not from the package's
statistics), and the statistics the output-aware init reads agree with a brute-force computation."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_causal_lm

from mha2mla_exp.mla import LOWRANK_INITS, LatentCache, LowRankInit, ModelShape, convert_to_mla, max_d_kv
from mha2mla_exp.mla.calibration import Calibration
from mha2mla_exp.mla.lowrank_init.output import OutputAware


class DerivedOutputWeighting(LowRankInit):
    """The output init's derived weighting alone (no measured balance), as an init of its own."""

    name = "test-output-derived"
    statistics = ("input_gram", "query_moments", "value_spread")

    def weighting(self, problem, calibration):
        return OutputAware().derived(problem, calibration)


def calibration_tokens(seed: int = 3, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (2, 20), generator=g) for _ in range(n)]


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def layer_inputs(model, calib) -> list[torch.Tensor]:
    """Per layer, the attention input x (the input-normed hidden states), every calibration token [N, d]."""
    per_layer = [[] for _ in model.model.layers]
    for ids in calib:
        hidden = model(ids, output_hidden_states=True).hidden_states
        for i, layer in enumerate(model.model.layers):
            per_layer[i].append(layer.input_layernorm(hidden[i]).reshape(-1, hidden[i].shape[-1]))
    return [torch.cat(x).double() for x in per_layer]


@torch.no_grad()
def value_spread_brute_force(model, calib) -> torch.Tensor:
    """tau[l, h] from the eager attention probabilities transformers returns."""
    implementation, model.config._attn_implementation = model.config._attn_implementation, "eager"
    shape = ModelShape.from_config(model.config)
    n_h, n_kv, d_h = shape.num_heads, shape.num_kv_heads, shape.head_dim
    total, count = torch.zeros(shape.num_layers, n_h, dtype=torch.float64), 0
    for ids in calib:
        out = model(ids, output_hidden_states=True, output_attentions=True)
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(out.hidden_states[i])
            v = attn.v_proj(x).view(*ids.shape, n_kv, d_h).transpose(1, 2).repeat_interleave(n_h // n_kv, 1)
            w_o = attn.o_proj.weight.view(-1, n_h, d_h)
            u = torch.einsum("dhe,bhse->bhsd", w_o, v).double()  # W_o,h v_s
            p = out.attentions[i].double()
            o = p @ u
            total[i] += (torch.einsum("bhts,bhsd->bht", p, u**2) - (o**2).sum(-1)).sum(dim=(0, 2))
        count += ids.numel()
    model.config._attn_implementation = implementation
    return total / count


def test_value_spread_statistic_matches_brute_force():
    model = tiny_causal_lm("qwen2")  # biases in q/k/v
    calib = calibration_tokens()
    shape = ModelShape.from_config(model.config)
    tau = Calibration(model, calib, shape).get("value_spread")
    expected = value_spread_brute_force(model, calib)
    assert tau.shape == (shape.num_layers, shape.num_heads) and (tau > 0).all()
    assert torch.allclose(tau, expected, rtol=1e-4, atol=1e-8)


@torch.no_grad()
def seen_maps(mla, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The NoPE keys the query heads meet [n_kv*nope_dim, d] and the values [n_kv*d_h, d] of one layer of a
    converted model, as linear maps of the attention input (biases aside)."""
    a = mla.model.layers[layer].self_attn
    down = a.kv_down_proj.weight.double()
    k, v = down[a.k_latent], down[a.v_latent]
    if a.k_up_proj is not None:
        k = a.k_up_proj.weight.double() @ k
    if a.v_up_proj is not None:
        v = a.v_up_proj.weight.double() @ v
    return k, v


def _sqrt_psd(m: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh(m)
    return (vectors * values.clamp_min(0).sqrt()) @ vectors.T


@torch.no_grad()
def objectives(original, full_rank, mla, calib, rank: int | None = None) -> dict[str, float]:
    """Both objectives of a truncation `mla` against the full-rank conversion with the same RoPE selection:
    activation-aware: E||dK x||^2 + E||dV x||^2; output-aware: per group g, E[s^2 tau_h (q_h . dK_g x)^2]
    summed over its query heads plus E||W_o,h dV_g x||^2 summed likewise (q: the NoPE query the heads use).
    With `rank`, also each objective's optimum over all rank-`rank` truncations (Eckart-Young on the
    weighted rows, weights built here), as "<name>_optimum"."""
    shape = ModelShape.from_config(original.config)
    n_h, n_kv, d_h = shape.num_heads, shape.num_kv_heads, shape.head_dim
    group = n_h // n_kv
    tau = value_spread_brute_force(original, calib)
    inputs = layer_inputs(original, calib)
    result = dict.fromkeys(("activation", "output", "activation_optimum", "output_optimum"), 0.0)
    for i, x in enumerate(inputs):
        gram = x.T @ x / len(x)
        (k_ref, v_ref), (k, v) = seen_maps(full_rank, i), seen_maps(mla, i)
        dk, dv = k - k_ref, v - v_ref
        attn = full_rank.model.layers[i].self_attn
        q = attn.q_proj(x.float()).view(len(x), 1, n_h, d_h).transpose(1, 2)
        q_nope = attn._split_query(q)[1].squeeze(2).transpose(0, 1).double()  # [n_h, N, nope_dim]
        w_o = original.model.layers[i].self_attn.o_proj.weight.double().view(-1, n_h, d_h)
        k_weight = [
            sum(tau[i, h] / d_h * q_nope[h].T @ q_nope[h] / len(x) for h in range(g * group, (g + 1) * group))
            for g in range(n_kv)
        ]
        v_weight = [sum(w_o[:, h].T @ w_o[:, h] for h in range(g * group, (g + 1) * group)) for g in range(n_kv)]
        output_weight = torch.block_diag(*k_weight, *v_weight)
        delta = torch.cat([dk, dv])
        result["activation"] += torch.trace(delta @ gram @ delta.T).item()
        result["output"] += torch.trace(delta.T @ output_weight @ delta @ gram).item()
        if rank is not None:
            target, root = torch.cat([k_ref, v_ref]), _sqrt_psd(gram)
            for name, left in (("activation", torch.eye(len(target), dtype=torch.float64)), ("output", output_weight)):
                s = torch.linalg.svdvals(_sqrt_psd(left) @ target @ root)
                result[f"{name}_optimum"] += (s[rank:] ** 2).sum().item()
    return result


@pytest.mark.parametrize("rope", ["uniform", "rorope"])
@pytest.mark.parametrize("init", sorted(LOWRANK_INITS))
def test_every_init_is_exact_at_full_rank(rope, init, tokens):
    model = tiny_causal_lm("qwen2")
    calib = calibration_tokens()
    shape = ModelShape.from_config(model.config)
    ref = convert_to_mla(model, rope=rope, r=2, svd="none", calibration=calib)(tokens).logits
    full = convert_to_mla(
        model, rope=rope, r=2, svd="joint", d_kv=max_d_kv(shape, 2, "joint"), init=init, calibration=calib
    )
    assert max_diff(full(tokens).logits, ref) < 1e-4
    assert full.config.mla["init"] == init


@pytest.mark.parametrize("rope", ["uniform", "rorope"])
def test_each_weighting_reaches_the_optimum_of_its_objective_and_beats_the_others_there(rope):
    model = tiny_causal_lm("gqa", layers=2)
    calib = calibration_tokens()
    full_rank = convert_to_mla(model, rope=rope, r=2, svd="none", calibration=calib)
    inits = ("weight", "activation", "bkv", "test-output-derived")
    for d_kv in (2, 6, 12):
        scores = {
            init: objectives(
                model,
                full_rank,
                convert_to_mla(model, rope=rope, r=2, svd="joint", d_kv=d_kv, init=init, calibration=calib),
                calib,
                2 * d_kv,
            )
            for init in inits
        }
        optimum, derived = scores["weight"], scores["test-output-derived"]
        assert derived["output"] == pytest.approx(optimum["output_optimum"], rel=1e-5), d_kv
        assert scores["activation"]["activation"] == pytest.approx(optimum["activation_optimum"], rel=1e-5), d_kv
        for other in inits:
            assert derived["output"] <= scores[other]["output"] * (1 + 1e-6), (d_kv, other, scores)
            assert scores["activation"]["activation"] <= scores[other]["activation"] * (1 + 1e-6), (d_kv, other)
        assert derived["output"] < scores["activation"]["output"] * 0.999  # it does change the result


@torch.no_grad()
def attention_output_errors(original, full_rank, mla, calib) -> list[float]:
    """Per layer, sum over the calibration tokens of ||attn_mla(x) - attn_full_rank(x)||^2 (W_o included),
    x the original model's attention inputs, each layer run through the models' own modules."""
    errors = []
    for i, layer in enumerate(original.model.layers):
        total = 0.0
        for ids in calib:
            hidden = original(ids, output_hidden_states=True).hidden_states[i]
            x = layer.input_layernorm(hidden)
            rotary = full_rank.model.rotary_emb(x, torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1))
            t = ids.shape[1]
            causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
            outs = [m.model.layers[i].self_attn(x, rotary, attention_mask=causal)[0] for m in (mla, full_rank)]
            total += ((outs[0] - outs[1]).double() ** 2).sum().item()
        errors.append(total)
    return errors


@pytest.mark.parametrize("rope, svd", [("uniform", "joint"), ("rorope", "joint"), ("rorope", "split")])
def test_output_init_is_never_worse_than_activation_or_bkv_on_the_attention_output(rope, svd):
    model = tiny_causal_lm("qwen2", layers=2)
    calib = calibration_tokens()
    full_rank = convert_to_mla(model, rope=rope, r=2, svd="none", calibration=calib)
    for d_kv in (2, 6):
        errors = {
            init: attention_output_errors(
                model,
                full_rank,
                convert_to_mla(model, rope=rope, r=2, svd=svd, d_kv=d_kv, init=init, calibration=calib),
                calib,
            )
            for init in ("activation", "bkv", "output")
        }
        for layer, error in enumerate(errors["output"]):
            for other in ("activation", "bkv"):
                assert error <= errors[other][layer] * (1 + 1e-5), (d_kv, layer, other, errors)


@torch.no_grad()
def test_global_allocation_keeps_the_total_and_lowers_the_objective(tmp_path, tokens):
    model = tiny_causal_lm("gqa", layers=4)
    with torch.no_grad():  # layers of very different scale: the allocation must notice
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.v_proj.weight.mul_(0.3 * (i + 1))
    calib = calibration_tokens()
    full_rank = convert_to_mla(model, rope="high", r=2, svd="none")
    init = "test-output-derived"  # each layer optimal for the objective the allocation sums
    uniform = convert_to_mla(model, rope="high", r=2, svd="joint", d_kv=6, init=init, calibration=calib)
    spread = convert_to_mla(
        model, rope="high", r=2, svd="joint", d_kv=6, init=init, allocation="global", calibration=calib
    )
    widths = [layer.self_attn.latent_dim for layer in spread.model.layers]
    assert sum(widths) == 4 * 2 * 6 and len(set(widths)) > 1 and spread.config.latent_dims == widths
    assert (
        objectives(model, full_rank, spread, calib)["output"] < objectives(model, full_rank, uniform, calib)["output"]
    )

    cache = LatentCache()
    spread.generate(tokens[:1], max_new_tokens=4, do_sample=False, cache=cache)
    t = tokens.shape[1] + 3
    assert cache.nbytes() == t * (4 * 2 * 2 * 2 + sum(widths)) * 4  # rope keys + the allocated latents, fp32
    spread.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.latent_dims == widths
    assert max_diff(loaded(tokens).logits, spread(tokens).logits) == 0


@pytest.mark.parametrize("sigma", ["up", "sqrt"])
def test_factors_split_each_direction_as_plain_svd_does_whatever_the_statistics_scale(sigma):
    """AdamW moves every entry by ~lr: the factors a fine-tune starts from must not depend on whether a Gram is
    summed or averaged over calibration tokens (it shrank `down` by sqrt(tokens) before)."""
    from mha2mla_exp.mla.lowrank import weighted_svd

    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(24, 16, generator=g), torch.randn(500, 16, generator=g) * 3
    gram, left = x.T @ x, (lambda a: a @ a.T)(torch.randn(24, 24, generator=g))
    plain_down, plain_up = weighted_svd(weight).factors(6, sigma)
    down, up = weighted_svd(weight, left, gram).factors(6, sigma)
    scaled_down, scaled_up = weighted_svd(weight, 1e3 * left, gram / 500).factors(6, sigma)
    torch.testing.assert_close(scaled_down, down, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(scaled_up, up, rtol=1e-4, atol=1e-5)
    if sigma == "up":  # the paper's convention: unit rows in down, the gain in up
        torch.testing.assert_close(down.norm(dim=1), torch.ones(6), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(plain_down.norm(dim=1), torch.ones(6), rtol=1e-5, atol=1e-5)
    else:  # equal norms on both sides of every direction
        torch.testing.assert_close(down.norm(dim=1), up.norm(dim=0), rtol=1e-5, atol=1e-5)
    u, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)
    torch.testing.assert_close((plain_up @ plain_down).double(), (u[:, :6] * s[:6]) @ vh[:6], rtol=1e-5, atol=1e-5)
