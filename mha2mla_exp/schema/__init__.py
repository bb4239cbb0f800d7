"""The run config's schema (sections), how an option is declared (fields), the run identity computed from it
(identity) and its registration with Hydra (store)."""
