"""moe_ep.bench.host_poll on a CPU: its copy kernel moves exactly the words it is given (the
interpreter), and its arguments are checked, a machine without a GPU refused with a clear line."""
from __future__ import annotations

import pytest
import torch

from moe_ep.bench import host_poll


@pytest.mark.parametrize("n, programs", [(5000, 3), (2048, 1), (7, 4)])
def test_copy_kernel_moves_every_word(n, programs):
    src = torch.arange(n, dtype=torch.int64) * 7 - 3
    dst = torch.full((n + 5,), -1, dtype=torch.int64)
    host_poll._copy_kernel[(programs,)](src, dst, n, BLOCK=2048)
    assert torch.equal(dst[:n], src)
    assert (dst[n:] == -1).all()  # nothing past n


@pytest.mark.parametrize("argv, says", [
    (["--bytes", "12"], "--bytes: a positive multiple of 8"),
    (["--warps", "3"], "--warps: expected a comma-separated list of powers of two"),
    (["--iters", "0"], "--iters must be positive"),
    (["--pollers", "x"], "--pollers: expected a comma-separated list"),
    ([], "no CUDA GPU"),
])
def test_arguments_checked(argv, says, capsys):
    if not argv and torch.cuda.is_available():
        pytest.skip("a GPU is here: nothing to refuse")
    with pytest.raises(SystemExit) as e:
        host_poll.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err
