"""Prompts given as token buffers (array('q'), numpy, torch) decide exactly as lists do."""

import subprocess
import sys
from array import array

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trtllm_mtp_carry import CarriedDrafter, CarryOutcome, StoreRange, decide_adopt
from trtllm_mtp_carry.core import common_prefix_len
from trtllm_mtp_carry.core.tokens import as_token_buffer

H, G = 0xABCDEF, 41


def forms(prompt):
    """The prompt as every type the core accepts."""
    return {
        "list": list(prompt),
        "array": array("q", prompt),
        "numpy64": np.array(prompt, dtype=np.int64),
        "numpy32": np.array(prompt, dtype=np.int32),
        "numpy strided": np.repeat(np.array(prompt, dtype=np.int64), 2)[::2],
        "tensor": torch.tensor(prompt, dtype=torch.int64),
        "tensor32": torch.tensor(prompt, dtype=torch.int32),
        "tuple": tuple(prompt),
    }


def test_buffers_are_int64_copies_and_other_types_are_not_buffers():
    assert as_token_buffer(array("q", [1, 2])) == array("q", [1, 2])
    for x in (np.array([5, 7], dtype=np.uint16), torch.tensor([5, 7], dtype=torch.int16)):
        assert as_token_buffer(x) == array("q", [5, 7])
    not_buffers = [[1, 2], (1, 2), array("i", [1, 2]), np.array([True, False]), np.array([1.0]),
                   np.array([1], dtype=np.uint64), np.zeros((2, 2), dtype=np.int64),
                   torch.tensor([1.0]), torch.tensor([True]), torch.zeros(2, 2, dtype=torch.long)]
    assert [as_token_buffer(x) for x in not_buffers] == [None] * len(not_buffers)


def test_entry_holds_its_tokens_as_a_buffer_too():
    e = CarriedDrafter([0], 3, 3, [10, 11, 12, 13, 14], H)
    assert e.token_buffer == array("q", [10, 11, 12, 13, 14]) and e.tokens == [10, 11, 12, 13, 14]
    huge = CarriedDrafter([0], 1, 0, [2**63, 5], H)  # does not fit int64: lists only
    assert huge.token_buffer is None
    assert huge.common_prefix_len(np.array([7, 5])) == 0 and huge.common_prefix_len([2**63, 5, 1]) == 2


@pytest.mark.parametrize("cut", [0, 1, 15, 16, 4095, 4096, 4097, 9_999, 10_000])
def test_every_form_decides_like_the_list(cut):
    tokens = list(range(1000, 11_000))
    e = CarriedDrafter(list(range(625)), 9_999, 9_998, tokens, H)
    prompt = tokens + list(range(50_000, 50_020))
    if cut < len(tokens):
        prompt[cut] = 7
    store = StoreRange(G, 0, len(prompt))
    expect = decide_adopt(e, prompt, H, G, store)
    assert expect == (CarryOutcome.Adopted(9_999, 20, 9_999) if cut == 10_000 else
                      CarryOutcome.PrefixMismatch(cut, 9_999) if cut < 2 else
                      CarryOutcome.Adopted(cut - 1, len(prompt) - cut, cut - 1))
    for name, p in forms(prompt).items():
        assert decide_adopt(e, p, H, G, store) == expect, name
        assert e.common_prefix_len(p) == min(cut, 10_000), name


def test_a_foreign_session_is_refused_before_a_buffer_is_built(monkeypatch):
    import trtllm_mtp_carry.core.adopt as adopt

    def boom(_):
        raise AssertionError("tokens compared before the session check")

    monkeypatch.setattr(adopt, "as_token_buffer", boom)
    e = CarriedDrafter([0], 3, 3, [1, 2, 3, 4, 5], H)
    out = decide_adopt(e, np.array([1, 2, 3, 4, 5, 6]), H + 1, G, StoreRange.EMPTY)
    assert out == CarryOutcome.ForeignSession(H, H + 1)


@given(st.lists(st.integers(-3, 3), max_size=60), st.lists(st.integers(-3, 3), max_size=60))
def test_buffer_common_prefix_len_matches_naive(a, b):
    naive = 0
    while naive < min(len(a), len(b)) and a[naive] == b[naive]:
        naive += 1
    assert common_prefix_len(array("q", a), array("q", b)) == naive


def test_core_still_imports_neither_numpy_nor_torch():
    code = ("import sys, trtllm_mtp_carry as t\n"
            "from array import array\n"
            "e = t.CarriedDrafter([0], 3, 3, [1, 2, 3, 4, 5], 9)\n"
            "t.decide_adopt(e, array('q', [1, 2, 3, 4, 5, 6]), 9, 1, t.StoreRange(1, 0, 6))\n"
            "print([m for m in ('numpy', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
