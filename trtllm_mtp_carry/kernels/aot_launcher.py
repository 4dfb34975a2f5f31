"""Run the built plugin PTX through the CUDA driver API (cuda-python), without TensorRT or Triton.

What it is for: the exact binary a TensorRT AOT plugin runs (the ABI-fixed PTX
of `builders/build_abi_kernels.py`), launched with the same parameter list
(`abi.py`) and the same launch rule, from torch tensors. It backs the custom
ops when `TRTLLM_MTP_CARRY_KERNELS=aot` (`dataplane/ops.py`), so a deployment
runs without Triton's JIT, and it is how the GPU checks test the plugins'
kernels on any CUDA machine.

Where the binaries come from: `$TRTLLM_MTP_CARRY_KERNEL_DIR` (a build
directory with `manifest.json`; hashes are verified at load), else a cache
directory that is built on first use (that needs `triton` to compile; the
launch itself never does).

Invariants: every call runs `dataplane.checks` first (a refused call writes
nothing); row offsets reach the kernel as device int32 values without a host
copy (the destination / block-table pointer is advanced on the host and the
remainder read from a per-device `arange` table); modules are loaded once per
(device, file) into the device's primary context, the one torch uses; a warm
call looks its kernel up in one dict and allocates nothing but the int32 copy of
int64 keys. With `check_data=True` the append's content checks cost one device
sync (`dataplane.checks`); the pools call with `check_data=False`.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from ..dataplane.checks import check_drafter_row_append, check_hidden_row_copy
from ..dataplane.rope import rope_kernel_table
from . import abi

__all__ = [
    "KERNEL_DIR_ENV", "drafter_row_append_aot", "hidden_row_copy_aot", "kernel_dir", "loaded_images",
]

KERNEL_DIR_ENV = "TRTLLM_MTP_CARRY_KERNEL_DIR"
_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_CUDA_EXTRA = "install the 'cuda' extra: pip install 'trtllm-mtp-carry[cuda]' (cuda-python)"


def _driver() -> Any:
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]  # older cuda-python
        except ImportError as e:
            raise RuntimeError(f"the AOT kernel launcher needs cuda-python: {_CUDA_EXTRA}") from e
    return driver


def _check(result: Any, what: str) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest


def target_of(device: torch.device) -> str:
    """`sm_XYa` of a CUDA device (`sm_121a` on GB10); ValueError below sm_90."""
    return _target_of(device.index if device.index is not None else torch.cuda.current_device())


@lru_cache(maxsize=16)
def _target_of(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        raise ValueError(f"AOT kernels are built for sm_90a and newer, device is sm_{major}{minor}")
    return f"sm_{major}{minor}a"


def kernel_dir() -> tuple[Path, bool]:
    """`(directory, built_on_demand)`: `$TRTLLM_MTP_CARRY_KERNEL_DIR`, else the user cache."""
    env = os.environ.get(KERNEL_DIR_ENV)
    if env:
        return Path(env), False
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "trtllm_mtp_carry" / "abi-kernels", True


class _Store:
    """Manifest entries and loaded CUfunctions of one kernel directory."""

    def __init__(self) -> None:
        self.manifests: dict[Path, dict] = {}
        self.functions: dict[tuple[int, str], Any] = {}
        self.loaded: dict[str, str] = {}  # file stem -> "ptx" | "cubin" (which image loaded)

    def entry(self, kernel: str, dtype: str, variant: str, target: str,
              shape: tuple[int, int] | None) -> tuple[Path, dict]:
        from .build import build, load_manifest, pick_artifact

        directory, on_demand = kernel_dir()
        for attempt in range(2):
            if directory not in self.manifests and (directory / "manifest.json").exists():
                self.manifests[directory] = load_manifest(directory)
            found = pick_artifact(self.manifests.get(directory), kernel, dtype, variant, target,
                                  shape)
            if found is not None:
                return directory, found
            if not on_demand or attempt:
                break
            hkv, hd = shape or (2, 256)
            build(directory, [target], (dtype,), hkv, hd, (variant,), (kernel,))
            self.manifests.pop(directory, None)
        raise RuntimeError(
            f"no built {kernel} kernel for dtype={dtype} variant={variant} target={target}"
            + (f" num_kv_heads/head_dim <= {shape}" if shape else "")
            + f" in {directory}: run builders/build_abi_kernels.py --out {directory} "
            "with that target/dtype/shape"
        )

    def function(self, device: torch.device, directory: Path, e: dict) -> Any:
        key = (device.index or 0, str(directory / e["ptx"]))
        fn = self.functions.get(key)
        if fn is None:
            drv = _driver()
            _check(drv.cuInit(0), "cuInit")
            torch.cuda.init()
            with torch.cuda.device(device):
                # torch runs on the device's primary context; make it current for the driver API
                dev = _check(drv.cuDeviceGet(device.index or 0), "cuDeviceGet")
                ctx = _check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
                _check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
                module, kind = _load_module(drv, directory, e)
                self.loaded[e[kind]] = kind
                fn = _check(drv.cuModuleGetFunction(module, e["entry"].encode()),
                            "cuModuleGetFunction")
            self.functions[key] = fn
        return fn


def _load_module(drv: Any, directory: Path, e: dict) -> tuple[Any, str]:
    """Load the PTX (what TensorRT receives); if this driver cannot JIT it (a PTX ISA newer
    than the driver), load the cubin ptxas made from that same PTX."""
    errors = []
    for kind in ("ptx", "cubin"):
        image = (directory / e[kind]).read_bytes() + (b"\0" if kind == "ptx" else b"")
        buf = ctypes.create_string_buffer(image, len(image))
        err, module = drv.cuModuleLoadData(ctypes.addressof(buf))
        if int(err) == 0:
            return module, kind
        errors.append(f"{e[kind]}: {err}")
    raise RuntimeError(f"cuModuleLoadData failed for {'; '.join(errors)}")


_STORE = _Store()
_KERNELS: dict[tuple, tuple[Any, dict]] = {}


def _kernel(kernel: str, dtype: str, variant: str, device: torch.device,
            shape: tuple[int, int] | None) -> tuple[Any, dict]:
    """`(CUfunction, manifest entry)`, looked up once per (kernel dir, kernel, dtype, variant,
    device, shape): a warm call pays a dict lookup, not a manifest search."""
    key = (os.environ.get(KERNEL_DIR_ENV), kernel, dtype, variant, device.index, shape)
    found = _KERNELS.get(key)
    if found is None:
        directory, e = _STORE.entry(kernel, dtype, variant, target_of(device), shape)
        found = _KERNELS[key] = (_STORE.function(device, directory, e), e)
    return found


def loaded_images() -> dict[str, str]:
    """Files loaded so far and which image each was (`ptx` normally; `cubin` if the driver
    could not JIT the PTX)."""
    return dict(_STORE.loaded)


@lru_cache(maxsize=64)
def _row_table(device: torch.device, size: int) -> torch.Tensor:  # [size] i32: 0, 1, ..
    return torch.arange(max(size, 1), dtype=torch.int32, device=device)


def _aligned(ptrs: list[int], ints: list[int]) -> bool:
    return all(p % 16 == 0 for p in ptrs) and all(v % 16 == 0 for v in ints)


@lru_cache(maxsize=8)
def _param_types(kabi: abi.KernelABI) -> tuple[Any, ...]:
    return tuple(ctypes.c_void_p if p.ptx_type() == ".u64" else ctypes.c_int32 for p in kabi.params)


def _launch(fn: Any, launch: abi.Launch, args: list[int], kabi: abi.KernelABI,
            device: torch.device) -> None:
    drv = _driver()
    types = _param_types(kabi)
    if len(args) != len(types):
        raise RuntimeError(f"{kabi.name}: {len(args)} arguments for {len(types)} parameters")
    stream = drv.CUstream(torch.cuda.current_stream(device).cuda_stream)
    gx, gy, gz = (int(g) for g in launch.grid)
    bx, by, bz = launch.block
    _check(drv.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, launch.shared_bytes, stream,
                              (tuple(args), types), 0), f"cuLaunchKernel({kabi.name})")


def hidden_row_copy_aot(
    src: torch.Tensor,  # [S, H] unit column stride, CUDA
    src_row: int,
    dst: torch.Tensor,  # [D, H] same dtype/device
    dst_row: int,
    n: int,
) -> None:
    """AOT twin of `hidden_row_copy_reference`: same checks, same bits written."""
    check_hidden_row_copy(src, src_row, dst, dst_row, n)
    hidden = src.shape[1]
    if n == 0 or hidden == 0:
        return
    dtype = _DTYPE.get(src.dtype)
    if dtype is None:
        raise ValueError(f"AOT hidden_row_copy supports {sorted(map(str, _DTYPE))}, got {src.dtype}")
    es = src.element_size()
    s_ptr = src.data_ptr() + src_row * src.stride(0) * es
    d_ptr = dst.data_ptr() + dst_row * dst.stride(0) * es
    ints = [src.stride(0), dst.stride(0), hidden]
    variant = "a16" if _aligned([s_ptr, d_ptr], ints) else "any"
    fn, e = _kernel("hidden_row_copy", dtype, variant, src.device, None)
    zero = _row_table(src.device, 1)  # dst_row already folded into d_ptr
    args = [s_ptr, zero.data_ptr(), d_ptr, src.stride(0), dst.stride(0), hidden,
            dst.shape[0] - dst_row, d_ptr]
    _launch(fn, abi.copy_launch(n, hidden, e["shared_bytes"]), args, abi.COPY_ABI, src.device)


def drafter_row_append_aot(
    k_new: torch.Tensor,  # [n, Hkv, D] cache dtype
    v_new: torch.Tensor,  # [n, Hkv, D] cache dtype
    keys: torch.Tensor,  # [n] int32/int64, strictly increasing, < 2**31
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] contiguous
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int32
    start_row: int,
    rotary_dim: int,
    rope_theta: float,
    check_data: bool = True,
) -> None:
    """AOT twin of `drafter_row_append_reference` (BF16/FP16 rounding of the rotated K).

    Keys reach the kernel as int32 (TensorRT-LLM positions are int32); with `check_data`
    a key >= 2**31 is refused.
    """
    check_drafter_row_append(k_new, v_new, keys, k_cache, v_cache, block_table, start_row,
                             rotary_dim, rope_theta, check_data, key_limit=2**31,
                             key_limit_why="the AOT kernel (int32 keys)")
    n = k_new.shape[0]
    if n == 0:
        return
    num_blocks, page, hkv, hd = k_cache.shape
    device = k_cache.device
    if k_new.stride(2) != 1:
        k_new = k_new.contiguous()
    if v_new.stride(2) != 1:
        v_new = v_new.contiguous()
    keys32 = keys if keys.dtype == torch.int32 else keys.to(torch.int32)
    inv = rope_kernel_table(rotary_dim, rope_theta, device)
    first_block, in_block = divmod(start_row, page)
    rows = _row_table(device, page)
    bt_ptr = block_table.data_ptr() + first_block * 4
    ptr_args = [k_new.data_ptr(), v_new.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()]
    ints = [hd, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1)]
    variant = "a16" if _aligned(ptr_args, ints) else "any"
    fn, e = _kernel("drafter_row_append", _DTYPE[k_cache.dtype], variant, device, (hkv, hd))
    args = [k_new.data_ptr(), v_new.data_ptr(), keys32.data_ptr(), bt_ptr, inv.data_ptr(),
            rows.data_ptr() + in_block * 4, k_cache.data_ptr(), v_cache.data_ptr(),
            hkv, hd, page, rotary_dim, k_new.stride(0), k_new.stride(1),
            v_new.stride(0), v_new.stride(1), block_table.shape[0] - first_block, num_blocks,
            k_cache.data_ptr(), v_cache.data_ptr()]
    _launch(fn, abi.append_launch(n, e["shared_bytes"]), args, abi.APPEND_ABI, device)
