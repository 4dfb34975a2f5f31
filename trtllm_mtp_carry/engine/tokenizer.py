"""Byte-level chat tokenizer for the reference engine.

Ids 0..255 are the UTF-8 bytes; the specials follow (`pad`, `<|im_start|>`,
`<|im_end|>`, one token per role) and the vocabulary is padded to a multiple of
8. A chat renders ChatML-like, one message as

    <|im_start|> <|role|> content-bytes <|im_end|> "\\n"

and `add_generation_prompt` appends `<|im_start|> <|assistant|>`.

Invariant (the prefix cache relies on it): for messages `m` and an assistant
answer whose ids `a` decode to text `s` with `encode(s) == a` (valid UTF-8, no
specials), `render_chat(m + [assistant s, ...])` starts with exactly
`render_chat(m) + a + [im_end_id]`.

`next_prompt` renders a chat's next turn from the last turn's ids (prompt and
answer, then the next user message); the bench and the served model both
extend a conversation with it, so a text turn reaches the engine as exactly
the ids the bench measured.
"""

from __future__ import annotations

ROLES = ("system", "user", "assistant")


class ChatTokenizer:
    """Bytes plus chat specials; `encode`/`decode` round-trip any UTF-8 text."""

    def __init__(self) -> None:
        self.pad_id = 256
        self.im_start_id = 257
        self.im_end_id = 258
        self.role_ids = {role: 259 + i for i, role in enumerate(ROLES)}
        self.system_id = self.role_ids["system"]
        self.user_id = self.role_ids["user"]
        self.assistant_id = self.role_ids["assistant"]
        self.eos_id = self.im_end_id
        self.special_names = {
            self.pad_id: "<|pad|>",
            self.im_start_id: "<|im_start|>",
            self.im_end_id: "<|im_end|>",
            **{i: f"<|{r}|>" for r, i in self.role_ids.items()},
        }
        self.vocab_size = 264  # 262 used ids, padded to a multiple of 8
        self._newline = self.encode("\n")

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text`; never produces a special id."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes decoded with errors="replace"; specials rendered as their names."""
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
                continue
            if buf:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
            if i not in self.special_names:
                raise ValueError(f"token id {i} is not in the vocabulary (size {self.vocab_size})")
            out.append(self.special_names[i])
        if buf:
            out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def render_message(self, role: str, content: str) -> list[int]:
        """`<|im_start|><|role|>` + bytes + `<|im_end|>` + "\\n" for one message."""
        if role not in self.role_ids:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        return [self.im_start_id, self.role_ids[role], *self.encode(content), self.im_end_id,
                *self._newline]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render `messages` (dicts with role, content); the prefix invariant above holds."""
        ids: list[int] = []
        for m in messages:
            ids += self.render_message(m["role"], m["content"])
        if add_generation_prompt:
            ids += [self.im_start_id, self.assistant_id]
        return ids

    def next_prompt(self, prompt: list[int], output: list[int], user: str) -> list[int]:
        """The next turn's prompt: `prompt` and its answer `output` unchanged (closed with
        `<|im_end|>` once, when the answer did not end with it), "\\n", the user message
        `user`, the generation prompt. The ids the same chat renders to when the answer's
        ids round-trip as text (the invariant above)."""
        closed = output if output and output[-1] == self.eos_id else [*output, self.eos_id]
        return [*prompt, *closed, *self._newline, *self.render_message("user", user),
                self.im_start_id, self.assistant_id]
