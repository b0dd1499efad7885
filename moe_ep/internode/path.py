"""The inter-node half of an ``EPBuffer`` (``group.node_size < world_size``): the proxy, its regions,
and the kernels that pack rows for remote peers and unpack what arrived (docs/ARCHITECTURE.md §10).

Node peers keep the store path (``kernels/dispatch.py``, ``kernels/combine.py``, with ``N`` the
node's ranks); ranks of other nodes are reached through this rank's proxy. A dispatch of epoch
``e`` is: the node send half; ``pack`` into the proxy's send buffer; the doorbell; the node flags
and ``disp_ready >= e``; the count matrix (every source's selections of each local expert, from
the round-1 headers); the node receive half (rows placed with the whole count matrix, so every
source, of any node, keeps the order (source rank, token, k)); ``unpack`` of the remote rows. A
combine: the node send half; ``combine_pack``; the doorbell; the node flags and ``comb_ready``;
the node receive half into a float32 sum; ``combine_unpack`` adds the remote owners' rows and
rounds once.

The kernels ring the doorbells (``ring``) and wait for the ready words (``wait_ready``) in the
mailbox, host memory the GPU maps, so no host call sits between the launches and a CUDA graph
replays the whole exchange; the epoch advances on the device. On a GPU the regions and the
mailbox are pinned host memory (the TCP transport reads and writes host memory; rows cross PCIe
once each way). Under the interpreter the host waits for the ready word first (a kernel cannot
spin there), then the same wait kernel looks once.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import BufferBrokenError
from . import launches as R_
from .session import default_private_capacity, start_proxy
from .spec import REGIONS, RemoteSpec, RemoteState


class RemotePath:
    """One rank's proxy, regions and device state for its peers on other nodes (``buf.remote``)."""

    def __init__(self, buf, private_capacity: Optional[int], overflow_capacity: Optional[int]):
        g, M, R, G = buf.group, buf.max_tokens, buf.world_size, buf.node_size
        if private_capacity is None:
            private_capacity = default_private_capacity(M, buf.topk, buf.num_experts, R)
        private_capacity = min(private_capacity, M)
        if overflow_capacity is None:
            overflow_capacity = (R - G) * (M - private_capacity)
        self.spec = RemoteSpec(rank=buf.rank, world=R, node_size=G, num_experts=buf.num_experts, topk=buf.topk,
                                  hidden=buf.hidden, max_tokens=M, fp8=buf.fp8, private_capacity=private_capacity,
                                  overflow_capacity=overflow_capacity, layout=buf.layout,
                                  expert_alignment=buf.expert_alignment,
                                  masked_capacity=buf.capacity if buf.layout == "masked" else None)
        self.state = RemoteState(self.spec, buf.device)
        kw = {k: v for k, v in self.spec.proxy_kwargs().items() if k != "node_size"}
        self.gpu = buf.device.type == "cuda"
        regions = mailbox = None
        if self.gpu:  # the proxy and the kernels share these: host memory the GPU addresses
            regions = {n: torch.zeros(max(16, b), dtype=torch.uint8, pin_memory=True)
                       for n, b in self.spec.region_bytes().items()}
            self.mailbox = torch.zeros(8, dtype=torch.int64, pin_memory=True)
            mailbox = self.mailbox.numpy()
        self.proxy = start_proxy(g, timeout_s=buf.timeout_s, regions=regions, mailbox=mailbox, **kw)
        if not self.gpu:  # the proxy allocated numpy arrays; the kernels see the same memory as tensors
            regions = {n: torch.from_numpy(getattr(self.proxy, n)) for n in REGIONS}
            self.mailbox = torch.from_numpy(self.proxy.mailbox)
        self.regions = regions
        self.timeout_s = buf.timeout_s
        self.programs = buf.num_programs
        self.combined = -1  # serial of the last dispatch combined (the proxy serves one combine each)

    # ------------------------------------------------------------------ dispatch
    def send(self, buf, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             x_scales: Optional[torch.Tensor], epoch: int) -> None:
        """Advances the device epoch (to ``epoch``, the host's count), packs this rank's rows for
        remote peers and rings the dispatch doorbell."""
        self.state.epoch.add_(1)  # on the device: a graph replay advances it too
        R_.pack(self.spec, self.state, x, topk_idx, topk_weights, self.regions["disp_send"], x_scales=x_scales,
                num_programs=self.programs, num_warps=buf.num_warps)
        R_.ring(self.state, self.mailbox, "dispatch")

    def wait(self, buf, phase: str, epoch: int) -> None:
        """The launches after this see what the proxy received for the current epoch. The
        proxy's errors (timeout naming the peer, lost peer, capacity) break the buffer; its own
        deadline runs out first, so its error, which names the peer, is the one raised. Under
        the interpreter the host waits (and raises) here; on a GPU the error comes at the next
        call or ``synchronize()``."""
        if buf.interp:
            try:
                self.proxy.wait_ready(phase, epoch, self.timeout_s + 5.0)
            except Exception as exc:  # noqa: BLE001
                buf.calls.fail(exc)
        R_.wait_ready(self.state, self.mailbox, buf.err, int((self.timeout_s + 5.0) * 1e9), phase)

    def count_matrix(self) -> torch.Tensor:
        """int32 [R, EL]: selections of each local expert from each source (after the dispatch wait)."""
        R_.fill_count_matrix(self.spec, self.state, self.regions["round1"])
        return self.state.sel

    def recv(self, buf) -> None:
        """Expands the remote sources' rows into the expert layout (rows layout: places them)."""
        if buf.layout == "rows":
            R_.unpack_rows(self.spec, self.state, self.regions["round1"], self.regions["overflow"], buf.expert_x,
                           buf.expert_scales, buf.recv_topk_idx, buf.recv_topk_weights, buf.recv_src,
                           num_programs=self.programs, num_warps=buf.num_warps)
            return
        R_.unpack(self.spec, self.state, self.regions["round1"], self.regions["overflow"], buf.expert_x,
                  buf.expert_scales, buf.expert_counts, buf.expert_offsets, num_programs=self.programs,
                  num_warps=buf.num_warps, scale_column_rows=buf.scale_column_rows)

    # ------------------------------------------------------------------ combine
    def combine_send(self, buf, expert_y: torch.Tensor, serial: int, epoch: int,
                     topk_weights: Optional[torch.Tensor] = None) -> None:
        """Pre-reduces the rows received from remote sources (rows layout: sends them back as they
        are, with ``topk_weights``) and rings the combine doorbell."""
        if serial == self.combined:
            raise ValueError("handle: already combined; over the inter-node path each dispatch is combined once "
                             "(dispatch again for another combine)")
        self.combined = serial
        R_.combine_pack(self.spec, self.state, expert_y, self.regions["comb_send"], num_programs=self.programs,
                        num_warps=buf.num_warps, topk_weights=topk_weights)
        R_.ring(self.state, self.mailbox, "combine")

    def combine_recv(self, buf, topk_idx: torch.Tensor, base: torch.Tensor, out: torch.Tensor,
                     wout: Optional[torch.Tensor] = None) -> None:
        """``out = bf16(base + the remote owners' rows)``; base float32 [T, H] (the node owners' sum),
        topk_idx [T, K] the dispatch's routing; rows layout: ``wout`` float32 [T, K] += the remote
        owners' combine weights."""
        R_.combine_unpack(self.spec, self.state, self.regions["comb_recv"], topk_idx, out, base=base,
                          num_programs=self.programs, num_warps=buf.num_warps, wout=wout)

    def check(self) -> None:
        """Raises the proxy's error, or one a remote kernel recorded (bad ids, rows beyond the send
        buffer). Both records are host memory: no device sync."""
        self.proxy.check_error()
        code = int(self.state.err_host[0])
        if code != 0:
            raise BufferBrokenError(f"rank {self.spec.rank}: inter-node kernel error record "
                                    f"{[int(v) for v in self.state.err_host[:5]]}")

    def close(self) -> None:
        self.proxy.close()
        self.proxy.engine.close()
