"""The model directory Dynamo's frontend reads: the package's tokenizer as Hugging Face files.

What it is for: in token mode the frontend tokenizes the request, applies the
chat template and detokenizes the stream itself, from a model directory. This
module writes one from `engine.tokenizer.ChatTokenizer`:

- `tokenizer.json`: a `tokenizers` byte-level BPE with no merges, so every
  UTF-8 byte b is token b, plus the specials (`<|pad|>`, `<|im_start|>`,
  `<|im_end|>`, one token per role) as added special tokens at their ids;
- `tokenizer_config.json`: the chat template, rendering exactly
  `ChatTokenizer.render_chat` (an unknown role raises, as there);
- `config.json`: an `architectures` field, the vocabulary, the context
  length and the end-of-turn token as `eos_token_id`.

Invariant (tests/dynamo pins it through the real frontend): for chat
messages whose contents hold no special token's name, the frontend's prompt
tokens equal `render_chat(messages)`, so a turn served through Dynamo equals
the same turn served in process. Pure Python: no torch, no Dynamo.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ...engine.tokenizer import ROLES, ChatTokenizer

ARCHITECTURE = "MtpCarryReferenceForCausalLM"
"""The `architectures` entry of config.json (the frontend only needs it to be present)."""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in [" + ", ".join(f"'{r}'" for r in ROLES) + "] -%}"
    "{{- raise_exception('unknown role ' ~ message['role'] ~ '; expected one of "
    + ", ".join(ROLES) + "') -}}"
    "{%- endif -%}"
    "{{- '<|im_start|><|' ~ message['role'] ~ '|>' ~ message['content'] ~ '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|><|assistant|>' -}}{%- endif -%}"
)
"""Jinja chat template equal to `ChatTokenizer.render_chat` (ChatML-like, one token per role)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, which `ByteLevel` pre-tokenizes with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def tokenizer_json(tok: ChatTokenizer) -> dict[str, Any]:
    """The `tokenizers` file: token b is byte b (0..255), the specials keep their ids."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    vocab = {char: b for b, char in sorted(_bytes_to_unicode().items())}
    added = [{"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, name in sorted(tok.special_names.items())]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def write_model_dir(directory: str | Path, context_length: int,
                    tok: ChatTokenizer | None = None) -> Path:
    """Write tokenizer.json, tokenizer_config.json, config.json and generation_config.json
    into `directory` (created; each file replaced atomically); returns its path.
    `context_length` is the engine's max_model_len."""
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length <= 0:
        raise ValueError(f"context_length must be a positive int, got {context_length!r}")
    tok = tok or ChatTokenizer()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    names = tok.special_names
    files: dict[str, Any] = {
        "tokenizer.json": tokenizer_json(tok),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
            "bos_token": None, "eos_token": names[tok.eos_id], "pad_token": names[tok.pad_id],
            "add_bos_token": False, "add_eos_token": False, "model_max_length": context_length,
            "clean_up_tokenization_spaces": False,
        },
        "config.json": {
            "architectures": [ARCHITECTURE], "model_type": "mtp_carry_reference",
            "vocab_size": tok.vocab_size, "max_position_embeddings": context_length,
            "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id,
        },
        "generation_config.json": {"eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id},
    }
    for name, content in files.items():  # atomically: several workers may share the directory
        tmp = path / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(tmp, path / name)
    return path
