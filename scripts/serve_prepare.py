"""Build the models scripts/serve_bench.py serves (main venv): a random Llama with Llama-2-7B's attention shape
(hidden 4096, 32 x 128 heads, MLP 11008, vocab 32000) and a few layers, converted with the 576-element conversion
(conf/cells/conversion/serve576.yaml) and exported to DeepSeek-V3; plus our model's prompt log-probabilities.

    python scripts/serve_prepare.py [--layers 2] [--out runs/serve]

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

from mha2mla_exp.export import export
from mha2mla_exp.mla.convert import convert_to_mla
from mha2mla_exp.models import build_random_model
from mha2mla_exp.schema.sections import ModelConfig, ShapeConfig

CELL = Path(__file__).resolve().parents[1] / "conf/cells/conversion/serve576.yaml"
PROMPT_LENGTHS = (16, 64, 256)


def conversion_options() -> dict:
    """convert_to_mla's arguments from the conversion cell (one source for the runner and this script)."""
    cell = yaml.safe_load(CELL.read_text())
    rope, svd = cell["rope"], cell["svd"]
    return {"rope": rope["strategy"], "r": rope["r"], "svd": svd["method"], "d_kv": svd["d_kv"]}


@torch.no_grad()
def token_logprobs(model, ids: list[int]) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1."""
    x = torch.tensor([ids])
    logp = torch.log_softmax(model(input_ids=x, use_cache=False).logits.float(), dim=-1)[0, :-1]
    return logp.gather(-1, x[0, 1:, None])[:, 0].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default="runs/serve")
    args = parser.parse_args()
    out = Path(args.out)
    t0 = time.time()
    shape = ShapeConfig(
        num_layers=args.layers,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        rope_base=10000,
        context_length=32768,
    )
    cfg = ModelConfig(
        name="llama2-7b-shape", source="random", dtype="float32", shape=shape, vocab_size=32000, intermediate_size=11008
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
    mla = convert_to_mla(model, calibration=calibration, **conversion_options()).eval()
    prompts = [torch.randint(1, 257, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    fp32 = [token_logprobs(mla, p) for p in prompts]
    mla.to(torch.bfloat16).save_pretrained(out / "converted")
    tokenizer.save_pretrained(out / "converted")
    bf16 = [token_logprobs(mla, p) for p in prompts]
    del mla, model

    record = export(out / "converted", out / "export")
    reference = {"prompts": prompts, "logprobs_bf16": bf16, "logprobs_fp32": fp32, "model": "converted (ours)"}
    (out / "export" / "reference_logprobs.json").write_text(json.dumps(reference))
    summary = {k: record[k] for k in ("plan", "norm", "verification", "cache_elements_per_token")}
    print(json.dumps(summary | {"seconds": round(time.time() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
