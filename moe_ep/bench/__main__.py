"""``python -m moe_ep.bench`` (under torchrun): the bench CLI, same as the ``moe-ep-bench`` command."""
import sys

from .cli import main

sys.exit(main())
