"""Hydra's basic sweeper plus non-cartesian rows: an experiment declares its grid as named rows of overrides."""
