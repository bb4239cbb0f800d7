"""One KV-quantization check serves the MLA latent cache and the MHA baseline alike: what it accepts, both caches
quantize; what a backend cannot do is refused before any model work."""

from __future__ import annotations

import pytest
import torch

from mha2mla_exp.evaluation.kv import KVQuant, new_cache
from mha2mla_exp.mla import convert_to_mla
from mha2mla_exp.mla.cache import BACKEND_NBITS, cache_nbytes, check_kv_quant
from tests.conftest import tiny_causal_lm


@pytest.mark.parametrize("backend, nbits", [(b, n) for b, bits in BACKEND_NBITS.items() for n in bits])
def test_every_accepted_setting_quantizes_both_caches(backend, nbits):
    original = tiny_causal_lm("gqa")
    mla = convert_to_mla(original, rope="high", r=2, svd="joint", d_kv=8)
    ids = torch.randint(0, 97, (1, 160))
    setting = KVQuant(backend=backend, nbits=nbits, residual_length=16, q_group_size=32)
    for model in (original, mla):
        cache = new_cache(model, setting)
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
        full = new_cache(model, None)
        with torch.no_grad():
            model(input_ids=ids, cache=full, use_cache=True)
        assert 0 < cache_nbytes(cache) < cache_nbytes(full), (type(model).__name__, backend, nbits)


def test_what_no_backend_implements_is_refused():
    with pytest.raises(ValueError, match="kv_quant.nbits: 3 is not supported by quanto"):
        check_kv_quant("quanto", 3)
    with pytest.raises(ValueError, match="kv_quant.backend: unknown 'bnb'"):
        check_kv_quant("bnb", 4)
    with pytest.raises(ValueError, match="kv_quant.residual_length"):
        KVQuant(backend="hqq", nbits=4, residual_length=-1)
