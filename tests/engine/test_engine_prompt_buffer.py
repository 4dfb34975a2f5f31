"""The carry decision gets the prompt as int64 when it came as token ids (compared in typed memory)."""

from array import array

import torch
from engine_factories import engine, random_prompt


def _prompts_prepare_saw(eng, prompt):
    seen = []
    real = eng.runtime.prepare

    def spy(seq_id, ticket, key, tokens, *args, **kwargs):
        seen.append(tokens)
        return real(seq_id, ticket, key, tokens, *args, **kwargs)

    eng.runtime.prepare = spy
    eng.generate("s", prompt, max_new_tokens=2)
    return seen


def test_token_ids_reach_the_carry_decision_as_the_int64_buffer_submit_checked():
    eng = engine()
    ids = random_prompt(torch.Generator().manual_seed(3), 40)
    (seen,) = _prompts_prepare_saw(eng, ids)
    assert isinstance(seen, array) and seen.typecode == "q" and seen.tolist() == ids


def test_a_message_prompt_reaches_it_as_the_rendered_list():
    eng = engine()
    (seen,) = _prompts_prepare_saw(eng, [{"role": "user", "content": "hello there"}])
    assert type(seen) is list and seen == eng.tokenizer.render_chat([{"role": "user", "content": "hello there"}])
