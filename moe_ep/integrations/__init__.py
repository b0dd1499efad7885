"""Adapters that put ``moe_ep.MoELayer`` into models of other libraries (``hf``: HF transformers)."""
