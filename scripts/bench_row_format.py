#!/usr/bin/env python3
"""Throughput of the FP8 row format's pack and unpack against a plain copy of the same bytes.

What it is for: issue 31's kernel benchmark. A carried entry is packed once when
it is deposited and unpacked once when it is adopted; this says what each costs
next to copying the bf16 rows, the least a bf16 carry does.

Pairs, one process: every repetition runs each operation once, in an order
rotated from one repetition to the next (no operation always runs first), after
`--warmup` untimed rounds; each operation's ratio to the copy is taken within
its repetition, then the median and the interquartile range (p25-p75) over the
repetitions are printed. Throughput is bytes of bf16 rows per second (rows
`[keys, 2, Hkv, D]`, the same bytes for every line), so a line's GB/s compares
directly with the copy's.

Operations (`kernel`: Triton on CUDA, plain torch on CPU, as `row_format` picks):
- `copy`            dst.copy_(rows): the baseline, bf16 rows to bf16 rows;
- `pack_rows`       rows -> payload + scales;
- `unpack_rows`     payload + scales -> bf16 rows (into a preallocated out);
- `gather_rows`     TensorRT-LLM HND pages -> bf16 rows (the bf16 carry's gather);
- `gather_packed`   HND pages -> packed rows (the fp8 carry's gather);
- `scatter_rows`    bf16 rows -> HND pages (the bf16 carry's adopt);
- `scatter_packed`  packed rows -> HND pages (the fp8 carry's adopt);
- `select_blocks`   the reference pool's K and V blocks -> bf16 copies (`index_select`, what
                    `DrafterKVPool.export_carried` copies);
- `pack_blocks`     the pool's blocks -> packed rows (the reference runtime's fp8 deposit);
- `unpack_blocks`   packed rows -> whole K and V blocks (its fp8 adoption, before the copy in).

Then the reference runtime's fp8 deposit and adoption of one entry of `--entry-rows` rows
(default 8,192; the carry's arena home, `service.homes.ArenaHome`, over the pool's sequence,
`runtime.SequenceRows`: what the session bench's `pack_ms`/`unpack_ms` time): `deposit` packs
the sequence's rows out of the pool's blocks into the room reserved in the arena and frees the
blocks, `adoption` unpacks them into fresh blocks the sequence adopts
(`DrafterKVPool.carry_in`, then the codec's `scatter_blocks`), each paired with a copy of the same bf16 rows.

Headline lines (scripts/gpu_smoke.sh collects them), tab-separated:
  FIGURE <op>/copy at <keys> keys: the median ratio, target <= 2.0x (pack, unpack, gather_packed,
         scatter_packed, pack_blocks, unpack_blocks); deposit and adoption at <entry-rows> rows:
         median ms, target <= 0.1 ms. PASS/MISS on CUDA; INFO on the CPU (the targets are a GPU's).
  CHECK  the Triton kernels against the torch path, bit for bit, on this device (every packed
         move, and scales `amax / 448` correctly rounded where `amax * (1/448)` is not): only
         where the Triton FP8 kernels run (CUDA, compute capability 8.9+); else none.
  CHECK  on CUDA, every row codec's gather into an arena extent (`out=`: the codec's view of
         bytes at offset 12 of a larger buffer of random bytes), from HND pages (an MLA latent
         pool's too: BF16, FP8 and footer-scale `fp8_ds_mla`) and from K/V blocks, as a deposit
         writes its reserved extent: the extent holds exactly the CPU torch
         path's bytes for the same rows, as does the same gather without `out`, and no byte
         outside the extent changed; a row that arrives corrupt FAILs it. On a CPU none (the
         test suite runs these gathers there).

Usage: python scripts/bench_row_format.py [--keys N] [--kv-heads H] [--head-dim D] [--reps R]
                                          [--entry-rows N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trtllm_mtp_carry.core.row_format import FP8_DS_MLA_DIM  # noqa: E402
from trtllm_mtp_carry.dataplane.arena import Arena  # noqa: E402
from trtllm_mtp_carry.dataplane.hnd_pages import (  # noqa: E402
    gather_packed_rows,
    gather_rows,
    scatter_packed_rows,
    scatter_rows,
)
from trtllm_mtp_carry.dataplane.kv_pool import DrafterKVPool  # noqa: E402
from trtllm_mtp_carry.dataplane.latent_pages import TOKEN_BYTES, FooterScalePages  # noqa: E402
from trtllm_mtp_carry.dataplane.nvfp4_kv import NVFP4_KV_DTYPE, Nvfp4KvPages  # noqa: E402
from trtllm_mtp_carry.dataplane.rope import RopeConfig  # noqa: E402
from trtllm_mtp_carry.dataplane.row_codec import (  # noqa: E402
    CompositeCodec,
    RowCodec,
    Rows,
    SideRows,
    SlotPages,
    codec_for,
    latent_codec,
)
from trtllm_mtp_carry.dataplane.row_format import (  # noqa: E402
    FP8_MAX,
    PackedRows,
    pack_blocks,
    pack_rows,
    row_kernel,
    unpack_blocks,
    unpack_into_blocks,
    unpack_rows,
)
from trtllm_mtp_carry.runtime.carry_runtime import SequenceRows  # noqa: E402
from trtllm_mtp_carry.service.homes import ArenaHome  # noqa: E402


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(p25, median, p75) by `statistics.quantiles` (inclusive method)."""
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def run_pairs(ops: dict[str, Callable[[], object]], reps: int, warmup: int,
              device: torch.device) -> dict[str, list[float]]:
    """Seconds per call of each op, one call each per repetition, order rotated each repetition."""
    names = list(ops)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        for name in names:
            ops[name]()
    sync()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            sync()
            t0 = time.perf_counter()
            ops[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
    return times


#: The targets (issue 36): each packed move <= 2x a plain copy of the same bf16 rows; a deposit
#: and an adoption of an 8k-row entry <= 0.1 ms each.
RATIO_TARGET = 2.0
ENTRY_MS_TARGET = 0.1
RATIO_OPS = ("pack_rows", "unpack_rows", "gather_packed", "scatter_packed", "pack_blocks", "unpack_blocks")


def figure(name: str, value: str, target: str, ok: bool | None) -> str:
    """One FIGURE line (tab-separated); `ok` None: INFO (no GPU target applies here)."""
    return "\t".join(("FIGURE", name, value, target, "INFO" if ok is None else "PASS" if ok else "MISS"))


def check(name: str, ok: bool, detail: str) -> str:
    """One CHECK line (tab-separated)."""
    return "\t".join(("CHECK", name, "PASS" if ok else "FAIL", detail))


def _same(a: torch.Tensor | PackedRows, b: torch.Tensor | PackedRows) -> bool:
    """Bit for bit (NaN payloads included)."""
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.uint8)
    if isinstance(a, PackedRows) and isinstance(b, PackedRows):
        return bool(torch.equal(raw(a.payload), raw(b.payload)) and torch.equal(raw(a.scales), raw(b.scales)))
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return bool(torch.equal(raw(a), raw(b)))


def bit_checks(device: torch.device, hkv: int, d: int) -> list[str]:
    """CHECK lines: every packed move, Triton against torch, bit for bit on `device`."""
    g = torch.Generator().manual_seed(1)
    rows = (torch.randn(300, 2, hkv, d, generator=g) * 10.0 ** torch.randint(-20, 20, (300, 2, hkv, 1),
                                                                             generator=g)).to(torch.bfloat16)
    rows = rows.to(device)
    out = []
    a, b = pack_rows(rows, kernel="torch"), pack_rows(rows, kernel="triton")
    out.append(check("fp8 pack_rows triton == torch", _same(a, b), f"{rows.shape[0]} rows, payload and scales"))
    out.append(check("fp8 unpack_rows triton == torch",
                     _same(unpack_rows(a, kernel="torch"), unpack_rows(a, kernel="triton")), "bf16 bits"))
    # amaxes whose reciprocal product differs from the quotient: the scales must be the quotient
    amax = (1.0 + torch.arange(1, 4097, dtype=torch.float64) * 2.0**-12).float()
    exact = (amax.double() / FP8_MAX).float()
    trap = amax[(amax * (1 / torch.tensor(FP8_MAX))) != exact][:256]
    vec = torch.zeros(trap.numel(), 4)
    vec[:, 1] = -trap
    vec[:, 2] = trap / 3
    want = (trap.double() / FP8_MAX).float()
    for kernel in ("torch", "triton"):
        got = pack_rows(vec.to(device), kernel=kernel).scales.cpu()
        out.append(check(f"fp8 scales are amax / 448 correctly rounded ({kernel})", _same(got, want),
                         f"{trap.numel()} amaxes where amax * fl(1/448) differs"))
    tpb, lo = 32, 7
    npages = -(-(lo + 300) // tpb)
    buf = torch.randn(2 * npages, 2, hkv, tpb, d, generator=g).to(torch.bfloat16).to(device)
    pages = torch.randperm(2 * npages, generator=g)[:npages].tolist()
    out.append(check("fp8 gather_packed triton == torch",
                     _same(gather_packed_rows(buf, pages, lo, lo + 300, kernel="torch"),
                           gather_packed_rows(buf, pages, lo, lo + 300, kernel="triton")), "HND pages, shuffled"))
    x, y = buf.clone(), buf.clone()
    scatter_packed_rows(x, pages, lo, a, kernel="torch")
    scatter_packed_rows(y, pages, lo, a, kernel="triton")
    out.append(check("fp8 scatter_packed triton == torch", _same(x, y), "whole pages compared"))
    bs = 16
    nb = -(-300 // bs)
    kc = torch.randn(2 * nb, bs, hkv, d, generator=g).to(torch.bfloat16).to(device)
    vc = torch.randn(2 * nb, bs, hkv, d, generator=g).to(torch.bfloat16).to(device)
    ids = torch.randperm(2 * nb, generator=g)[:nb].tolist()
    pb = pack_blocks(kc, vc, ids, 300, kernel="torch")
    out.append(check("fp8 pack_blocks triton == torch", _same(pb, pack_blocks(kc, vc, ids, 300, kernel="triton")),
                     "K and V caches, shuffled blocks"))
    ub_t, ub_g = unpack_blocks(pb, bs, kernel="torch"), unpack_blocks(pb, bs, kernel="triton")
    out.append(check("fp8 unpack_blocks triton == torch", _same(ub_t[0], ub_g[0]) and _same(ub_t[1], ub_g[1]),
                     "whole blocks"))
    idx = torch.tensor(ids, device=device)
    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    unpack_into_blocks(pb, k1, v1, idx, kernel="torch")
    unpack_into_blocks(pb, k2, v2, idx, kernel="triton")
    out.append(check("fp8 unpack_into_blocks triton == torch", _same(k1, k2) and _same(v1, v2),
                     "whole caches compared"))
    return out


#: Where an extent starts in its buffer in `extent_checks`: 4-byte aligned (the float32 scales'
#: and int32 side rows' views need it), as an arena extent is, and aligned to nothing wider.
EXTENT_OFFSET = 12


def _held_bytes(codec: RowCodec, rows: Rows) -> torch.Tensor:
    """Held rows' bytes on the CPU, laid out as `codec.view` lays them in an extent."""
    return torch.cat([t.contiguous().cpu().view(torch.uint8).reshape(-1) for t in codec.tensors(rows)])


def _gather_into_extent(codec: RowCodec, gather: Callable[[Rows | None], Rows], want: Rows, rows: int, hkv: int,
                        d: int, device: torch.device, g: torch.Generator) -> tuple[bool, str]:
    """Run `gather(out)` into an extent of a random-byte buffer on `device`, and `gather(None)`;
    `(ok, detail)`: the extent and the returned rows hold `want`'s bytes (the CPU torch path's),
    `out` came back, and no byte outside the extent changed."""
    nbytes = rows * codec.row_nbytes(hkv, d)
    before = torch.randint(0, 256, (EXTENT_OFFSET + nbytes + 64,), generator=g, dtype=torch.uint8)
    buffer = before.to(device, copy=True)  # a copy on the CPU too: `before` is what it held
    out = codec.view(buffer[EXTENT_OFFSET:EXTENT_OFFSET + nbytes], codec.held_shape(rows, hkv, d))
    same_out = gather(out) is out
    returned = _held_bytes(codec, gather(None))
    after, expect = buffer.cpu(), _held_bytes(codec, want)
    in_extent = bool(torch.equal(after[EXTENT_OFFSET:EXTENT_OFFSET + nbytes], expect))
    as_returned = bool(torch.equal(returned, expect))
    outside = bool(torch.equal(after[:EXTENT_OFFSET], before[:EXTENT_OFFSET])
                   and torch.equal(after[EXTENT_OFFSET + nbytes:], before[EXTENT_OFFSET + nbytes:]))
    return (same_out and in_extent and as_returned and outside,
            f"{rows} rows, {nbytes} B at offset {EXTENT_OFFSET}: extent == CPU torch path {in_extent}, "
            f"gather without out == CPU {as_returned}, out returned {same_out}, bytes outside untouched {outside}")


def extent_checks(device: torch.device, hkv: int, d: int) -> list[str]:
    """CHECK lines: every row codec's gather into an arena extent on `device` (see the header),
    from shuffled HND pages (keys [7, 307)) and from shuffled K/V blocks (300 rows)."""
    g = torch.Generator().manual_seed(3)
    tpb, lo, n, bs = 32, 7, 300, 16
    npages = -(-(lo + n) // tpb)
    pages = torch.randperm(2 * npages, generator=g)[:npages].tolist()

    def fp8_codes(*shape: int) -> torch.Tensor:  # an FP8 KV pool's own bytes: every code but NaN
        codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3C  # e4m3fn's NaN codes: a finite code instead
        return codes.view(torch.float8_e4m3fn)

    bf16 = (torch.randn(2 * npages, 2, hkv, tpb, d, generator=g) * 3).to(torch.bfloat16)
    fp8 = fp8_codes(*bf16.shape)
    nvfp4_kv = Nvfp4KvPages(torch.randint(-128, 128, (*bf16.shape[:4], d // 2), generator=g, dtype=torch.int8),
                            torch.randint(0, 256, (*bf16.shape[:4], d // 16), generator=g, dtype=torch.uint8))
    sides = (SideRows("position", (3,), torch.int32), SideRows("index_k", (1, hkv * d), torch.bfloat16))
    slots = SlotPages(bf16, (torch.randint(0, 1 << 20, (2 * npages, tpb, 3), generator=g, dtype=torch.int32),
                             torch.randn(2 * npages, tpb, 1, hkv * d, generator=g).to(torch.bfloat16)))

    def on(buf):  # a pool's pages on `device`
        if isinstance(buf, SlotPages):
            return SlotPages(on(buf.kv), tuple(t.to(device) for t in buf.sides))
        if isinstance(buf, Nvfp4KvPages):
            return Nvfp4KvPages(buf.payload.to(device), buf.scales.to(device))
        return buf.to(device)

    out = []
    for codec, host in ((codec_for("bf16", torch.bfloat16), bf16), (codec_for("fp8", torch.bfloat16), bf16),
                        (codec_for("nvfp4", torch.bfloat16), bf16), (codec_for("bf16", fp8.dtype), fp8),
                        (codec_for("bf16", NVFP4_KV_DTYPE), nvfp4_kv),
                        (CompositeCodec(codec_for("nvfp4", torch.bfloat16), sides), slots)):
        dev = on(host)
        ok, detail = _gather_into_extent(
            codec, lambda o, c=codec, p=dev: c.gather_pages(p, pages, lo, lo + n, out=o),
            codec.gather_pages(host, pages, lo, lo + n), n, hkv, d, device, g)
        out.append(check(f"{codec.name} gather_pages into an arena extent", ok, detail))
    # an MLA latent pool's codecs: one vector a key, over BF16 / FP8 HND pages `[pages, 1, 1, tpb, 512]`
    # and over DeepSeek-V4's footer-scale bytes `[pages, tpb, 584]` (writer pages of tpb and tpb / 4 tokens)
    latent = (torch.randn(2 * npages, 1, 1, tpb, FP8_DS_MLA_DIM, generator=g) * 3).to(torch.bfloat16)
    footer = torch.randint(0, 256, (2 * npages, tpb, TOKEN_BYTES), generator=g, dtype=torch.uint8)
    for name, host in (("latent bf16", latent), ("latent fp8_kv", fp8_codes(*latent.shape)),
                       ("fp8_ds_mla", FooterScalePages(footer, tpb)),
                       ("fp8_ds_mla, writer pages of tpb / 4", FooterScalePages(footer, tpb // 4))):
        codec = latent_codec(host.dtype)
        dev = host.to(device) if isinstance(host, torch.Tensor) else FooterScalePages(host.data.to(device),
                                                                                      host.page_tokens)
        ok, detail = _gather_into_extent(
            codec, lambda o, c=codec, p=dev: c.gather_pages(p, pages, lo, lo + n, out=o),
            codec.gather_pages(host, pages, lo, lo + n), n, 1, FP8_DS_MLA_DIM, device, g)
        out.append(check(f"{name} gather_pages into an arena extent", ok, detail))
    nb = -(-n // bs)
    ids = torch.randperm(2 * nb, generator=g)[:nb].tolist()
    for pool_dtype, row_dtype in ((torch.bfloat16, "bf16"), (torch.bfloat16, "fp8"), (torch.bfloat16, "nvfp4"),
                                  (torch.float8_e4m3fn, "bf16")):
        codec = codec_for(row_dtype, pool_dtype)
        k, v = (fp8_codes(2 * nb, bs, hkv, d) if pool_dtype == torch.float8_e4m3fn
                else (torch.randn(2 * nb, bs, hkv, d, generator=g) * 3).to(pool_dtype) for _ in range(2))
        kd, vd = k.to(device), v.to(device)
        ok, detail = _gather_into_extent(
            codec, lambda o, c=codec, a=kd, b=vd: c.gather_blocks(a, b, ids, n, out=o),
            codec.gather_blocks(k, v, ids, n), n, hkv, d, device, g)
        out.append(check(f"{codec.name} gather_blocks into an arena extent", ok, detail))
    return out


def entry_round_trips(rows: int, hkv: int, d: int, reps: int, warmup: int,
                      device: torch.device) -> dict[str, list[float]]:
    """Seconds of each deposit (pack out of the pool) and adoption (unpack into fresh blocks) of one
    `rows`-row entry, and of a copy of its bf16 rows, paired per repetition (synchronized)."""
    bs = 16
    nblocks = -(-rows // bs)
    pool = DrafterKVPool(nblocks + 1, bs, hkv, d, RopeConfig(d, d // 4, 1e7), device=device)
    g = torch.Generator().manual_seed(2)
    pool.allocate_sequence(1)
    k = torch.randn(rows, hkv, d, generator=g).to(torch.bfloat16).to(device)
    v = torch.randn(rows, hkv, d, generator=g).to(torch.bfloat16).to(device)
    pool.append_rows(1, torch.arange(rows), k, v)
    codec = codec_for("fp8", pool.k_cache.dtype)
    home = ArenaHome(codec, Arena.reserve(rows * codec.row_nbytes(hkv, d), device), hkv, d)
    runs, tokens = ((0, rows),), list(range(rows + 1))

    def deposit() -> None:  # the turn's rows packed into their reserved room; its blocks freed
        assert home.reserve(7, rows)
        home.carry_out(SequenceRows(pool, 1), 7, rows, runs, tokens)
        pool.free_sequence(1)

    def adoption() -> None:  # unpacked into fresh blocks the next turn's sequence adopts
        pool.allocate_sequence(1)
        home.carry_in(7, SequenceRows(pool, 1), rows)

    src = torch.randn(rows, 2, hkv, d, generator=g).to(torch.bfloat16).to(device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {"copy": [], "deposit": [], "adoption": []}
    for i in range(warmup + reps):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        t1 = time.perf_counter()
        deposit()
        sync()
        t2 = time.perf_counter()
        adoption()
        sync()
        t3 = time.perf_counter()
        if i >= warmup:
            times["copy"].append(t1 - t0)
            times["deposit"].append(t2 - t1)
            times["adoption"].append(t3 - t2)
    pool.check()
    assert home.idle(), "the arena home holds rows after the adoptions"
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keys", type=int, default=4096, help="carried keys (rows) per call (default 4096)")
    p.add_argument("--kv-heads", type=int, default=2, help="drafter KV heads (Qwen3-Next: 2)")
    p.add_argument("--head-dim", type=int, default=256, help="head dim (Qwen3-Next: 256)")
    p.add_argument("--tokens-per-block", type=int, default=32, help="TensorRT-LLM page size in keys")
    p.add_argument("--pool-block-size", type=int, default=16, help="reference pool rows per block")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (default: 200 cuda, 41 cpu)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: on a shared CPU, OpenMP waits dominate)")
    p.add_argument("--entry-rows", type=int, default=8192,
                   help="rows of the entry the deposit and adoption move (default 8192)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    reps = args.reps or (200 if cuda else 41)
    n, hkv, d, tpb = args.keys, args.kv_heads, args.head_dim, args.tokens_per_block
    g = torch.Generator().manual_seed(0)
    bf16 = torch.bfloat16

    rows = torch.randn(n, 2, hkv, d, generator=g).to(bf16).to(device)
    dst = torch.empty_like(rows)
    packed = pack_rows(rows)
    # draft pages: a shuffled page list over twice the pages needed, keys start mid-page
    lo = tpb // 2
    npages = -(-(lo + n) // tpb)
    buf = torch.randn(2 * npages, 2, hkv, tpb, d, generator=g).to(bf16).to(device)
    pages = torch.randperm(2 * npages, generator=g)[:npages].tolist()

    # the reference runtime's pool: K and V caches of blocks, an entry's blocks shuffled
    bs = args.pool_block_size
    nblocks = -(-n // bs)
    k_cache = torch.randn(2 * nblocks, bs, hkv, d, generator=g).to(bf16).to(device)
    v_cache = torch.randn(2 * nblocks, bs, hkv, d, generator=g).to(bf16).to(device)
    block_ids = torch.randperm(2 * nblocks, generator=g)[:nblocks].tolist()
    block_idx = torch.tensor(block_ids, device=device)

    ops: dict[str, Callable[[], object]] = {
        "copy": lambda: dst.copy_(rows),
        "pack_rows": lambda: pack_rows(rows),
        "unpack_rows": lambda: unpack_rows(packed, out=dst),
        "gather_rows": lambda: gather_rows(buf, pages, lo, lo + n),
        "gather_packed": lambda: gather_packed_rows(buf, pages, lo, lo + n),
        "scatter_rows": lambda: scatter_rows(buf, pages, lo, rows),
        "scatter_packed": lambda: scatter_packed_rows(buf, pages, lo, packed),
        "select_blocks": lambda: (k_cache.index_select(0, block_idx), v_cache.index_select(0, block_idx)),
        "pack_blocks": lambda: pack_blocks(k_cache, v_cache, block_ids, n),
        "unpack_blocks": lambda: unpack_blocks(packed, bs),
    }
    times = run_pairs(ops, reps, args.warmup, device)

    nbytes = rows.numel() * rows.element_size()
    name = torch.cuda.get_device_name() if cuda else f"cpu, {torch.get_num_threads()} thread(s)"
    print(f"device={device} ({name}) kernel={row_kernel(rows)} torch={torch.__version__}")
    print(f"rows [{n}, 2, {hkv}, {d}] bf16 = {nbytes / 2**20:.2f} MiB; packed {packed.nbytes / 2**20:.2f} MiB "
          f"({packed.nbytes / nbytes:.3f}x); reps={reps} warmup={args.warmup}, order rotated per rep")
    print(f"{'operation':16s} {'median us':>10s} {'IQR us':>17s} {'GB/s':>8s}   {'/copy time: median [p25, p75]':s}")
    base = times["copy"]
    for op, ts in times.items():
        q1, med, q3 = quartiles(ts)
        ratios = [t / b for t, b in zip(ts, base, strict=True)]
        r1, rm, r3 = quartiles(ratios)
        print(f"{op:16s} {med * 1e6:10.1f} {q1 * 1e6:8.1f}-{q3 * 1e6:<8.1f} {nbytes / med / 1e9:8.2f}   "
              f"{rm:6.2f} [{r1:.2f}, {r3:.2f}]")
    lines = []
    for op in RATIO_OPS:
        rm = quartiles([t / b for t, b in zip(times[op], base, strict=True)])[1]
        lines.append(figure(f"fp8 {op}/copy at {n} keys", f"{rm:.2f}x", f"<= {RATIO_TARGET:.1f}x copy",
                            rm <= RATIO_TARGET if cuda else None))

    er = args.entry_rows
    entry = entry_round_trips(er, hkv, d, reps, args.warmup, device)
    print()
    print(f"reference runtime fp8 entry of {er} rows ({er * 2 * hkv * d * 2 / 2**20:.2f} MiB bf16): "
          f"deposit = ArenaHome.carry_out, adoption = ArenaHome.carry_in (synchronized); reps={reps}")
    print(f"{'operation':16s} {'median ms':>10s} {'IQR ms':>17s}   {'/copy time: median [p25, p75]':s}")
    for op, ts in entry.items():
        q1, med, q3 = quartiles(ts)
        r1, rm, r3 = quartiles([t / b for t, b in zip(ts, entry["copy"], strict=True)])
        print(f"{op:16s} {med * 1e3:10.4f} {q1 * 1e3:8.4f}-{q3 * 1e3:<8.4f}   {rm:6.2f} [{r1:.2f}, {r3:.2f}]")
    for op in ("deposit", "adoption"):
        med_ms = quartiles(entry[op])[1] * 1e3
        lines.append(figure(f"fp8 {op} at {er} rows", f"{med_ms:.3f} ms", f"<= {ENTRY_MS_TARGET} ms",
                            med_ms <= ENTRY_MS_TARGET if cuda else None))
    print()
    if row_kernel(rows) == "triton":
        lines += bit_checks(device, hkv, d)
    else:
        print("no Triton CHECK lines: the Triton FP8 kernels run on CUDA from compute capability 8.9 only")
    if cuda:
        lines += extent_checks(device, hkv, d)
    else:
        print("no extent CHECK lines: the codecs' gathers into an extent are checked on CUDA (the tests run them here)")
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
