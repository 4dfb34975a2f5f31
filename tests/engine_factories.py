"""Small factories for engine tests: a tiny random hybrid model and the greedy oracle."""

from __future__ import annotations

import torch

from trtllm_mtp_carry.engine.engine import EngineConfig, ReferenceEngine
from trtllm_mtp_carry.engine.model import DenseTargetCache, HybridConfig, HybridLM, init_random
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer

TOK = ChatTokenizer()


def tiny_config() -> HybridConfig:
    """Two hybrid blocks (linear, full) small enough for float64 on a CPU."""
    return HybridConfig(
        vocab_size=264, hidden_size=32, num_layers=4,
        layer_types=["linear", "full", "linear", "full"], num_heads=2, num_kv_heads=1,
        head_dim=16, partial_rotary_factor=0.25, rope_theta=1e7, intermediate_size=64,
        linear_num_heads=2, linear_key_dim=8, linear_value_dim=8, linear_chunk_size=16,
        max_position=4096,
    )


def tiny_model(seed: int = 0) -> HybridLM:
    """A random model whose drafter shares the target's weights' scale (drafts sometimes match)."""
    return init_random(tiny_config(), seed=seed)


def engine(model: HybridLM | None = None, **overrides) -> ReferenceEngine:
    """A float64 engine with 16-token blocks and chunks, unless overridden."""
    cfg = dict(block_size=16, num_target_blocks=256, drafter_block_size=16, num_drafter_blocks=256,
               max_model_len=2048, prefill_chunk=16, draft_len=2, dtype="float64")
    cfg.update(overrides)
    return ReferenceEngine(model if model is not None else tiny_model(), TOK, EngineConfig(**cfg))


@torch.no_grad()
def greedy_oracle(model: HybridLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding, one token per target forward, on a dense cache."""
    cache = DenseTargetCache(model.cfg)
    _, logits = model.forward_target(torch.tensor(prompt), 0, cache)
    out = [int(logits[-1].argmax())]
    while len(out) < max_new_tokens and out[-1] != TOK.eos_id:
        pos = len(prompt) + len(out) - 1
        _, logits = model.forward_target(torch.tensor([out[-1]]), pos, cache)
        out.append(int(logits[-1].argmax()))
    return out


def random_prompt(gen: torch.Generator, n: int) -> list[int]:
    """`n` byte tokens (no specials), deterministic under `gen`."""
    return torch.randint(32, 127, (n,), generator=gen).tolist()


def first_turn_then(eng: ReferenceEngine, gen: torch.Generator, session: str, history: int,
                    max_new_tokens: int, span: int):
    """Run a first turn of `history` random tokens; return it, its result, and the next
    turn's prompt (that turn, its answer, then `span` new tokens)."""
    turn1 = random_prompt(gen, history)
    r1 = eng.generate(session, turn1, max_new_tokens=max_new_tokens)
    return turn1, r1, turn1 + r1.output + random_prompt(gen, span)
