"""Small factories for engine tests: a tiny random hybrid model and the greedy oracle.

`MTP_CARRY_TEST_DEVICE` (default `cpu`; `cuda` or `cuda:N`) is where `engine()` puts the
reference engine (its model, caches, drafter pool, carry): the GPU check
(scripts/gpu_smoke.sh) runs the engine and runtime tests on the GPU with it. The greedy
oracle computes on a CPU copy of the model wherever the engine moved it.
"""

from __future__ import annotations

import copy
import os

import torch

from trtllm_mtp_carry.engine.engine import EngineConfig, ReferenceEngine
from trtllm_mtp_carry.engine.model import DenseTargetCache, HybridConfig, HybridLM, init_random
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer

TOK = ChatTokenizer()


def _test_device() -> str:
    value = os.environ.get("MTP_CARRY_TEST_DEVICE", "cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"MTP_CARRY_TEST_DEVICE must be cpu, cuda or cuda:N, got {value!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"MTP_CARRY_TEST_DEVICE={value!r} but torch.cuda.is_available() is False")
    return value


TEST_DEVICE = _test_device()
"""Where `engine()` puts the engine unless told (`MTP_CARRY_TEST_DEVICE`)."""


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
               max_model_len=2048, prefill_chunk=16, draft_len=2, dtype="float64", device=TEST_DEVICE)
    cfg.update(overrides)
    return ReferenceEngine(model if model is not None else tiny_model(), TOK, EngineConfig(**cfg))


@torch.no_grad()
def greedy_oracle(model: HybridLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding, one token per target forward, on a dense cache (on the CPU: a
    model an engine moved to a GPU is copied back)."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        model = copy.deepcopy(model).cpu()
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
