"""Commands a user runs: ``python -m moe_ep.doctor`` and ``python -m moe_ep.demo``."""
