"""`bench --openai` and `bench --server` refuse what the target owns with one error line,
before any connection: the flag checks every remote driver shares."""

from __future__ import annotations

import pytest

from trtllm_mtp_carry.cli import main

URL = "http://127.0.0.1:1/v1"  # nothing listens on port 1


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err


@pytest.mark.parametrize("flags, named", [
    (["--chunk", "256"], "--chunk"),
    (["--draft-len", "2", "--device", "cpu"], "--draft-len, --device"),
])
def test_bench_openai_refuses_the_workers_flags_naming_them(capsys, flags, named):
    assert main(["bench", "--openai", URL, *flags, "--no-progress"]) == 2
    assert _error(capsys) == (
        f"trtllm-mtp-carry: error: {named} with --openai {URL}: the engine is the workers' "
        "(set it with `trtllm-mtp-carry serve --dynamo` options); "
        f"drop {'it' if ',' not in named else 'them'} here\n")


def test_bench_openai_with_server_asks_for_one(capsys):
    assert main(["bench", "--openai", URL, "--server", "127.0.0.1:1", "--no-progress"]) == 2
    assert _error(capsys) == ("trtllm-mtp-carry: error: --server and --openai: pick one "
                              "(Triton's gRPC or Dynamo's OpenAI API)\n")


def test_bench_openai_unreachable_is_one_error_line_naming_the_url(capsys):
    assert main(["bench", "--openai", URL, "--no-progress"]) == 2
    err = _error(capsys)
    assert err.startswith(f"trtllm-mtp-carry: error: --openai {URL}: ConnectionRefusedError: ")
    assert err.count("\n") == 1


def test_bench_server_refuses_paired_before_connecting(capsys):
    assert main(["bench", "--server", "127.0.0.1:1", "--policies", "carry,paired", "--no-progress"]) == 2
    assert _error(capsys) == (
        "trtllm-mtp-carry: error: --policies paired with --server 127.0.0.1:1: paired (the model of "
        "TensorRT-LLM's paired draft reuse) runs on the in-process reference engine only\n")
