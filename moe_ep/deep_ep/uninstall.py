"""``python -m moe_ep.deep_ep.uninstall [--target DIR]``: removes the forwarding ``deep_ep``
package that ``python -m moe_ep.deep_ep.install`` wrote."""
import sys

from .install import main

if __name__ == "__main__":
    sys.exit(main(remove=True))
