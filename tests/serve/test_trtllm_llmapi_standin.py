"""The LLM API stand-in (`trtllm_standin`) behaves as TensorRT-LLM's source does, name by name.

Each test pins one row of docs/TRTLLM-CONFORMANCE.md section 4 on the stand-in the
Triton model's tests run on: what `LLM(...)` and `generate_async` refuse, how a
stream accumulates `token_ids` and `text`, the finish reasons, `SamplingParams`,
`ConversationParams` and `update_llm_args_with_extra_dict`. Not TensorRT-LLM: the
semantics are the source's as read (file and commit in the doc).
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
import trtllm_standin as standin

from trtllm_mtp_carry.serve.trtllm.serving import sampling_kwargs

TOK = standin.ChatMLTokenizer()


def collect(result) -> list[tuple[list[int], str, list[int], str, str | None, bool]]:
    """Every step of a stream: (token_ids, text, token_ids_diff, text_diff, finish_reason, finished)."""
    async def run():
        steps = []
        async for out in result:
            c = out.outputs[0]
            steps.append((list(c.token_ids), c.text, list(c.token_ids_diff), c.text_diff, c.finish_reason,
                          out.finished))
        return steps

    return asyncio.run(run())


def answer(prompt_len: int) -> list[int]:
    return TOK.encode(f"answer to {prompt_len} tokens", add_special_tokens=False) + [standin.EOS]


def test_a_stream_accumulates_token_ids_and_text_and_diffs_the_last_response():
    llm = standin.LLM("/ckpt/q")
    steps = collect(llm.generate_async({"prompt_token_ids": [1, 2, 3]}, standin.SamplingParams(max_tokens=64),
                                       streaming=True))
    full = answer(3)
    assert [s[0] for s in steps] == [full[: i + 2] for i in range(0, len(full), 2)]  # cumulative
    assert [s[2] for s in steps] == [full[i: i + 2] for i in range(0, len(full), 2)]  # the last response's
    assert "".join(s[3] for s in steps) == steps[-1][1] == "answer to 3 tokens"  # no end id in the text
    assert [s[4] for s in steps] == [None] * (len(steps) - 1) + ["stop"]
    assert [s[5] for s in steps] == [False] * (len(steps) - 1) + [True]


def test_without_streaming_only_the_final_response_comes_with_every_token():
    llm = standin.LLM("/ckpt/q")
    steps = collect(llm.generate_async({"prompt_token_ids": [1, 2, 3]}, standin.SamplingParams(max_tokens=64)))
    assert steps == [(answer(3), "answer to 3 tokens", answer(3), "answer to 3 tokens", "stop", True)]


def test_finish_reasons_are_the_sources():
    llm = standin.LLM("/ckpt/q")
    cut = collect(llm.generate_async({"prompt_token_ids": [1, 2, 3]}, standin.SamplingParams(max_tokens=5),
                                     streaming=True))
    assert cut[-1][0] == answer(3)[:5] and cut[-1][4] == "length"

    result = llm.generate_async({"prompt_token_ids": [1, 2, 3]}, standin.SamplingParams(max_tokens=64),
                                streaming=True)

    async def abort_after_first():
        first = await result.__anext__()
        assert first.outputs[0].finish_reason is None
        result.abort()
        last = await result.__anext__()
        with pytest.raises(StopAsyncIteration):
            await result.__anext__()
        return last

    last = asyncio.run(abort_after_first())
    assert (last.finished, last.aborted(), last.outputs[0].finish_reason) == (True, True, "cancelled")
    assert last.outputs[0].token_ids == answer(3)[:2] and last.outputs[0].token_ids_diff == []


def test_generate_async_checks_as_the_source_does():
    llm = standin.LLM("/ckpt/q")
    with pytest.raises(TypeError, match=r"^The sampling_params must be type SamplingParams or None, but got "):
        llm.generate_async({"prompt_token_ids": [1, 2]}, {"max_tokens": 4})
    with pytest.raises(TypeError, match=r"^The inputs must be type str or list of int, but got <class 'dict'>$"):
        llm.generate_async({"token_ids": [1, 2]}, standin.SamplingParams())
    with pytest.raises(TypeError):  # streaming and the rest are keywords, as the model passes them
        llm.generate_async({"prompt_token_ids": [1, 2]}, standin.SamplingParams(), True)
    params = standin.SamplingParams(max_tokens=4)
    collect(llm.generate_async({"prompt_token_ids": [1, 2]}, params))
    assert params.end_id is None  # the caller's object is left as built; the request got the tokenizer's
    assert llm.results[0]._sampling_params.end_id == standin.EOS
    blind = standin.LLM("/ckpt/q", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match=r"^tokenizer is required to reset end_id if it is None"):
        blind.generate_async({"prompt_token_ids": [1, 2]}, standin.SamplingParams())
    collect(blind.generate_async({"prompt_token_ids": [1, 2]}, standin.SamplingParams(end_id=standin.EOS)))
    llm.shutdown()
    with pytest.raises(RuntimeError, match=r"^LLM is shutting down$"):
        llm.generate_async({"prompt_token_ids": [1, 2]}, standin.SamplingParams())


def test_the_generate_async_keywords_are_the_sources():
    for cls in (standin.LLM, standin.ExecutorLLM):
        params = list(inspect.signature(cls.generate_async).parameters)[1:]
        assert params[:2] == ["inputs", "sampling_params"]
        assert set(params) <= set(standin.GENERATE_ASYNC_PARAMETERS), cls
        assert list(standin.GENERATE_ASYNC_PARAMETERS[:2]) == params[:2]


def test_an_unknown_llm_argument_is_refused_as_the_source_does():
    with pytest.raises(ValueError, match=r"^LLM got invalid argument: mtp_carry$"):
        standin.LLM("/ckpt/q", mtp_carry={"enable": True})
    with pytest.raises(TypeError):
        standin.LLM()  # model is required
    assert standin.LLM("/ckpt/q", kv_cache_config={"enable_block_reuse": True}).kwargs == {
        "model": "/ckpt/q", "kv_cache_config": {"enable_block_reuse": True}}


def test_sampling_params_take_the_sources_keywords_and_checks():
    sp = standin.SamplingParams()
    assert (sp.max_tokens, sp.top_k, sp.return_perf_metrics, sp.end_id, sp.best_of) == (32, None, False, None, 1)
    with pytest.raises(TypeError):
        standin.SamplingParams(max_new_tokens=4)
    with pytest.raises(TypeError):
        standin.SamplingParams(4)  # keyword-only
    with pytest.raises(ValueError, match=r"^require top_k >= 0, got top_k=-1$"):
        standin.SamplingParams(top_k=-1)
    # the model's keywords are SamplingParams fields the table lists
    assert set(sampling_kwargs(7, 64)) == standin.LLMAPI_NAMES["SamplingParams"]
    assert standin.SamplingParams(**sampling_kwargs(7, 64)) == standin.SamplingParams(
        max_tokens=7, top_k=1, return_perf_metrics=True)


@pytest.mark.parametrize("given, kept", [("triton-corrid-7", "triton-corrid-7"), ("  s-1 \n", "s-1"), (42, "42")])
def test_conversation_params_strip_and_refuse_as_the_source_does(given, kept):
    assert standin.ConversationParams(conversation_id=given).conversation_id == kept
    for bad in (None, "", "   "):
        with pytest.raises(ValueError, match=r"^conversation_id must be non-empty$"):
            standin.ConversationParams(conversation_id=bad)
    with pytest.raises(TypeError):
        standin.ConversationParams(given)  # keyword-only
    with pytest.raises(AttributeError):
        standin.ConversationParams(conversation_id=given).session = "x"  # slots: no other attribute


def test_extra_llm_args_merge_as_the_source_does():
    merged = standin.update_llm_args_with_extra_dict({"model": "/m", "backend": "pytorch"},
                                                     {"backend": "_autodeploy", "kv_cache_config": {"x": 1}})
    assert merged == {"model": "/m", "backend": "_autodeploy", "kv_cache_config": {"x": 1}}
    with pytest.raises(TypeError, match=r"^kv_cache_config: argument after \*\* must be a mapping, not int$"):
        standin.update_llm_args_with_extra_dict({"model": "/m"}, {"kv_cache_config": 5})
