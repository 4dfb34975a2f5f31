"""The trtllm Triton model's sessions, streaming and errors, in process, on a STAND-IN for TensorRT-LLM.

`trtllm_standin` provides TensorRT-LLM's LLM API names (not TensorRT-LLM) and
Triton's `pb_utils` (not Triton), and the adapter's `attach`/`detach` are
replaced by recorders: what runs for real is this package's model code, its
asyncio loop thread, the reference model's request parser and response
sender. The real server and real TensorRT-LLM are tested elsewhere
(test_trtllm_model.py: the load failure; scripts/trtllm_smoke.py on a GPU).
"""

from __future__ import annotations

import json
import sys
import time

import pytest
import trtllm_standin as standin

import trtllm_mtp_carry.trtllm as adapter_package
from trtllm_mtp_carry.serve.trtllm import serving as serving_module
from trtllm_mtp_carry.serve.trtllm.model import NO_TOKENIZER, TritonPythonModel
from trtllm_mtp_carry.serve.trtllm.serving import ChatTemplate
from trtllm_mtp_carry.service import CarryStats

TOK = standin.ChatMLTokenizer()
CHAT = ChatTemplate(TOK)


def start(monkeypatch, tmp_path, options_yaml: str | None = None) -> tuple[TritonPythonModel, dict]:
    """A model initialized on the stand-ins (its LLM options file `options_yaml`, if any),
    with the adapter's attach/detach replaced by recorders."""
    standin.install_tensorrt_llm(monkeypatch)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", standin.pb_utils_module())
    monkeypatch.delenv("TLLM_WORKER_USE_SINGLE_PROCESS", raising=False)
    record: dict = {"options": [], "detached": 0, "popped": [], "forgotten": []}

    def attach(llm, options):
        record["options"].append(options)
        llm.events.append("attached")
        stats = CarryStats(rows_adopted=5, outcomes={"adopted": 1})  # what the adapter's stats() returns

        def forget_conversation(conversation_id):
            record["forgotten"].append(conversation_id)
            return 7

        return standin.SimpleNamespace(topology="unpaired", armed=True, reason="stand-in", stats=lambda: stats,
                                       pop_turn=lambda rid: record["popped"].append(rid),  # no record: None
                                       forget_conversation=forget_conversation)

    def detach(llm):
        record["detached"] += 1

    monkeypatch.setattr(adapter_package, "attach", attach, raising=False)
    monkeypatch.setattr(adapter_package, "detach", detach, raising=False)
    monkeypatch.setattr(adapter_package, "parse_carry_options", lambda section: {"parsed": section},
                        raising=False)
    if options_yaml is not None:
        (tmp_path / "llm.yaml").write_text(options_yaml)
    config = {"parameters": {"engine": {"string_value": "trtllm"}, "model": {"string_value": "/ckpt/q"},
                             "llm_options": {"string_value": "" if options_yaml is None else "llm.yaml"},
                             "max_tokens": {"string_value": "64"}},
              "sequence_batching": {"max_sequence_idle_microseconds": 600_000_000}}
    model = TritonPythonModel()
    model.initialize({"model_config": json.dumps(config), "model_instance_name": "m_0", "model_name": "m",
                      "model_repository": str(tmp_path)})
    return model, record


@pytest.fixture
def served(monkeypatch, tmp_path):
    model, record = start(monkeypatch, tmp_path)
    try:
        yield model, standin.LLM.instances[0], record
    finally:
        model.finalize()


def send(model, request) -> standin.Sender:
    model.execute([request])
    assert request.sender.done.wait(10), "no final response"
    return request.sender


def streamed(sender: standin.Sender) -> tuple[list[int], str]:
    ids: list[int] = []
    text = ""
    for r in sender.responses:
        if r.error is None:
            ids += [int(i) for i in r.tensors["output_ids"]]
            text += r.tensors["text_output"][0].decode()
    return ids, text


def test_the_llm_is_built_single_process_then_attached_before_any_request(served):
    model, llm, record = served
    assert llm.single_process_env == "1" and llm.kwargs == {"model": "/ckpt/q"}
    assert record["options"] == [{"parsed": None}]  # no options file: the adapter's defaults
    send(model, standin.Request(3, start=True, input_ids=[5, 6, 7]))
    assert llm.events[:3] == ["built", "attached", "request"]


def test_a_session_streams_its_turns_as_one_conversation_with_its_salt(served):
    model, llm, record = served
    first = send(model, standin.Request(7, start=True, text_input="hi", cache_salt="tenant-a", max_tokens=32))
    assert first.error() is None and len(first.responses) > 1  # streamed, then the final response
    ids, text = streamed(first)
    call = llm.calls[0]
    assert call.prompt == CHAT.first_prompt("hi")
    assert (call.conversation_id, call.cache_salt, call.streaming) == ("triton-corrid-7", "tenant-a", True)
    assert call.sampling == standin.SamplingParams(max_tokens=32, top_k=1, return_perf_metrics=True)
    assert ids == TOK.encode(f"answer to {len(call.prompt)} tokens", add_special_tokens=False) + [standin.EOS]
    assert text == f"answer to {len(call.prompt)} tokens"
    final = first.responses[-1].tensors
    steps = llm.results[0].decoding_iter
    assert (int(final["drafted"][0]), int(final["accepted"][0])) == (3 * steps, steps)
    stats = json.loads(final["turn_stats"][0])
    assert (stats["prompt_tokens"], stats["output_tokens"], stats["verify_steps"]) == (len(call.prompt), len(ids),
                                                                                      steps)
    assert (stats["topology"], stats["carry_armed"], stats["finish_reason"]) == ("unpaired", True, "stop")
    assert final["model_instance"][0] == b"m_0"
    # the recorder has no turn record: the carry fields are left out, not guessed
    assert record["popped"] == [llm.results[0].request_id] and llm.results[0].request_id != 0
    assert "carry_outcome" not in final and "drafter_rows_computed" not in final
    assert (stats["outcome_kind"], stats["drafter_rows_computed"]) == ("", None)

    second = send(model, standin.Request(7, text_input="more", cache_salt="tenant-a"))
    assert second.error() is None
    follow = TOK.encode("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    assert llm.calls[1].prompt == [*call.prompt, *ids, *follow]  # the history token for token
    assert llm.calls[1].conversation_id == "triton-corrid-7"
    # the stand-in "reuses" the common prefix with the last prompt, in blocks of 4
    assert int(second.responses[-1].tensors["kv_cache_reused_blocks"][0]) == len(call.prompt) // 4
    drafted = 3 * (llm.results[0].decoding_iter + llm.results[1].decoding_iter)
    assert standin.metric("mtp_carry_drafts_total", result="proposed") == drafted
    assert standin.metric("mtp_carry_runtime", field="outcomes.adopted") == 1


def test_two_sessions_are_two_conversations(served):
    model, llm, _ = served
    send(model, standin.Request(1, start=True, input_ids=[9, 9, 9]))
    send(model, standin.Request(2, start=True, input_ids=[9, 9, 9]))
    assert [c.conversation_id for c in llm.calls] == ["triton-corrid-1", "triton-corrid-2"]
    assert [c.cache_salt for c in llm.calls] == [None, None]


def test_end_ends_the_session_and_a_continuation_of_an_unknown_one_is_refused(served):
    model, llm, record = served
    send(model, standin.Request(4, start=True, end=True, text_input="bye"))
    late = send(model, standin.Request(4, text_input="again"))
    assert late.error() == "unknown session CORRID=4: its first request must set START"
    assert len(llm.calls) == 1
    assert standin.metric("mtp_carry_sessions_ended_total", cause="end") == 1
    assert record["forgotten"] == ["triton-corrid-4"]  # only the session TensorRT-LLM served
    assert standin.metric("mtp_carry_rows_freed_total") == 7  # what forget_conversation dropped
    send(model, standin.Request(5, start=True, input_ids=[1, 2]))
    send(model, standin.Request(5, start=True, input_ids=[1, 2]))  # START again: the old session ends
    assert standin.metric("mtp_carry_sessions_ended_total", cause="restart") == 1
    assert record["forgotten"] == ["triton-corrid-4", "triton-corrid-5"]


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(corrid=8, start=True, text_input="a", input_ids=[1]), "request has both text_input and input_ids"),
    (dict(corrid=8, start=True), "request needs text_input (the new user message) or input_ids"),
    (dict(corrid=0, start=True, input_ids=[1]), "CORRID 0 is not a session"),
    (dict(corrid="user-1", start=True, input_ids=[1]), "sequence id 'user-1' is a string"),
    (dict(corrid=8, start=True, input_ids=[1], cache_salt=b"\xff"), "cache_salt is not valid UTF-8"),
    (dict(corrid=8, start=True, input_ids=[1], max_tokens=0), "max_tokens must be >= 1, got 0"),
])
def test_a_bad_request_gets_one_error_naming_it_and_generates_nothing(served, request_kwargs, message):
    model, llm, _ = served
    sender = send(model, standin.Request(**request_kwargs))
    assert len(sender.responses) == 1 and message in sender.error()
    assert llm.calls == []
    ok = send(model, standin.Request(8, start=True, input_ids=[1, 2, 3]))  # and the model keeps serving
    assert ok.error() is None


def test_a_cancelled_request_is_aborted_with_one_error(served):
    model, llm, _ = served
    request = standin.Request(6, start=True, input_ids=[1, 2, 3])
    request.cancel = True
    sender = send(model, request)
    assert llm.results[0].aborted() and sender.error() == "request cancelled by the client"


def test_a_cancelled_admitted_request_counts_the_outcome_decided_at_its_admission(served):
    model, llm, record = served
    turn = {"outcome": "no_carry", "no_carry_reason": "never_carried", "reused": 0, "rows_adopted": 0,
            "rows_computed": 3}  # the adapter's turn record: it decided this turn's outcome at admission
    model._engine.attachment.pop_turn = lambda rid: record["popped"].append(rid) or turn
    before = [standin.metric("mtp_carry_outcomes_total", kind="no_carry"),
              standin.metric("mtp_carry_no_carry_total", reason="never_carried")]
    request = standin.Request(6, start=True, input_ids=[1, 2, 3])
    request.cancel = True
    sender = send(model, request)
    assert llm.results[0].aborted() and sender.error() == "request cancelled by the client"
    assert record["popped"] == [llm.results[0].request_id]
    assert [standin.metric("mtp_carry_outcomes_total", kind="no_carry"),
            standin.metric("mtp_carry_no_carry_total", reason="never_carried")] == [before[0] + 1, before[1] + 1]


def test_finalize_detaches_the_carry_and_shuts_the_llm_down(served):
    model, llm, record = served
    model.finalize()
    assert record["detached"] == 1 and llm.shut_down


def test_a_refused_start_still_ends_the_previous_session(served):
    model, llm, _ = served
    send(model, standin.Request(11, start=True, input_ids=[1, 2]))
    refused = send(model, standin.Request(11, start=True, text_input="a", input_ids=[1]))
    assert "request has both text_input and input_ids" in refused.error()
    assert standin.metric("mtp_carry_sessions_ended_total", cause="restart") == 1
    late = send(model, standin.Request(11, input_ids=[1, 2, 3]))
    assert late.error() == "unknown session CORRID=11: its first request must set START"


def test_ended_sessions_leave_no_lock_or_queue_entry_behind(served):
    model, _, _ = served
    for corrid in range(20, 30):
        send(model, standin.Request(corrid, start=True, end=True, input_ids=[corrid, 1]))
    send(model, standin.Request(99, start=True, input_ids=[3]))  # still open: it keeps its lock
    deadline = time.monotonic() + 5  # the final response goes out just before the turn's bookkeeping
    while model._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(model._locks) == {99} and model._waiting == {} and set(model._conversations) == {99}


def test_a_zeroed_speculative_section_reports_nothing_drafted(served, monkeypatch):
    # TensorRT-LLM's PyTorch flow before _maybe_fill_spec_dec_perf_metrics leaves
    # RequestPerfMetrics.speculative_decoding zeroed even when drafting ran
    model, llm, _ = served
    monkeypatch.setattr(standin.LLM, "SPEC_DEC_FILLED", False)
    final = send(model, standin.Request(12, start=True, input_ids=[5, 6, 7])).responses[-1].tensors
    stats = json.loads(final["turn_stats"][0])
    assert (int(final["drafted"][0]), int(final["accepted"][0]), stats["acceptance"]) == (0, 0, 0.0)
    assert stats["verify_steps"] == llm.results[0].decoding_iter > 0
    assert standin.metric("mtp_carry_drafts_total") == 0


def test_an_llm_without_a_tokenizer_is_refused_at_load(monkeypatch, tmp_path):
    # generate_async takes SamplingParams.end_id from the tokenizer and raises without one
    with pytest.raises(ValueError) as err:
        start(monkeypatch, tmp_path, "skip_tokenizer_init: true\n")
    assert str(err.value) == NO_TOKENIZER
    llm = standin.LLM.instances[0]
    assert llm.kwargs == {"model": "/ckpt/q", "skip_tokenizer_init": True} and llm.tokenizer is None
    assert llm.shut_down and llm.calls == []


def test_package_code_reading_an_output_name_tensorrt_llm_lacks_gets_attribute_error(served):
    model, llm, _ = served
    send(model, standin.Request(13, start=True, input_ids=[5, 6, 7]))
    out = llm.results[0]
    assert out._done  # the stand-in's own bookkeeping, for tests
    code = compile("out.outputs[0].tokens", serving_module.__file__, "eval")
    with pytest.raises(AttributeError, match=r"TensorRT-LLM's CompletionOutput has no 'tokens' in "
                                             r"docs/TRTLLM-CONFORMANCE.md"):
        eval(code, vars(serving_module), {"out": out})
    assert eval(compile("getattr(out, 'prompt_ids', 'absent')", serving_module.__file__, "eval"),
                vars(serving_module), {"out": out}) == "absent"
    assert eval(compile("out.outputs[0].token_ids_diff", serving_module.__file__, "eval"),
                vars(serving_module), {"out": out}) == [standin.EOS]  # what the final response added
