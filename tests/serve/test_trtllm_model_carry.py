"""The trtllm Triton model's per-turn carry outcome and its forget on session end, with the REAL adapter.

In process, on stand-ins for what cannot run here: `trtllm_standin.ExecutorLLM`
is TensorRT-LLM's LLM API over the package's CPU STAND-IN executor
(`trtllm_mtp_carry/trtllm/standin/`, not TensorRT-LLM) and `pb_utils` is
Triton's Python-backend module stand-in. What runs for real: the model code,
its loop thread, `attach` and the carry resource manager over the stand-in
executor's pages, the core's `CarryStore`. (A real `tritonserver` cannot load
this model without TensorRT-LLM: test_trtllm_model.py pins that failure.)

Prompts are the reference model's own domain (standard-library source), and
every warm turn extends the last prompt and answer, so under the repository's
default `llm_options.yaml` (a snapshot at each prompt's end) the stand-in executor
reuses the last prompt (R = its length) as TensorRT-LLM's hybrid manager would.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import trtllm_standin as standin

from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer
from trtllm_mtp_carry.serve.trtllm.model import TritonPythonModel
from trtllm_mtp_carry.serve.trtllm.repo import DEFAULT_LLM_OPTIONS, LLM_OPTIONS_FILE

CORPUS = ChatTokenizer().encode(Path(json.__file__).with_name("decoder.py").read_text())
MAX_TOKENS = 6


def serve(monkeypatch, tmp_path, idle_us: int, max_turn_s: int = 300) -> TritonPythonModel:
    standin.install_tensorrt_llm(monkeypatch, standin.ExecutorLLM)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", standin.pb_utils_module())
    monkeypatch.delenv("TLLM_WORKER_USE_SINGLE_PROCESS", raising=False)
    # the llm_options.yaml `triton-repo` writes: block reuse on, a snapshot at each prompt's end
    (tmp_path / LLM_OPTIONS_FILE).write_text(DEFAULT_LLM_OPTIONS)
    config = {"parameters": {"engine": {"string_value": "trtllm"}, "model": {"string_value": "/ckpt/q"},
                             "llm_options": {"string_value": LLM_OPTIONS_FILE},
                             "max_tokens": {"string_value": "64"},
                             "max_turn_s": {"string_value": str(max_turn_s)}},
              "sequence_batching": {"max_sequence_idle_microseconds": idle_us}}
    model = TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_instance_name": "m_0", "model_name": "m",
                      "model_repository": str(tmp_path)})
    return model


def send(model, request) -> dict:
    """The final response's tensors, with every streamed output id under `ids`."""
    model.execute([request])
    assert request.sender.done.wait(60), "no final response"
    assert request.sender.error() is None, request.sender.error()
    final = dict(request.sender.responses[-1].tensors)
    final["ids"] = [int(i) for r in request.sender.responses for i in r.tensors["output_ids"]]
    final["stats"] = json.loads(final["turn_stats"][0])
    return final


def carry_of(final: dict) -> tuple:
    s = final["stats"]
    return (final["carry_outcome"][0].decode(), int(final["drafter_rows_computed"][0]), s["outcome_kind"],
            s["no_carry_reason"], s["reused_tokens"], s["drafter_rows_kept"], s["drafter_rows_computed"])


@pytest.fixture
def model(monkeypatch, tmp_path):
    served = serve(monkeypatch, tmp_path, 600_000_000)
    try:
        yield served
    finally:
        served.finalize()


def test_each_turn_reports_the_adapters_carry_outcome_and_rows(model):
    p1 = list(CORPUS[:70])
    first = send(model, standin.Request(7, start=True, input_ids=p1, max_tokens=MAX_TOKENS))
    # cold: TensorRT-LLM reused nothing and the session has nothing deposited (judged, a miss);
    # its context computed keys [0, L - 1)
    assert carry_of(first) == ("no_carry", len(p1) - 1, "no_carry", "never_carried", 0, 0, len(p1) - 1)
    p2 = p1 + first["ids"] + list(CORPUS[70:90])
    second = send(model, standin.Request(7, input_ids=p2, max_tokens=MAX_TOKENS))
    # warm: the executor reused p1 (R = 70); the carry restored those 70 rows, the context
    # phase computed keys [70, L - 1)
    assert carry_of(second) == ("adopted", len(p2) - 1 - len(p1), "adopted", "", len(p1), len(p1),
                                len(p2) - 1 - len(p1))
    assert (second["stats"]["topology"], second["stats"]["carry_armed"]) == ("unpaired", True)
    assert standin.metric("mtp_carry_outcomes_total", kind="no_carry") == 1
    assert standin.metric("mtp_carry_outcomes_total", kind="adopted") == 1
    assert standin.metric("mtp_carry_drafter_rows_total", source="adopted") == len(p1)
    attachment = model._engine.attachment
    assert attachment.stats().outcomes["adopted"] == 1
    # every record was read once by the model: nothing is left behind for these requests
    assert [attachment.pop_turn(rid) for rid in (1001, 1002)] == [None, None]


@pytest.mark.parametrize("cause", ["end", "restart", "idle"])
def test_an_ended_sessions_next_turn_finds_its_rows_dropped_session_end(monkeypatch, tmp_path, cause):
    # idle: Triton's idle timer is the session's idle timeout (0.05 s here) plus max_turn_s
    model = serve(monkeypatch, tmp_path, 1_050_000, max_turn_s=1) if cause == "idle" else \
        serve(monkeypatch, tmp_path, 600_000_000)
    try:
        p1 = list(CORPUS[:70])
        first = send(model, standin.Request(9, start=True, input_ids=p1, max_tokens=MAX_TOKENS))
        p2 = p1 + first["ids"] + list(CORPUS[70:90])
        second = send(model, standin.Request(9, end=cause == "end", input_ids=p2, max_tokens=MAX_TOKENS))
        assert carry_of(second)[0] == "adopted"  # the rows were carried until the session ended
        freed = len(p2) + len(second["ids"]) - 1  # the second turn's deposit: keys [0, N - 1)
        if cause == "idle":
            time.sleep(0.1)
            # another session's turn runs the expiry (and ends itself: the suite's one carry slot)
            other = list(CORPUS[200:240])
            done = send(model, standin.Request(10, start=True, end=True, input_ids=other, max_tokens=MAX_TOKENS))
            freed += len(other) + len(done["ids"]) - 1
        p3 = p2 + second["ids"] + list(CORPUS[90:110])
        third = send(model, standin.Request(9, start=True, input_ids=p3, max_tokens=MAX_TOKENS))
        # the same conversation id, and TensorRT-LLM still reuses p2: only the forget stops the carry
        assert carry_of(third) == ("no_carry", len(p3) - 1 - len(p2), "no_carry", "session_end", len(p2), 0,
                                   len(p3) - 1 - len(p2))
        stats = model._engine.attachment.stats()
        ended = 1 + (cause == "idle")  # and session 10's END
        assert stats.evictions["session_end"] == ended and stats.evictions["capacity"] == 0
        assert standin.metric("mtp_carry_sessions_ended_total", cause=cause) == 1
        assert standin.metric("mtp_carry_sessions_ended_total") == ended
        assert standin.metric("mtp_carry_rows_freed_total") == freed
        assert standin.metric("mtp_carry_no_carry_total", reason="session_end") == 1
    finally:
        model.finalize()
