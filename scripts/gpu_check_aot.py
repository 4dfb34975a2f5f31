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
  bandwidth      each kernel's time per launch against a device-to-device copy of the
                 same bytes, CUDA events over many launches, paired rounds, warm-up first
                 (target: copy >= 85% of the D2D copy; the append's ratio is reported).

Exit status 1 if a correctness check fails (bandwidth below target is reported, not fatal).
Usage: python scripts/gpu_check_aot.py [--kernel-dir DIR] [--rounds 7] [--launches 200]
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
    os.environ.pop("TRTLLM_MTP_CARRY_KERNELS")


def paired_times(fns: dict, rounds: int, launches: int) -> dict:
    """Per-launch ms of each fn: `rounds` rounds (fns interleaved per round) of `launches` each."""
    for fn in fns.values():
        for _ in range(10):
            fn()
    torch.cuda.synchronize()
    out: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(launches):
                fn()
            e.record()
            e.synchronize()
            out[k].append(s.elapsed_time(e) / launches)
    return out


def check_bandwidth(g: torch.Generator, rounds: int, launches: int) -> None:
    n, H = 4096, 2048
    src = torch.randn(n, H, generator=g).to(torch.bfloat16).cuda()
    dst = torch.empty(n + 64, H, dtype=torch.bfloat16, device="cuda")
    flat_dst = torch.empty(n * H, dtype=torch.bfloat16, device="cuda")
    flat_src = src.view(-1)
    t = paired_times({
        "copy": lambda: aot_launcher.hidden_row_copy_aot(src, 0, dst, 64, n),
        "d2d": lambda: flat_dst.copy_(flat_src),
    }, rounds, launches)
    _print_ratio("hidden_row_copy", t["copy"], t["d2d"], 2 * n * H * 2, target=0.85)

    rows, hkv, hd, page = 4096, 2, 256, 64
    k_new, v_new, keys, kc, vc, table = append_case(g, torch.bfloat16, rows, hkv, hd, 64, page, 0,
                                                    rows // page + 8, rows // page)
    kv_src = torch.cat([k_new.view(-1), v_new.view(-1)])
    kv_dst = torch.empty_like(kv_src)
    t = paired_times({
        "append": lambda: aot_launcher.drafter_row_append_aot(
            k_new, v_new, keys, kc, vc, table, 0, 64, 1e7, check_data=False),
        "d2d": lambda: kv_dst.copy_(kv_src),
    }, rounds, launches)
    _print_ratio("drafter_row_append", t["append"], t["d2d"], 2 * kv_src.numel() * 2, target=None)


def _print_ratio(name: str, ours: list, d2d: list, nbytes: int, target: float | None) -> None:
    ratios = [d / o for o, d in zip(ours, d2d, strict=True)]  # paired per round
    med = statistics.median(ratios)
    gbs = nbytes / (statistics.median(ours) * 1e-3) / 1e9
    line = (f"bandwidth {name}: {statistics.median(ours) * 1e3:.1f} us/launch ({gbs:.0f} GB/s), "
            f"D2D copy of the same bytes {statistics.median(d2d) * 1e3:.1f} us; ratio median "
            f"{med:.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}, {len(ratios)} paired rounds)")
    if target is not None:
        line += f" -> {'target met' if med >= target else 'BELOW TARGET'} ({target:.0%})"
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernel-dir", type=Path, default=None,
                   help="a build_abi_kernels.py output; default: build one into a temp dir")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--launches", type=int, default=200)
    p.add_argument("--no-bandwidth", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check_aot: error: no CUDA device", file=sys.stderr)
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
    check_copy(g)
    check_append(g)
    check_ops(g)
    report(all(k == "ptx" for k in aot_launcher.loaded_images().values()),
           f"ptx-loaded the driver JIT-compiled the PTX TensorRT receives: {aot_launcher.loaded_images()}")
    if not args.no_bandwidth:
        check_bandwidth(g, args.rounds, args.launches)
    print(f"gpu_check_aot: {len(FAILS)} failed check(s)")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
