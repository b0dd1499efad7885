"""The mailbox's looks (moe_ep.internode.mailbox.look_word, look_words): each word of pinned host
memory is loaded by one thread of a program and handed to every thread, so the value a wait sees
is the word itself (negative, wide, or past the loaded count as 0), at every width a kernel uses."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from moe_ep.internode.mailbox import look_word, look_words


@triton.jit
def _look_kernel(src_ptr, n, words_ptr, word_ptr, BLOCK: tl.constexpr):
    """``words_ptr[:BLOCK] = look_words(src, n)``, ``word_ptr[0] = look_word(src + 1)``."""
    tl.store(words_ptr + tl.arange(0, BLOCK), look_words(src_ptr, n, BLOCK))
    tl.store(word_ptr, look_word(src_ptr + 1))


@pytest.mark.parametrize("n, block", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 16), (64, 64), (600, 1024)])
def test_looks_return_the_words(n, block):
    g = torch.Generator().manual_seed(n * 31 + block)
    src = torch.randint(-2**62, 2**62, (max(n, 2) + 8,), dtype=torch.int64, generator=g)
    src[0] = -(2**63)  # the extremes survive the hand-round (one lane holds a word, the rest 0)
    src[min(1, n - 1)] = 2**63 - 1
    words = torch.full((block,), 7, dtype=torch.int64)
    word = torch.zeros(1, dtype=torch.int64)
    _look_kernel[(1,)](src, n, words, word, BLOCK=block)
    assert torch.equal(words[:n], src[:n])
    assert (words[n:] == 0).all()  # past n: 0, the words there not read
    assert word.item() == src[1].item()
