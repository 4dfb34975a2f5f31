#!/usr/bin/env python3
"""Smoke test of the carry inside real TensorRT-LLM, for a machine with TensorRT-LLM and an NVIDIA GPU.

This project has never run it: no machine it was developed on has TensorRT-LLM
(its wheels are not on the package registry there) or a GPU that could hold a
hybrid MTP model. It is written against TensorRT-LLM's public source (LLM,
MTPDecodingConfig, KvCacheConfig, SamplingParams, ConversationParams,
generate_async, the PyTorch executor's resource managers) and checks, on the
user's machine, what the CPU stand-in cannot:

  layout      after a cold turn, the MTP layer's rows in TensorRT-LLM's draft KV pages
              equal the rows recomputed from the target's captured hidden states (fc,
              norms, qkv, k-norm, RoPE at position k): the page layout and the RoPE
              convention the adapter's gather/scatter assume (it also reports which
              RoPE position fits, k or k + 1);
  scatter     after a warm turn, the rows the carry scattered into the request's draft
              pages for keys [0, R) equal the rows a rebuild run (no reuse, full
              prefill) computes for the same turn;
  acceptance  over >= 32 conversations x 3 turns, warm-turn acceptance under the carry
              is within --acceptance-tol of rebuild's and above blind's by at least
              --blind-margin (paired per-turn medians with p25-p75 are printed);
  outputs     greedy outputs are token-identical across carry, blind, rebuild and no
              speculation (off);
  ttft        time to first token per turn and mode (median, p25-p75), reported.

Modes, each its own LLM in this process (TLLM_WORKER_USE_SINGLE_PROCESS=1, TP=1, so
the checks can read the draft pages; the carry is installed as in a worker process).
Block reuse, where on, comes with the recommended snapshot placement
(`kv_cache_config.mamba_state_config.additional_snapshot_offsets_from_end: [0]`: the
hybrid target reuses a prefix only at snapshot points; a placement in --llm-options wins):
  off      no speculative decoding, block reuse on;
  rebuild  one-model MTP, block reuse off (every turn prefills its whole history);
  blind    one-model MTP, block reuse on, no carry (the drafter is blind over the
           reused prefix on unpaired builds);
  carry    one-model MTP, block reuse on, the carry installed by the supported path
           (`trtllm_mtp_carry.trtllm.worker`: TRTLLM_MTP_CARRY_WORKER set while the LLM is
           built, so the hook puts the carry into `create_py_executor_instance`'s
           resources, exactly as in a trtllm-serve or Dynamo worker).

It prints one line per check, PROVED / FAILED / NOT CHECKED with the reason, and
exits 1 if a check failed, 0 otherwise (a check it could not make is not a
failure, and says so). Without TensorRT-LLM, a GPU or the adapter it exits 2
with one line saying what is missing.

Usage: python scripts/trtllm_smoke.py --model /ckpt/Qwen3-Next-80B-A3B-Instruct-FP8 \\
           [--conversations 32] [--turns 3] [--max-tokens 64] [--max-draft-len 3] \\
           [--llm-options extra.yaml] [--json-out smoke.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtllm_mtp_carry.bench.stats import Spread  # noqa: E402
from trtllm_mtp_carry.serve.trtllm.serving import (  # noqa: E402
    TRTLLM_EXTRA,
    ChatTemplate,
    conversation_id_for,
    sampling_kwargs,
)
from trtllm_mtp_carry.trtllm.options import RECOMMENDED_SNAPSHOT_PLACEMENT  # noqa: E402

PROG = "trtllm_smoke.py"
MODES = ("off", "rebuild", "blind", "carry")
MIN_CONVERSATIONS, MIN_TURNS = 32, 3  # what the acceptance claim needs
ROW_COSINE = 0.999  # bf16-level agreement of a row; a wrong page, slot or RoPE position is far below
LAYOUT_SALT = "mtp-carry-smoke-layout"  # the layout probe's own reuse scope: it never warms the replay
TOPICS = (
    "tides", "volcanoes", "compilers", "bread", "glaciers", "bees", "sailing", "chess", "radio",
    "coral reefs", "bridges", "jazz", "deserts", "vaccines", "railways", "origami", "comets",
    "mushrooms", "lighthouses", "typography", "wind turbines", "owls", "tea", "earthquakes",
    "pottery", "satellites", "rivers", "violins", "maps", "cheese", "clocks", "penguins",
    "printing presses", "rainforests", "telescopes", "kites", "submarines", "honey", "caves", "ink",
)


class SmokeError(Exception):
    """Something this machine lacks (exit 2, one line)."""


# ---- arguments -------------------------------------------------------------------------


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (a hybrid MTP model, e.g. Qwen3-Next)")
    p.add_argument("--conversations", type=_positive, default=MIN_CONVERSATIONS,
                   help=f"conversations replayed per mode (the acceptance claim needs >= {MIN_CONVERSATIONS})")
    p.add_argument("--turns", type=_positive, default=MIN_TURNS,
                   help=f"turns per conversation (the claim needs >= {MIN_TURNS})")
    p.add_argument("--max-tokens", type=_positive, default=64, help="max_tokens of every turn")
    p.add_argument("--max-draft-len", type=_positive, default=3, help="drafts per step: MTPDecodingConfig(num_nextn_predict_layers=...), from which TensorRT-LLM sets max_draft_len")
    p.add_argument("--context-words", type=_positive, default=400,
                   help="words of shared background in each conversation's first message (history length)")
    p.add_argument("--concurrency", type=_positive, default=8, help="conversations in flight at once")
    p.add_argument("--check-conversations", type=_positive, default=4,
                   help="conversations whose draft rows the scatter check compares")
    p.add_argument("--kv-fraction", type=_fraction, default=0.6, help="KvCacheConfig(free_gpu_memory_fraction)")
    p.add_argument("--acceptance-tol", type=float, default=0.02,
                   help="|carry - rebuild| warm-turn acceptance allowed (absolute)")
    p.add_argument("--blind-margin", type=float, default=0.02,
                   help="carry - blind warm-turn acceptance required (absolute)")
    p.add_argument("--llm-options", default=None, metavar="YAML",
                   help="extra LLM(**options) keywords (extra_llm_api_options YAML) for every mode; "
                        "its mtp_carry section goes to the worker-side install in the carry mode")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--json-out", default=None, metavar="PATH", help="write every turn and verdict as JSON")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes must name some of {', '.join(MODES)}, got {args.modes!r}")
    args.modes = [m for m in MODES if m in modes]
    if args.llm_options is not None and not Path(args.llm_options).is_file():
        p.error(f"--llm-options {args.llm_options}: not a file")
    return args


def require_environment() -> dict[str, Any]:
    """TensorRT-LLM's classes, the adapter and a GPU; SmokeError naming what is missing."""
    os.environ["TLLM_WORKER_USE_SINGLE_PROCESS"] = "1"  # before the first LLM: the in-process executor
    try:
        import tensorrt_llm  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "tensorrt_llm":
            raise SmokeError(f"TensorRT-LLM is not installed: {TRTLLM_EXTRA} "
                             "(on a machine with an NVIDIA GPU)") from None
        raise SmokeError(f"tensorrt_llm failed to import: {exc}") from None
    except ImportError as exc:
        raise SmokeError(f"tensorrt_llm failed to import: {exc}") from None
    import torch

    if not torch.cuda.is_available():
        raise SmokeError("no CUDA device: TensorRT-LLM's PyTorch backend needs an NVIDIA GPU")
    from tensorrt_llm import LLM, SamplingParams
    from tensorrt_llm._torch.pyexecutor.resource_manager import (
        BaseResourceManager,
        ResourceManagerType,
    )
    from tensorrt_llm.conversation_params import ConversationParams
    from tensorrt_llm.llmapi import KvCacheConfig, MTPDecodingConfig
    from tensorrt_llm.llmapi.llm_utils import update_llm_args_with_extra_dict

    try:
        from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, parse_carry_options, worker
        from trtllm_mtp_carry.trtllm.probe import probe_managers
    except ImportError as exc:
        raise SmokeError(f"the carry adapter is missing from this checkout: {exc}") from None
    return dict(LLM=LLM, SamplingParams=SamplingParams, ConversationParams=ConversationParams,
                KvCacheConfig=KvCacheConfig, MTPDecodingConfig=MTPDecodingConfig,
                BaseResourceManager=BaseResourceManager, ResourceManagerType=ResourceManagerType,
                update=update_llm_args_with_extra_dict, worker=worker, carry_key=CARRY_MANAGER_KEY,
                parse_carry_options=parse_carry_options, probe_managers=probe_managers)


# ---- the workload ----------------------------------------------------------------------


def conversations(n: int, turns: int, context_words: int) -> list[list[str]]:
    """`n` conversations of `turns` user messages; the first carries a long shared background."""
    background = " ".join(f"note{i % 97} about the archive's record {i}." for i in range(context_words // 5 + 1))
    out = []
    for c in range(n):
        topic = TOPICS[c % len(TOPICS)] + ("" if c < len(TOPICS) else f" (part {c // len(TOPICS) + 1})")
        msgs = [f"Background, keep it in mind: {background}\n\nExplain {topic} to a curious student."]
        follow = [f"Give one concrete example about {topic}.", f"What do people often get wrong about {topic}?",
                  f"Summarise what you said about {topic} in three sentences."]
        msgs += [follow[(t - 1) % len(follow)] for t in range(1, turns)]
        out.append(msgs)
    return out


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    prompt_len: int
    output: list[int]
    ttft_ms: float
    drafted: int = 0
    accepted: int = 0
    reused_blocks: int = 0
    perf_metrics: bool = False


def build_llm(env: dict[str, Any], mode: str, args: argparse.Namespace, extra: dict[str, Any]) -> Any:
    # the hybrid target reuses a prefix only at its snapshot points: one at each prompt's end
    # (RECOMMENDED_SNAPSHOT_PLACEMENT, DECISIONS.md "Snapshot placement"), or no warm turn reuses any
    kv = env["KvCacheConfig"](enable_block_reuse=mode != "rebuild", free_gpu_memory_fraction=args.kv_fraction,
                              mamba_state_config=dict(RECOMMENDED_SNAPSHOT_PLACEMENT))
    kwargs: dict[str, Any] = {"enable_chunked_prefill": False, "tensor_parallel_size": 1}
    kwargs.update({k: v for k, v in extra.items() if k not in ("kv_cache_config", "speculative_config")})
    kwargs = env["update"]({"model": args.model}, kwargs)
    kwargs["kv_cache_config"] = kv
    if "kv_cache_config" in extra:  # the user's KV options, with this mode's reuse setting
        kwargs["kv_cache_config"] = env["KvCacheConfig"](**{
            "mamba_state_config": dict(RECOMMENDED_SNAPSHOT_PLACEMENT),  # unless the user's sets one
            **extra["kv_cache_config"], "enable_block_reuse": mode != "rebuild"})
    if mode != "off":
        kwargs["speculative_config"] = env["MTPDecodingConfig"](num_nextn_predict_layers=args.max_draft_len)
    return env["LLM"](**kwargs)


def build_carry_llm(env: dict[str, Any], args: argparse.Namespace, extra: dict[str, Any],
                    carry_section: Any) -> Any:
    """The carry mode's LLM, with the carry installed where TensorRT-LLM builds the executor:
    `TRTLLM_MTP_CARRY_WORKER` names a file holding the `mtp_carry` section while the LLM is
    built (the worker hook reads it at `create_py_executor_instance`), then is unset."""
    import tempfile

    import yaml

    env["parse_carry_options"](carry_section)  # a bad section is one line, before any GPU work
    worker = env["worker"]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="mtp_carry_", delete=False) as f:
        yaml.safe_dump({"mtp_carry": carry_section or {}}, f)
    os.environ[worker.ENV] = f.name
    try:
        worker.boot()  # what the .pth line runs in a worker process
        return build_llm(env, "carry", args, extra)
    finally:
        os.environ.pop(worker.ENV, None)
        os.unlink(f.name)


def executor_of(llm: Any) -> Any:
    """The in-process PyExecutor (single-process worker, TP=1), as the adapter reaches it."""
    engine = getattr(getattr(llm, "_executor", None), "engine", None)
    if engine is None or not hasattr(engine, "resource_manager"):
        raise SmokeError("no in-process executor at llm._executor.engine (TLLM_WORKER_USE_SINGLE_PROCESS=1?)")
    return engine


# ---- reading TensorRT-LLM's draft pages -------------------------------------------------


def draft_rows(draft: Any, layer_idx: int, request_id: int, n: int) -> tuple[Any, Any, str]:
    """(K, V) float32 `[n, kv_heads, head_dim]` of keys [0, n) of a live request's draft pages,
    and the layout read (HND from KVCacheManagerV2, else V1's NHD)."""
    import torch

    pages = torch.as_tensor(list(draft.get_batch_cache_indices([request_id], layer_idx=layer_idx)[0]))
    try:
        buf, layout = draft.get_buffers(layer_idx, kv_layout="HND"), "HND"
    except TypeError:  # V1 has no kv_layout: [blocks, 2, tokens_per_block, kv_heads, head_dim]
        buf, layout = draft.get_buffers(layer_idx), "NHD"
    tpb = buf.shape[3] if layout == "HND" else buf.shape[2]
    keys = torch.arange(n)
    page = pages[keys // tpb]
    if bool((page < 0).any()) or bool((page >= buf.shape[0]).any()):
        raise SmokeError(f"draft page index out of range for keys [0, {n}): the {layout} layout assumption "
                         "is wrong for this build")
    page, slot = page.to(buf.device), (keys % tpb).to(buf.device)
    if buf.is_cuda:  # the carry scatters on the draft manager's stream
        torch.cuda.synchronize()
    if layout == "HND":  # [pages, 2, heads, tpb, dim] -> [n, heads, dim]
        k, v = buf[page, 0, :, slot, :], buf[page, 1, :, slot, :]
    else:
        k, v = buf[page, 0, slot], buf[page, 1, slot]
    return k.float().cpu(), v.float().cpu(), layout


def make_probe(env: dict[str, Any], draft: Any, layer_idx: int, watch: set[str]) -> Any:
    """A resource manager placed last: on a watched conversation's first context chunk with
    R > 0 it reads rows [0, R) (after the carry's scatter), and at free_resources (before the
    draft pool frees) rows [0, L - 1). Keyed by (conversation id, turn)."""

    class RowProbe(env["BaseResourceManager"]):  # type: ignore[misc]
        def __init__(self) -> None:
            self.seen: set[int] = set()
            self.turns: dict[str, int] = defaultdict(int)
            self.turn_of: dict[int, tuple[str, int]] = {}
            self.at_admission: dict[tuple[str, int], tuple[int, Any, Any]] = {}
            self.at_free: dict[tuple[str, int], tuple[Any, Any]] = {}

        def get_max_resource_count(self) -> int:
            return 2**31 - 1

        def get_needed_resource_to_completion(self, request: Any) -> int:
            return 0

        @staticmethod
        def _conversation(request: Any) -> str | None:
            params = getattr(request, "py_conversation_params", None)
            return None if params is None else str(params.conversation_id).strip()

        def prepare_resources(self, scheduled_batch: Any) -> None:
            for req in scheduled_batch.context_requests:
                rid = req.py_request_id
                if rid in self.seen or getattr(req, "is_dummy_request", False):
                    continue
                self.seen.add(rid)
                conv = self._conversation(req)
                if conv is None or conv not in watch:
                    continue
                key = (conv, self.turns[conv])
                self.turns[conv] += 1
                self.turn_of[rid] = key
                r = int(req.context_current_position)
                if r > 0:
                    k, v, _ = draft_rows(draft, layer_idx, rid, r)
                    self.at_admission[key] = (r, k, v)

        def free_resources(self, request: Any) -> None:
            key = self.turn_of.pop(request.py_request_id, None)
            self.seen.discard(request.py_request_id)
            if key is not None:
                n = len(request.get_tokens(0)) - 1
                k, v, _ = draft_rows(draft, layer_idx, request.py_request_id, n)
                self.at_free[key] = (k, v)

    return RowProbe()


# ---- recomputing the MTP rows from hidden states ---------------------------------------


def rope_neox(x: Any, positions: Any, rotary_dim: int, theta: float) -> Any:
    """Rotary embedding (rotate-half, Qwen's style) on the first `rotary_dim` features of
    `x` `[n, heads, dim]` (float32) at `positions` `[n]`."""
    import torch

    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angles).float()[:, None, :], torch.sin(angles).float()[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def row_cosines(a: Any, b: Any) -> Any:
    """Cosine similarity of each row (key) of `a` and `b` `[n, heads, dim]`, flattened per key."""
    import torch

    a2, b2 = a.reshape(a.shape[0], -1).double(), b.reshape(b.shape[0], -1).double()
    return torch.nn.functional.cosine_similarity(a2, b2, dim=1, eps=1e-30)


def recompute_mtp_kv(model: Any, hidden: Any, next_ids: Any, positions: Any) -> tuple[Any, Any, Any]:
    """The MTP layer's (K unroped, K roped at `positions`, V) `[n, kv_heads, head_dim]` float32 for
    pair keys with target hidden states `hidden` `[n, H]` and next tokens `next_ids` `[n]`."""
    import torch

    cfg = getattr(model, "config", None) or model.model_config.pretrained_config
    n_layers = int(cfg.num_hidden_layers)
    mtp = model.draft_model.mtp_layers[0] if hasattr(model, "draft_model") else model.model.layers[n_layers]
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    kv_heads = int(cfg.num_key_value_heads)
    with torch.inference_mode():
        e = model.model.embed_tokens(next_ids)
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(e), mtp.pre_fc_norm_hidden(hidden)], dim=-1))
        x = mtp.input_layernorm(x)
        qkv = mtp.self_attn.qkv_proj(x)
        kv_size = kv_heads * head_dim
        k = qkv[:, -2 * kv_size:-kv_size].reshape(-1, head_dim)
        v = qkv[:, -kv_size:].reshape(-1, kv_heads, head_dim)
        k = mtp.self_attn.k_norm(k).reshape(-1, kv_heads, head_dim)
    k, v = k.float().cpu(), v.float().cpu()
    rotary = int(head_dim * float(getattr(cfg, "partial_rotary_factor", 1.0)))
    theta = float(getattr(cfg, "rope_theta", 10000.0))
    return k, rope_neox(k, positions.cpu(), rotary, theta), v


class HiddenCapture:
    """A forward hook on the target model's decoder stack (its output is what the MTP layer
    consumes: post-final-norm hidden states); armed, it keeps the next single-request
    context forward's rows and token ids."""

    def __init__(self, model: Any) -> None:
        self.armed = False
        self.hidden: Any = None
        self.input_ids: Any = None
        self._handle = model.model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        meta = kwargs.get("attn_metadata")
        if not self.armed or meta is None or int(getattr(meta, "num_contexts", 0)) != 1:
            return
        n = int(meta.num_ctx_tokens)
        out = output[0] if isinstance(output, tuple) else output
        ids = kwargs.get("input_ids")
        self.hidden = out[:n].detach().clone()
        self.input_ids = None if ids is None else ids.reshape(-1)[:n].detach().clone()
        self.armed = False

    def remove(self) -> None:
        self._handle.remove()


# ---- replay ----------------------------------------------------------------------------


async def _turn(env: dict[str, Any], llm: Any, prompt: list[int], corrid: int, max_tokens: int,
                salt: str | None = None) -> tuple[list[int], float, Any]:
    params = env["SamplingParams"](**sampling_kwargs(max_tokens, max_tokens))
    start = time.perf_counter()
    ttft = None
    result = llm.generate_async({"prompt_token_ids": prompt}, params, streaming=True,
                                conversation_params=env["ConversationParams"](
                                    conversation_id=conversation_id_for(corrid)),
                                cache_salt=salt)
    final = None
    async for out in result:
        if ttft is None and out.outputs[0].token_ids:
            ttft = (time.perf_counter() - start) * 1e3
        final = out
    assert final is not None
    completion = final.outputs[0]
    return list(completion.token_ids), ttft if ttft is not None else (time.perf_counter() - start) * 1e3, completion


async def replay(env: dict[str, Any], llm: Any, chat: ChatTemplate, convs: list[list[str]],
                 args: argparse.Namespace) -> list[TurnRecord]:
    """Every conversation's turns in order, `--concurrency` conversations at once."""
    records: list[TurnRecord] = []
    gate = asyncio.Semaphore(args.concurrency)

    async def one(c: int, messages: list[str]) -> None:
        async with gate:
            prompt: list[int] = []
            output: list[int] = []
            for t, user in enumerate(messages):
                prompt = chat.first_prompt(user) if t == 0 else chat.next_prompt(prompt, output, user)
                output, ttft, completion = await _turn(env, llm, prompt, c + 1, args.max_tokens)
                perf = getattr(completion, "request_perf_metrics", None)
                spec = getattr(perf, "speculative_decoding", None)
                kv = getattr(perf, "kv_cache_metrics", None)
                records.append(TurnRecord(
                    c, t, len(prompt), output, ttft,
                    drafted=int(getattr(spec, "total_draft_tokens", 0) or 0),
                    accepted=int(getattr(spec, "total_accepted_draft_tokens", 0) or 0),
                    reused_blocks=int(getattr(kv, "num_reused_blocks", 0) or 0), perf_metrics=perf is not None))

    await asyncio.gather(*(one(c, m) for c, m in enumerate(convs)))
    return sorted(records, key=lambda r: (r.conversation, r.turn))


# ---- verdicts (pure) --------------------------------------------------------------------


@dataclass
class Verdict:
    check: str
    status: str  # PROVED, FAILED, NOT CHECKED
    detail: str

    def line(self) -> str:
        return f"{self.status:<12} {self.check:<11} {self.detail}"


@dataclass
class Run:
    mode: str
    records: list[TurnRecord] = field(default_factory=list)
    topology: str = ""
    armed: bool = False
    reason: str = ""


def _spread(values: list[float], fmt: str = ".3f") -> str:
    s = Spread.of(values)
    if s.median is None:
        return "n/a"
    return f"{s.median:{fmt}} (p25 {s.p25:{fmt}} - p75 {s.p75:{fmt}}, n={s.n})"


def outputs_verdict(runs: dict[str, Run]) -> Verdict:
    """Greedy outputs token-identical across every mode run, turn by turn."""
    if len(runs) < 2:
        return Verdict("outputs", "NOT CHECKED", "needs at least two modes")
    names = list(runs)
    base = {(r.conversation, r.turn): r.output for r in runs[names[0]].records}
    for name in names[1:]:
        for r in runs[name].records:
            if base.get((r.conversation, r.turn)) != r.output:
                return Verdict("outputs", "FAILED", f"{name} differs from {names[0]} at conversation "
                               f"{r.conversation} turn {r.turn}")
    return Verdict("outputs", "PROVED", f"{len(base)} turns token-identical across {', '.join(names)}")


def _acceptance(records: list[TurnRecord]) -> dict[tuple[int, int], float]:
    return {(r.conversation, r.turn): r.accepted / r.drafted for r in records if r.turn > 0 and r.drafted}


def acceptance_verdict(runs: dict[str, Run], conversations: int, turns: int, tol: float,
                       margin: float) -> Verdict:
    """Warm-turn acceptance: carry within `tol` of rebuild and above blind by `margin`, on
    paired turns (the same conversation and turn in each mode)."""
    need = [m for m in ("carry", "rebuild", "blind") if m not in runs]
    if need:
        return Verdict("acceptance", "NOT CHECKED", f"modes not run: {', '.join(need)}")
    if conversations < MIN_CONVERSATIONS or turns < MIN_TURNS:
        return Verdict("acceptance", "NOT CHECKED", f"needs >= {MIN_CONVERSATIONS} conversations x "
                       f"{MIN_TURNS} turns, ran {conversations} x {turns}")
    if runs["carry"].topology != "unpaired" or not runs["carry"].armed:
        return Verdict("acceptance", "NOT CHECKED", f"the carry stood aside (topology "
                       f"{runs['carry'].topology or '?'}, {runs['carry'].reason or 'not armed'})")
    if not all(r.perf_metrics for m in ("carry", "rebuild", "blind") for r in runs[m].records):
        return Verdict("acceptance", "NOT CHECKED", "TensorRT-LLM returned no request_perf_metrics")
    acc = {m: _acceptance(runs[m].records) for m in ("carry", "rebuild", "blind")}
    keys = sorted(set(acc["carry"]) & set(acc["rebuild"]) & set(acc["blind"]))
    if not keys:
        return Verdict("acceptance", "NOT CHECKED", "no warm turn drafted in every mode")
    d_rebuild = [acc["carry"][k] - acc["rebuild"][k] for k in keys]
    d_blind = [acc["carry"][k] - acc["blind"][k] for k in keys]
    med_rebuild, med_blind = Spread.of(d_rebuild).median, Spread.of(d_blind).median
    assert med_rebuild is not None and med_blind is not None
    detail = (f"warm turns, carry - rebuild {_spread(d_rebuild)}, carry - blind {_spread(d_blind)}; "
              f"carry {_spread([acc['carry'][k] for k in keys])}")
    ok = abs(med_rebuild) <= tol and med_blind >= margin
    return Verdict("acceptance", "PROVED" if ok else "FAILED", detail)


def rows_verdict(check: str, cos: Any, max_abs: float, what: str) -> Verdict:
    """PROVED when every row's cosine similarity is >= ROW_COSINE."""
    worst = float(cos.min()) if cos.numel() else float("nan")
    detail = f"{what}: {cos.numel()} rows, min cosine {worst:.6f}, max |diff| {max_abs:.3g}"
    return Verdict(check, "PROVED" if cos.numel() and worst >= ROW_COSINE else "FAILED", detail)


def ttft_lines(runs: dict[str, Run], turns: int) -> list[str]:
    lines = []
    for name, run in runs.items():
        per_turn = [_spread([r.ttft_ms for r in run.records if r.turn == t], ".1f") for t in range(turns)]
        lines.append(f"ttft ms {name:<8} " + " | ".join(f"turn {t}: {s}" for t, s in enumerate(per_turn)))
    return lines


# ---- the checks that read pages ---------------------------------------------------------


def layout_check(env: dict[str, Any], llm: Any, chat: ChatTemplate, probe: Any, capture: HiddenCapture,
                 corrid: int) -> Verdict:
    """One cold request alone (its own salt): draft rows [0, L-1) vs the recomputed MTP rows."""
    import torch

    prompt = chat.first_prompt("Describe, in a few sentences, how a lighthouse keeper's day goes. "
                               "Mention the lamp, the weather log and the tides.")
    capture.armed = True
    output, _, _ = asyncio.run(_turn(env, llm, prompt, corrid, 8, salt=LAYOUT_SALT))
    key = (conversation_id_for(corrid), 0)
    deadline = time.monotonic() + 30.0
    while key not in probe.at_free and time.monotonic() < deadline:  # freed after its last response
        time.sleep(0.05)
    if capture.hidden is None or key not in probe.at_free:
        return Verdict("layout", "NOT CHECKED", "the hidden-state hook or the probe saw no single-request "
                       "context forward (CUDA graphs or torch.compile on the context phase?)")
    model = executor_of(llm).model_engine.model
    n = len(prompt) - 1
    hidden = capture.hidden[:n]
    next_ids = torch.as_tensor(prompt[1:], device=hidden.device)
    _, k_at_k, v = recompute_mtp_kv(model, hidden, next_ids, torch.arange(n))
    _, k_at_k1, _ = recompute_mtp_kv(model, hidden, next_ids, torch.arange(1, n + 1))
    k_page, v_page = probe.at_free[key]
    k_page, v_page = k_page[:n], v_page[:n]
    cos_k, cos_k1, cos_v = row_cosines(k_page, k_at_k), row_cosines(k_page, k_at_k1), row_cosines(v_page, v)
    fits = "k" if float(cos_k.mean()) >= float(cos_k1.mean()) else "k + 1"
    max_abs = float(max((k_page - k_at_k).abs().max(), (v_page - v).abs().max()))
    verdict = rows_verdict("layout", torch.minimum(cos_k, cos_v), max_abs,
                           f"cold turn, keys [0, {n}) (output {len(output)} tokens)")
    verdict.detail += (f"; K fits RoPE at {fits} (mean cosine at k {float(cos_k.mean()):.6f}, "
                       f"at k + 1 {float(cos_k1.mean()):.6f})")
    return verdict


def scatter_verdict(carry_probe: Any, rebuild_probe: Any) -> Verdict:
    """Rows the carry scattered for [0, R) on warm turns vs the rebuild run's rows there."""
    import torch

    cos_all, max_abs, rows, turns = [], 0.0, 0, 0
    for key, (r, k, v) in sorted(carry_probe.at_admission.items()):
        if key not in rebuild_probe.at_free:
            continue
        k_ref, v_ref = rebuild_probe.at_free[key]
        cos_all.append(torch.minimum(row_cosines(k, k_ref[:r]), row_cosines(v, v_ref[:r])))
        max_abs = max(max_abs, float((k - k_ref[:r]).abs().max()), float((v - v_ref[:r]).abs().max()))
        rows, turns = rows + r, turns + 1
    if not turns:
        return Verdict("scatter", "NOT CHECKED", "no warm turn with R > 0 in both the carry and rebuild runs "
                       "(did TensorRT-LLM reuse any prefix?)")
    return rows_verdict("scatter", torch.cat(cos_all), max_abs, f"{turns} warm turns, {rows} scattered rows")


# ---- main ------------------------------------------------------------------------------


def run_mode(env: dict[str, Any], mode: str, args: argparse.Namespace, extra: dict[str, Any],
             carry_section: Any, convs: list[list[str]], watch: set[str],
             verdicts: list[Verdict]) -> tuple[Run, Any]:
    llm = build_carry_llm(env, args, extra, carry_section) if mode == "carry" else \
        build_llm(env, mode, args, extra)
    run, probe = Run(mode), None
    try:
        executor = executor_of(llm)
        managers = executor.resource_manager.resource_managers
        draft = managers.get(env["ResourceManagerType"].DRAFT_KV_CACHE_MANAGER)
        carry = managers.get(env["carry_key"]) if mode == "carry" else None
        if mode == "carry":
            said = env["worker"].messages()
            run.armed, run.reason = carry is not None, said[-1] if said else "the worker hook printed nothing"
            try:
                run.topology = env["probe_managers"](managers, "installed").topology
            except ValueError as exc:  # TrtllmAdapterError: refused
                run.topology = f"refused ({exc})"
            print(f"carry: topology {run.topology}, {'armed' if run.armed else 'not armed'}: {run.reason}")
        chat = ChatTemplate(getattr(llm.tokenizer, "tokenizer", llm.tokenizer))
        if draft is not None and mode in ("carry", "rebuild"):
            model = executor.model_engine.model
            cfg = getattr(model, "config", None) or model.model_config.pretrained_config
            layout_corrid = len(convs) + 1  # a conversation of its own, outside the replay
            probe_watch = set(watch) | ({conversation_id_for(layout_corrid)} if mode == "carry" else set())
            probe = make_probe(env, draft, int(cfg.num_hidden_layers), probe_watch)
            managers["mtp_carry_smoke_probe"] = probe  # last: after the draft (and carry) managers
            if mode == "carry":
                capture = HiddenCapture(model)
                try:
                    verdicts.append(layout_check(env, llm, chat, probe, capture, layout_corrid))
                finally:
                    capture.remove()
        start = time.perf_counter()
        run.records = asyncio.run(replay(env, llm, chat, convs, args))
        print(f"{mode}: {len(run.records)} turns in {time.perf_counter() - start:.1f} s")
        if carry is not None:
            print(f"carry counters: {carry.stats()}")
    finally:
        llm.shutdown()
        import gc

        import torch

        gc.collect()  # the next mode's LLM needs this one's GPU memory back
        torch.cuda.empty_cache()
    return run, probe


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        env = require_environment()
        extra: dict[str, Any] = {}
        carry_section = None
        if args.llm_options:
            import yaml

            loaded = yaml.safe_load(Path(args.llm_options).read_text()) or {}
            if not isinstance(loaded, dict):
                raise SmokeError(f"--llm-options {args.llm_options}: not a YAML mapping")
            carry_section = loaded.pop("mtp_carry", None)
            extra = loaded
    except SmokeError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    convs = conversations(args.conversations, args.turns, args.context_words)
    watch = {conversation_id_for(c + 1) for c in range(min(args.check_conversations, len(convs)))}
    runs: dict[str, Run] = {}
    probes: dict[str, Any] = {}
    verdicts: list[Verdict] = []
    for mode in args.modes:
        try:
            runs[mode], probes[mode] = run_mode(env, mode, args, extra, carry_section, convs, watch, verdicts)
        except SmokeError as exc:
            verdicts.append(Verdict(mode, "NOT CHECKED", str(exc)))
    if "layout" not in {v.check for v in verdicts}:
        verdicts.append(Verdict("layout", "NOT CHECKED", "needs the carry mode on a separate draft pool"))
    if probes.get("carry") is not None and probes.get("rebuild") is not None:
        verdicts.append(scatter_verdict(probes["carry"], probes["rebuild"]))
    else:
        verdicts.append(Verdict("scatter", "NOT CHECKED", "needs the carry and rebuild modes on a separate "
                                "draft pool"))
    verdicts.append(acceptance_verdict(runs, args.conversations, args.turns, args.acceptance_tol,
                                       args.blind_margin))
    verdicts.append(outputs_verdict(runs))
    reused = {m: [r.reused_blocks for r in run.records if r.turn > 0] for m, run in runs.items()}
    print("\n".join(ttft_lines(runs, args.turns)))
    for m, values in reused.items():
        print(f"reused blocks, warm turns, {m:<8} {_spread([float(v) for v in values], '.0f')}")
    print("\n" + "\n".join(v.line() for v in verdicts))
    print("\nNot proved by this script: multi-GPU (TP > 1), attention data parallelism, FP8/NVFP4 KV, "
          "chunked prefill, trtllm-serve (multi-process), the Triton model under load.")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "args": {k: v for k, v in vars(args).items()},
            "verdicts": [asdict(v) for v in verdicts],
            "runs": {m: {"topology": r.topology, "armed": r.armed, "reason": r.reason,
                         "records": [asdict(x) for x in r.records]} for m, r in runs.items()},
        }, indent=1))
    return 1 if any(v.status == "FAILED" for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
