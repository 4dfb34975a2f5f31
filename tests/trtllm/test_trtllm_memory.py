"""The carry's memory is part of TensorRT-LLM's budget (issue 33), on the STAND-IN.

The stand-in models one device's memory (`standin.torch_cuda.StandinDeviceMemory`, the
`torch.cuda.mem_get_info()` KV cache estimation reads) and `KvCacheCreator`'s order
(`_util.py` @ 0004396720054fd8e205cbf616f21f0b57c6b412, `py_executor_creator.py` @
000429d57d42ecc8d481e5cdf653fff238be5974): `try_prepare_estimation` (where the worker hook
reserves the carry's bytes; V2 sizes the estimation cache from the memory free then), the
estimation build, the first `create_py_executor_instance` (where the hook builds the arenas
over those bytes, or reserves when the earlier point did not run), then
`configure_kv_cache_capacity` measures free memory and sizes the served KV cache. No
TensorRT-LLM and no GPU ran: what these pin is our order against that model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from arena_carry import ArenaCarry
from standin_helpers import CHUNK, model, padded, user_tokens

from trtllm_mtp_carry.core import CarryStore
from trtllm_mtp_carry.dataplane.arena import Arena
from trtllm_mtp_carry.service import SKIP_REASONS
from trtllm_mtp_carry.trtllm import CARRY_MANAGER_KEY, worker
from trtllm_mtp_carry.trtllm.options import RECOMMENDED_KV_CACHE_CONFIG
from trtllm_mtp_carry.trtllm.reservation import row_nbytes
from trtllm_mtp_carry.trtllm.standin import ConversationParams, StandinLLM
from trtllm_mtp_carry.trtllm.standin.torch_cuda import StandinDeviceMemory

MiB = 1 << 20
TOTAL = 64 * MiB  # the modelled device
WEIGHTS = 6 * MiB + 123 * 1024
CARRY = 4 * MiB
ROW = 256  # one carried row of the reference model's draft pool: [2, Hkv=2, D=32] bf16
MAX_NEW = 12


@pytest.fixture
def carry_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    config = tmp_path / "carry.yaml"
    config.write_text(f"mtp_carry: {{carry_slots: 8, carry_memory: {CARRY}, carry_host_memory: 0}}\n")
    monkeypatch.setenv(worker.ENV, str(config))
    return config


def _llm(memory: StandinDeviceMemory, estimate: bool = True, **kv: Any) -> StandinLLM:
    return StandinLLM(model(), kv_cache_config={**RECOMMENDED_KV_CACHE_CONFIG, **kv}, chunk_size=CHUNK,
                      max_batch=4, num_pages=64, estimate_kv_cache=estimate, device_memory=memory)


def _manager(llm: StandinLLM) -> Any:
    return llm.executor.resource_manager.resource_managers.get(CARRY_MANAGER_KEY)


def _budget(llm: StandinLLM) -> int:
    return int(llm.executor.kv_cache_budget_bytes)


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.9])
def test_the_kv_budget_shrinks_by_the_arena_reserved_before_estimation_measures(
        carry_file: Path, monkeypatch: pytest.MonkeyPatch, fraction: float) -> None:
    with_carry = StandinDeviceMemory(TOTAL, WEIGHTS)
    llm = _llm(with_carry, free_gpu_memory_fraction=fraction)
    line = worker.messages()[-1]
    monkeypatch.delenv(worker.ENV)
    without = StandinDeviceMemory(TOTAL, WEIGHTS)
    plain = _llm(without, free_gpu_memory_fraction=fraction)
    assert _manager(plain) is None and without.charged["carry"] == 0
    # _cal_max_memory: (total - peak + estimation KV) * fraction; the arena is in the peak
    assert _budget(plain) == int((TOTAL - WEIGHTS) * fraction)
    assert _budget(llm) == int((TOTAL - WEIGHTS - CARRY) * fraction)
    assert _budget(plain) - _budget(llm) in (int(CARRY * fraction), int(CARRY * fraction) + 1)
    # reserved once for both builds (the served build's carry took the estimation build's arena)
    assert with_carry.charged["carry"] == CARRY
    assert _manager(llm).reserved.device.nbytes == CARRY and _manager(llm).reserved.host is None
    assert llm.executor.paged.buf.shape[0] == _budget(llm) // (32 * ROW)  # tokens_per_block rows a page
    assert "carried rows hold 4MiB of cpu memory, reserved before TensorRT-LLM's KV cache " \
           "estimation measures free memory" in line and "and 0B of host memory (one row = 256 bytes)" in line
    stats = _manager(llm).stats()
    assert (stats.reserved_bytes, stats.host_reserved_bytes) == (CARRY, 0)


def test_a_fixed_max_gpu_total_bytes_keeps_the_kv_cache_and_the_start_line_says_what_the_carry_holds(
        carry_file: Path) -> None:
    memory = StandinDeviceMemory(TOTAL, WEIGHTS)
    llm = _llm(memory, max_gpu_total_bytes=8 * MiB)
    assert _budget(llm) == 8 * MiB  # the user's size: the carry's 4 MiB are on top of it
    assert memory.charged == {"weights": WEIGHTS, "kv": 8 * MiB, "carry": CARRY}
    line = worker.messages()[-1]
    assert line.startswith(f"mtp carry: installed in the worker's PyExecutor as {CARRY_MANAGER_KEY}")
    assert "carried rows hold 4MiB of cpu memory" in line and "max_gpu_total_bytes" in line


def test_a_skipped_estimation_sizes_the_kv_cache_around_the_arena_reserved_at_try_prepare_estimation(
        carry_file: Path) -> None:
    """Estimation skipped (`TRTLLM_SKIP_KV_CACHE_ESTIMATION`: `build_managers` measures before the
    build) with the whole free memory given to the KV cache: the hook reserved at
    `try_prepare_estimation`, before that measurement, so the KV cache is sized around it."""
    memory = StandinDeviceMemory(TOTAL, WEIGHTS)
    llm = _llm(memory, estimate=False, free_gpu_memory_fraction=1.0)
    assert _manager(llm) is not None and _manager(llm).reserved.early
    assert memory.charged == {"weights": WEIGHTS, "kv": _budget(llm) // (32 * ROW) * 32 * ROW, "carry": CARRY}
    assert _budget(llm) == TOTAL - WEIGHTS - CARRY
    assert "reserved before TensorRT-LLM's KV cache estimation measures free memory before any KV " \
           "cache exists" in worker.messages()[-1]


def test_without_room_for_the_arena_the_carry_stands_aside_and_the_executor_serves(
        carry_file: Path) -> None:
    """Less free memory than `carry_memory`: the reservation at `try_prepare_estimation` fails, the
    install says so in one line, nothing is raised, and the KV cache gets all it would have."""
    memory = StandinDeviceMemory(TOTAL, TOTAL - CARRY + 64 * 1024)
    llm = _llm(memory, free_gpu_memory_fraction=0.9)
    assert _manager(llm) is None and memory.charged["carry"] == 0
    assert _budget(llm) == int((CARRY - 64 * 1024) * 0.9)
    line = worker.messages()[-1]
    assert line.startswith("mtp carry: stands aside: OutOfMemoryError while installing the carry "
                           f"(stand-in device: tried to allocate {CARRY} bytes for carry;")
    req = llm.generate_async(user_tokens(0, 2 * CHUNK), MAX_NEW,
                             conversation_params=ConversationParams(conversation_id="s"))
    llm.run_until_done()
    assert len(req.output) == MAX_NEW


def test_a_v2_estimation_cache_sized_from_free_memory_leaves_room_for_the_arena_reserved_before_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KV cache manager V2's estimation build gets `fraction * free` (measured in
    `try_prepare_estimation`) when the dummy workload asks for more, mapped at construction. An
    arena reserved after it (at the first `create_py_executor_instance`, the fallback) must fit in
    the `(1 - fraction)` margin; reserved before it, it is sized around. 8 MiB > 0.1 * 57.9 MiB."""
    from trtllm_mtp_carry.trtllm.standin._util import KvCacheCreator

    carry = 8 * MiB
    config = tmp_path / "carry.yaml"
    config.write_text(f"mtp_carry: {{carry_slots: 8, carry_memory: {carry}, carry_host_memory: 0}}\n")
    monkeypatch.setenv(worker.ENV, str(config))
    worker.boot()  # installs the hook on the stand-in's creator (as the .pth line does)
    wrap = KvCacheCreator.__dict__["try_prepare_estimation"]
    assert getattr(wrap, "_mtp_carry_wrapped", False)

    def build(memory: StandinDeviceMemory) -> StandinLLM:  # a dummy workload of 64 MiB of pages
        return StandinLLM(model(), kv_cache_config={**RECOMMENDED_KV_CACHE_CONFIG}, chunk_size=CHUNK,
                          max_batch=4, num_pages=8192, estimate_kv_cache=True, device_memory=memory)

    free = TOTAL - WEIGHTS
    early = StandinDeviceMemory(TOTAL, WEIGHTS)
    llm = build(early)
    assert _manager(llm) is not None and _manager(llm).reserved.device.nbytes == carry
    assert llm.executor.estimation_draft.paged.buf.shape[0] == int((free - carry) * 0.9) // (32 * ROW)
    assert _budget(llm) == int((free - carry) * 0.9)
    assert early.charged["carry"] == carry
    # a build whose creator has no try_prepare_estimation to wrap: the first
    # create_py_executor_instance reserves, after the estimation cache took 0.9 of the free memory
    monkeypatch.setattr(KvCacheCreator, "try_prepare_estimation", wrap.__wrapped__)
    late = StandinDeviceMemory(TOTAL, WEIGHTS)
    llm = build(late)
    assert _manager(llm) is None and late.charged["carry"] == 0
    assert worker.messages()[-1].startswith(
        f"mtp carry: stands aside: OutOfMemoryError while installing the carry (stand-in device: tried "
        f"to allocate {carry} bytes for carry; {free - int(free * 0.9) // (32 * ROW) * (32 * ROW)} of")
    assert _budget(llm) == int(free * 0.9)


def test_a_carry_that_stands_aside_gives_its_early_bytes_back_before_the_kv_cache_is_measured(
        carry_file: Path) -> None:
    memory = StandinDeviceMemory(TOTAL, WEIGHTS)
    llm = StandinLLM(model(), kv_cache_config=dict(RECOMMENDED_KV_CACHE_CONFIG), chunk_size=CHUNK,
                     max_batch=4, num_pages=64, estimate_kv_cache=True, device_memory=memory,
                     topology="paired")
    assert _manager(llm) is None and memory.charged["carry"] == 0
    assert worker.messages()[-1].startswith("mtp carry: stands aside: ")
    assert _budget(llm) == int((TOTAL - WEIGHTS) * 0.9)  # as without the carry


def test_a_failure_giving_the_early_bytes_back_is_one_line_and_the_executor_is_built(
        carry_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trtllm_mtp_carry.trtllm.reservation import EarlyReservation

    def refuse(self: Any) -> None:
        raise RuntimeError("cannot free")

    monkeypatch.setattr(EarlyReservation, "release", refuse)
    memory = StandinDeviceMemory(TOTAL, WEIGHTS)
    llm = StandinLLM(model(), kv_cache_config=dict(RECOMMENDED_KV_CACHE_CONFIG), chunk_size=CHUNK,
                     max_batch=4, num_pages=64, estimate_kv_cache=True, device_memory=memory,
                     topology="paired")  # stands aside: its early bytes go back, which fails here
    assert _manager(llm) is None
    first, give_back, second = worker.messages()[-3:]  # the estimation build, then the served one
    assert first == second and first.startswith("mtp carry: stands aside: paired: ")
    assert give_back == "mtp carry: RuntimeError while giving back the carry's reserved bytes (cannot free)"
    req = llm.generate_async(user_tokens(0, 2 * CHUNK), MAX_NEW,
                             conversation_params=ConversationParams(conversation_id="s"))
    llm.run_until_done()  # the executor serves
    assert len(req.output) == MAX_NEW


def _rows(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 2, 2, 32, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _carried(rows: int, budget_rows: int | None = None) -> ArenaCarry:
    """The carry over a device arena of `rows` rows (the store's budget: `budget_rows`, else the arena)."""
    arena = Arena(torch.zeros(rows * ROW, dtype=torch.uint8))
    return ArenaCarry(None, (rows if budget_rows is None else budget_rows) * ROW, "lrd", head_dim=32, arena=arena)


def test_one_block_is_one_row_in_the_carry_s_format() -> None:
    assert row_nbytes(2, 32, torch.bfloat16, "bf16") == ROW == _rows(1, 0).nbytes
    assert row_nbytes(2, 32, torch.bfloat16, "fp8") == 2 * 2 * 32 + 2 * 2 * 4  # payload + float32 scales
    for row_dtype in ("bf16", "fp8"):  # an FP8 KV pool: its own bytes, one an element, no scales
        assert row_nbytes(2, 32, torch.float8_e4m3fn, row_dtype) == 2 * 2 * 32


def test_a_full_arena_refuses_the_deposit_as_oom_and_the_carry_keeps_what_it_holds(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trtllm_mtp_carry")
    # the store's budget (10 rows) above the arena's (4 rows): only the arena can refuse
    carried = _carried(4, budget_rows=10)
    kept = _rows(3, 1)
    assert carried.deposit(1, list(range(4)), kept)
    assert not carried.deposit(2, list(range(4)), _rows(3, 2))
    assert not carried.deposit(3, list(range(4)), _rows(2, 3))
    stats = carried.stats()
    assert stats.refusals == {"not_admitted": 0, "too_large": 0, "oom": 2}
    assert stats.entries_held == 1 and stats.bytes_held == 3 * ROW
    assert carried.get(2) is None and carried.service.store.miss_reason(2) == "oom"
    assert carried.arena.keys() == [1]  # a refused deposit reserved nothing and wrote nothing
    lines = [r.getMessage() for r in caplog.records if "refused as oom" in r.getMessage()]
    assert len(lines) == 1  # logged once, counted every time
    taken = carried.take(1)
    assert torch.equal(taken, kept)  # the held entry adopts bit for bit
    carried.check()


def test_a_fragmented_arena_compacts_and_the_moved_rows_stay_bit_equal() -> None:
    carried = _carried(6)
    arena = carried.arena
    a, b, c, d = _rows(2, 1), _rows(2, 2), _rows(2, 3), _rows(4, 4)
    for key, rows in ((1, a), (2, b), (3, c)):
        assert carried.deposit(key, list(range(3)), rows, session=key)
    carried.forget(1)
    carried.forget(3)  # 4 rows free, in two extents of 2
    assert carried.deposit(4, list(range(5)), d)
    assert arena.compactions == 1 and arena.keys() == [2, 4]
    arena.check()
    assert arena.take(5, ROW) is None  # full
    assert torch.equal(carried.take(2), b) and torch.equal(carried.take(4), d)
    carried.check()


def test_fp8_rows_are_payload_then_scales_in_one_extent() -> None:
    from trtllm_mtp_carry.dataplane.row_format import pack_rows

    packed = pack_rows(_rows(3, 7))
    row = row_nbytes(2, 32, torch.bfloat16, "fp8")
    carried = ArenaCarry(None, 3 * row, "lrd", row_dtype="fp8", head_dim=32)
    assert carried.deposit(9, list(range(4)), packed)
    extent = carried.arena.view(9)
    payload = packed.payload.view(torch.uint8).flatten()
    assert torch.equal(extent[: payload.numel()], payload)  # the payload first, then the float32 scales
    assert torch.equal(extent[payload.numel():], packed.scales.flatten().view(torch.uint8))
    got = carried.take(9)
    assert torch.equal(got.payload.view(torch.uint8), packed.payload.view(torch.uint8))
    assert torch.equal(got.scales, packed.scales) and got.dtype == packed.dtype
    assert extent.numel() == carried.arena.capacity == 3 * row


def test_a_compaction_that_cannot_stage_is_refused_as_oom_and_the_arena_stays_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    carried = _carried(6)
    b = _rows(3, 2)  # rows [1, 4): sliding it to [0, 3) overlaps itself, so it is staged
    assert carried.deposit(1, list(range(2)), _rows(1, 1), session=1) and carried.deposit(2, list(range(4)), b)
    assert carried.deposit(3, list(range(3)), _rows(2, 3), session=3)
    carried.forget(1)
    carried.forget(3)  # 3 rows free, in extents of 1 and 2
    real = carried.arena._move

    def staged(dst: int, src: int, n: int) -> None:  # a device arena stages an overlapping move:
        if src < dst + n:  # out of memory there (a CPU arena moves with memmove, staging nothing)
            raise torch.OutOfMemoryError("injected")
        real(dst, src, n)

    monkeypatch.setattr(carried.arena, "_move", staged)
    assert not carried.deposit(4, list(range(4)), _rows(3, 4))  # needs the compaction's staging
    monkeypatch.undo()
    assert carried.stats().refusals["oom"] == 1 and carried.arena.keys() == [2]
    assert torch.equal(carried.take(2), b)
    carried.check()


def test_an_injected_allocation_failure_in_the_worker_is_refused_as_oom_and_nothing_is_raised(
        carry_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _llm(StandinDeviceMemory(TOTAL, WEIGHTS))
    manager = _manager(llm)
    arena = manager.reserved.device
    real = arena.take
    failures = [1]

    def take(key: Any, nbytes: int, *args: Any, **kwargs: Any) -> Any:
        if failures:
            failures.pop()
            raise torch.OutOfMemoryError("injected")
        return real(key, nbytes, *args, **kwargs)

    monkeypatch.setattr(arena, "take", take)
    convs = [ConversationParams(conversation_id=name) for name in "ab"]
    first = [llm.generate_async(user_tokens(97 * i, 2 * CHUNK), MAX_NEW, conversation_params=c)
             for i, c in enumerate(convs)]
    llm.run_until_done()  # the first deposit fails, the other is kept
    second = [llm.generate_async(padded(r.get_tokens(0), 5 + i), MAX_NEW, conversation_params=c)
              for i, (r, c) in enumerate(zip(first, convs, strict=True))]
    llm.run_until_done()
    stats = manager.stats()
    assert stats.refusals["oom"] == 1 and stats.faults == {}
    assert stats.no_carry_reasons["oom"] == 1
    records = sorted((manager.turn(r.py_request_id) for r in second), key=lambda t: str(t["outcome"]))
    assert [(t["outcome"], t["no_carry_reason"]) for t in records] == [("adopted", ""), ("no_carry", "oom")]
    # the kept session deposited both turns; the refused one's warm turn ran blind over [0, R),
    # as TensorRT-LLM without the carry, and deposited the run its context computed, [R, N - 1)
    assert stats.deposits == 3 and stats.skipped == dict.fromkeys(SKIP_REASONS, 0)
    manager.service.check()
    llm.executor.check()
    from trtllm_mtp_carry.trtllm.metrics import WorkerMetrics

    exporter = WorkerMetrics(0)  # what the worker's Prometheus endpoint serves
    exporter.bind(manager)
    text = exporter.render()
    assert any(x.endswith('field="refusals.oom"} 1') for x in text.splitlines()), text
    assert any(x.endswith(f'field="reserved_bytes"}} {CARRY}') for x in text.splitlines())


def test_the_store_and_the_arena_charge_the_same_bytes() -> None:
    """The store's budget is the arena's capacity: whatever the store admits, the arena holds."""
    carried = _carried(8)
    arena = carried.arena
    for key, n in enumerate([3, 2, 3, 4, 1, 5, 2, 2, 8], start=1):
        assert carried.deposit(key, list(range(n + 1)), _rows(n, key))
        assert carried.stats().bytes_held == arena.held_bytes
        carried.check()
    assert carried.stats().refusals["oom"] == 0
    assert isinstance(carried.service.store, CarryStore)


@pytest.mark.parametrize(("kv", "size"), [
    ("{}", "estimated: free_gpu_memory_fraction=0.9 of the memory free after the carry's arena"),
    ("{max_gpu_total_bytes: 8000000000}",
     "fixed (max_gpu_total_bytes=8000000000): the carry's reservation is on top of it"),
])
def test_info_reports_what_the_worker_reserves_and_how_the_kv_cache_is_sized(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], kv: str, size: str) -> None:
    from trtllm_mtp_carry.cli import main

    path = tmp_path / "llm.yaml"
    path.write_text(f"mtp_carry: {{carry_memory: 1GiB, carry_host_memory: 2GiB}}\nkv_cache_config: {kv}\n")
    assert main(["info", "--json", "--llm-config", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["trtllm_reserved_device_bytes"], report["trtllm_reserved_host_bytes"]) == (1 << 30, 2 << 30)
    assert report["trtllm_kv_cache_size"] == size
    assert main(["info", "--llm-config", str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("TensorRT-LLM worker reserves"))
    assert "1GiB device, 2GiB host" in line and size in line
    assert "; the host bytes exactly, page-locked once on a GPU;" in line  # no power-of-two round-up


def test_info_s_reservation_follows_the_memory_flags_for_both_arenas_by_one_rule(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys

    def info(*argv: str) -> tuple[dict, str]:
        run = [sys.executable, "-m", "trtllm_mtp_carry.cli", "info", *argv]
        report = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, check=True).stdout)
        line = next(x for x in subprocess.run(run, capture_output=True, text=True, check=True).stdout.splitlines()
                    if x.startswith("TensorRT-LLM worker reserves"))
        return report, line

    report, line = info("--carry-memory", "512MiB", "--carry-host-memory", "64MiB")
    assert (report["trtllm_reserved_device_bytes"], report["trtllm_reserved_host_bytes"]) == (512 << 20, 64 << 20)
    assert "512MiB device, 64MiB host  each: mtp_carry.carry_memory / carry_host_memory, else the setting above " \
           "(flag, env), else 1GiB / no host tier;" in line
    report, line = info()
    assert (report["trtllm_reserved_device_bytes"], report["trtllm_reserved_host_bytes"]) == (1 << 30, 0)
    assert "1GiB device, no host tier  each:" in line and "page-locked" not in line
    report, line = info("--carry-memory", "0.5")  # a pool fraction: no pool to apply it to there
    assert (report["trtllm_reserved_device_bytes"], report["trtllm_reserved_refused"]) == (
        None, "carry_memory=50% of the drafter pool (--carry-memory): the carry inside TensorRT-LLM reserves "
              "bytes, before TensorRT-LLM sizes its pools; give bytes (e.g. 1GiB) there or in mtp_carry.carry_memory")
    path = tmp_path / "llm.yaml"  # the carry file's own size wins over the flag
    path.write_text("mtp_carry: {carry_memory: 256MiB}\nkv_cache_config: {}\n")
    report, line = info("--carry-memory", "512MiB", "--carry-host-memory", "64MiB", "--llm-config", str(path))
    assert "256MiB device, 64MiB host  each:" in line


@pytest.mark.parametrize(("section", "port"), [("{metrics_port: 9400}", 9400), ("{}", None),
                                              ("{enable: false, metrics_port: 9400}", None)])
def test_info_shows_the_worker_s_metrics_port_when_the_carry_file_sets_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], section: str, port: int | None) -> None:
    from trtllm_mtp_carry.cli import main

    path = tmp_path / "llm.yaml"
    path.write_text(f"mtp_carry: {section}\nkv_cache_config: {{}}\n")
    assert main(["info", "--json", "--llm-config", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["trtllm_metrics_port"] == port
    assert main(["info", "--llm-config", str(path)]) == 0
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith("worker metrics (metrics_port)")]
    assert [row.split()[3:5] for row in rows] == ([] if port is None else [["9400", "Prometheus"]])
    if port is not None:
        assert rows[0].endswith("http://<host>:<metrics_port + rank>/metrics, one port per worker rank")


def test_attach_reserves_the_arenas_and_info_says_how_much() -> None:
    from standin_helpers import make_llm

    from trtllm_mtp_carry.trtllm import attach

    llm, _ = make_llm("blind")
    carry = attach(llm, {"carry_slots": 8, "carry_memory": 1000, "carry_host_memory": 600})
    reserved = carry.manager.reserved
    # rounded down to whole 256-byte rows: 3 rows on the device, 2 on the host
    assert (reserved.device.nbytes, reserved.host.nbytes) == (768, 512)
    assert carry.info()[-1][:2] == ("carry reserved", "768B device, 512B host")
    assert carry.stats().reserved_bytes == 768


@pytest.mark.parametrize(("row_dtype", "kv", "row"), [
    ("bf16", "BF16", ROW), ("fp8", "BF16", 2 * 2 * 32 + 2 * 2 * 4),
    ("bf16", "FP8", 2 * 2 * 32), ("fp8", "FP8", 2 * 2 * 32)])  # an FP8 pool: its own 1-byte rows
def test_both_tiers_serve_from_their_arenas_bit_for_bit_and_outputs_stay_the_same(
        row_dtype: str, kv: str, row: int) -> None:
    """The device arena holds one session's first turn (at most 559 rows), the host arena all
    four: every warm turn adopts, some from the host tier, and the outputs are TensorRT-LLM's."""
    from standin_helpers import make_llm, quote_sessions, run_turns

    from trtllm_mtp_carry.trtllm import attach
    from trtllm_mtp_carry.trtllm.standin import DataType

    sessions = quote_sessions(4)
    blind, _ = make_llm("blind", kv_dtype=DataType[kv])
    want = {c: [r.output for r in t] for c, t in run_turns(blind, sessions, 2, 48).items()}
    llm, _ = make_llm("blind", kv_dtype=DataType[kv])
    carry = attach(llm, {"carry_slots": 8, "carry_memory": 560 * row, "carry_host_memory": 4 * 560 * row,
                         "carry_row_dtype": row_dtype})
    got = run_turns(llm, sessions, 2, 48)
    assert {c: [r.output for r in t] for c, t in got.items()} == want
    stats = carry.stats()
    assert stats.outcomes["adopted"] == 4 and stats.hits_host >= 1
    assert (stats.reserved_bytes, stats.host_reserved_bytes) == (560 * row, 4 * 560 * row)
    assert stats.refusals["oom"] == 0 and stats.bytes_held == stats.rows_held * row
    carry.manager.service.check()  # entries and arena extents agree, the extents tile each arena
    llm.executor.check()


def test_a_taken_entry_s_range_goes_back_once_its_scatter_read_it_and_nothing_stays_held() -> None:
    carried = _carried(4)
    arena = carried.arena
    a = _rows(4, 1)
    assert carried.deposit(1, list(range(5)), a)
    taken = carried.take(1)  # on the CPU the scatter is done when it returns (CUDA: after its event)
    assert carried.stats().bytes_held == 0 and arena.held_bytes == arena.pending_bytes == 0
    carried.forget(7)  # another session's end frees nothing
    assert torch.equal(taken, a)
    assert carried.deposit(2, list(range(5)), _rows(4, 2))  # the next deposit takes the range
    assert arena.held_bytes == 4 * ROW and torch.equal(carried.take(2), _rows(4, 2))
    carried.check()
    carried.service.detach()  # nothing held: detach finds no leak


def test_early_bytes_are_cut_into_whole_rows_and_given_back_once() -> None:
    from trtllm_mtp_carry.trtllm.reservation import arenas_over, reserve_early

    memory = StandinDeviceMemory(TOTAL, WEIGHTS)
    early = reserve_early(10 * ROW + 100, 3 * ROW + 7, torch.device("cpu"), memory.allocate, memory.free)
    assert memory.charged["carry"] == 10 * ROW + 100 and early.host is not None
    pages = torch.zeros(4, 2, 2, 32, 32, dtype=torch.bfloat16)  # HND [pages, 2, Hkv, tpb, D]
    reserved = arenas_over(early, pages, "bf16")
    assert reserved is not None and reserved.early
    assert reserved.row_nbytes == ROW and (reserved.device.capacity, reserved.device.nbytes) == (10 * ROW, 10 * ROW)
    assert reserved.host is not None and (reserved.host.capacity, reserved.host.nbytes) == (3 * ROW, 3 * ROW)
    assert reserved.device.storage.data_ptr() == early.device.data_ptr()  # over the same bytes, no copy
    early.release()
    early.release()
    assert memory.charged["carry"] == 0
    with pytest.raises(torch.OutOfMemoryError):
        reserve_early(TOTAL, 0, torch.device("cpu"), memory.allocate, memory.free)
    assert memory.charged["carry"] == 0
    if torch.cuda.is_available():  # the early bytes on another device than the pages: not used
        assert arenas_over(reserve_early(ROW, 0, torch.device("cuda")), pages, "bf16") is None


def test_an_unarmed_attachment_answers_stats_and_info_under_a_fraction_carry_memory() -> None:
    """A fraction in TRTLLM_MTP_CARRY_MEMORY makes the install stand aside (no pool to size it by);
    `stats()` and `info()` of that attachment (a serving front end polls them) still answer."""
    import os
    import subprocess
    import sys

    code = ("from trtllm_mtp_carry.trtllm import CarryAttachment\n"
            "from trtllm_mtp_carry.trtllm.options import CarryOptions\n"
            "a = CarryAttachment('unpaired', False, 'refused', CarryOptions(), None, None, 1, None)\n"
            "print(a.stats().carry_memory_bytes)\n"
            "print(dict((n, v) for n, v, _ in a.info())['carry memory (carry_memory)'])\n")
    env = {**os.environ, "TRTLLM_MTP_CARRY_MEMORY": "0.5"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.splitlines() == ["0", "refused (a fraction: give bytes)"]
