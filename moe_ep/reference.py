"""The pure-torch oracle's public name: ``moe_ep.reference`` is ``moe_ep.testing.reference``."""
from .testing.reference import *  # noqa: F401,F403
