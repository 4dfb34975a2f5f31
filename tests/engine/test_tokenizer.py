"""ChatTokenizer: byte round-trip, special rendering, and the chat prefix property."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer

TOK = ChatTokenizer()
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


def test_special_ids_are_distinct_and_in_vocab():
    ids = [TOK.pad_id, TOK.im_start_id, TOK.im_end_id, TOK.system_id, TOK.user_id,
           TOK.assistant_id]
    assert len(set(ids)) == len(ids)
    assert all(256 <= i < TOK.vocab_size for i in ids)
    assert TOK.eos_id == TOK.im_end_id
    assert TOK.vocab_size == 264


@given(texts)
def test_encode_decode_round_trip(text):
    ids = TOK.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert TOK.decode(ids) == text


def test_decode_renders_specials_and_replaces_bad_bytes():
    assert TOK.decode([TOK.im_start_id, TOK.user_id, 104, 105, TOK.im_end_id]) == \
        "<|im_start|><|user|>hi<|im_end|>"
    assert TOK.decode([0xFF, 65]) == "\ufffdA"
    with pytest.raises(ValueError, match="999"):
        TOK.decode([999])


def test_render_chat_layout():
    ids = TOK.render_chat([{"role": "user", "content": "ab"}])
    assert ids == [TOK.im_start_id, TOK.user_id, 97, 98, TOK.im_end_id, 10,
                   TOK.im_start_id, TOK.assistant_id]
    assert TOK.render_chat([{"role": "user", "content": "ab"}], add_generation_prompt=False) == \
        ids[:-2]
    with pytest.raises(ValueError, match="'robot'"):
        TOK.render_chat([{"role": "robot", "content": "x"}])


@settings(max_examples=50)
@given(st.lists(texts, min_size=2, max_size=7), st.booleans())
def test_next_turn_starts_with_prompt_plus_answer_plus_im_end(contents, system):
    """Turn n+1's rendering extends turn n's prompt + answer ids + <|im_end|> (prefix cache)."""
    msgs = [{"role": "system", "content": "sys"}] if system else []
    for i, c in enumerate(contents):
        if i % 2 == 0:
            msgs.append({"role": "user", "content": c})
            continue
        prompt = TOK.render_chat(msgs, add_generation_prompt=True)
        answer = TOK.encode(c)  # what the engine generated; decode(answer) == c
        msgs.append({"role": "assistant", "content": TOK.decode(answer)})
        nxt = TOK.render_chat(msgs + [{"role": "user", "content": "next"}])
        expect = prompt + answer + [TOK.im_end_id]
        assert nxt[:len(expect)] == expect


def test_next_prompt_closes_an_unfinished_answer_once():
    closed = TOK.next_prompt([1], [65, TOK.eos_id], "hi")
    cut = TOK.next_prompt([1], [65], "hi")
    assert closed == cut == [1, 65, TOK.eos_id, 10, *TOK.render_message("user", "hi"),
                             TOK.im_start_id, TOK.assistant_id]


@settings(max_examples=50, deadline=None)
@given(history=texts, answer=texts, user=texts)
def test_next_prompt_is_the_extended_chat_rendered(history, answer, user):
    # what the bench sends as ids and what a served text turn builds are the same chat
    chat = [{"role": "user", "content": history}]
    prompt = TOK.render_chat(chat)
    extended = [*chat, {"role": "assistant", "content": answer}, {"role": "user", "content": user}]
    assert TOK.next_prompt(prompt, TOK.encode(answer), user) == TOK.render_chat(extended)
