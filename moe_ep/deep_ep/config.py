"""``Config``: DeepEP's tuning record for normal-mode kernels. moe_ep sizes and schedules its own
buffers, so a Config is accepted, kept and checked for type, and changes nothing."""
from __future__ import annotations


class Config:
    """DeepEP's performance tuning config (SMs and chunk sizes of its normal-mode kernels).

    Accepted wherever DeepEP takes one; moe_ep picks its own program count and chunking, so the
    values only tune DeepEP. The size hints below answer how many bytes moe_ep would like DeepEP
    callers to pass, for code that sizes ``num_nvl_bytes`` / ``num_rdma_bytes`` from them; those
    byte counts are accepted and not used either (moe_ep sizes its buffers per call shape).
    """

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        for name, v in (("num_sms", num_sms), ("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens),
                        ("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens),
                        ("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens),
                        ("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: expected a positive int, got {v!r}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of one channel ring per rank pair, as DeepEP sizes it (informational: moe_ep
        allocates per call shape, whatever ``num_nvl_bytes`` says)."""
        return int(hidden_bytes) * int(num_ranks) * self.num_max_nvl_chunked_recv_tokens * (self.num_sms // 2 or 1)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """As ``get_nvl_buffer_size_hint``, for the RDMA ring (informational)."""
        return int(hidden_bytes) * int(num_ranks) * self.num_max_rdma_chunked_recv_tokens * (self.num_sms // 2 or 1)

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, nvl_send={self.num_max_nvl_chunked_send_tokens}, "
                f"nvl_recv={self.num_max_nvl_chunked_recv_tokens}, rdma_send={self.num_max_rdma_chunked_send_tokens}, "
                f"rdma_recv={self.num_max_rdma_chunked_recv_tokens})")
