"""The inter-node path (docs/ARCHITECTURE.md §10): peers on other nodes through this rank's proxy.

``path``: ``RemotePath``, the host half an ``EPBuffer`` drives when ``node_size < world_size`` (the
arguments of the two launches each op takes); ``spec``: the row format, region sizes and device
state; ``dispatch_kernels`` and ``combine_kernels``: the send and receive halves of each op (the
remote peers' part around the node kernels); ``mailbox``: their bells and ready words;
``session``: a rank's proxy from an ``EPGroup`` (transport choice, endpoint exchange).
Nothing is imported here, so ``session`` loads without torch (``moe_ep.tools.doctor``).
"""
