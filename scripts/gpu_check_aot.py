#!/usr/bin/env python3
"""GPU check of the plugins' kernels through the AOT launcher (no TensorRT, no Triton JIT).

What it is for: on any CUDA machine (sm_90a and newer), run the exact PTX the
TensorRT plugins embed, through the CUDA driver API, and check it. Each line
says PASS/FAIL and what the check proves:

  copy-exact     the copy PTX writes the reference's bits (bf16, fp16, fp32; a16 and
                 `any` variants; offset views) and not one byte outside the target rows;
  append-exact   the append PTX writes V and K's non-rotary columns bit for bit and K's
                 rotary columns within one 16-bit rounding, for row counts that are not a
                 multiple of the block size, a shuffled block table and a mid-block start,
                 and leaves every other cache slot untouched;
  op-aot         the torch custom ops with TRTLLM_MTP_CARRY_KERNELS=aot give the same
                 bits as the launcher (the deployment path without Triton);
  bandwidth      each kernel's KERNEL time (a CUDA graph of many launches, replayed and
                 timed with CUDA events, so Python launch cost is not counted) against a
                 device-to-device copy of the same bytes in the same run, at 64k and 256k
                 rows (sizes well past the 60 MB L2), paired rounds, warm-up first
                 (target: each kernel >= 0.85 of the D2D copy's bandwidth).

Besides the human lines it prints the GPU figures convention's lines (gpu_smoke.sh collects
them): `CHECK<TAB>name<TAB>PASS|FAIL<TAB>detail` per check group and
`FIGURE<TAB>name<TAB>value<TAB>target<TAB>PASS|MISS|INFO` per bandwidth figure.
A check that raises is a FAIL with the exception's message; the later checks still run.

Exit status 1 if a correctness check fails (bandwidth below target is reported, not fatal).
Usage: python3 scripts/gpu_check_aot.py [--kernel-dir DIR] [--rounds 7] [--launches 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trtllm_mtp_carry.dataplane.ops  # noqa: E402,F401  (registers torch.ops.trtllm_mtp_carry.*)
from trtllm_mtp_carry.dataplane.reference import (  # noqa: E402
    drafter_row_append_reference,
    hidden_row_copy_reference,
)
from trtllm_mtp_carry.kernels import aot_launcher  # noqa: E402

FAILS: list[str] = []


def report(ok: bool, what: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        FAILS.append(what)


def check_line(name: str, ok: bool, detail: str) -> None:
    """One CHECK line of the GPU figures convention (tabs; detail on one line)."""
    detail = " ".join(detail.split())
    print(f"CHECK\t{name}\t{'PASS' if ok else 'FAIL'}\t{detail}", flush=True)


def figure_line(name: str, value: str, target: str, verdict: str) -> None:
    """One FIGURE line of the GPU figures convention."""
    print(f"FIGURE\t{name}\t{value}\t{target}\t{verdict}", flush=True)


def run_group(name: str, fn, *args) -> None:
    """Run one check group; its CHECK line counts the group's FAIL lines (a raise is a FAIL)."""
    before = len(FAILS)
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - reported as a failed check, the next group runs
        msg = f"{type(e).__name__}: {e}".splitlines()[0]
        report(False, f"{name} raised {msg}")
    failed = FAILS[before:]
    check_line(f"aot {name}", not failed,
               "all cases equal the reference" if not failed else f"{len(failed)} failed: {failed[0]}")


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def poison(g: torch.Generator, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    b = torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8)
    return b.view(dtype).view(shape).cuda()


def close_16bit(out: torch.Tensor, ref: torch.Tensor) -> bool:
    rtol = 2.0**-7 if out.dtype == torch.bfloat16 else 2.0**-10
    err = (out.double() - ref.double()).abs()
    return bool((err <= rtol * ref.double().abs() + 2e-3).all())


def check_copy(g: torch.Generator) -> None:
    cases = [  # (src_rows, dst_rows, hidden, src_row, dst_row, n): 2048 -> a16, 40/1100 -> any
        (4096, 8192, 2048, 0, 3000, 4096), (77, 300, 2048, 5, 211, 61),
        (9, 20, 40, 2, 7, 5), (6, 9, 1100, 1, 2, 4)]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for S, D, H, sr, dr, n in cases:
            src = torch.randn(S, H, generator=g).to(dtype).cuda()
            dst = poison(g, (D, H), dtype)
            ref = dst.clone()
            hidden_row_copy_reference(src, sr, ref, dr, n)
            aot_launcher.hidden_row_copy_aot(src, sr, dst, dr, n)
            torch.cuda.synchronize()
            report(torch.equal(raw(dst), raw(ref)),
                   f"copy-exact {dtype} S={S} D={D} H={H} src_row={sr} dst_row={dr} n={n} "
                   "(written rows bit for bit, all other rows untouched)")


def append_case(g, dtype, n, hkv, hd, rd, page, start, num_blocks, max_blocks):
    k_new = torch.randn(n, hkv, hd, generator=g).to(dtype).cuda()
    v_new = torch.randn(n, hkv, hd, generator=g).to(dtype).cuda()
    keys = (torch.randint(1, 4, (n,), generator=g).cumsum(0) + 3).cuda()
    table = torch.randperm(num_blocks, generator=g)[:max_blocks].to(torch.int32).cuda()
    k_cache = poison(g, (num_blocks, page, hkv, hd), dtype)
    v_cache = poison(g, (num_blocks, page, hkv, hd), dtype)
    return k_new, v_new, keys, k_cache, v_cache, table


def check_append(g: torch.Generator) -> None:
    cases = [  # (n, hkv, hd, rd, page, start, num_blocks, max_blocks)
        (77, 2, 256, 64, 64, 33, 40, 8),     # Qwen3-Next MTP shape (a16), mid-block start
        (1000, 2, 256, 64, 16, 5, 200, 70),  # many blocks, scattered
        (13, 3, 40, 40, 8, 7, 9, 4),         # padded tile (any), full rotary
    ]
    for dtype in (torch.bfloat16, torch.float16):
        for n, hkv, hd, rd, page, start, nb, mb in cases:
            k_new, v_new, keys, kc, vc, table = append_case(g, dtype, n, hkv, hd, rd, page, start, nb, mb)
            kr, vr = kc.clone(), vc.clone()
            drafter_row_append_reference(k_new, v_new, keys, kr, vr, table, start, rd, 1.0e7)
            aot_launcher.drafter_row_append_aot(k_new, v_new, keys, kc, vc, table, start, rd, 1.0e7)
            torch.cuda.synchronize()
            rows = torch.arange(start, start + n, device="cuda")
            slots = table.long()[rows // page] * page + rows % page
            kf, krf = kc.view(-1, hkv, hd), kr.view(-1, hkv, hd)
            other = torch.ones(kf.shape[0], dtype=torch.bool, device="cuda")
            other[slots] = False
            ok = (torch.equal(raw(vc), raw(vr))
                  and torch.equal(raw(kc[..., rd:]), raw(kr[..., rd:]))
                  and torch.equal(raw(kf[other]), raw(krf[other]))
                  and close_16bit(kf[slots, :, :rd], krf[slots, :, :rd]))
            report(ok, f"append-exact {dtype} n={n} Hkv={hkv} D={hd} rd={rd} page={page} "
                       f"start={start} (V, non-rotary K and untouched slots bit for bit; "
                       "rotary K within one 16-bit rounding)")


def check_ops(g: torch.Generator) -> None:
    os.environ["TRTLLM_MTP_CARRY_KERNELS"] = "aot"
    try:
        _check_ops(g)
    finally:
        os.environ.pop("TRTLLM_MTP_CARRY_KERNELS", None)


def _check_ops(g: torch.Generator) -> None:
    src = torch.randn(300, 2048, generator=g).to(torch.bfloat16).cuda()
    a = poison(g, (500, 2048), torch.bfloat16)
    b = a.clone()
    torch.ops.trtllm_mtp_carry.hidden_row_copy(src, 3, a, 100, 250)
    aot_launcher.hidden_row_copy_aot(src, 3, b, 100, 250)
    k_new, v_new, keys, kc, vc, table = append_case(g, torch.bfloat16, 50, 2, 256, 64, 64, 10, 16, 4)
    kc2, vc2 = kc.clone(), vc.clone()
    torch.ops.trtllm_mtp_carry.drafter_row_append(k_new, v_new, keys, kc, vc, table, 10, 64, 1e7)
    aot_launcher.drafter_row_append_aot(k_new, v_new, keys, kc2, vc2, table, 10, 64, 1e7)
    torch.cuda.synchronize()
    report(torch.equal(raw(a), raw(b)) and torch.equal(raw(kc), raw(kc2)) and torch.equal(raw(vc), raw(vc2)),
           "op-aot custom ops with TRTLLM_MTP_CARRY_KERNELS=aot equal the launcher bit for bit")


def graph_of(fn, launches: int):
    """`(replay, method)`: `launches` calls of `fn` captured in one CUDA graph (falls back to
    plain back-to-back launches if capture fails, which then also time Python's launch)."""
    try:
        fn()  # warm: loads the module, fills caches outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(launches):
                fn()
        g.replay()
        torch.cuda.synchronize()
        return g.replay, "cuda-graph"
    except Exception as e:  # noqa: BLE001 - reported in the method name
        torch.cuda.synchronize()

        def plain() -> None:
            for _ in range(launches):
                fn()
        return plain, f"events (graph capture failed: {type(e).__name__})"


def paired_times(fns: dict, rounds: int, launches: int) -> tuple[dict, dict]:
    """Per-launch ms of each fn's kernel: `rounds` paired rounds of one replay each."""
    replays, methods = {}, {}
    for k, fn in fns.items():
        replays[k], methods[k] = graph_of(fn, launches)
    for r in replays.values():  # warm-up
        r()
    torch.cuda.synchronize()
    out: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, replay in replays.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            replay()
            e.record()
            e.synchronize()
            out[k].append(s.elapsed_time(e) / launches)
    return out, methods


def check_bandwidth(g: torch.Generator, rounds: int, launches: int, sizes: list[int]) -> None:
    for n in sizes:
        _bandwidth_copy(g, n, rounds, launches)
        _bandwidth_append(g, n, rounds, launches)
        torch.cuda.empty_cache()


def _bandwidth_copy(g: torch.Generator, n: int, rounds: int, launches: int) -> None:
    H = 2048
    src = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)  # made on the device: fast
    dst = torch.empty(n + 64, H, dtype=torch.bfloat16, device="cuda")
    flat_dst = torch.empty(n * H, dtype=torch.bfloat16, device="cuda")
    flat_src = src.view(-1)
    t, how = paired_times({
        "copy": lambda: aot_launcher.hidden_row_copy_aot(src, 0, dst, 64, n),
        "d2d": lambda: flat_dst.copy_(flat_src),
    }, rounds, launches)
    _print_ratio(f"aot hidden_row_copy {_rows(n)}", t["copy"], t["d2d"], 2 * n * H * 2,
                 0.85, how["copy"])


def _bandwidth_append(g: torch.Generator, n: int, rounds: int, launches: int) -> None:
    hkv, hd, page = 2, 256, 64
    num_blocks = -(-n // page) + 8
    k_new = torch.randn(n, hkv, hd, device="cuda", dtype=torch.bfloat16)  # made on the device
    v_new = torch.randn(n, hkv, hd, device="cuda", dtype=torch.bfloat16)
    keys32 = torch.arange(100, 100 + 2 * n, 2, dtype=torch.int32, device="cuda")
    kc = torch.zeros(num_blocks, page, hkv, hd, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    table = torch.randperm(num_blocks, generator=g)[: -(-n // page)].to(torch.int32).cuda()
    kv_src = torch.cat([k_new.view(-1), v_new.view(-1)])
    kv_dst = torch.empty_like(kv_src)
    t, how = paired_times({
        "append": lambda: aot_launcher.drafter_row_append_aot(
            k_new, v_new, keys32, kc, vc, table, 0, 64, 1e7, check_data=False),
        "d2d": lambda: kv_dst.copy_(kv_src),
    }, rounds, launches)
    _print_ratio(f"aot drafter_row_append {_rows(n)}", t["append"], t["d2d"],
                 2 * kv_src.numel() * 2, 0.85, how["append"])


def _rows(n: int) -> str:
    return f"{n // 1024}k rows" if n % 1024 == 0 else f"{n} rows"


def _print_ratio(name: str, ours: list, d2d: list, nbytes: int, target: float, how: str) -> None:
    ratios = [d / o for o, d in zip(ours, d2d, strict=True)]  # paired per round
    med = statistics.median(ratios)
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [med, med, med]
    gbs = nbytes / (statistics.median(ours) * 1e-3) / 1e9
    print(f"bandwidth {name}: {statistics.median(ours) * 1e3:.1f} us/launch kernel time "
          f"({gbs:.0f} GB/s, {how}), D2D copy of the same bytes {statistics.median(d2d) * 1e3:.1f} us; "
          f"ratio median {med:.2f} (IQR {q[0]:.2f}-{q[2]:.2f}, {len(ratios)} paired rounds)",
          flush=True)
    figure_line(f"{name} kernel BW", f"{med:.2f} of D2D (IQR {q[0]:.2f}-{q[2]:.2f})",
                f">= {target:.2f} of D2D", "PASS" if med >= target else "MISS")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernel-dir", type=Path, default=None,
                   help="a build_abi_kernels.py output; default: build one into a temp dir")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--launches", type=int, default=20, help="launches per CUDA graph")
    p.add_argument("--rows", type=int, nargs="+", default=[65536, 262144],
                   help="row counts of the bandwidth step (default 64k and 256k)")
    p.add_argument("--no-bandwidth", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check_aot: error: no CUDA device", file=sys.stderr)
        return 2
    for n in args.rows:
        if n < 64:
            print(f"gpu_check_aot: error: --rows must be >= 64, got {n}", file=sys.stderr)
            return 2
    target = aot_launcher.target_of(torch.device("cuda"))
    kdir = args.kernel_dir
    if kdir is None:
        from trtllm_mtp_carry.kernels.build import build

        kdir = Path(tempfile.mkdtemp(prefix="abi-kernels-"))
        build(kdir, [target], ("bf16", "fp16", "fp32"), 2, 256)
        build(kdir, [target], ("bf16", "fp16"), 3, 40, kernels=("drafter_row_append",))
    os.environ[aot_launcher.KERNEL_DIR_ENV] = str(kdir)
    print(f"device {torch.cuda.get_device_name()} ({target}); kernels from {kdir}", flush=True)
    g = torch.Generator().manual_seed(0)
    run_group("copy-exact", check_copy, g)
    run_group("append-exact", check_append, g)
    run_group("op-aot", check_ops, g)
    images = aot_launcher.loaded_images()
    ok = bool(images) and all(k == "ptx" for k in images.values())
    report(ok, f"ptx-loaded the driver JIT-compiled the PTX TensorRT receives: {images}")
    check_line("aot ptx-loaded", ok, f"images loaded: {images}")
    if not args.no_bandwidth:
        try:
            check_bandwidth(g, args.rounds, args.launches, args.rows)
        except Exception as e:  # noqa: BLE001 - a speed step; reported, not a correctness failure
            print(f"bandwidth step raised {type(e).__name__}: {e}", flush=True)
            figure_line("aot kernel BW", f"not measured ({type(e).__name__})", ">= 0.85 of D2D", "MISS")
    print(f"gpu_check_aot: {len(FAILS)} failed check(s)")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
