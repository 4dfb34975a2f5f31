"""What the TensorRT-LLM Triton model does between a request and `LLM.generate_async` (pure Python).

What it is for: the request mapping of `triton-repo --engine trtllm`, kept
apart from Triton and TensorRT-LLM so it is tested with exact values on any
machine: the model's options (`TrtllmServeOptions`, Triton string parameters),
the session identity (`conversation_id_for`: the sequence batcher's `CORRID`
becomes `ConversationParams.conversation_id`), the salt (`salt_text`: the
`cache_salt` input becomes `generate_async(cache_salt=...)`), the sampling
keywords, the next turn's prompt from a chat template (`ChatTemplate`), the
the model's `LLM(**...)` arguments from its options file (`triton_llm_args`:
`model` from the parameter, TensorRT-LLM's `triton_config` dropped, the
`mtp_carry` section returned unparsed), and the per-turn statistics read from
TensorRT-LLM's `RequestOutput` and the adapter's turn record (`TrtllmTurnStats`).

Invariants:
- one CORRID is one conversation id, and distinct CORRIDs never share one;
  a salt is passed through exactly (TensorRT-LLM hashes it into its reuse
  scope, and the adapter into the session key), never trimmed or defaulted;
- a text turn's prompt extends the previous turn's prompt and output token
  for token (only the chat template's closing and the new user message are
  appended), so TensorRT-LLM's prefix reuse and the carry see the history
  the engine itself produced;
- every malformed value raises ValueError naming it; nothing here imports
  tensorrt_llm, torch or Triton.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from ...engine.turn import DraftRates
from ..options import ServeOptions

TRTLLM_ENGINE = "trtllm"
TRTLLM_EXTRA = 'pip install "trtllm-mtp-carry[trtllm]"'
MISSING_TRTLLM = (f"the trtllm engine needs TensorRT-LLM, which is not installed: {TRTLLM_EXTRA} "
                  "(TensorRT-LLM runs on an NVIDIA GPU)")
CONVERSATION_PREFIX = "triton-corrid-"
CARRY_SECTION = "mtp_carry"
IGNORED_SECTION = "triton_config"  # TensorRT-LLM's own model.yaml key; config.pbtxt governs here
MAX_CORRID = 2**64 - 1


@dataclass(frozen=True)
class TrtllmServeOptions:
    """The TensorRT-LLM model's parameters: the checkpoint, its LLM options file, the
    default `max_tokens`. Parsed and written by the same rule as the reference model's."""

    engine: str = TRTLLM_ENGINE
    model: str = ""  # LLM(model=...): a checkpoint directory or a Hugging Face model name
    llm_options: str = ""  # file name in the model's directory ("" = no options)
    max_tokens: int = 64  # used when a request sends no max_tokens
    # Triton's idle timer starts at a request's arrival, so its value is the session idle
    # timeout plus this bound on a turn (as for the reference model, serve/triton/repo.py)
    max_turn_s: int = 300

    def __post_init__(self) -> None:
        if self.engine != TRTLLM_ENGINE:
            raise ValueError(f"parameter engine must be {TRTLLM_ENGINE}, got {self.engine!r}")
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("parameter model must name a checkpoint directory or model, got "
                             f"{self.model!r}")
        if not isinstance(self.llm_options, str) or "/" in self.llm_options or self.llm_options in (".", ".."):
            raise ValueError(f"parameter llm_options must be a file name in the model's directory, "
                             f"got {self.llm_options!r}")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"parameter max_tokens must be >= 1, got {self.max_tokens!r}")
        if isinstance(self.max_turn_s, bool) or not isinstance(self.max_turn_s, int) or self.max_turn_s <= 0:
            raise ValueError(f"parameter max_turn_s must be >= 1, got {self.max_turn_s!r}")

    @classmethod
    def from_parameters(cls, parameters: dict[str, Any]) -> TrtllmServeOptions:
        """Options from Triton's `parameters`, by the reference model's rule (it reads the
        fields of `cls`): unknown keys and malformed values raise ValueError naming the key."""
        parse = ServeOptions.from_parameters.__func__  # type: ignore[attr-defined]
        return cast(TrtllmServeOptions, parse(cls, parameters))

    def as_parameters(self) -> dict[str, str]:
        """The options as Triton string parameters."""
        return ServeOptions.as_parameters(self)  # type: ignore[arg-type]


def conversation_id_for(corrid: int) -> str:
    """The `ConversationParams.conversation_id` of sequence `corrid` ("triton-corrid-<n>").

    ValueError for 0 (the batcher's "no sequence") and for what is not a uint64."""
    if isinstance(corrid, bool) or not isinstance(corrid, int):
        raise ValueError(f"CORRID must be an unsigned 64-bit integer, got {corrid!r}")
    if corrid == 0:
        raise ValueError("CORRID 0 is not a session; send a non-zero correlation id")
    if not 0 < corrid <= MAX_CORRID:
        raise ValueError(f"CORRID must be an unsigned 64-bit integer, got {corrid}")
    return f"{CONVERSATION_PREFIX}{corrid}"


def salt_text(value: bytes | str | None) -> str | None:
    """The `cache_salt` for `generate_async` (TensorRT-LLM takes a str): the UTF-8 text of
    the input, unchanged; None when the request sent none."""
    if value is None:
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("cache_salt is not valid UTF-8 (TensorRT-LLM takes a text salt)") from None
    if not isinstance(value, str):
        raise ValueError(f"cache_salt must be text, got {value!r}")
    if value == "":
        raise ValueError("cache_salt is empty; send a non-empty salt or none")
    return value


def sampling_kwargs(max_tokens: int | None, default_max_tokens: int) -> dict[str, Any]:
    """`SamplingParams(**...)` of one turn: greedy (`top_k=1`, so greedy under every
    TensorRT-LLM version's rule), the turn's `max_tokens` (else the model's default),
    and per-request perf metrics (drafted/accepted tokens, reused blocks)."""
    n = default_max_tokens if max_tokens is None else max_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"max_tokens must be >= 1, got {n!r}")
    return {"max_tokens": n, "top_k": 1, "return_perf_metrics": True}


def triton_llm_args(options: Mapping[str, Any] | None, model: str) -> tuple[dict[str, Any], Any]:
    """(the Triton model's `LLM(**...)` keywords with `model`, its `mtp_carry` section
    unparsed or None) from the parsed YAML of its options file.

    `model` comes from the model's parameter, so the YAML may not set it; TensorRT-LLM's
    own `triton_config` key is dropped (config.pbtxt is this model's Triton config)."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ValueError(f"the LLM options must be a YAML mapping, got {type(options).__name__}")
    bad = [k for k in options if not isinstance(k, str)]
    if bad:
        raise ValueError(f"LLM option keys must be strings, got {bad[0]!r}")
    if "model" in options:
        raise ValueError("the LLM options set 'model'; give the checkpoint with --model only")
    llm_args = {k: v for k, v in options.items() if k not in (CARRY_SECTION, IGNORED_SECTION)}
    llm_args["model"] = model
    return llm_args, options.get(CARRY_SECTION)


class ChatTemplate:
    """A Hugging Face tokenizer's chat template as the session layer needs it.

    `render(messages)` is the template's text (`apply_chat_template(..., tokenize=False)`)
    and `encode` its ids without added specials, so a rendered chat is encoded once."""

    _USER = "\x00mtp-carry-user\x00"
    _ASSISTANT = "\x00mtp-carry-assistant\x00"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        if not isinstance(eos, int):
            raise ValueError("the tokenizer has no eos_token_id; send input_ids instead of text_input")
        self.eos_id = eos

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        if not isinstance(text, str):
            raise ValueError("the tokenizer's chat template did not render text")
        return text

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def first_prompt(self, user: str) -> list[int]:
        """The ids of a one-message chat with the generation prompt."""
        return self.encode(self.render([{"role": "user", "content": user}], add_generation_prompt=True))

    def follow_up(self, user: str, closed: bool) -> str:
        """The text after an assistant answer up to the next answer: the template's closing
        (without its leading end-of-turn token when the answer already ended with it), the
        user message, the generation prompt. ValueError when the template does not render
        an assistant answer verbatim (then the model cannot extend the history)."""
        chat = [{"role": "user", "content": self._USER}, {"role": "assistant", "content": self._ASSISTANT},
                {"role": "user", "content": user}]
        text = self.render(chat, add_generation_prompt=True)
        if text.count(self._ASSISTANT) != 1:
            raise ValueError("the chat template does not render an assistant turn verbatim; "
                             "send input_ids (the full prompt) instead of text_input")
        tail = text[text.index(self._ASSISTANT) + len(self._ASSISTANT):]
        eos_text = self.tokenizer.decode([self.eos_id])
        if closed and eos_text and tail.startswith(eos_text):
            tail = tail[len(eos_text):]
        return tail

    def next_prompt(self, prompt: Sequence[int], output: Sequence[int], user: str) -> list[int]:
        """The next turn's ids: the last prompt and output unchanged, then `follow_up`."""
        closed = bool(output) and output[-1] == self.eos_id
        return [*prompt, *output, *self.encode(self.follow_up(user, closed))]


NOT_ARMED = "not_armed"
"""`outcome_kind` of a turn on a model whose carry is not armed (paired, folded, disabled)."""


@dataclass
class TrtllmTurnStats(DraftRates):
    """What one turn cost and bought: TensorRT-LLM's per-request metrics and the adapter's
    turn record (times in milliseconds).

    The names are the reference model's (`TurnStats`) where the meaning is the same;
    `ttft_ms` is measured by the model from the request's submission to its first token.
    The carry's fields come from the adapter (`CarryAttachment.pop_turn`), which takes the
    carry decision for every request: `outcome_kind` is the core's outcome kind (`adopted`,
    `no_carry`, ...; every turn of a conversation is judged, so a first turn is `no_carry`
    with `no_carry_reason` `never_carried`), `not_armed` when the carry is not installed, "" when unknown (no record); `drafter_rows_kept` the carried
    rows restored over the reused prefix; `drafter_rows_computed` the prompt's pair keys
    `[R, L - 1)` TensorRT-LLM's context phase computes (the reference's count); a value
    the adapter does not know is None (not armed, or no record)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0  # TensorRT-LLM's decoding iterations of the turn
    kv_cache_reused_blocks: int = 0
    kv_cache_hit_rate: float = 0.0
    ttft_ms: float = 0.0
    decode_ms: float = 0.0
    finish_reason: str = ""
    topology: str = ""  # the adapter's: unpaired / paired / folded
    carry_armed: bool = False
    outcome_kind: str = ""
    no_carry_reason: str = ""  # a no_carry outcome's reason (NO_CARRY_REASONS), else ""
    reused_tokens: int | None = None  # R: the prompt tokens TensorRT-LLM reused
    drafter_rows_kept: int | None = None
    drafter_rows_computed: int | None = None


def carry_fields(record: Mapping[str, Any] | None, armed: bool) -> dict[str, Any]:
    """`TrtllmTurnStats`'s carry fields from the adapter's turn record (`pop_turn`), or
    what is known without one: `not_armed` (nothing was carried) or unknown ("" and None)."""
    if not armed:
        return {"outcome_kind": NOT_ARMED, "drafter_rows_kept": 0}
    if record is None:
        return {}
    return {"outcome_kind": str(record["outcome"]), "no_carry_reason": str(record["no_carry_reason"]),
            "reused_tokens": int(record["reused"]), "drafter_rows_kept": int(record["rows_adopted"]),
            "drafter_rows_computed": int(record["rows_computed"])}


def turn_stats(prompt_tokens: int, output: Any, result: Any, ttft_ms: float, total_ms: float,
               topology: str = "", carry_armed: bool = False,
               carry: Mapping[str, Any] | None = None) -> TrtllmTurnStats:
    """The statistics of a finished turn from its final `CompletionOutput` (`output`) and
    `RequestOutput` (`result`), and the adapter's turn record `carry` (`carry_fields`);
    a metric TensorRT-LLM did not return stays 0."""
    perf = getattr(output, "request_perf_metrics", None)
    spec = getattr(perf, "speculative_decoding", None)
    kv = getattr(perf, "kv_cache_metrics", None)

    def num(obj: Any, name: str) -> int:
        value = getattr(obj, name, None)
        return int(value) if value is not None else 0

    hit = getattr(kv, "kv_cache_hit_rate", None)
    return TrtllmTurnStats(
        prompt_tokens=prompt_tokens, output_tokens=len(getattr(output, "token_ids", None) or []),
        drafted=num(spec, "total_draft_tokens"), accepted=num(spec, "total_accepted_draft_tokens"),
        verify_steps=num(result, "decoding_iter"), kv_cache_reused_blocks=num(kv, "num_reused_blocks"),
        kv_cache_hit_rate=float(hit) if hit is not None else 0.0,
        ttft_ms=ttft_ms, decode_ms=max(0.0, total_ms - ttft_ms),
        finish_reason=str(getattr(output, "finish_reason", None) or ""),
        topology=topology, carry_armed=carry_armed, **carry_fields(carry, carry_armed),
    )
