"""Factories for the adapter's tests on the TensorRT-LLM STAND-IN (no TensorRT-LLM is run).

Conversations are built from the reference model's own training domain
(Python source from the standard library), so drafts are accepted at a real
rate. Every turn's prompt is padded with new user tokens to a multiple of the
prefill chunk, so a warm turn's reused depth R is chunk-aligned and a rebuild
run computes the rows of keys [0, R) in exactly the same chunks: bit-equal.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

from trtllm_mtp_carry.bench.sessions import BenchSession, load_conversations
from trtllm_mtp_carry.engine.model import HybridLM, load_reference
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer
from trtllm_mtp_carry.trtllm import CarryAttachment, attach
from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG
from trtllm_mtp_carry.trtllm.standin import ConversationParams, LlmRequest, StandinLLM

CHUNK = 32
TOKENIZER = ChatTokenizer()
POLICIES = ("carry", "blind", "rebuild", "off")


@functools.cache
def model() -> HybridLM:
    """The shipped reference weights in float32 (shared, read-only)."""
    return load_reference()[0]


@functools.cache
def corpus() -> tuple[int, ...]:
    """Token ids of a few standard-library modules (the model's training domain)."""
    root = Path(json.__file__).parent
    text = "".join((root / name).read_text() for name in ("decoder.py", "encoder.py", "scanner.py"))
    return tuple(ChatTokenizer().encode(text))


def user_tokens(offset: int, n: int) -> list[int]:
    ids = corpus()
    start = offset % (len(ids) - n)
    return list(ids[start:start + n])


def padded(prefix: list[int], offset: int, minimum: int = CHUNK // 2) -> list[int]:
    """`prefix` plus at least `minimum` new user tokens, to a multiple of CHUNK."""
    n = minimum + (-(len(prefix) + minimum)) % CHUNK
    return prefix + user_tokens(offset, n)


def make_llm(policy: str, **options: object) -> tuple[StandinLLM, CarryAttachment | None]:
    """A stand-in LLM for `policy`: carry (attached), blind (TensorRT-LLM as is), rebuild
    (block reuse off: every turn prefills from 0), off (no speculation)."""
    kw: dict[str, object] = {"chunk_size": CHUNK, "max_batch": 4, "single_process": True,
                             "kv_cache_config": RECOMMENDED_KV_CACHE_CONFIG}
    if policy == "rebuild":
        kw["enable_block_reuse"] = False
    if policy == "off":
        kw["max_draft_len"] = 0
    kw.update(options)
    llm = StandinLLM(model(), **kw)
    # the suite pins carry_slots() to 1 (tests/conftest.py): these sessions need one slot each
    return llm, attach(llm, {"carry_slots": 8}) if policy == "carry" else None


GATHER_ORDER = ["draft stream waits for the executor stream", "on the draft stream",
                "cpu waits for the draft stream"]
"""A deposit's gather on the draft stream, as the stream-order tests record it: ordered after the
executor's stream, and the CPU waits (its pages go back to the pool at free)."""
ADOPTION_ORDER = ["draft stream waits for the executor stream", "on the draft stream",  # the scatter
                  "executor stream waits for the draft stream", *GATHER_ORDER]
"""A warm turn's: the scatter on the draft stream, the executor's stream after it (no CPU wait),
then the turn's own deposit's gather."""


def cold_then_warm_turn(llm: StandinLLM, carry: CarryAttachment, log: list[str]) -> tuple[list[str], list[str]]:
    """One session's cold turn, then its warm turn (which must adopt): what `log` recorded during
    each (the stream-order tests' recorded CUDA calls)."""
    cold = llm.executor.submit(user_tokens(0, 70), 6, conversation_id="c", client_id=901)
    llm.run_until_done()
    first = list(log)
    log.clear()
    llm.executor.submit(cold.get_tokens(0) + user_tokens(100, 20), 6, conversation_id="c", client_id=902)
    llm.run_until_done()
    assert carry.pop_turn(902)["outcome"] == "adopted"  # type: ignore[index]
    return first, list(log)


def aligned(text: str, prefix_len: int, render: Callable[[str], list[int]]) -> list[int]:
    """`render(text + spaces)`, padded so that `prefix_len` plus it is a multiple of CHUNK."""
    n = len(render(text))
    return render(text + " " * ((-(prefix_len + n)) % CHUNK))


def quote_sessions(num: int) -> list[BenchSession]:
    """Held-out sessions where the user shows code, then asks to repeat it exactly.

    The second turn's answer copies the first turn's context, so a drafter
    blind over the reused prefix has nothing to copy from: the carry's case.
    """
    out = []
    for i, messages in enumerate(load_conversations()):
        first = next(j for j, m in enumerate(messages) if m["role"] == "user")
        repeat = [m["content"] for m in messages if m["role"] == "user"
                  and m["content"].startswith("Repeat `")]
        if repeat:
            out.append(BenchSession(f"q{i}", messages[: first + 1], repeat[:1]))
        if len(out) == num:
            return out
    raise AssertionError(f"only {len(out)} held-out sessions ask to repeat code")


def run_turns(llm: StandinLLM, sessions: list[BenchSession], turns: int, max_new: int,
              salt: str | None = None) -> dict[str, list[LlmRequest]]:
    """Run `turns` turns of every session, interleaved (all sessions' turn t run together).

    Turn 1 renders the history, each later turn appends the answer and the next
    user message (`ChatTokenizer.next_prompt`); every prompt is padded with
    spaces in its last user message to a multiple of CHUNK.
    """
    tok = TOKENIZER
    prompts = {}
    for s in sessions:
        head = tok.render_chat(s.history[:-1], add_generation_prompt=False)
        last = s.history[-1]["content"]
        prompts[s.name] = head + aligned(
            last, len(head), lambda t: tok.render_chat([{"role": "user", "content": t}]))
    done: dict[str, list[LlmRequest]] = {s.name: [] for s in sessions}
    for t in range(turns):
        reqs = {s.name: llm.generate_async(
            prompts[s.name], max_new, cache_salt=salt,
            conversation_params=ConversationParams(conversation_id=s.name)) for s in sessions}
        llm.run_until_done()
        for s in sessions:
            req = reqs[s.name]
            done[s.name].append(req)
            if t + 1 < turns:
                base = tok.next_prompt(req.prompt, req.output, "")
                prompts[s.name] = req.prompt + aligned(
                    s.followups[t], len(req.prompt),
                    lambda u, r=req: tok.next_prompt(r.prompt, r.output, u)[len(r.prompt):])
                assert prompts[s.name][: len(base) - 4] == base[: len(base) - 4]
    return done


def acceptance(reqs: dict[str, list[LlmRequest]], warm_only: bool = True) -> tuple[int, int]:
    """(accepted drafts, verify steps) over every (warm) turn."""
    acc = steps = 0
    for turns in reqs.values():
        for i, r in enumerate(turns):
            if i or not warm_only:
                acc, steps = acc + r.accepted, steps + r.verify_steps
    return acc, steps
