"""The inter-node path (docs/ARCHITECTURE.md §10): peers on other nodes through this rank's proxy.

``path``: ``RemotePath``, the host half an ``EPBuffer`` drives when ``node_size < world_size``;
``spec``: the row format, region sizes and device state; ``kernels`` and ``mailbox``: the kernels
(pack for remote peers, unpack what arrived, the doorbells and ready words); ``launches``: their
launches; ``session``: a rank's proxy from an ``EPGroup`` (transport choice, endpoint exchange).
Nothing is imported here, so ``session`` loads without torch (``moe_ep.doctor``).
"""
