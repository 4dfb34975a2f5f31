"""One contract suite over every row codec (`dataplane/row_codec.py`) and every place rows are held.

Each codec (bf16, fp8 and nvfp4 over a bf16 pool, fp8_kv over a float8_e4m3fn pool, nvfp4_kv over
an NVFP4 pool's payload and block-scale pages) is run
through the same checks, in the way trio runs one suite over every lock: the bytes held
are the bytes the core charges, gather/scatter round-trip bit for bit where the format is
exact (fp8, nvfp4: the codec's own deterministic round trip), and every holder (the plain rows,
the device arena, a host copy, a copy back) keeps the held bytes unchanged. A gather into a given
`out` (a codec's view of an arena extent at an unaligned-to-8 offset of a larger buffer) writes the
bytes the gather returns, all of the extent and nothing outside it, on the torch paths and on the
Triton kernels (interpreted on CPU without a GPU); a wrong `out` is refused before any write. A new
codec joins by adding one entry to `CODECS`.

An MLA latent pool's codecs (one vector a key: `LatentRowsCodec` over BF16 or FP8 pages,
`FooterScaleCodec` over DeepSeek-V4's footer-scale pages) run the same checks over latent
pages (`LATENT_CASES`), and the footer layout is pinned against an independent per-byte
rewrite of the writer's addressing.
"""

from __future__ import annotations

import pytest
import torch

from trtllm_mtp_carry.core.row_format import ROW_FORMATS, RowFormat, rows_nbytes
from trtllm_mtp_carry.dataplane import nvfp4, row_format, row_layout
from trtllm_mtp_carry.dataplane.arena import Arena
from trtllm_mtp_carry.dataplane.hnd_pages import gather_rows
from trtllm_mtp_carry.dataplane.nvfp4 import Nvfp4Rows
from trtllm_mtp_carry.dataplane.nvfp4_kv import NVFP4_KV_DTYPE, Nvfp4KvPages, Nvfp4KvRows
from trtllm_mtp_carry.dataplane.row_codec import (
    CODECS,
    CompositeCodec,
    CompositeRows,
    Fp8PackedCodec,
    PoolRowsCodec,
    RowCodec,
    SideRows,
    SlotPages,
    codec_for,
    codec_of,
)
from trtllm_mtp_carry.dataplane.row_format import FP8_TRITON_MIN_CAPABILITY, PackedRows

HKV, D, TPB = 2, 32, 8  # D = 32: two block scales a vector, so V's 4-token interleave is no identity

CODEC_CASES = {  # id -> (carry_row_dtype, pool dtype, the format it must resolve to)
    "bf16": ("bf16", torch.bfloat16, "bf16"),
    "fp8": ("fp8", torch.bfloat16, "fp8"),
    "nvfp4": ("nvfp4", torch.bfloat16, "nvfp4"),
    "fp8_kv": ("bf16", torch.float8_e4m3fn, "fp8_kv"),
    "fp8_kv/fp8": ("fp8", torch.float8_e4m3fn, "fp8_kv"),  # no second quantization of an FP8 pool
    "nvfp4_kv": ("bf16", NVFP4_KV_DTYPE, "nvfp4_kv"),  # an NVFP4 pool's own bytes
    "nvfp4_kv/nvfp4": ("nvfp4", NVFP4_KV_DTYPE, "nvfp4_kv"),  # nor of an NVFP4 pool
}


@pytest.fixture(params=sorted(CODEC_CASES))
def case(request):
    row_dtype, pool_dtype, name = CODEC_CASES[request.param]
    return codec_for(row_dtype, pool_dtype), pool_dtype, name


def raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (float8 compared bit for bit, whatever float8 ops torch has)."""
    return t.contiguous().view(torch.uint8)


def held_bytes(codec: RowCodec, rows) -> list[torch.Tensor]:
    return [raw(t) for t in codec.tensors(rows)]


def same_held(codec: RowCodec, a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(held_bytes(codec, a), held_bytes(codec, b), strict=True))


def pool_values(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random pool contents: bf16 values, or every float8 byte but NaN (an FP8 pool's own codes)."""
    if dtype == torch.float8_e4m3fn:
        codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3C  # e4m3fn's NaN codes: a finite code instead
        return codes.view(dtype)
    return (torch.randn(shape, generator=gen) * 3).to(dtype)


def hnd_pages(gen: torch.Generator, pages: int, dtype: torch.dtype):
    if dtype == NVFP4_KV_DTYPE:  # every byte value: payload as get_buffers types it (int8), scales
        payload = torch.randint(-128, 128, (pages, 2, HKV, TPB, D // 2), generator=gen, dtype=torch.int8)
        return Nvfp4KvPages(payload, torch.randint(0, 256, (pages, 2, HKV, TPB, D // 16), generator=gen,
                                                   dtype=torch.uint8))
    return pool_values(gen, (pages, 2, HKV, TPB, D), dtype)  # [pages, 2, Hkv, tpb, D]


def page_bytes(buf) -> list[torch.Tensor]:
    """Every byte a pool holds (an NVFP4 pool: its payload and its scale pages)."""
    if isinstance(buf, Nvfp4KvPages):
        return [raw(buf.payload).clone(), buf.scales.clone()]
    return [raw(buf).clone()]


def nvfp4_key_bytes(pages: Nvfp4KvPages, page_ids: list[int], lo: int, hi: int) -> list[list[int]]:
    """Each key's bytes, read one by one at the addresses `quantizeAndWriteFP4KVCache` (@ 0097566b)
    writes (an independent rewrite of the layout, loops and all): per role and head, the payload,
    then the scales in block order: K's at `row * S + s`, V's at `(row // 4) * 4 * S + s * 4 +
    row % 4` of the role's scale page, `row = head * tpb + slot`."""
    s_blocks = D // 16
    out = []
    for k in range(lo, hi):
        page, slot = page_ids[k // TPB], k % TPB
        key: list[int] = []
        for role in range(2):
            flat = pages.scales[page, role].reshape(-1).tolist()
            for head in range(HKV):
                key += raw(pages.payload[page, role, head, slot]).tolist()
                row = head * TPB + slot
                for b in range(s_blocks):
                    at = row * s_blocks + b if role == 0 else (row // 4) * 4 * s_blocks + b * 4 + row % 4
                    key.append(flat[at])
        out.append(key)
    return out


def expected_rows(codec: RowCodec, rows: torch.Tensor) -> torch.Tensor:
    """What a scatter of `rows` must write: the rows (exact codecs), else the codec's round trip."""
    return rows if codec.exact else codec.decode(codec.encode(rows))


def test_every_format_has_a_codec_and_codec_for_picks_the_pools_own_bytes_for_an_fp8_pool(case):
    codec, pool_dtype, name = case
    assert codec.name == name and codec.pool_dtype == pool_dtype
    assert set(CODECS) == set(ROW_FORMATS)
    assert codec_for("fp8", torch.float8_e4m3fn) is codec_for("bf16", torch.float8_e4m3fn)  # one object


@pytest.mark.parametrize("n", [0, 1, 7, 20])
def test_bytes_held_equal_the_bytes_the_core_charges(case, n):
    codec, pool_dtype, name = case
    gen = torch.Generator().manual_seed(n)
    buf = hnd_pages(gen, 4, pool_dtype)
    rows = codec.gather_pages(buf, [3, 0, 2], 0, n)
    elem = 1 if pool_dtype == NVFP4_KV_DTYPE else torch.empty((), dtype=pool_dtype).element_size()
    per_row = {"bf16": 2 * HKV * D * 2, "fp8": 2 * HKV * (D + 4), "nvfp4": 2 * HKV * (D // 2 + D // 16 + 1),
               "fp8_kv": 2 * HKV * D, "nvfp4_kv": 2 * HKV * (D // 2 + D // 16)}[name]
    assert codec.row_nbytes(HKV, D) == per_row == RowFormat(name, 2 * HKV, D, elem).row_nbytes
    assert codec.nbytes(rows) == n * per_row == rows_nbytes(name, n * 2 * HKV, D, elem)


def test_pages_round_trip_exactly_where_the_format_is_exact(case):
    codec, pool_dtype, _ = case
    gen = torch.Generator().manual_seed(3)
    src, dst = hnd_pages(gen, 5, pool_dtype), hnd_pages(gen, 6, pool_dtype)
    before = page_bytes(dst)
    rows = codec.gather_pages(src, [4, 1, 3], 2, 19)  # keys [2, 19) across three pages
    codec.scatter_pages(dst, [5, 0, 2], 2, rows)
    if isinstance(src, Nvfp4KvPages):  # every key's bytes, at the writer's addresses, both ends
        assert nvfp4_key_bytes(dst, [5, 0, 2], 2, 19) == nvfp4_key_bytes(src, [4, 1, 3], 2, 19)
        # the held rows are those bytes, vector by vector (V's scales de-interleaved)
        held = torch.cat([rows.payload, rows.scales], dim=3).flatten(1).tolist()
        assert held == nvfp4_key_bytes(src, [4, 1, 3], 2, 19)
        # nothing else written: other pages, and the keys of pages 5 and 2 outside [2, 19)
        # (V's scales of a 4-token group share bytes: the copy writes single bytes)
        after = nvfp4_key_bytes(dst, [5, 0, 2], 0, 24)
        want = nvfp4_key_bytes(Nvfp4KvPages(before[0].view(torch.int8), before[1]), [5, 0, 2], 0, 24)
        assert after[:2] == want[:2] and after[19:] == want[19:]
        for got, old in zip(page_bytes(dst), before, strict=True):
            assert torch.equal(got[[1, 3, 4]], old[[1, 3, 4]])
        return
    want = expected_rows(codec, gather_rows(src, [4, 1, 3], 2, 19))
    assert torch.equal(raw(gather_rows(dst, [5, 0, 2], 2, 19)), raw(want))
    untouched = torch.ones(6, dtype=torch.bool)
    untouched[[5, 0, 2]] = False
    assert torch.equal(raw(dst[untouched]), before[0][untouched])  # no other page written
    if codec.exact:  # the held rows are the pool's bytes
        assert torch.equal(raw(codec.decode(rows)), raw(gather_rows(src, [4, 1, 3], 2, 19)))


def test_blocks_round_trip_exactly_where_the_format_is_exact(case):
    codec, pool_dtype, _ = case
    gen = torch.Generator().manual_seed(4)
    if pool_dtype == NVFP4_KV_DTYPE:  # the reference runtime's caches are never NVFP4: said, not guessed
        with pytest.raises(TypeError, match="never NVFP4"):
            codec.gather_blocks(torch.zeros(1, 4, HKV, D), torch.zeros(1, 4, HKV, D), [0], 1)
        return
    k, v = (pool_values(gen, (6, 4, HKV, D), pool_dtype) for _ in range(2))  # [blocks, block_size, Hkv, D]
    rows = codec.gather_blocks(k, v, [5, 1, 3], 10)  # rows 0..9 over blocks 5, 1, 3
    k2, v2 = (pool_values(gen, (6, 4, HKV, D), pool_dtype) for _ in range(2))
    tail = raw(k2[2, 2:]).clone()
    codec.scatter_blocks(rows, k2, v2, torch.tensor([0, 4, 2]))
    src = torch.stack([c[[5, 1, 3]].flatten(0, 1)[:10] for c in (k, v)], dim=1)  # [10, 2, Hkv, D]
    got = torch.stack([c[[0, 4, 2]].flatten(0, 1)[:10] for c in (k2, v2)], dim=1)
    assert torch.equal(raw(got), raw(expected_rows(codec, src)))
    assert torch.equal(raw(k2[2, 2:]), tail)  # the last block's tail keeps its bytes


def test_every_holder_keeps_the_held_bytes(case):
    from trtllm_mtp_carry.dataplane.arena import Arena

    codec, pool_dtype, _ = case
    gen = torch.Generator().manual_seed(5)
    rows = codec.gather_pages(hnd_pages(gen, 3, pool_dtype), [0, 1, 2], 0, 13)
    block = codec.row_nbytes(HKV, D)
    arena = Arena(torch.zeros(20 * block, dtype=torch.uint8))
    assert codec.nbytes(rows) == 13 * block  # one row's bytes a row: the arena's bytes are the charge

    def put(key: int, held) -> None:
        codec.copy_(codec.view(arena.take(key, codec.nbytes(held)), tuple(held.shape)), held)

    def get(key: int, n: int):
        return codec.view(arena.view(key), codec.held_shape(n, HKV, D))

    put(7, rows)
    assert same_held(codec, get(7, 13), rows)
    put(8, codec.head(rows, 3))
    arena.release(7)
    arena.compact()  # the range moves: its bytes do not change
    assert arena.compactions == 1 and arena.view(8).data_ptr() == arena.storage.data_ptr()
    assert same_held(codec, get(8, 3), codec.head(rows, 3))
    host = codec.host_copy(rows)
    assert all(t.device.type == "cpu" for t in codec.tensors(host)) and same_held(codec, host, rows)
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(codec.tensors(host), codec.tensors(rows), strict=True))
    assert same_held(codec, codec.to(host, torch.device("cpu")), rows)
    assert codec_of(rows) is codec  # the held form names its codec


def test_a_codec_refuses_rows_of_another_form_before_any_write(case):
    codec, pool_dtype, _ = case
    other = (torch.zeros(2, 2, HKV, D, dtype=torch.float32) if not isinstance(codec, Fp8PackedCodec)
             else torch.zeros(2, 2, HKV, D, dtype=pool_dtype))
    buf = hnd_pages(torch.Generator().manual_seed(6), 2, pool_dtype)
    before = page_bytes(buf)
    with pytest.raises(TypeError, match=f"a {codec.name} codec holds"):
        codec.scatter_pages(buf, [0, 1], 0, other)
    assert all(torch.equal(a, b) for a, b in zip(page_bytes(buf), before, strict=True))


def test_codecs_that_cannot_hold_a_pool_say_so():
    with pytest.raises(ValueError, match="fp8 packs rows of"):
        Fp8PackedCodec(torch.float8_e4m3fn)  # an FP8 pool is never packed a second time
    with pytest.raises(ValueError, match="pool dtype must be one of"):
        PoolRowsCodec(torch.int8)
    with pytest.raises(ValueError, match="carry_row_dtype='nvfp5' is not a row format"):
        codec_for("nvfp5", torch.bfloat16)
    with pytest.raises(RuntimeError, match="got torch.float8_e4m3fn pages"):
        codec_for("bf16", torch.bfloat16).gather_pages(hnd_pages(torch.Generator(), 1, torch.float8_e4m3fn),
                                                       [0], 0, 1)
    assert isinstance(codec_of(PackedRows(torch.zeros(1, 4, dtype=torch.float8_e4m3fn),
                                          torch.ones(1), torch.bfloat16)), Fp8PackedCodec)


@pytest.mark.parametrize("row_dtype", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize(("kv_dtype", "pool_dtype"), [("auto", torch.bfloat16), ("fp8", torch.float8_e4m3fn),
                                                      ("nvfp4", NVFP4_KV_DTYPE)])
def test_the_cores_torch_free_format_choice_agrees_with_the_codec_chosen(row_dtype, kv_dtype, pool_dtype):
    from trtllm_mtp_carry.core.row_format import carried_row_format

    assert carried_row_format(row_dtype, kv_dtype) == codec_for(row_dtype, pool_dtype).name


# ---- gathers written straight into a given `out` (an arena extent's view) -----------------------

SIDES = (SideRows("position", (3,), torch.int32), SideRows("index_k", (1, HKV * D), torch.bfloat16))
OFFSET = 12  # an extent's start in its buffer: 4-byte aligned (float32/int32 views), not 8 or 16


@pytest.fixture(params=["torch", "triton"])
def kernel(request, monkeypatch, device):
    """`(path, device)` the gathers run on: 'torch', the torch paths on CPU tensors; 'triton', the
    packed formats' Triton kernels, forced (`row_layout.choose_kernel`), on the kernels' device
    (interpreted on CPU without a GPU); the copy-only codecs index there."""
    if request.param == "torch":
        return "torch", torch.device("cpu")
    monkeypatch.setattr(row_layout, "choose_kernel", lambda t, kernel, triton_ok: kernel or "triton")
    return "triton", torch.device(device)


def fp8_triton_or_skip(codec: RowCodec, path: str, where: torch.device) -> None:
    packs_fp8 = isinstance(codec, Fp8PackedCodec) or (isinstance(codec, CompositeCodec)
                                                      and isinstance(codec.main, Fp8PackedCodec))
    if packs_fp8 and path == "triton" and where.type == "cuda" \
            and torch.cuda.get_device_capability() < FP8_TRITON_MIN_CAPABILITY:
        pytest.skip("Triton's float8 e4m3 conversions need compute capability 8.9 or later")


def on(buf, where: torch.device):
    """HND pages (a tensor or `Nvfp4KvPages`) on `where`."""
    if isinstance(buf, Nvfp4KvPages):
        return Nvfp4KvPages(buf.payload.to(where), buf.scales.to(where))
    return buf.to(where)


def slot_pages(gen: torch.Generator, slots: int, dtype: torch.dtype, where: torch.device) -> SlotPages:
    """A composite pool: K/V pages and one slot-major view per side of `SIDES`."""
    sides = (torch.randint(0, 1 << 20, (slots, TPB, 3), generator=gen, dtype=torch.int32),
             torch.randn(slots, TPB, 1, HKV * D, generator=gen).to(torch.bfloat16))
    return SlotPages(on(hnd_pages(gen, slots, dtype), where), tuple(t.to(where) for t in sides))


def extent(gen: torch.Generator, nbytes: int, where: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(buffer, extent)`: random bytes with `nbytes` of them at `OFFSET`, as an arena extent lies."""
    buffer = torch.randint(0, 256, (OFFSET + nbytes + 20,), generator=gen, dtype=torch.uint8).to(where)
    return buffer, buffer[OFFSET:OFFSET + nbytes]


def laid_out(codec: RowCodec, rows) -> torch.Tensor:
    """Held rows' bytes as `codec.view` lays them in an extent: each tensor's, back to back."""
    return torch.cat([raw(t).cpu().reshape(-1) for t in codec.tensors(rows)])


def assert_gathered_into(codec: RowCodec, got, out, want, buffer: torch.Tensor, before: torch.Tensor) -> None:
    """`got` is `out`, still over the extent, holding `want`'s bytes; every extent byte written and
    no byte of the buffer outside it."""
    assert got is out
    nbytes = codec.nbytes(want)
    assert torch.equal(buffer[OFFSET:OFFSET + nbytes].cpu(), laid_out(codec, want))
    assert same_held(codec, out, want)
    assert torch.equal(buffer[:OFFSET].cpu(), before[:OFFSET])
    assert torch.equal(buffer[OFFSET + nbytes:].cpu(), before[OFFSET + nbytes:])


@pytest.mark.parametrize("composite", [False, True], ids=["kv", "composite"])
@pytest.mark.parametrize(("lo", "hi"), [(5, 5), (5, 6), (2, 19)])  # none, one, keys across three pages
def test_a_gather_into_an_extent_writes_the_bytes_the_gather_returns_and_nothing_outside(case, kernel, composite,
                                                                                       lo, hi):
    codec, pool_dtype, _ = case
    path, where = kernel
    if composite:
        codec = CompositeCodec(codec, SIDES)
    fp8_triton_or_skip(codec, path, where)
    gen = torch.Generator().manual_seed(hi)
    buf = slot_pages(gen, 5, pool_dtype, where) if composite else on(hnd_pages(gen, 5, pool_dtype), where)
    want = codec.gather_pages(buf, [4, 1, 3], lo, hi)
    buffer, raw_extent = extent(gen, (hi - lo) * codec.row_nbytes(HKV, D), where)
    before = buffer.cpu().clone()
    out = codec.view(raw_extent, (hi - lo, 2, HKV, D))
    ptrs = [t.data_ptr() for t in codec.tensors(out)]
    got = codec.gather_pages(buf, [4, 1, 3], lo, hi, out=out)
    assert_gathered_into(codec, got, out, want, buffer, before)
    assert [t.data_ptr() for t in codec.tensors(out)] == ptrs  # written in place, never re-allocated


@pytest.mark.parametrize("rows", [0, 1, 10])
def test_a_block_gather_into_an_extent_writes_the_bytes_the_gather_returns_and_nothing_outside(case, kernel, rows):
    codec, pool_dtype, _ = case
    path, where = kernel
    if pool_dtype == NVFP4_KV_DTYPE:
        return  # no K/V block caches are NVFP4 (test_blocks_round_trip_... pins the refusal)
    fp8_triton_or_skip(codec, path, where)
    gen = torch.Generator().manual_seed(rows)
    k, v = (pool_values(gen, (6, 4, HKV, D), pool_dtype).to(where) for _ in range(2))  # [blocks, 4, Hkv, D]
    want = codec.gather_blocks(k, v, [5, 1, 3], rows)  # rows over blocks 5, 1, 3 (the last one part full)
    buffer, raw_extent = extent(gen, rows * codec.row_nbytes(HKV, D), where)
    before = buffer.cpu().clone()
    out = codec.view(raw_extent, (rows, 2, HKV, D))
    got = codec.gather_blocks(k, v, [5, 1, 3], rows, out=out)
    assert_gathered_into(codec, got, out, want, buffer, before)
    src = torch.stack([c[[5, 1, 3]].flatten(0, 1)[:rows] for c in (k, v)], dim=1)  # [rows, 2, Hkv, D]
    if codec.exact:
        assert torch.equal(raw(codec.decode(out)), raw(src))


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_packing_into_an_extent_writes_the_bytes_packing_returns(fmt, kernel):
    path, where = kernel
    codec = codec_for(fmt, torch.bfloat16)
    fp8_triton_or_skip(codec, path, where)
    pack_rows = row_format.pack_rows if fmt == "fp8" else nvfp4.pack_rows
    gen = torch.Generator().manual_seed(7)
    rows = (torch.randn(5, 2, HKV, D, generator=gen) * 3).to(torch.bfloat16).to(where)
    want = pack_rows(rows, kernel=path)
    buffer, raw_extent = extent(gen, 5 * codec.row_nbytes(HKV, D), where)
    before = buffer.cpu().clone()
    out = codec.view(raw_extent, (5, 2, HKV, D))
    assert_gathered_into(codec, pack_rows(rows, kernel=path, out=out), out, want, buffer, before)
    assert same_held(codec, want, pack_rows(rows.cpu(), kernel="torch"))  # both paths, the same bits


def strided(codec: RowCodec, rows):
    """`rows` held with every tensor a non-contiguous view (every other element of a wider one)."""
    def spread(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros((*t.shape, 2), dtype=t.dtype, device=t.device)[..., 0]

    if isinstance(rows, torch.Tensor):
        return spread(rows)
    if isinstance(rows, Nvfp4KvRows):
        return Nvfp4KvRows(spread(rows.payload), spread(rows.scales))
    assert isinstance(rows, (PackedRows, Nvfp4Rows))
    return row_layout.map_tensors(rows, spread)


def test_a_gather_refuses_an_out_that_does_not_fit_before_any_write(case):
    codec, pool_dtype, _ = case
    gen = torch.Generator().manual_seed(8)
    buf = hnd_pages(gen, 4, pool_dtype)
    other = codec_for("bf16", torch.float16)  # rows of a float16 pool: no codec here holds them
    buffer, raw_extent = extent(gen, 10 * max(codec.row_nbytes(HKV, D), other.row_nbytes(HKV, D)),
                                torch.device("cpu"))
    before = buffer.clone()

    def rows_of(c: RowCodec, n: int, where: torch.Tensor = raw_extent):
        return c.view(where[:n * c.row_nbytes(HKV, D)], (n, 2, HKV, D))

    wrong = {
        "gathers into": rows_of(other, 9),  # another codec's form
        r"out holds rows \[8, 2, 2, 32\], the gather gives rows \[9, 2, 2, 32\]": rows_of(codec, 8),
        r"out holds rows \[10, 2, 2, 32\]": rows_of(codec, 10),
        "out is on meta": rows_of(codec, 9, torch.empty(raw_extent.shape, dtype=torch.uint8, device="meta")),
        "a gather writes contiguous tensors": strided(codec, rows_of(codec, 9)),
    }
    for match, out in wrong.items():
        with pytest.raises(RuntimeError, match=match):
            codec.gather_pages(buf, [3, 0, 2], 2, 11, out=out)
        assert torch.equal(buffer, before), match
    if pool_dtype in (torch.bfloat16,):  # a codec of a bf16 pool given float16 pages: their rows are not out's
        half = hnd_pages(gen, 4, torch.float16)
        with pytest.raises(RuntimeError, match="torch.float16"):
            codec.gather_pages(half, [3, 0, 2], 2, 11, out=rows_of(codec, 9))
        assert torch.equal(buffer, before)


def test_a_composite_gather_refuses_a_side_that_does_not_fit_before_any_write():
    codec = CompositeCodec(codec_for("bf16", torch.bfloat16), SIDES)
    gen = torch.Generator().manual_seed(9)
    buf = slot_pages(gen, 4, torch.bfloat16, torch.device("cpu"))
    buffer, raw_extent = extent(gen, 9 * codec.row_nbytes(HKV, D), torch.device("cpu"))
    before = buffer.clone()
    out = codec.view(raw_extent, (9, 2, HKV, D))
    assert isinstance(out, CompositeRows)
    bad = CompositeRows(out.kv, (out.sides[0], strided(codec.main, out.sides[1])), SIDES)
    with pytest.raises(RuntimeError, match="a gather writes contiguous tensors"):
        codec.gather_pages(buf, [3, 0, 2], 2, 11, out=bad)
    assert torch.equal(buffer, before)  # the K/V rows were not written either


# ---- MLA latent pools: one vector a key ---------------------------------------------------------

from trtllm_mtp_carry.dataplane.latent_pages import (  # noqa: E402
    DATA_ROW_BYTES,
    FOOTER_ROW_BYTES,
    TOKEN_BYTES,
    FooterScalePages,
)
from trtllm_mtp_carry.dataplane.row_codec import FooterScaleCodec, LatentRowsCodec, latent_codec  # noqa: E402

LATENT, LTPB = 512, 8
LATENT_CASES = {  # id -> (pool dtype, writer page tokens, the format it holds, bytes a row)
    "latent_bf16": (torch.bfloat16, None, "bf16", LATENT * 2),
    "latent_fp8": (torch.float8_e4m3fn, None, "fp8_kv", LATENT),
    "fp8_ds_mla": (torch.uint8, LTPB, "fp8_ds_mla", 584),  # Hopper: a writer page is the block
    "fp8_ds_mla/subpages": (torch.uint8, LTPB // 2, "fp8_ds_mla", 584),  # a writer page inside a block
}


@pytest.fixture(params=sorted(LATENT_CASES))
def latent_case(request):
    return LATENT_CASES[request.param]


def latent_pages(gen: torch.Generator, pages: int, dtype: torch.dtype, page_tokens: int | None):
    """Random pages: HND `[pages, 1, 1, tpb, 512]` of a BF16/FP8 latent pool, or footer-scale bytes."""
    if page_tokens is not None:
        data = torch.randint(0, 256, (pages, LTPB, TOKEN_BYTES), generator=gen, dtype=torch.uint8)
        return FooterScalePages(data, page_tokens)
    return pool_values(gen, (pages, LTPB, LATENT), dtype).view(pages, 1, 1, LTPB, LATENT)


def latent_bytes(buf) -> torch.Tensor:
    return (buf.data if isinstance(buf, FooterScalePages) else raw(buf)).clone()


def footer_key_bytes(pages: FooterScalePages, ids: list[int], lo: int, hi: int) -> list[list[int]]:
    """Each key's bytes, read one by one where `quant_scatter` (footer_scale_kv.py @ d77955c5) puts
    them (an independent rewrite, loops and all): slot `loc = page * tpb + k % tpb`; writer page
    `loc // P` of `P * 584` bytes; the data row at `off * 576`, the footer row after the page's
    `P` data rows, at `off * 8`."""
    flat = pages.data.reshape(-1).tolist()
    p = pages.page_tokens
    out = []
    for k in range(lo, hi):
        loc = ids[k // LTPB] * LTPB + k % LTPB
        page_base, off = (loc // p) * p * TOKEN_BYTES, loc % p
        data = [flat[page_base + off * DATA_ROW_BYTES + i] for i in range(DATA_ROW_BYTES)]
        footer = [flat[page_base + p * DATA_ROW_BYTES + off * FOOTER_ROW_BYTES + i] for i in range(FOOTER_ROW_BYTES)]
        out.append(data + footer)
    return out


def test_a_latent_codec_is_the_pools_own_rows_and_charges_what_it_holds(latent_case):
    dtype, page_tokens, name, per_row = latent_case
    codec = latent_codec(dtype)
    assert codec.name == name and codec.exact
    assert isinstance(codec, FooterScaleCodec if page_tokens else LatentRowsCodec)
    buf = latent_pages(torch.Generator().manual_seed(1), 4, dtype, page_tokens)
    for n in (0, 1, 13):
        rows = codec.gather_pages(buf, [3, 0, 2], 0, n)
        elem = 1 if page_tokens else torch.empty((), dtype=dtype).element_size()
        assert tuple(rows.shape) == codec.held_shape(n, 1, LATENT)
        assert codec.row_nbytes(1, LATENT) == per_row == RowFormat(name, 1, LATENT, elem).row_nbytes
        assert codec.nbytes(rows) == n * per_row == rows_nbytes(name, n, LATENT, elem)


def test_latent_pages_round_trip_bit_for_bit_and_nothing_else_is_written(latent_case):
    dtype, page_tokens, _, _ = latent_case
    codec = latent_codec(dtype)
    gen = torch.Generator().manual_seed(2)
    src, dst = latent_pages(gen, 5, dtype, page_tokens), latent_pages(gen, 6, dtype, page_tokens)
    before = latent_bytes(dst)
    rows = codec.gather_pages(src, [4, 1, 3], 2, 19)  # keys [2, 19) across three pages
    codec.scatter_pages(dst, [5, 0, 2], 2, rows)
    after = latent_bytes(dst)
    if page_tokens:
        # the held row is the key's bytes where the writer put them, and they land at the same addresses
        assert rows.tolist() == footer_key_bytes(src, [4, 1, 3], 2, 19)
        assert footer_key_bytes(dst, [5, 0, 2], 2, 19) == footer_key_bytes(src, [4, 1, 3], 2, 19)
        old = FooterScalePages(before, page_tokens)
        assert footer_key_bytes(dst, [5, 0, 2], 0, 2) == footer_key_bytes(old, [5, 0, 2], 0, 2)
        assert footer_key_bytes(dst, [5, 0, 2], 19, 24) == footer_key_bytes(old, [5, 0, 2], 19, 24)
        # every other byte, the footer's unwritten pad of the keys outside [2, 19) included
        changed = (after != before).reshape(-1).nonzero().flatten()
        written = {b for k in range(2, 19) for b in _footer_offsets(dst, [5, 0, 2], k)}
        assert set(changed.tolist()) <= written
        return
    assert torch.equal(raw(gather_rows(dst, [5, 0, 2], 2, 19)), raw(gather_rows(src, [4, 1, 3], 2, 19)))
    keep = torch.ones(6, LTPB, dtype=torch.bool)
    for k in range(2, 19):
        keep[[5, 0, 2][k // LTPB], k % LTPB] = False
    assert torch.equal(after[:, 0, 0][keep], before[:, 0, 0][keep])  # no other key written


def _footer_offsets(pages: FooterScalePages, ids: list[int], k: int) -> list[int]:
    p = pages.page_tokens
    loc = ids[k // LTPB] * LTPB + k % LTPB
    base, off = (loc // p) * p * TOKEN_BYTES, loc % p
    return ([base + off * DATA_ROW_BYTES + i for i in range(DATA_ROW_BYTES)]
            + [base + p * DATA_ROW_BYTES + off * FOOTER_ROW_BYTES + i for i in range(FOOTER_ROW_BYTES)])


def test_every_holder_keeps_latent_rows_bytes(latent_case):
    dtype, page_tokens, _, per_row = latent_case
    codec = latent_codec(dtype)
    rows = codec.gather_pages(latent_pages(torch.Generator().manual_seed(3), 3, dtype, page_tokens), [0, 1, 2], 0, 13)
    arena = Arena(torch.zeros(20 * per_row, dtype=torch.uint8))
    arena.take("a", 13 * per_row)
    arena.take("b", 3 * per_row)
    held = codec.view(arena.view("a"), codec.held_shape(13, 1, LATENT))
    codec.copy_(held, rows)
    codec.copy_(codec.view(arena.view("b"), codec.held_shape(3, 1, LATENT)), codec.head(rows, 3))
    assert same_held(codec, held, rows)
    arena.release("a")
    arena.compact()  # the extent moves: its bytes do not change
    assert same_held(codec, codec.view(arena.view("b"), codec.held_shape(3, 1, LATENT)), codec.head(rows, 3))
    host = codec.host_copy(rows)
    assert same_held(codec, host, rows) and host.data_ptr() != rows.data_ptr()
    assert same_held(codec, codec.to(host, torch.device("cpu")), rows)


def test_a_latent_gather_into_an_extent_writes_the_bytes_the_gather_returns_and_nothing_outside(latent_case):
    dtype, page_tokens, _, per_row = latent_case
    codec = latent_codec(dtype)
    buf = latent_pages(torch.Generator().manual_seed(6), 4, dtype, page_tokens)
    buffer = torch.full((OFFSET + 9 * per_row + 8,), 0xA5, dtype=torch.uint8)
    before = buffer.clone()
    extent = buffer[OFFSET:OFFSET + 9 * per_row]
    out = codec.view(extent, codec.held_shape(9, 1, LATENT))
    assert codec.gather_pages(buf, [3, 0, 2], 2, 11, out=out) is out
    assert same_held(codec, out, codec.gather_pages(buf, [3, 0, 2], 2, 11))
    assert torch.equal(buffer[:OFFSET], before[:OFFSET]) and torch.equal(buffer[OFFSET + 9 * per_row:],
                                                                          before[OFFSET + 9 * per_row:])
    written = buffer.clone()
    with pytest.raises(RuntimeError):  # a wrong shape is refused before any write
        codec.gather_pages(buf, [3, 0, 2], 2, 12, out=out)
    assert torch.equal(buffer, written)


def test_a_latent_codec_refuses_what_it_cannot_hold_before_any_write(latent_case):
    dtype, page_tokens, name, _ = latent_case
    codec = latent_codec(dtype)
    buf = latent_pages(torch.Generator().manual_seed(4), 2, dtype, page_tokens)
    before = latent_bytes(buf)
    with pytest.raises(TypeError, match=f"a {name} codec holds"):
        codec.scatter_pages(buf, [0, 1], 0, torch.zeros(2, 1, 1, LATENT, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="BAD_PAGE_INDEX"):  # a dropped block is never addressed
        codec.scatter_pages(buf, [0, -1], 0, codec.gather_pages(buf, [0, 1], 0, 12))
    with pytest.raises(RuntimeError, match="reads FooterScalePages" if page_tokens else "latent pages are HND"):
        codec.gather_pages(hnd_pages(torch.Generator(), 1, torch.bfloat16), [0], 0, 1)
    with pytest.raises(TypeError, match="K/V block caches"):
        codec.gather_blocks(torch.zeros(1, 4, 1, LATENT), torch.zeros(1, 4, 1, LATENT), [0], 1)
    assert torch.equal(latent_bytes(buf), before)


def test_latent_codecs_that_cannot_hold_a_pool_say_so():
    with pytest.raises(ValueError, match="pool dtype must be one of"):
        latent_codec(torch.int8)
    with pytest.raises(ValueError, match="fp8_ds_mla holds 512-wide MLA latent vectors only"):
        rows_nbytes("fp8_ds_mla", 1, 576)
    with pytest.raises(ValueError, match="one 512-wide latent vector a key"):
        FooterScaleCodec().held_shape(1, 2, LATENT)
    with pytest.raises(ValueError, match="not whole writer pages of 3"):
        FooterScalePages(torch.zeros(1, LTPB, TOKEN_BYTES, dtype=torch.uint8), 3)
