"""carry_row_dtype and the row format of a store tier: bytes charged exactly (payload plus scales),
pinned like every carry setting, a bad value one error naming it (issue 31)."""

from __future__ import annotations

import json

import pytest
from store_helpers import Clock, entry
from test_cli import run_cli
from test_settings import run_py

from trtllm_mtp_carry import CarryStore
from trtllm_mtp_carry.core.row_format import RowFormat, check_row_dtype, rows_nbytes, vector_nbytes

QWEN = RowFormat("fp8", 4, 256)  # 1 MTP layer x (K, V) x 2 KV heads, head_dim 256


def test_fp8_rows_cost_one_byte_an_element_plus_a_float32_scale_per_vector():
    assert vector_nbytes("fp8", 256) == 260 and vector_nbytes("bf16", 256) == 512
    assert rows_nbytes("fp8", 4, 256) == 1040 and rows_nbytes("bf16", 4, 256) == 2048
    assert rows_nbytes("bf16", 4, 256, elem_bytes=4) == 4096
    assert QWEN.row_nbytes == 1040 and QWEN.nbytes(7) == 7280 and QWEN.nbytes(0) == 0
    assert RowFormat("bf16", 4, 256).nbytes(7) == 7 * 2048


@pytest.mark.parametrize(("value", "message"), [
    ("fp4", "carry_row_dtype='fp4' is not a row format; expected one of bf16, fp8, nvfp4"),
    ("FP8", "carry_row_dtype='FP8' is not a row format; expected one of bf16, fp8, nvfp4"),
    (8, "carry_row_dtype=8 is not a row format; expected one of bf16, fp8, nvfp4"),
])
def test_a_bad_row_dtype_is_one_error_naming_it(value, message):
    with pytest.raises(ValueError) as exc:
        check_row_dtype(value)
    assert str(exc.value) == message
    with pytest.raises(ValueError, match="RowFormat.head_dim must be an int >= 1, got 0"):
        RowFormat("fp8", 4, 0)


def test_carry_row_dtype_defaults_to_bf16_and_env_or_setter_pins_it():
    code = ("import trtllm_mtp_carry as t\n"
            "print(t.carry_row_dtype(), t.set_carry_row_dtype('fp8'), t.carry_row_dtype())")
    assert run_py(code).stdout.split() == ["bf16", "False", "bf16"]
    assert run_py(code, TRTLLM_MTP_CARRY_ROW_DTYPE="fp8").stdout.split() == ["fp8", "False", "fp8"]
    code = "import trtllm_mtp_carry as t\nprint(t.set_carry_row_dtype('fp8'), t.carry_row_dtype())"
    assert run_py(code, TRTLLM_MTP_CARRY_ROW_DTYPE="bf16").stdout.split() == ["True", "fp8"]
    out = run_py("import trtllm_mtp_carry as t; t.set_carry_row_dtype('int4')")
    assert "ValueError: carry_row_dtype='int4' is not a row format; expected one of bf16, fp8, nvfp4" in out.stderr


def test_info_reports_the_row_format_and_refuses_a_bad_one_with_one_line():
    report = json.loads(run_cli("info", "--json", "--carry-row-dtype", "fp8").stdout)
    assert (report["carry_row_dtype"], report["carry_row_dtype_source"]) == ("fp8", "--carry-row-dtype")
    report = json.loads(run_cli("info", "--json", TRTLLM_MTP_CARRY_ROW_DTYPE="fp8").stdout)
    assert (report["carry_row_dtype"], report["carry_row_dtype_source"]) == ("fp8", "env TRTLLM_MTP_CARRY_ROW_DTYPE")
    out = run_cli("info", TRTLLM_MTP_CARRY_ROW_DTYPE="fp16")
    assert out.returncode == 2 and out.stderr.strip() == (
        "trtllm-mtp-carry: error: environment variable TRTLLM_MTP_CARRY_ROW_DTYPE='fp16' is not a row "
        "format; expected one of bf16, fp8, nvfp4")
    out = run_cli("info", "--carry-row-dtype", "fp16")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "argument --carry-row-dtype: invalid choice: 'fp16'" in out.stderr


def test_a_store_in_fp8_charges_each_entry_its_packed_bytes_exactly():
    store = CarryStore(None, QWEN.nbytes(10), "lrd", row_format=QWEN)
    assert store.admit(1, QWEN.nbytes(3)) == []
    store.put(entry(1, rows=3), QWEN.nbytes(3))
    assert store.bytes_held == store.nbytes(1) == 3 * 1040
    assert store.admit(2, QWEN.nbytes(7)) == []
    store.put(entry(2, rows=7), QWEN.nbytes(7))
    assert store.bytes_held == 10 * 1040 == store.budget_bytes
    evicted = store.admit(3, QWEN.nbytes(1))  # full to the byte: one more row evicts the oldest
    assert [e.session_hash for e in evicted] == [1]
    with pytest.raises(ValueError, match=r"1 rows in fp8 take 1040 bytes \(4 vectors of 256 a row\), "
                                         r"the deposit states 2048"):
        store.put(entry(3, rows=1), 2048)  # bf16 bytes for fp8 rows: the executor's accounting is wrong
    assert store.tier_stats().row_dtypes == {"device": "fp8"}


def test_the_host_tier_holds_the_packed_form_at_its_packed_bytes():
    clock = Clock()
    store = CarryStore(None, QWEN.nbytes(4), "lrd", None, clock, host_budget_bytes=QWEN.nbytes(8),
                       row_format=QWEN)
    for key, rows in ((1, 4), (2, 4)):
        assert store.admit(key, QWEN.nbytes(rows)) is not None
        store.put(entry(key, rows=rows), QWEN.nbytes(rows))
        clock.now += 1
    assert store.tier(1) == "host" and store.tier(2) == "device"
    assert store.host_bytes_held == 4 * 1040 and store.bytes_held == 4 * 1040
    t = store.tier_stats()
    assert (t.bytes_demoted, t.row_dtypes) == (4 * 1040, {"device": "fp8", "host": "fp8"})
    assert store.take(1).rows == 4 and store.tier_stats().bytes_restored == 4 * 1040
