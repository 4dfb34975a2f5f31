"""Which session a TensorRT-LLM request belongs to: its conversation id, cache salt and LoRA.

What it is for: the carry adopts rows only for the same session, never for a
shared token prefix (two conversations agree on hundreds of chat-template
tokens). Inside TensorRT-LLM's PyTorch backend the session is the request's
`py_conversation_params.conversation_id` (`tensorrt_llm/conversation_params.py`:
`ConversationParams(conversation_id: str)`, stripped; copied onto the
executor request as `py_conversation_params`), scoped exactly as KV cache
manager V2 scopes its own reuse: by the request's `cache_salt` string and
`lora_task_id`. V2 builds `ReuseScope(lora_id=req.lora_task_id,
salt=self._derive_reuse_salt(req.cache_salt))` (`probe_context_reuse`,
`kv_cache_manager_v2.py` @ 00043967, whose `_mirror_draft_kv_cache` also passes
`cache_salt=req.cache_salt` to `_create_kv_cache`), and newer
`LlmRequest`s carry only that string (`llm_request.py` @ 002f3cc3 passes
`cache_salt=executor_request.cache_salt`). Older builds carry only
`cache_salt_id`, the 64-bit hash `tensorrt_llm.inputs.utils.get_cache_salt_id`
makes of the client's salt (`executor_request_to_llm_request`; V1's C++ block
keys): read only where the string is absent.

Invariants:
- `session_key_for` is stable across processes (the core's blake2b
  `session_hash` of one unambiguous encoding) and never 0.
- A different salt or LoRA id is a different session. `session_key_for` refuses an
  empty salt (no salt is None); a request's empty `cache_salt` is a session of its own,
  as it is a reuse scope of its own in V2.
- A request without a conversation id has no session (`None`): it is never carried.
- `conversation_session` is the key without the salt: every key of one
  conversation (any salt) names it as its session, so ending the conversation
  drops its rows under every salt (`CarryStore.evict_session`).
"""

from __future__ import annotations

import json

from ..core.session import carry_key, session_hash


def conversation_session(conversation_id: str, lora_id: int | None = None) -> int:
    """Non-zero 64-bit session of `(conversation_id.strip(), lora_id)`, before any salt.

    `ValueError` for an empty or blank conversation id, `TypeError` for a non-str id
    or a non-int LoRA id; each names the value.
    """
    if not isinstance(conversation_id, str):
        raise TypeError(f"conversation_id must be a str, got {conversation_id!r}")
    conv = conversation_id.strip()  # ConversationParams strips it the same way
    if not conv:
        raise ValueError(f"conversation_id must be a non-blank string, got {conversation_id!r}")
    if lora_id is not None and (isinstance(lora_id, bool) or not isinstance(lora_id, int)
                                or lora_id < 0):
        raise TypeError(f"lora_id must be a non-negative int or None, got {lora_id!r}")
    # JSON of a list: no separator trick can make two different pairs collide
    return session_hash(json.dumps(["trtllm", conv, lora_id], ensure_ascii=False))


def session_key_for(conversation_id: str, cache_salt: str | None = None,
                    lora_id: int | None = None, *, cache_salt_id: int | None = None) -> int:
    """Non-zero 64-bit carry key of `(conversation_id.strip(), lora_id)` under a salt.

    The salt is `cache_salt` (text) or `cache_salt_id` (TensorRT-LLM's 64-bit id of
    a salt, what its executor request holds), not both. `ValueError` for an empty or
    blank conversation id, an empty salt or both salts, `TypeError` for a non-str id
    or salt, a non-int salt id or LoRA id; each names the value.
    """
    session = conversation_session(conversation_id, lora_id)
    if cache_salt_id is not None:
        if cache_salt is not None:
            raise ValueError("give cache_salt or cache_salt_id, not both")
        if isinstance(cache_salt_id, bool) or not isinstance(cache_salt_id, int) or \
                not 0 <= cache_salt_id < 1 << 64:
            raise TypeError(f"cache_salt_id must be an int in [0, 2**64), got {cache_salt_id!r}")
        return carry_key(session, f"trtllm-salt-id:{cache_salt_id}")
    if cache_salt is not None:
        if not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {cache_salt!r}")
        if not cache_salt:
            raise ValueError("cache_salt must be a non-empty string or None, got ''")
    # the salt scopes the key by the core's one rule (`carry_key`), as in the reference engine
    return carry_key(session, cache_salt)


def request_session(request: object) -> tuple[int, int] | None:
    """`(carry key, conversation session)` of an executor request (`LlmRequest`), or None
    when it has no conversation id.

    Reads `py_conversation_params.conversation_id`, `lora_task_id` and the salt V2's
    reuse scope reads, the `cache_salt` string; only where a request has no salt string
    (older builds: no such attribute, or None), `cache_salt_id`; neither: unsalted. A
    missing or blank conversation id means "no session". The key under salt text `s`
    equals `session_key_for(conversation_id, s, lora_id)`; the empty salt, a scope of its
    own in V2 (`_derive_reuse_salt` tells None from ""), gets a key of its own.
    """
    params = getattr(request, "py_conversation_params", None)
    conv = getattr(params, "conversation_id", None) if params is not None else None
    if not isinstance(conv, str) or not conv.strip():
        return None
    lora = getattr(request, "lora_task_id", None)
    lora_id = None if lora is None else int(lora)
    salt = getattr(request, "cache_salt", None)
    if isinstance(salt, str) and salt:
        key = session_key_for(conv, salt, lora_id)
    elif isinstance(salt, str):  # "": not None's scope, and no text session_key_for takes
        key = session_hash(json.dumps(["trtllm", conv.strip(), lora_id, ""], ensure_ascii=False))
    else:  # an older build: only the 64-bit id of the salt, if any
        salt_id = getattr(request, "cache_salt_id", None)
        key = session_key_for(conv, None, lora_id,
                              cache_salt_id=None if salt_id is None else int(salt_id))
    return key, conversation_session(conv, lora_id)


def request_session_key(request: object) -> int | None:
    """The carry key of an executor request (`request_session`'s first item), or None."""
    found = request_session(request)
    return None if found is None else found[0]
