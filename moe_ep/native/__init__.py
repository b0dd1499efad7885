"""The native library (csrc/proxy, csrc/launch) and its bindings, a module per job.

``library``: finding (in a source checkout, building) and loading the library, its ABI check,
its errors (``NativeError``, ``PeerLostError``) and the ctypes helpers the others share.
``launch``: the kernel launcher's plans (``moe_ep.kernels.launch`` uses them).
``transports``: ``Engine`` and its transports (``TcpTransport``, ``VerbsTransport``,
``FabricTransport``: libfabric, EFA through its ``efa`` provider), ``ImmCounter``.
``probes``: what this host offers them (RDMA devices, libfabric providers, GPU memory).
``protocol``: the inter-node protocol's numbers (mailbox words, phases, immediates, regions).
``proxy``: the host proxy (``Proxy``) that ``moe_ep.internode.session`` starts when
``node_size < world_size``. ``bench``: the native bench tools (``moe-ep-bench proxy``).
``identity``: the job identity every connection proves. ``nic``: the NIC nearest a GPU (sysfs).

Nothing is imported here: each module is imported by its own name, and none loads the library
before its first native call.
"""
