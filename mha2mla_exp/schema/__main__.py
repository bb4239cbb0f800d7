"""`python -m mha2mla_exp.schema`: print every option (docs/CONFIG.md)."""

from .reference import options_reference

print(options_reference(), end="")
