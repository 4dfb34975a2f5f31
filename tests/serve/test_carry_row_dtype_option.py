"""`carry_row_dtype` as a served-model parameter: typed, written back, one error naming a bad value,
and a reference-engine option refused with --engine trtllm (issue 31)."""

import pytest

from trtllm_mtp_carry.serve.options import ServeOptions


def test_the_row_dtype_parameter_round_trips():
    options = ServeOptions.from_parameters({"carry_row_dtype": {"string_value": "fp8"}})
    assert options.carry_row_dtype == "fp8" and options.as_parameters()["carry_row_dtype"] == "fp8"
    assert ServeOptions.from_parameters({"carry_row_dtype": ""}).carry_row_dtype is None  # the engine's default


def test_a_bad_row_dtype_parameter_names_itself():
    with pytest.raises(ValueError) as exc:
        ServeOptions.from_parameters({"carry_row_dtype": "fp4"})
    assert str(exc.value) == "parameter carry_row_dtype='fp4' is not a row format; expected one of bf16, fp8, nvfp4"


def test_serve_takes_the_row_dtype_for_the_reference_engine_only():
    from trtllm_mtp_carry.cli import build_parser
    from trtllm_mtp_carry.serve.cli import _spec

    args = build_parser().parse_args(["triton-repo", "/tmp/unused-repo", "--carry-row-dtype", "fp8"])
    assert _spec(args).options.carry_row_dtype == "fp8"
    args = build_parser().parse_args(["triton-repo", "/tmp/unused-repo", "--engine", "trtllm", "--model", "m",
                                      "--carry-row-dtype", "fp8"])
    with pytest.raises(ValueError) as exc:
        _spec(args)
    assert str(exc.value) == ("--carry-row-dtype is a reference-engine option; with --engine trtllm set "
                              "carry_row_dtype in the mtp_carry section in --llm-options")
