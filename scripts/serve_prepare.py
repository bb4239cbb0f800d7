"""Build the models scripts/serve_bench.py serves (main venv): a random Llama with Llama-2-7B's attention shape
(hidden 4096, 32 x 128 heads, MLP 11008, vocab 32000) and a few layers, converted with the 576-element conversion
(conf/cells/conversion/serve576.yaml) and exported to DeepSeek-V3 (--target vllm-cpu); plus our model's prompt
log-probabilities. About 14 min on 2 busy cores (docs/SERVING.md); `--shape small` (8 x 64 heads, the same
512 + 64 cache widths by r = 4, d_kv = 64) takes about a minute, for trying the recipe.

    python scripts/serve_prepare.py [--layers 2] [--shape llama2-7b|small] [--out runs/serve]

writes OUT/original (Llama, bf16), OUT/converted (our MLA model, bf16, remote code), OUT/export (DeepSeek-V3, bf16,
export.json) and OUT/export/reference_logprobs.json: the prompts' token ids and each token's log-probability
under our MLA model in bf16 and in fp32 (the tolerance: bf16's own rounding of our model).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import yaml

from mha2mla_exp.atomic import write_json
from mha2mla_exp.export import export
from mha2mla_exp.mla.convert import convert_to_mla
from mha2mla_exp.models import build_random_model
from mha2mla_exp.schema.sections import ModelConfig, ShapeConfig

CELL = Path(__file__).resolve().parents[1] / "conf/cells/conversion/serve576.yaml"
PROMPT_LENGTHS = (16, 64, 256)


SHAPES = {  # (hidden, heads = KV heads, head_dim, MLP, vocab)
    "llama2-7b": (4096, 32, 128, 11008, 32000),
    "small": (512, 8, 64, 1024, 32000),
}


def conversion_options(num_kv_heads: int) -> dict:
    """convert_to_mla's arguments: the conversion cell's (one source for the runner and this script), its rope
    pairs and latent (32 x 1 pairs, 32 x 16 latent: 512 + 64) spread over `num_kv_heads` KV heads."""
    cell = yaml.safe_load(CELL.read_text())
    rope, svd = cell["rope"], cell["svd"]
    pairs, latent = 32 * rope["r"], 32 * svd["d_kv"]  # the cell is written for Llama-2-7B's 32 KV heads
    r, d_kv = pairs // num_kv_heads, latent // num_kv_heads
    return {"rope": rope["strategy"], "r": r, "svd": svd["method"], "d_kv": d_kv}


@torch.no_grad()
def token_logprobs(model, ids: list[int]) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1."""
    x = torch.tensor([ids])
    logp = torch.log_softmax(model(input_ids=x, use_cache=False).logits.float(), dim=-1)[0, :-1]
    return logp.gather(-1, x[0, 1:, None])[:, 0].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shape", choices=SHAPES, default="llama2-7b")
    parser.add_argument("--out", default="runs/serve")
    args = parser.parse_args()
    out = Path(args.out)
    t0 = time.time()
    hidden, heads, head_dim, mlp, vocab = SHAPES[args.shape]
    shape = ShapeConfig(
        num_layers=args.layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        rope_base=10000,
        context_length=32768,
    )
    cfg = ModelConfig(
        name=f"{args.shape}-shape",
        source="random",
        dtype="float32",
        shape=shape,
        vocab_size=vocab,
        intermediate_size=mlp,
    )
    model, tokenizer = build_random_model(cfg)
    with torch.no_grad():  # untied (Llama-2-7B's head is its own); random init's std 0.02 kept
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.clone())
    model.config.tie_word_embeddings = False
    model.eval()
    model.to(torch.bfloat16).save_pretrained(out / "original")
    tokenizer.save_pretrained(out / "original")
    model.float()

    g = torch.Generator().manual_seed(0)
    calibration = [torch.randint(0, 256, (8, 256), generator=g) for _ in range(4)]  # byte tokens
    mla = convert_to_mla(model, calibration=calibration, **conversion_options(heads)).eval()
    prompts = [torch.randint(1, 257, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    fp32 = [token_logprobs(mla, p) for p in prompts]
    mla.to(torch.bfloat16).save_pretrained(out / "converted")
    tokenizer.save_pretrained(out / "converted")
    bf16 = [token_logprobs(mla, p) for p in prompts]
    del mla, model

    record = export(out / "converted", out / "export", target="vllm-cpu")
    reference = {"prompts": prompts, "logprobs_bf16": bf16, "logprobs_fp32": fp32, "model": "converted (ours)"}
    write_json(out / "export" / "reference_logprobs.json", reference, indent=None)
    summary = {k: record[k] for k in ("plan", "norm", "verification", "cache_elements_per_token", "targets")}
    print(json.dumps(summary | {"seconds": round(time.time() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
