"""Load a saved MLA folder the way a stock tool does: a fresh interpreter in which `import mha2mla_exp` (and
triton, an optional dependency) raise ImportError, so only the folder's own code and `auto_map` can serve.

    python tests/remote_load.py FOLDER IDS.pt OUT.pt

writes the logits of IDS, greedy continuations (expanded and absorbed) and the cache class generate used.
`blocked_python(code)` runs any code under the same block (lm-eval's command line, for instance).
"""

from __future__ import annotations

import importlib.abc
import sys

BLOCKED = ("mha2mla_exp", "triton")


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: the folder must load without it")
        return None


def install_block() -> None:
    sys.meta_path.insert(0, _Block())


def main(folder: str, ids_path: str, out_path: str) -> None:
    install_block()
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert not any(name.split(".")[0] in BLOCKED for name in sys.modules), "a blocked package was imported"
    ids = torch.load(ids_path)
    out = {"class": f"{type(model).__module__}.{type(model).__name__}"}
    with torch.no_grad():
        out["logits"] = model(ids).logits
        for absorb in (False, True):
            model.set_absorb(absorb)
            gen = model.generate(ids[:1], max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
            out[f"greedy_absorb={absorb}"] = gen.sequences
            out["cache"] = type(gen.get("cache", gen.get("past_key_values"))).__name__
    torch.save(out, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])
