"""What each transport on this machine does with a region in GPU memory and in pinned host memory.

For every transport that can open here (native TCP, each libfabric provider with an FI_EP_RDM
endpoint, verbs on each RDMA device), one engine is created and asked whether it could register
(``Engine.try_register``: tried and released at once) a CUDA tensor and a pinned host tensor; the
answer and the engine's reason are printed as a table, and as JSON with ``--json``. This is what
``EPBuffer(proxy_memory="auto")`` decides each row region's place from (docs/ARCHITECTURE.md §10).

    python scripts/region_probe.py            # needs a CUDA GPU
    python scripts/region_probe.py --json out.json
"""
import argparse
import json

import torch

from moe_ep.native import probes, transports


def _engines():
    """(name, factory) for every transport that may open here."""
    yield "tcp", lambda: transports.TcpTransport(0, 2, streams=1)
    info = probes.fabric_providers()
    seen = set()
    for e in info.get("entries", []):
        if e.get("ep_type") not in (None, "FI_EP_RDM") or e["provider"] in seen:
            continue
        seen.add(e["provider"])
        yield f"libfabric {e['provider']}", lambda p=e["provider"]: transports.FabricTransport(0, 2, provider=p)
    for dev in probes.rdma_devices().get("devices", []):
        name = dev["name"] if isinstance(dev, dict) else str(dev)
        yield f"verbs {name}", lambda d=name: transports.VerbsTransport(0, 2, device=d)


def probe(nbytes: int = 1 << 20) -> list[dict]:
    """One row per transport: ``{"transport", "gpu": (ok, how), "pinned": (ok, how)}`` or
    ``{"transport", "error"}`` where the engine cannot be created."""
    dev = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.zeros(nbytes, dtype=torch.uint8).pin_memory()
    rows = []
    for name, make in _engines():
        try:
            eng = make()
        except Exception as e:  # a provider listed but not openable: say so, keep going
            rows.append({"transport": name, "error": f"{type(e).__name__}: {e}"})
            continue
        try:
            rows.append({"transport": name, "gpu": eng.try_register(dev), "pinned": eng.try_register(host)})
        finally:
            eng.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("region_probe: needs a CUDA GPU")
    fab = probes.fabric_providers()
    print(f"libfabric: {fab.get('library_version', fab.get('error'))}; "
          f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    rows = probe()
    print(f"{'transport':<28} {'GPU memory':<48} pinned host")
    for r in rows:
        if "error" in r:
            print(f"{r['transport']:<28} cannot open: {r['error']}")
            continue
        g = ("yes: " if r["gpu"][0] else "no: ") + r["gpu"][1]
        h = ("yes: " if r["pinned"][0] else "no: ") + r["pinned"][1]
        print(f"{r['transport']:<28} {g:<48} {h}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"libfabric": fab.get("library_version"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
