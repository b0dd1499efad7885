"""Byte layout of each rank's symmetric workspace (identical on every rank of a node).

Regions, each 256-byte aligned; ``par`` = epoch & 1 double-buffers everything peers write:
  hdr_flag   int64 [N]                   written by source rank s at [s]: its header is in place
  disp_flag  int64 [N][CMAX]             written by source rank s at [s][c]: its chunk c is in place
  comb_flag  int64 [N][CMAX]             written by expert owner o at [o][c]: chunk c of this rank's tokens
  wgt_flag   int64 [N][CMAX]             written by source rank s at [s][c]: combine-time weights of its
                                         chunk c are in meta_w (only combines given topk_weights)
  hdr        int32 [2][N][HDR]           [0] tokens of the source, [1 + e] selections of local expert e,
                                         [1 + EL] its rows for this rank (rows layout)
  meta_i     int32 [2][N][M][2K]         local expert id (or -1) and position j, per (source, slot)
  meta_w     f32   [2][N][M][K]          weights
  rows       u8    [2][N][M][RB]         dispatch payload (+ fp8 scales)
  comb       bf16  [2][N][M][H]          pre-reduced combine rows, per (owner, slot)
  comb_w     f32   [2][N][M][K]          rows layout only: the combine weights of each (owner, slot)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .interpret import interpreting


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= ``max(n, 1)``, at least ``lo`` (Triton block sizes)."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


INTERP_MAX_CHUNKS = 4
ROWS_CHUNK_TOKENS = 128  # the rows layout's largest chunk (its send half counts positions over [tokens] vectors)
OWN_TILE_TOKENS = 16     # tokens per tile of the payload loops (a rows chunk's tokens go through them in sub-blocks)
COMBINE_STEP_TOKENS = 8  # tokens per step of combine's receive half (packed; masked at <= 64 programs; buffer.py says why)


def max_chunks(max_tokens: int, programs: int = 0, forced: Optional[int] = None) -> int:
    """CMAX, the most chunks a source's tokens are cut into: one token per chunk at decode sizes
    (many programs share few tokens), at most 16 tokens per chunk at prefill sizes. Under Triton's
    interpreter (CPU ranks) at most ``INTERP_MAX_CHUNKS``: its programs run one after another, so
    more chunks overlap nothing and only add interpreted steps (four still run the chunk logic);
    the 16 tokens per chunk hold there too (the kernels' per-chunk tiles are quadratic in them).

    ``programs`` > 0 (the rows layout, whose chunk work is linear in its tokens): at most one
    chunk per program (the largest power of two <= programs), up to ``ROWS_CHUNK_TOKENS`` tokens
    each. A chunk's routing metadata is a chain of dependent loads and stores (~2.7 us on an
    H200 whatever its size), so fewer, larger chunks pay it fewer times: the rows fp8 dispatch at
    T=4096 and 32 programs went from 75.1 us at 16 tokens per chunk to 59.5 at 128 (one H200;
    the kernels take such chunks' own rows in sub-blocks of ``OWN_TILE_TOKENS``).
    ``forced`` (``Tuning.max_chunks``) replaces that rule's chunks per program, for tuning."""
    most = 256 if not interpreting() else INTERP_MAX_CHUNKS
    if programs > 0:
        # one chunk per program (the largest power of two <= programs), or what the tuning says
        fit = pow2(forced) if forced else min(most, 1 << (programs.bit_length() - 1))
        return max(pow2(-(-max_tokens // ROWS_CHUNK_TOKENS)), min(pow2(max_tokens), fit))
    return max(pow2(-(-max_tokens // 16)), min(pow2(max_tokens), most))


def chunking(T: int, cmax: int) -> tuple:
    """(tokens per chunk, chunks) of a source with T tokens; the kernels' ``chunking`` rule."""
    bt = max(1, -(-T // cmax))
    return bt, -(-T // bt)


@dataclass(frozen=True)
class WorkspaceLayout:
    """Offsets (bytes) of the workspace regions for N node ranks, M slots, top-K, EL local experts."""

    N: int
    M: int
    K: int
    EL: int
    H: int
    payload_bytes: int   # H * element size, plus 4 * ceil(H/128) scale bytes for fp8
    rows: bool = False   # the rows layout (EPBuffer(layout="rows")): comb_w is sized
    programs: int = 0    # the rows layout: programs per launch, which set its chunks (max_chunks)
    max_chunks: Optional[int] = None  # the rows layout: Tuning.max_chunks (None: the rule)

    @property
    def CMAX(self) -> int:
        return max_chunks(self.M, self.programs if self.rows else 0, self.max_chunks)

    @property
    def HDR(self) -> int:
        return _align(2 + self.EL, 4)

    @property
    def RB(self) -> int:
        return _align(self.payload_bytes, 16)

    def _regions(self):
        N, M, K = self.N, self.M, self.K
        sizes = [
            ("hdr_flag", 8 * N),
            ("disp_flag", 8 * N * self.CMAX),
            ("comb_flag", 8 * N * self.CMAX),
            ("wgt_flag", 8 * N * self.CMAX),
            ("hdr", 4 * 2 * N * self.HDR),
            ("meta_i", 4 * 2 * N * M * 2 * K),
            ("meta_w", 4 * 2 * N * M * K),
            ("rows", 2 * N * M * self.RB),
            ("comb", 2 * 2 * N * M * self.H),
            ("comb_w", 4 * 2 * N * M * K if self.rows else 0),
        ]
        off, out = 0, {}
        for name, size in sizes:
            out[name] = off
            off = _align(off + size, 256)
        out["total"] = off
        return out

    def offsets(self) -> dict:
        """{region name: byte offset, 'total': bytes}."""
        return self._regions()
