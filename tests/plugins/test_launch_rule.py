"""The launch rules (plain ints): every row and column written exactly once, nothing else."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_mtp_carry.kernels import abi


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 12), hidden=st.integers(1, 5000))
def test_copy_launch_covers_every_cell_once(n, hidden):
    launch = abi.copy_launch(n, hidden)
    gx, gy, gz = launch.grid
    assert (gx, gz) == (n, 1) and launch.block == (abi.NUM_WARPS * 32, 1, 1)
    seen: Counter = Counter()
    for r in range(gx):
        for c in range(gy):
            row, cols = abi.copy_program_cells((r, c), hidden)
            assert len(cols) > 0  # no idle program along y
            seen.update((row, col) for col in cols)
    assert set(seen) == {(r, c) for r in range(n) for c in range(hidden)}
    assert set(seen.values()) <= {1}


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 40), start=st.integers(0, 100), hkv=st.integers(1, 9),
       head_dim=st.integers(1, 300), page=st.integers(1, 17), seed=st.randoms())
def test_append_launch_writes_every_row_head_column_once(n, start, hkv, head_dim, page, seed):
    launch = abi.append_launch(n)
    assert launch.grid == (n, 1, 1)
    bh, bd = abi.append_block_shape(hkv, head_dim)
    assert bh >= hkv and bd >= head_dim and bh < 2 * hkv and bd < 2 * head_dim
    rows: Counter = Counter()
    for i in range(launch.grid[0]):
        row, cells = abi.append_program_cells(i, start, hkv, head_dim, bh, bd)
        assert sorted(cells) == [(h, d) for h in range(hkv) for d in range(head_dim)]
        rows[row] += 1
    assert set(rows) == set(range(start, start + n)) and set(rows.values()) <= {1}
    # a scattered block table (distinct block ids) maps distinct rows to distinct slots
    max_blocks = (start + n) // page + 1
    table = list(range(3 * max_blocks))
    seed.shuffle(table)
    slots = [table[r // page] * page + r % page for r in rows]
    assert len(set(slots)) == len(slots)


def test_copy_launch_evaluates_on_another_number_type():
    """The plugin passes shape expressions and `trtp.cdiv`: the rule must only use `div`."""
    calls = []

    def div(a, b):
        calls.append((a, b))
        return ("cdiv", a, b)

    launch = abi.copy_launch("N", "H", 0, div=div)
    assert launch.grid == ("N", ("cdiv", "H", abi.COPY_BLOCK), 1)
    assert calls == [("H", abi.COPY_BLOCK)]


def test_append_block_shape_refuses_empty_shapes():
    import pytest

    with pytest.raises(ValueError, match="num_kv_heads and head_dim must be >= 1, got 0, 8"):
        abi.append_block_shape(0, 8)
    assert abi.append_block_shape(2, 256) == (2, 256)
    assert abi.append_block_shape(3, 40) == (4, 64)


def test_abi_orders_inputs_extras_outputs_and_aliases_real_names():
    for kabi in (abi.COPY_ABI, abi.APPEND_ABI):
        roles = [p.role for p in kabi.params]
        assert roles == sorted(roles, key=["input", "extra", "output"].index)
        for out, inp in kabi.aliases:
            assert out in kabi.names("output") and inp in kabi.names("input")
    assert abi.COPY_ABI.names("extra") == ["src_stride", "dst_stride", "hidden_size", "dst_capacity"]
    assert len(abi.APPEND_ABI.params) == 20
    assert abi.APPEND_ABI.signature("bf16")["k_new"] == "*bf16"
    assert abi.APPEND_ABI.signature("bf16")["keys"] == "*i32"


def test_abi_refuses_an_extra_after_an_output():
    import pytest

    with pytest.raises(ValueError, match="inputs, then extras, then outputs"):
        abi.KernelABI("bad", (abi.Param("o", "output", "*data"), abi.Param("e", "extra", "i32")), ())
