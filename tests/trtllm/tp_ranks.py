"""Tensor-parallel ranks of the TensorRT-LLM STAND-IN as real processes (torch.distributed, gloo).

`run_ranks(tp, scenarios, tmp)` spawns `tp` processes; each initializes a gloo process group,
then runs every named scenario in order, each on a fresh stand-in LLM built "in a worker" with
the carry's worker hook (`TRTLLM_MTP_CARRY_WORKER`): its own executor, resource managers and
draft pool holding its KV-head shard, requests submitted on rank 0 only and broadcast by the
executor. `run_scenario(name, tp=1)` runs one in this process (the single-rank reference).

A scenario returns what one rank saw, per request id (the same ids on every rank: rank 0
assigns them and broadcasts them): the carry's turn record, this rank's draft rows at free
(every byte of keys `[0, N - 1)`, its head shard), the output and accepted drafts; and the
carry's stats and the worker's lines. No TensorRT-LLM is run.
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from standin_helpers import model, user_tokens

from trtllm_mtp_carry.serve.dynamo.launcher import free_port

CHUNK = 32
SESSIONS = 3
TURNS = 4
SHORT = {"turns": 3, "sessions": 2}  # the divergence scenarios: enough turns to see a miss and its aftermath
MAX_NEW = 12
IDLE_S = 60  # every rank's idle TTL; the skewed-clock scenario moves one rank's clock far past it
CARRY_FILE = "mtp_carry: {carry_slots: 8, carry_memory: 4194304}\n"
SKEW_S = 10_000.0



def run_ranks(tp: int, scenarios: list[str], tmp: Path, timeout: float = 240.0) -> list[dict[str, Any]]:
    """Run `scenarios` on `tp` spawned rank processes; each rank's results, rank order.
    RuntimeError naming the rank and its traceback when one fails; TimeoutError (the ranks
    killed) when they do not finish in `timeout` seconds (a hang: mismatched collectives)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, scenarios, str(tmp)), daemon=True)
             for r in range(tp)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if alive:
        raise TimeoutError(f"ranks {alive} of {tp} did not finish in {timeout} s")
    for r, p in enumerate(procs):
        if p.exitcode != 0:
            err = Path(tmp, f"rank{r}.err")
            raise RuntimeError(f"rank {r} exited {p.exitcode}: {err.read_text() if err.exists() else ''}")
    return [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(tp)]


def _rank_main(rank: int, tp: int, port: int, scenarios: list[str], out: str) -> None:
    try:
        torch.set_num_threads(1)
        os.environ["TRTLLM_MTP_CARRY_IDLE_S"] = str(IDLE_S)
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                                timeout=timedelta(seconds=120))
        results = {name: run_scenario(name, tp, Path(out)) for name in scenarios}
        Path(out, f"rank{rank}.pkl").write_bytes(pickle.dumps(results))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_scenario(name: str, tp: int, tmp: Path) -> dict[str, Any]:
    """One scenario on this rank (tp 1: this process alone); see `SCENARIOS`."""
    config = Path(tmp, "carry.yaml")
    if not config.exists():
        config.write_text(CARRY_FILE)
    os.environ["TRTLLM_MTP_CARRY_WORKER"] = str(config)
    return SCENARIOS[name](tp)


# ---- the driver: every rank runs the same turns, rank 0 submits ------------------------------


class Ranked:
    """One rank's stand-in LLM (worker install) and what it records per request."""

    def __init__(self, tp: int, **options: Any) -> None:
        from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, worker
        from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG
        from trtllm_mtp_carry.trtllm.standin import StandinLLM

        before = len(worker.messages())
        self.llm = StandinLLM(model(), kv_cache_config=RECOMMENDED_KV_CACHE_CONFIG, chunk_size=CHUNK,
                              max_batch=4, num_pages=512, tp_size=tp, **options)
        self.lines = worker.messages()[before:]
        self.executor = self.llm.executor
        self.manager = self.executor.resource_manager.resource_managers.get(CARRY_MANAGER_KEY)
        self.rank = self.executor.tp_rank
        self.rows: dict[int, torch.Tensor] = {}
        rm = self.executor.resource_manager
        free, paged = rm.free_resources, self.executor.paged

        def capture(request: Any) -> None:
            n = len(request.get_tokens(0)) - 1
            if n > 0 and request.py_request_id in paged.tables:
                self.rows[request.py_request_id] = paged.key_bytes(request.py_request_id, 0, n).clone()
            free(request)

        rm.free_resources = capture

    def turns(self, turns: int = TURNS, sessions: int = SESSIONS,
              between: Callable[[int], None] | None = None,
              during: Callable[[int, list[Any]], None] | None = None) -> None:
        """`sessions` conversations of `turns` turns, interleaved; `between(t)` runs on every rank
        before turn t, `during(t, requests)` after its requests were submitted (rank 0's; none
        elsewhere) and before the executor runs them to the end. Every warm prompt is the
        history plus new user tokens to a multiple of CHUNK (R chunk-aligned)."""
        from trtllm_mtp_carry.trtllm.standin import ConversationParams

        prompts = [user_tokens(1000 * i, 2 * CHUNK) for i in range(sessions)]
        for t in range(turns):
            if between is not None:
                between(t)
            reqs = []
            if self.rank == 0:  # only rank 0 takes requests; the executor broadcasts them
                reqs = [self.llm.generate_async(prompts[i], MAX_NEW,
                                                conversation_params=ConversationParams(conversation_id=f"s{i}"))
                        for i in range(sessions)]
            if during is not None:
                during(t, reqs)
            self.llm.run_until_done()
            for i, req in enumerate(reqs):
                history = req.get_tokens(0)
                prompts[i] = history + user_tokens(300 * t + 77 * i, CHUNK // 2 + (-(len(history) + CHUNK // 2)) % CHUNK)

    def result(self) -> dict[str, Any]:
        finished = self.executor.finished
        m = self.manager
        return {
            "rank": self.rank,
            "heads": list(self.executor.heads),
            "lines": self.lines,
            "installed": m is not None,
            "records": {rid: m.turn(rid) for rid in sorted(finished)} if m is not None else {},
            "rows": self.rows,
            "outputs": {rid: list(r.output) for rid, r in finished.items()},
            "accepted": {rid: r.accepted for rid, r in finished.items()},
            "stats": None if m is None else asdict(m.stats()),
        }


@contextmanager
def _during(obj: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]):  # type: ignore[no-untyped-def]
    """`obj.name` wrapped by `wrap` inside the block."""
    real = getattr(obj, name)
    setattr(obj, name, wrap(real))
    try:
        yield
    finally:
        setattr(obj, name, real)


def _fault_once_inside(manager: Any, step: str) -> Callable[[int], None]:
    """A `between` that makes this rank's first page lookup inside `manager.<step>` of turn 1
    raise KeyError (a page this rank cannot resolve), once."""
    state = {"armed": False, "inside": False}
    pages = manager.pages
    real_lookup = pages.page_ids

    def lookup(rid: int) -> Any:
        if state["armed"] and state["inside"]:
            state["armed"] = False
            raise KeyError(f"injected: request {rid}'s pages on this rank")
        return real_lookup(rid)

    pages.page_ids = lookup
    real_step = getattr(manager, step)

    def stepped(*args: Any, **kwargs: Any) -> Any:
        state["inside"] = True
        try:
            return real_step(*args, **kwargs)
        finally:
            state["inside"] = False

    setattr(manager, step, stepped)

    def between(t: int) -> None:
        state["armed"] = t == 1

    return between


# ---- scenarios ------------------------------------------------------------------------------


def turns(tp: int) -> dict[str, Any]:
    """Several sessions over several turns: every warm turn adopts."""
    ranked = Ranked(tp)
    ranked.turns()
    return ranked.result()


def adopt_fault(tp: int) -> dict[str, Any]:
    """The last rank cannot resolve one warm request's pages at adoption (turn 1)."""
    ranked = Ranked(tp)
    between = _fault_once_inside(ranked.manager, "_adopt_firsts") if ranked.rank == tp - 1 else None
    ranked.turns(between=between, **SHORT)
    return ranked.result()


def deposit_fault(tp: int) -> dict[str, Any]:
    """The last rank cannot gather one freed request's pages at deposit (turn 1)."""
    ranked = Ranked(tp)
    between = _fault_once_inside(ranked.manager, "_deposit") if ranked.rank == tp - 1 else None
    ranked.turns(between=between, **SHORT)
    return ranked.result()


def arena_full(tp: int) -> dict[str, Any]:
    """The last rank's arena is full (blocks its store does not know of) during turn 0, then
    freed: its placements fail, so no rank keeps turn 0's rows (refused `oom` on every rank), and
    every later warm turn misses alike (a turn whose prefix was not restored deposits nothing)."""
    ranked = Ranked(tp)
    foreign = -7  # an arena key no carry key can be (carry keys are u64 >= 1)

    def between(t: int) -> None:
        if ranked.rank != tp - 1:
            return
        arena = ranked.manager.reserved.device
        if t == 0:
            assert arena.take(foreign, arena.capacity) is not None  # every byte, behind the store's back
        if t == 1:
            assert arena.release(foreign)

    ranked.turns(between=between, **SHORT)
    return ranked.result()


def slow_skewed_rank(tp: int) -> dict[str, Any]:
    """Rank 1 is slow (a sleep in its prepare and free) and its own clock jumps SKEW_S seconds
    ahead after turn 0's deposits, far past the idle TTL: a store reading that rank's own clock
    would expire every entry there (and there only); the store reads the agreed clock, so no
    entry expires on any rank."""
    ranked = Ranked(tp)
    between = None
    if ranked.rank == 1:
        lockstep = ranked.manager.lockstep
        base, skew = lockstep._clock, [0.0]
        lockstep._clock = lambda: base() + skew[0]

        def between(t: int) -> None:
            skew[0] = SKEW_S if t >= 1 else 0.0

        def slow(fn: Callable[..., Any]) -> Callable[..., Any]:
            def slowed(*args: Any, **kwargs: Any) -> Any:
                time.sleep(0.02)
                return fn(*args, **kwargs)
            return slowed

        ranked.manager.prepare_resources = slow(ranked.manager.prepare_resources)
        ranked.manager.free_resources = slow(ranked.manager.free_resources)
    ranked.turns(between=between, **SHORT)
    return ranked.result()


def cancel(tp: int) -> dict[str, Any]:
    """Rank 0 cancels session 0's turn-1 request after its first iteration: the executor
    broadcasts the cancellation and every rank frees it at the same iteration."""
    ranked = Ranked(tp)

    def during(t: int, reqs: list[Any]) -> None:
        if t != 1:
            return
        ranked.executor.step()  # every rank: the new requests fetched, their first chunks run
        if ranked.rank == 0:
            ranked.executor.cancel(reqs[0].py_request_id)

    ranked.turns(during=during, **SHORT)
    return ranked.result()


def install_fails(tp: int) -> dict[str, Any]:
    """The last rank cannot reserve its carry memory: every rank stands aside."""
    from trtllm_mtp_carry.trtllm import reservation as arena

    rank = int(torch.distributed.get_rank()) if tp > 1 else 0

    def no_room(*args: Any, **kwargs: Any) -> Any:
        raise torch.OutOfMemoryError("injected: no room for the carry's arena on this rank")

    if rank == tp - 1:  # the worker reserves at try_prepare_estimation, before any KV cache
        with _during(arena, "reserve_early", lambda real: no_room):
            ranked = Ranked(tp)
    else:
        ranked = Ranked(tp)
    ranked.turns(turns=2, sessions=1)
    return ranked.result()


SCENARIOS: dict[str, Callable[[int], dict[str, Any]]] = {
    "turns": turns, "adopt_fault": adopt_fault, "deposit_fault": deposit_fault, "arena_full": arena_full,
    "slow_skewed_rank": slow_skewed_rank, "cancel": cancel, "install_fails": install_fails,
}
