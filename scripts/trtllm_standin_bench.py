#!/usr/bin/env python3
"""Carry vs blind vs rebuild on the TensorRT-LLM STAND-IN executor (CPU; not TensorRT-LLM).

What it measures: the adapter (`trtllm_mtp_carry.trtllm`, installed unchanged
by the worker-process path, `TRTLLM_MTP_CARRY_WORKER`) on the stand-in executor
that follows TensorRT-LLM's PyExecutor source, at a long history. Policies:
`carry` (installed in the stand-in's worker-side executor), `blind` (TensorRT-LLM as is:
fresh draft pages over the reused prefix), `rebuild` (block reuse off: every
turn prefills from position 0). One executor per policy, in one process;
each (session, turn) runs under the three policies back to back, so every
per-turn ratio is paired. Figures: medians (p25-p75) over the warm turns.

Workload: held-out code sessions cycled to about `--history` tokens (the user
shows code, the model acknowledges it); each later turn asks to repeat one of
the functions shown in the history, so the answer copies the reused prefix.
Prompts are padded to a multiple of the prefill chunk, so a warm turn's
reused depth is chunk-aligned (rebuild then computes bit-equal rows).

Reuse: the stand-in's hybrid target reuses a prefix only at its snapshot points, as
TensorRT-LLM's `MambaHybridCacheManagerV2` does; every policy runs under the recommended
placement (`kv_cache_config.mamba_state_config.additional_snapshot_offsets_from_end: [0]`,
`--snapshot-placement end`), or under none (`none`: block reuse on, no snapshot point: no
warm turn reuses anything and the worker hook stands aside). The reused depth R of every
warm turn is printed next to the previous turn's prompt length.

The adapter's own data path (what a warm turn adds in PyExecutor's loop): the finished
request's gather into the carry's arena (`CarryManager._deposit`: the page gather, packed
with `carry-fp8`, and the arena copy) and the next request's scatter into its fresh draft
pages (`CarryManager._adopt_firsts`: the carry decision, the take and the scatter), each timed per
warm turn with the device synchronized before and after (so each counts its device work
too: the deposit's gather waits for it in TensorRT-LLM as well; the scatter's is ordered
before the next forward on the GPU), median (p25-p75), and paired against blind's warm TTFT
of the same turn. `--device cuda` puts the stand-in's KV pages (and so the carry's arenas) on the
GPU; the model computes on the CPU either way. After every scatter the pages' rows are read
back and compared with the rows gathered at the previous turn's free. Besides the tables, it
prints `FIGURE`/`CHECK` lines (tab-separated) for scripts/gpu_smoke.sh.

    python scripts/trtllm_standin_bench.py --history 8192 --sessions 3 --turns 4
    python scripts/trtllm_standin_bench.py --device cuda --history 28000 --fp8
    python scripts/trtllm_standin_bench.py --kv-dtype fp8 --history 4096   # an FP8 KV draft pool

`--kv-dtype fp8` builds every policy's draft pool with float8_e4m3fn pages (as KV cache manager
V2 stores FP8 KV): the carry then holds the pages' own bytes, one byte an element, and the
report says how many rows came back bit for bit and how many bytes a carried row takes.
`--kv-dtype nvfp4` builds NVFP4 pools (e2m1 payload pages and e4m3 block-scale pages): the
carry holds their own bytes, `head_dim/2 + head_dim/16` a vector, compared byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from itertools import cycle
from pathlib import Path

import torch

from trtllm_mtp_carry.bench.sessions import load_conversations
from trtllm_mtp_carry.bench.stats import Spread, paired_ratio
from trtllm_mtp_carry.engine.model import load_reference
from trtllm_mtp_carry.engine.tokenizer import ChatTokenizer
from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, worker
from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG
from trtllm_mtp_carry.trtllm.standin import ConversationParams, DataType, StandinLLM

POLICIES = ("carry", "blind", "rebuild")
CARRY_POLICIES = ("carry", "carry-fp8")


def _raw(t: torch.Tensor) -> torch.Tensor:
    """`t`, or its bytes when it is float8 (compared bit for bit, whatever float8 ops torch has)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _key_rows(buf, pages, lo: int, hi: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Keys `[lo, hi)` of the pages as the carry's checks compare them: the rows (bf16, FP8 pages),
    or an NVFP4 pool's payload and scale bytes, each read at its writer's address."""
    from trtllm_mtp_carry.dataplane.hnd_pages import gather_rows
    from trtllm_mtp_carry.dataplane.nvfp4_kv import Nvfp4KvPages, gather_kv_pages

    if isinstance(buf, Nvfp4KvPages):
        held = gather_kv_pages(buf, pages, lo, hi)
        return torch.cat((held.payload, held.scales), dim=-1)
    return gather_rows(buf, pages, lo, hi)


def _pool_rows(rows) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """What the pages will hold once held `rows` are scattered, in `_key_rows`' form: the rows
    (unpacked when packed), or an NVFP4 pool's own bytes."""
    from trtllm_mtp_carry.dataplane.nvfp4_kv import Nvfp4KvRows
    from trtllm_mtp_carry.dataplane.row_codec import codec_of

    if isinstance(rows, Nvfp4KvRows):
        return torch.cat((rows.payload, rows.scales), dim=-1)
    return codec_of(rows).decode(rows).clone()


class DataPath:
    """Times one carry executor's adapter data path per turn and checks what it scatters.

    Wraps the installed `CarryManager`'s `_deposit` (gather into the arena) and `_adopt_firsts`
    (decide, take, scatter) on the instance, the layout functions it calls (the copies
    alone), its service's home `carry_out` (which rows went in under which key, from which
    pair key) and its service's `adopt` (which key a scatter serves). `turn` labels the calls
    of the request being run."""

    def __init__(self, manager: object, device: torch.device, delay_cycles: int | None = None) -> None:
        from trtllm_mtp_carry.dataplane.row_codec import CODECS

        gather_rows = _key_rows
        self.delay_cycles = delay_cycles  # None: no race check; else delays (cycles; 0 on the CPU)
        self._gather_rows = gather_rows
        self._truth: torch.Tensor | None = None  # delays: the pages' rows at the gather, read after a sync
        self._pending: list[tuple[object, object, int, int, torch.Tensor | None]] = []  # scatters to read back
        self.turn: tuple[int, int] = (0, 0)
        self.times: dict[tuple[int, int], dict[str, float]] = {}
        self.checks: list[tuple[int, bool]] = []  # (rows compared, equal) per scatter
        self._cuda = device.type == "cuda"
        self._deposited: dict[int, tuple[int, torch.Tensor]] = {}  # key -> (its first pair key, rows)
        self._taking: int | None = None
        self.manager = manager
        m, service = manager, manager.service  # type: ignore[attr-defined]
        home = service.home
        m._deposit = self._timed("deposit_ms", m._deposit, own=True)  # type: ignore[attr-defined]
        m._adopt_firsts = self._timed("adopt_ms", m._adopt_firsts, own=True)  # type: ignore[attr-defined]
        if not DataPath._patched:  # the codecs' page copies, once for every manager: `active` times them
            DataPath._patched = True
            for cls in set(CODECS.values()):
                for name, key in (("gather_pages", "gather_ms"), ("scatter_pages", "scatter_ms")):
                    fn = DataPath._for_active(key, getattr(cls, name))
                    if name.startswith("scatter"):
                        fn = DataPath._checked(fn, gather_rows)
                    else:
                        fn = DataPath._gathered(fn, gather_rows)
                    setattr(cls, name, fn)
        carry_out, adopt = home.carry_out, service.adopt

        def kept(source: object, key: int, rows: int, runs: tuple[tuple[int, int], ...], *args: object,
                 **kwargs: object) -> object:
            entry = carry_out(source, key, rows, runs, *args, **kwargs)
            # what the pages will hold once scattered: the rows, unpacked when packed (set
            # aside: not part of the deposit's time)
            with self._aside("deposit_aside_ms"):
                if self._truth is not None:  # delays: the rows the pages held, not what arrived
                    self._deposited[key], self._truth = (runs[0][0], self._truth), None
                else:
                    self._deposited[key] = (runs[0][0], _pool_rows(home.rows(key)))  # the pool's form
            return entry

        def taken(turn: object, key: int, *args: object, **kwargs: object) -> object:
            self._taking = key
            return adopt(turn, key, *args, **kwargs)

        home.carry_out, service.adopt = kept, taken

    def want(self, lo: int, n: int) -> torch.Tensor | None:
        """The rows deposited for pair keys `[lo, lo + n)` under the key being adopted (None: unknown)."""
        if self._taking is None or self._taking not in self._deposited:
            return None
        first, rows = self._deposited[self._taking]
        return rows[lo - first: lo - first + n]

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def _delay(self) -> None:
        """Queue a delay on the current stream (delays on CUDA): the GPU work queued after it on
        this stream starts late, so any read not ordered after it sees what it must not."""
        if self._cuda and self.delay_cycles:
            torch.cuda._sleep(self.delay_cycles)

    @contextmanager
    def _aside(self, key: str):  # type: ignore[no-untyped-def]
        """Time the bench's own work inside a timed call, to take it out of that call's time."""
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        times = self.times.setdefault(self.turn, {})
        times[key] = times.get(key, 0.0) + (time.perf_counter() - t0) * 1e3

    def net(self, turn: tuple[int, int], key: str) -> float | None:
        """`deposit_ms` or `adopt_ms` of `turn` less the bench's own work inside it (None: no call)."""
        times = self.times.get(turn, {})
        if key not in times:
            return None
        return times[key] - times.get(key.replace("_ms", "_aside_ms"), 0.0)

    _patched = False
    active: DataPath | None = None  # the instance whose manager is in `_deposit` or `_adopt_firsts` now

    def _timed(self, key: str, fn, own: bool = False):  # type: ignore[no-untyped-def]
        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            if own:
                DataPath.active = self
            read: list[tuple[torch.Tensor, torch.Tensor | None]] = []
            try:
                self._sync()
                t0 = time.perf_counter()
                if own and self.delay_cycles is not None:
                    self._delay()  # on the executor's stream, before the adapter's work
                out = fn(*args, **kwargs)
                if own:  # delays: read the scattered pages back on the executor's stream, where
                    for buf, pages, lo, n, want in self._pending:  # the next forward reads them,
                        read.append((self._gather_rows(buf, pages, lo, lo + n), want))  # no sync first
                    self._pending.clear()
                self._sync()
            finally:
                if own:
                    DataPath.active = None
            times = self.times.setdefault(self.turn, {})
            times[key] = times.get(key, 0.0) + (time.perf_counter() - t0) * 1e3
            for got, want in read:
                n = got.shape[0]
                self.checks.append((n, want is not None and bool(torch.equal(got, want[:n]))))
            return out
        return timed

    @staticmethod
    def _for_active(key: str, fn):  # type: ignore[no-untyped-def]
        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            path = DataPath.active
            return fn(*args, **kwargs) if path is None else path._timed(key, fn)(*args, **kwargs)
        return timed

    @staticmethod
    def _gathered(gather, gather_rows):  # type: ignore[no-untyped-def]
        def gathered(codec, buf, pages, lo, hi, *args, **kwargs):  # type: ignore[no-untyped-def]
            path = DataPath.active
            if path is not None and path.delay_cycles is not None:
                path._sync()  # the truth: the pages' rows once every queued write landed
                truth = gather_rows(buf, pages, lo, hi)  # a packing codec's: what its round trip gives
                path._truth = truth if codec.exact else codec.decode(codec.encode(truth))
                path._sync()
                path._delay()  # on the draft stream (current here): the gather starts late
            return gather(codec, buf, pages, lo, hi, *args, **kwargs)
        return gathered

    @staticmethod
    def _checked(scatter, gather_rows):  # type: ignore[no-untyped-def]
        def checked(codec, buf, pages, lo, rows, *args, **kwargs):  # type: ignore[no-untyped-def]
            path = DataPath.active
            if path is not None and path.delay_cycles is not None:
                path._delay()  # on the draft stream (current here): the scatter lands late
                want = path.want(lo, rows.shape[0])
                scatter(codec, buf, pages, lo, rows, *args, **kwargs)
                path._pending.append((buf, pages, lo, rows.shape[0], want))
                return
            scatter(codec, buf, pages, lo, rows, *args, **kwargs)
            if path is None:
                return
            with path._aside("adopt_aside_ms"):  # read back what landed in the pages
                n = rows.shape[0]
                want = path.want(lo, n)
                got = gather_rows(buf if not isinstance(buf, torch.Tensor) else _raw(buf), pages, lo,
                                  lo + n)  # the pages' bytes, exactly
                path.checks.append((n, want is not None and bool(torch.equal(got, _raw(want)))))
        return checked


def session_history(offset: int, history: int, tok: ChatTokenizer) -> tuple[list[dict], list[str]]:
    """Messages (first user turns of held-out conversations) to about `history` tokens, and the
    names of the functions they show."""
    pool = load_conversations()
    messages: list[dict] = []
    names: list[str] = []
    size = 0
    for conv in cycle(pool[offset:] + pool[:offset]):
        first = next(j for j, m in enumerate(conv) if m["role"] == "user")
        part = conv[: first + 2]  # (system,) user shows code, assistant acknowledges
        shown = re.findall(r"defines `([^`]+)`", part[-1]["content"]) if len(part) > first + 1 else []
        if not shown or any(m["role"] == "system" for m in part[1:]):
            continue
        messages += [m for m in part if m["role"] != "system"]
        names.append(shown[0])
        size += sum(len(tok.render_message(m["role"], m["content"])) for m in part)
        if size >= history:
            break
    return messages, names


def pad(tokens_for: callable, text: str, prefix: int, chunk: int) -> list[int]:  # type: ignore[valid-type]
    n = len(tokens_for(text))
    return tokens_for(text + " " * ((-(prefix + n)) % chunk))


def _device(text: str) -> torch.device | str:
    """The `--device` value as a torch device, or the one error line saying why not."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        return f"--device {text!r}: not a torch device (cpu, cuda or cuda:N)"
    if device.type not in ("cpu", "cuda"):
        return f"--device {text!r}: the stand-in's pages go on the cpu or a cuda device"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return f"--device {text}: no CUDA device here (torch.cuda.is_available() is False)"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"--device {text}: this machine has {torch.cuda.device_count()} CUDA devices"
        torch.cuda.set_device(device)
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history", type=int, default=8192)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4, help="turns per session (the first is cold)")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    ap.add_argument("--json", help="write per-turn records here")
    ap.add_argument("--snapshot-placement", choices=("end", "none"), default="end",
                    help="the hybrid target's mamba_state_config: a snapshot at each prompt's end "
                         "(the recommended placement), or none")
    ap.add_argument("--device", default="cpu",
                    help="where the stand-in's KV pages and the carry's arenas live: cpu, cuda or cuda:N "
                         "(the model computes on the CPU)")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8", "nvfp4"), default="bf16",
                    help="the draft pool's KV dtype (kv_cache_config.dtype auto with a BF16 model, fp8: "
                         "float8_e4m3fn pages, or nvfp4: e2m1 payload and e4m3 block-scale pages; both "
                         "carried as their own bytes)")
    ap.add_argument("--fp8", action="store_true",
                    help="also run carry-fp8: the carry with its rows packed in FP8 (gathered packed, "
                         "scattered unpacked)")
    ap.add_argument("--delay-cycles", type=int, default=None,
                    help="the race check: queue a delay of this many GPU cycles (torch.cuda._sleep; "
                         "20000000 is about 10 ms on an H200) on the executor's stream before each "
                         "deposit and adoption and on the draft stream before each gather and scatter, "
                         "take the truth from the pages after a device sync, and read every scattered "
                         "row back on the executor's stream with no sync first; its times are then no "
                         "figures (on the CPU: the same read-backs, no delay)")
    args = ap.parse_args(argv)
    if args.delay_cycles is not None and args.delay_cycles < 0:
        print(f"{Path(sys.argv[0]).name}: error: --delay-cycles must be >= 0, got {args.delay_cycles}",
              file=sys.stderr)
        return 2
    device = _device(args.device)
    if isinstance(device, str):
        print(f"{Path(sys.argv[0]).name}: error: {device}", file=sys.stderr)
        return 2
    kv_cache_config = (RECOMMENDED_KV_CACHE_CONFIG if args.snapshot_placement == "end"
                       else {"enable_block_reuse": True})
    policies = ("carry", "carry-fp8", "blind", "rebuild") if args.fp8 else POLICIES
    kv_dtype = {"bf16": DataType.BF16, "fp8": DataType.FP8, "nvfp4": DataType.NVFP4}[args.kv_dtype]
    torch.set_num_threads(1)
    model, tok = load_reference()
    llms = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in policies:
            if p in CARRY_POLICIES:  # the executor "in a worker": only the worker hook can install it
                config = Path(tmp) / f"{p}.yaml"
                dtype = ", carry_row_dtype: fp8" if p == "carry-fp8" else ""
                config.write_text(f"mtp_carry: {{carry_slots: {args.sessions}{dtype}}}\n")
                os.environ[worker.ENV] = str(config)
            llms[p] = StandinLLM(model, single_process=p not in CARRY_POLICIES, chunk_size=args.chunk,
                                 max_batch=1, num_pages=16384, prefix_entries=4 * args.sessions,
                                 kv_cache_config=kv_cache_config, enable_block_reuse=p != "rebuild",
                                 device=str(device), kv_dtype=kv_dtype)
            os.environ.pop(worker.ENV, None)
    managers = {p: llms[p].executor.resource_manager.resource_managers.get(CARRY_MANAGER_KEY)
                for p in policies if p in CARRY_POLICIES}
    paths = {p: DataPath(m, device, args.delay_cycles) for p, m in managers.items() if m is not None}
    warm = StandinLLM(model, single_process=True, chunk_size=args.chunk, kv_cache_config=kv_cache_config,
                      device=str(device), kv_dtype=kv_dtype)  # torch's first calls are slow
    warm.generate_async(tok.render_chat([{"role": "user", "content": "warm up"}]), 8)
    warm.run_until_done()

    records = []
    for s in range(args.sessions):
        history, names = session_history(7 * s, args.history, tok)
        head = tok.render_chat(history[:-1], add_generation_prompt=False)
        prompt = head + pad(lambda t: tok.render_chat([{"role": "user", "content": t}]),
                            history[-1]["content"], len(head), args.chunk)
        prompts = dict.fromkeys(policies, prompt)
        last_prompt: dict[str, list[int]] = {}
        for turn in range(args.turns):
            outs = {}
            prompts_before = dict(last_prompt) if turn else {}
            for p in policies:  # the same session and turn under each policy, back to back
                llm = llms[p]
                if p in paths:
                    paths[p].turn = (s, turn)
                t0 = time.perf_counter()
                req = llm.generate_async(prompts[p], args.max_new, conversation_params=
                                         ConversationParams(conversation_id=f"s{s}"))
                while not req.output and not req.is_finished:  # until the first token
                    llm.executor.step()
                ttft = (time.perf_counter() - t0) * 1e3
                if p in paths:  # the bench's read-back of the scattered rows is not the turn's
                    ttft -= paths[p].times.get((s, turn), {}).get("adopt_aside_ms", 0.0)
                llm.run_until_done()
                outs[p] = req.output
                last_prompt[p] = req.prompt
                records.append({"session": s, "turn": turn, "policy": p, "ttft_ms": ttft,
                                "reused": req.reused, "prompt": len(req.prompt),
                                "previous_prompt": len(prompts_before[p]) if turn else 0,
                                "accepted": req.accepted, "verify_steps": req.verify_steps,
                                "acceptance": req.accepted / max(req.verify_steps, 1)})
                ask = f"Repeat `{names[turn % len(names)]}` exactly."
                prompts[p] = req.prompt + pad(
                    lambda u, r=req: tok.next_prompt(r.prompt, r.output, u)[len(r.prompt):],
                    ask, len(req.prompt), args.chunk)
            if len({tuple(o) for o in outs.values()}) != 1:
                print(f"outputs differ at session {s} turn {turn}", file=sys.stderr)
                print(f"CHECK\tstand-in outputs identical\tFAIL\tsession {s} turn {turn} differs "
                      f"across {', '.join(policies)}")
                return 1
    for p, path in paths.items():  # the data path's figures go with the records
        for r in records:
            if r["policy"] == p:
                key = (r["session"], r["turn"])
                r["deposit_ms"], r["adopt_ms"] = path.net(key, "deposit_ms"), path.net(key, "adopt_ms")
                r["gather_ms"] = path.times.get(key, {}).get("gather_ms")
                r["scatter_ms"] = path.times.get(key, {}).get("scatter_ms")
    warm_recs = [r for r in records if r["turn"] > 0]

    def col(p: str, key: str) -> list[float]:
        return [r[key] for r in warm_recs if r["policy"] == p]

    def fmt(sp: Spread, digits: int = 1) -> str:
        return f"{sp.median:.{digits}f} ({sp.p25:.{digits}f}-{sp.p75:.{digits}f})"

    print(f"history ~{args.history} tokens, {args.sessions} sessions x {args.turns - 1} warm turns, "
          f"chunk {args.chunk}, answers up to {args.max_new} tokens, pages on {device} "
          f"({args.kv_dtype} KV); outputs identical")
    print("| policy | warm TTFT ms | reused tokens | acceptance (accepted / verify step) |")
    print("|---|---:|---:|---:|")
    for p in policies:
        print(f"| {p} | {fmt(Spread.of(col(p, 'ttft_ms')))} | "
              f"{fmt(Spread.of(col(p, 'reused')), 0)} | {fmt(Spread.of(col(p, 'acceptance')), 3)} |")
    print("| paired ratio | carry/blind | carry/rebuild |")
    print("|---|---:|---:|")
    for key in ("ttft_ms", "acceptance"):
        cells = []
        for other in ("blind", "rebuild"):
            pr = paired_ratio(col("carry", key), col(other, key), key, other)
            cells.append(pr.reason or fmt(pr.spread, 3))
        print(f"| {key} | {cells[0]} | {cells[1]} |")
    r_col = [(r["session"], r["turn"], r["reused"], r["previous_prompt"]) for r in warm_recs
             if r["policy"] == "carry"]
    print("reused depth R per warm turn (carry; session, turn, R, previous prompt length):",
          ", ".join(f"s{s} t{t} R={r} prev={pp}" for s, t, r, pp in r_col))
    print("R = previous prompt length on every warm turn:", all(r == pp for _, _, r, pp in r_col))
    figures = _data_path_report(paths, warm_recs, col, device, args.delay_cycles)
    carry = managers.get("carry")
    if carry is not None:
        stats = carry.stats()
        print("carry stats:", json.dumps({"outcomes": stats.outcomes, "rows_adopted": stats.rows_adopted,
                                          "deposits": stats.deposits}))
    for line in figures:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0 if all(ok for path in paths.values() for _, ok in path.checks) else 1


def _rows_carried(policy: str, path: DataPath, suffix: str) -> list[str]:
    """FIGURE lines: the rows carried bit for bit (read back from the pages after each scatter and
    compared as bytes with the rows gathered at the previous turn's free) and the bytes a carried
    row takes in the carry's row format (the codec's; the store charges exactly these)."""
    stats = path.manager.stats()  # type: ignore[attr-defined]
    codec = path.manager.service.home.codec  # type: ignore[attr-defined]
    buf = path.manager.pages.kv()  # type: ignore[attr-defined]  # an NVFP4 pool: its logical shape
    per_row = codec.row_nbytes(buf.shape[2], buf.shape[4]) if codec is not None else 0
    equal = sum(n for n, ok in path.checks if ok)
    total = sum(n for n, _ in path.checks)
    held = (f", {stats.bytes_held} B held for {stats.rows_held} rows"
            if stats.rows_held else "")
    # a packed codec's rows come back as their unpacked form (within FP8 rounding), never bit for bit
    bits = (f"{equal} of {total} rows" if codec is None or codec.exact else
            f"n/a: {codec.name} packs the rows ({equal} of {total} rows equal their unpacked form)")
    print(f"{policy}: rows carried bit for bit {bits}; {per_row} bytes per row "
          f"({stats.row_dtype} rows of {buf.dtype} pages{held})")
    return [f"FIGURE\tcarried rows bit for bit{suffix}\t{bits} ({policy}, {buf.dtype} pages)\t-\tINFO",
            f"FIGURE\tcarried bytes per row{suffix}\t{per_row} B ({stats.row_dtype}, {buf.dtype} pages)\t-\tINFO"]


def _data_path_report(paths: dict[str, DataPath], warm_recs: list[dict], col, device: torch.device,  # type: ignore[no-untyped-def]
                      delays: int | None = None) -> list[str]:
    """The data path's table (per warm turn, median (p25-p75) ms) and its FIGURE/CHECK lines
    (with `delays`, the race check's: its CHECK only, its times being no figures)."""
    lines: list[str] = []
    check = "adapter scattered rows equal the gathered ones"
    if delays is not None:
        check += f", {delays} cycles of delay on both streams, read back unsynced"
    if not paths:
        return [f"CHECK\t{check}\tFAIL\tthe carry was not installed"]
    print(f"adapter data path per warm turn, pages on {device} (ms, median (p25-p75); "
          "gather/scatter: the page copies alone)")
    print("| policy | deposit (gather into the arena) | gather | adopt (decide, take, scatter) | scatter "
          "| rows scattered | (deposit + adopt) / blind TTFT |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for p in paths:
        spreads = {k: Spread.of([x for x in col(p, k) if x is not None])
                   for k in ("deposit_ms", "gather_ms", "adopt_ms", "scatter_ms")}
        pairs = [(r["deposit_ms"] + r["adopt_ms"], b["ttft_ms"]) for r in warm_recs if r["policy"] == p
                 if r["deposit_ms"] is not None and r["adopt_ms"] is not None
                 for b in warm_recs if b["policy"] == "blind"
                 and (b["session"], b["turn"]) == (r["session"], r["turn"])]
        share = paired_ratio([a for a, _ in pairs], [b for _, b in pairs], "ttft_ms", "blind")
        rows = Spread.of([n for n, _ in paths[p].checks])

        def cell(sp: Spread) -> str:
            return "-" if sp.median is None else f"{sp.median:.3f} ({sp.p25:.3f}-{sp.p75:.3f})"

        print(f"| {p} | {cell(spreads['deposit_ms'])} | {cell(spreads['gather_ms'])} | "
              f"{cell(spreads['adopt_ms'])} | {cell(spreads['scatter_ms'])} | "
              f"{'-' if rows.median is None else f'{rows.median:.0f}'} | "
              f"{share.reason or cell(share.spread)} |")
        suffix = "" if p == "carry" else ", fp8"
        if delays is not None:
            continue
        for name, key in (("gather", "deposit_ms"), ("scatter", "adopt_ms")):
            sp = spreads[key]
            value = ("n/a (no warm turn)" if sp.median is None else
                     f"{sp.median:.3f} ms [{sp.p25:.3f}-{sp.p75:.3f}] over {sp.n} warm turns ({p}, {device})")
            lines.append(f"FIGURE\tadapter {name} per warm turn{suffix}\t{value}\t-\tINFO")
        if share.spread.median is not None:
            lines.append(f"FIGURE\tadapter data path / blind warm ttft{suffix}\t{share.spread.median:.3f}x "
                         f"[{share.spread.p25:.3f}-{share.spread.p75:.3f}] ({p}, {device})\t-\tINFO")
        lines += _rows_carried(p, paths[p], suffix)
    checks = [c for path in paths.values() for c in path.checks]
    bad = [n for n, ok in checks if not ok]
    verdict = "PASS" if checks and not bad else "FAIL"
    detail = (f"{len(checks)} scatters, {sum(n for n, _ in checks)} rows read back from the pages "
              f"equal the rows gathered at the previous turn's free" if verdict == "PASS" else
              f"{len(bad)} of {len(checks)} scatters differ" if checks else "no scatter ran")
    lines.append(f"CHECK\t{check}\t{verdict}\t{detail}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
