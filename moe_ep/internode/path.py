"""The inter-node half of an ``EPBuffer`` (``group.node_size < world_size``): the proxy, its regions,
and the arguments of the kernel each op launches across nodes (docs/ARCHITECTURE.md §10).

A dispatch is two launches of ``internode_dispatch_kernel``, as the node path's halves: the send
half (headers and rows for remote peers, each peer's bell rung as soon as its rows are packed,
then the node stores) and the receive half (once every header is in, the node peers' rows placed
with the whole count matrix, then each remote source's rows as they land); one launch doing both
where every program is resident and ``Tuning.fused_internode`` asks for it. A combine likewise
(``internode_combine_kernel``). With a receive hook the receive half is what the hook launches.
``moe_ep.ops.dispatch`` and ``moe_ep.ops.combine`` launch them through the buffer's ``Launcher``,
so they have native launch plans and replay like node calls.

The kernels ring the bells and wait for the ready words in the mailbox, host memory the GPU maps,
so no host call sits between the launches and a CUDA graph replays the whole exchange. On a GPU
the five row regions are GPU memory where the transport registers it (verbs: dma-buf or
nvidia-peermem; libfabric: FI_HMEM_CUDA), so the NIC reads and writes rows where the kernels
pack and unpack them; else pinned host memory (tcp: the CPU moves the bytes; rows then cross
PCIe once each way). The header regions and the mailbox are always pinned host memory: the
proxy reads them. Under the interpreter the host waits for the headers (and the node flags)
between the halves; the receive half waits for each source's rows itself.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, NoReturn, Optional

import torch

from ..core.errors import CommTimeoutError
from ..core.workspace import pow2
from ..native.library import NativeError
from ..native.protocol import MAILBOX, mailbox_words
from .mailbox import LOOK_NS, PROXY_GRACE_NS
from .session import start_proxy
from .spec import PROXY_MEMORY, REGIONS, ROW_REGIONS, RemoteSpec, RemoteState  # noqa: F401  (PROXY_MEMORY: importable here too)

if TYPE_CHECKING:
    from ..core.group import EPGroup


def row_region_memory(engine, sizes: dict, device: torch.device, want: str) -> tuple[dict, str, str]:
    """The five row regions of a GPU rank (``sizes``: bytes to allocate by name, as
    ``RemoteSpec.region_sizes`` gives them) for ``engine``: GPU memory
    on ``device`` where ``engine.try_register`` takes it and ``want`` is ``"auto"`` or ``"gpu"``,
    else pinned host memory. Returns ``(regions, "gpu" | "host", how or why)``; ``want="gpu"``
    where the engine cannot raises ``NativeError`` saying why."""
    if want != "host":
        rows = {n: torch.zeros(sizes[n], dtype=torch.uint8, device=device) for n in ROW_REGIONS}
        if torch.device(device).type == "cuda":  # zeroed before a NIC can write them
            torch.cuda.current_stream(device).synchronize()
        ok, how = engine.try_register(rows["round1"])
        if ok:
            return rows, "gpu", how
        del rows
        if want == "gpu":
            raise NativeError(f"rank {engine.rank}: proxy_memory='gpu', but the {engine.transport} engine cannot "
                              f"register GPU memory here: {how}")
        why = how
    else:
        why = "proxy_memory='host'"
    return {n: torch.zeros(sizes[n], dtype=torch.uint8, pin_memory=True) for n in ROW_REGIONS}, "host", why


class RemotePath:
    """One rank's proxy, regions and device state for its peers on other nodes (``BufferMemory.remote``)."""

    def __init__(self, group: "EPGroup", spec: RemoteSpec, programs: int, proxy_memory: str, timeout_s: float):
        """For ``group``'s rank of an ``EPBuffer`` whose peers on other nodes ``spec`` sizes (its
        capacities as ``BufferShape.remote_spec`` gives them), launched on ``programs`` programs;
        ``proxy_memory``: where the row regions go (``PROXY_MEMORY``); ``timeout_s``: the
        buffer's deadline, the proxy's too. Collective: the proxy's endpoint exchange."""
        R, dev = group.world_size, group.device
        self.rank = group.rank
        self.spec = spec
        self.state = RemoteState(spec, dev, programs)
        kw = {k: v for k, v in self.spec.proxy_kwargs().items() if k != "node_size"}
        self.gpu = dev.type == "cuda"
        regions = mailbox = None
        self.memory, self.memory_why = "host", "CPU ranks"  # where the row regions are, and why
        if self.gpu:  # the proxy and the kernels share these; the headers: host memory the GPU addresses
            sizes = self.spec.region_sizes()
            headers = {n: torch.zeros(sizes[n], dtype=torch.uint8, pin_memory=True)
                       for n in REGIONS if n not in ROW_REGIONS}

            def regions(engine):  # once the engine exists: what it can register
                rows, self.memory, self.memory_why = row_region_memory(engine, sizes, dev, proxy_memory)
                return {**rows, **headers}
            self.mailbox = torch.zeros(mailbox_words(R), dtype=torch.int64, pin_memory=True)
            mailbox = self.mailbox.numpy()
        self.proxy = start_proxy(group, timeout_s=timeout_s, regions=regions, mailbox=mailbox, **kw)
        regions = {n: getattr(self.proxy, n) for n in REGIONS}
        if not self.gpu:  # the proxy allocated numpy arrays; the kernels see the same memory as tensors
            regions = {n: torch.from_numpy(r) for n, r in regions.items()}
            self.mailbox = torch.from_numpy(self.proxy.mailbox)
        self.regions = regions
        self.timeout_s = timeout_s
        # The kernels' waits for the proxy end PROXY_GRACE_NS after the buffer's deadline (the
        # proxy's own, which names the peer, runs out first); the interpreter has no clock and
        # bounds its looks instead (``mailbox.proxy_deadline``: the inter-node kernels derive both
        # from the buffer's timeout_ns; recv_total_kernel takes them).
        self.rtimeout_ns = int(timeout_s * 1e9) + PROXY_GRACE_NS.value
        self.spins = self.rtimeout_ns // LOOK_NS.value
        self.combined = -1  # serial of the last dispatch combined (the proxy serves one combine each)

    # ------------------------------------------------------------------ launch arguments
    def dispatch_args(self) -> dict:
        """The remote runtime arguments of the dispatch kernel (both halves), by name; the node
        kernel's ``sel_ptr`` / ``rows_from_ptr`` are this path's per-program copies."""
        st, reg = self.state, self.regions
        return dict(sel_ptr=st.sel, rows_from_ptr=st.rows_from, send_ptr=reg["disp_send"], hdr_send_ptr=reg["hdr_send"],
                    round1_ptr=reg["round1"], overflow_ptr=reg["overflow"], hdr_recv_ptr=reg["hdr_recv"],
                    mb_ptr=self.mailbox, tally_ptr=st.tally, comb_row_ptr=st.comb_row, rpos_ptr=st.rpos, rw_ptr=st.rw)

    def dispatch_consts(self, block_t: int) -> dict:
        """The inter-node sizes of both dispatch halves (the fields of ``moe_ep.kernels.args.Remote``
        they read; ``block_t``: tokens per payload tile)."""
        sp = self.spec
        return dict(PW=sp.payload_bytes // 4, RB=sp.row_bytes, HDR=sp.hdr_bytes, MAXROWS=sp.max_send_rows,
                    PCAP=sp.private_capacity, OVCAP=sp.overflow_capacity, ROWS_CAP=sp.recv_rows,
                    BLOCK_R=pow2(sp.world, 2), BLOCK_RW=16, BLOCK_RH=max(128, min(pow2(sp.hidden, 2), 4096 // block_t)),
                    OWN=sp.tally_at("own"), GOT=sp.tally_at("recv_rows"))

    def combine_args(self) -> dict:
        """The remote runtime arguments of the combine kernel (both halves), by name (the node
        kernel's ``xrows_ptr`` / ``xrecv_ptr`` included)."""
        st, R = self.state, self.spec.world
        return dict(xrows_ptr=st.comb_row, xrecv_ptr=self.regions["comb_recv"], comb_send_ptr=self.regions["comb_send"],
                    mb_ptr=self.mailbox, arrive_ptr=st.arrive[R + 1:], rpos_ptr=st.rpos, rw_ptr=st.rw,
                    recv_rows_ptr=st.recv_rows)

    def combine_consts(self) -> dict:
        """The inter-node sizes of both combine halves (the fields of ``moe_ep.kernels.args.Remote``
        they read)."""
        sp = self.spec
        return dict(CRB=sp.comb_row_bytes, MAXROWS=sp.max_send_rows, BLOCK_R=pow2(sp.world, 2),
                    PCAP=sp.private_capacity, OVCAP=sp.overflow_capacity, BLOCK_RW=16,
                    BLOCK_RH=max(16, min(pow2(sp.hidden, 2), 512)))

    # ------------------------------------------------------------------ host side
    def claim_combine(self, serial: int) -> None:
        """The combine of dispatch ``serial`` is issued: ``ValueError`` (before anything is sent)
        when it was combined already, since the proxy serves one combine per dispatch."""
        if serial == self.combined:
            raise ValueError("handle: already combined; over the inter-node path each dispatch is combined once "
                             "(dispatch again for another combine)")
        self.combined = serial

    def host_wait(self, fail: Callable[[BaseException], NoReturn], phase: str, epoch: int) -> None:
        """Interpreter only, between the halves: the proxy's ``hdr_ready`` (dispatch) or
        ``comb_ready`` (combine) reaching ``epoch``. The proxy's errors break the buffer at once
        (``fail(error)``: ``CallState.fail``); past the deadline (the proxy's own runs out first) a
        ``CommTimeoutError``."""
        word = MAILBOX["hdr_ready" if phase == "dispatch" else "comb_ready"]
        mb = self.proxy.mailbox
        deadline = time.monotonic() + self.rtimeout_ns * 1e-9
        delay = 1e-4
        while mb[word] < epoch:
            try:
                self.proxy.check_error()
            except Exception as exc:  # noqa: BLE001
                fail(exc)
            if time.monotonic() > deadline:
                fail(CommTimeoutError(self.rank, -1, phase, epoch, self.timeout_s))
            time.sleep(delay)
            delay = min(delay * 2, 5e-3)

    def proxy_error_address(self) -> int:
        """Address of the proxy's error code (a mailbox word, host memory; 0 while healthy)."""
        return self.mailbox.data_ptr() + 8 * MAILBOX["err_code"]

    def check(self) -> None:
        """Raises the proxy's error, if there is one (host memory: no device sync)."""
        self.proxy.check_error()

    def close(self, cause: Optional[BaseException] = None) -> None:
        """Stops the proxy, then closes the engine, whose goodbye tells every peer ``cause`` (the
        error this buffer broke with), else the proxy's own error record (on a GPU it reaches the
        buffer only at its next call), else nothing (a clean close), so a peer that sees this
        close names the original cause, not this rank."""
        if cause is None:
            cause = self.proxy.error()
        self.proxy.close()
        self.proxy.engine.close(cause)
