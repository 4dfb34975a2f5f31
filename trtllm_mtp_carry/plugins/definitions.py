"""The `tensorrt.plugin` definitions of both plugins; `define()` registers them (needs tensorrt).

What it is for: `@trtp.register` (output = the aliased cache, dtype checks) and
`@trtp.aot_impl` (kernel name, ABI-fixed PTX from the build directory,
`KernelLaunchParams` from `kernels.abi`'s launch rule evaluated on shape
expressions, and the int32 extras in ABI order) for each plugin. Followed
(NVIDIA/TensorRT OSS, the AOT-enabled `tensorrt.plugin` of TensorRT >= 10.9):
`samples/python/quickly_deployable_plugins/qdp_defs.py` @5ca4580
(`circ_pad_plugin_aot_impl`; `elemwise_add_plugin_` for `aliased()`),
`python/packaging/bindings_wheel/tensorrt/plugin/_plugin_class.py` @5ca4580
(`_TemplateAOTPlugin.get_launch_params`: the aot_impl gets the input descs, every
attribute, `outputs`, `tactic`; extras must be `SymInt32`), `_validate.py` @8c6d69d
(`_validate_aot_impl`: parameter names and the return annotation) and `_tensor.py`
(`KernelLaunchParams`, `SymIntExprs.from_tuple`).

Annotations use `typing.Tuple`/`Union` (not `tuple`/`|`) as NVIDIA's sample
does, which every 10.x `_validate` accepts; no `from __future__ import
annotations` here: `tensorrt.plugin` inspects them as classes.
"""
# ruff: noqa: UP006, UP007, UP035

from pathlib import Path
from typing import Any, Dict, Tuple, Union

from ..kernels import abi
from ..kernels.build import load_manifest, pick_artifact

__all__ = ["define", "device_target", "kernel_for"]


def device_target() -> str:
    """`sm_XYa` of CUDA device 0 via cuda-python's driver API (no torch); RuntimeError otherwise."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise RuntimeError("pass target='sm_121a' (or set TRTLLM_MTP_CARRY_TARGET), or install "
                           "cuda-python to read it from the device") from e
    (err,) = driver.cuInit(0)
    err_dev, dev = driver.cuDeviceGet(0)
    attr = driver.CUdevice_attribute
    err2, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    err3, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    if int(err) or int(err_dev) or int(err2) or int(err3):
        raise RuntimeError(f"cannot read the device's compute capability ({err}, {err_dev}, {err2}, "
                           f"{err3}): pass target='sm_121a' or set TRTLLM_MTP_CARRY_TARGET")
    return f"sm_{major}{minor}a"


def kernel_for(config: Dict[str, Any], kernel: str, dtype: str,
               shape: Union[Tuple[int, int], None] = None) -> Tuple[dict, str]:
    """`(manifest entry, PTX text)` of the `a16` build of `kernel` for the configured target."""
    directory = Path(config["kernel_dir"])
    manifest = load_manifest(directory)
    e = pick_artifact(manifest, kernel, dtype, "a16", config["target"], shape)
    if e is None:
        raise ValueError(
            f"{directory} has no a16 {kernel} build for dtype={dtype} target={config['target']}"
            + (f" covering num_kv_heads, head_dim = {shape}" if shape else "")
            + ": run builders/build_abi_kernels.py with that target, dtype and shape"
        )
    return e, (directory / e["ptx"]).read_text()


def _static(expr: Any, what: str) -> int:
    if expr.is_fake or not expr.is_constant:
        raise ValueError(f"{what} must be a build-time constant (it is baked into the kernel)")
    return int(expr.constant_value())


def define(trtp: Any, config: Dict[str, Any]) -> None:
    """Register both plugins' shape and AOT definitions with `tensorrt.plugin`."""
    import tensorrt as trt

    names = {trt.bfloat16: "bf16", trt.float16: "fp16", trt.float32: "fp32"}

    def dtype_name(desc: Any, what: str) -> str:
        if desc.dtype not in names:
            raise ValueError(f"{what} dtype must be bf16, fp16 or fp32, got {desc.dtype}")
        return names[desc.dtype]

    def launch_params(launch: abi.Launch) -> Any:
        lp = trtp.KernelLaunchParams()
        lp.grid_x, lp.grid_y, lp.grid_z = launch.grid
        lp.block_x, lp.block_y, lp.block_z = launch.block
        lp.shared_mem = launch.shared_bytes
        return lp

    def extras(kabi: abi.KernelABI, values: Dict[str, Any]) -> Any:
        return trtp.SymIntExprs.from_tuple([trtp.SymInt32(values[n]) for n in kabi.names("extra")])

    @trtp.register("trtllm_mtp_carry::hidden_row_copy")
    def hidden_row_copy_desc(src: trtp.TensorDesc, dst_row: trtp.TensorDesc,
                             dst_in: trtp.TensorDesc) -> trtp.TensorDesc:
        if src.dtype != dst_in.dtype:
            raise ValueError(f"src dtype {src.dtype} differs from dst dtype {dst_in.dtype}")
        if dst_row.dtype != trt.int32:
            raise ValueError(f"dst_row must be int32, got {dst_row.dtype}")
        return dst_in.aliased()

    @trtp.aot_impl("trtllm_mtp_carry::hidden_row_copy")
    def hidden_row_copy_aot(
        src: trtp.TensorDesc, dst_row: trtp.TensorDesc, dst_in: trtp.TensorDesc,
        outputs: Tuple[trtp.TensorDesc], tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]:
        e, ptx = kernel_for(config, "hidden_row_copy", dtype_name(src, "src"))
        n, hidden = src.shape_expr[0], src.shape_expr[1]
        if not hidden.is_fake and hidden.is_constant and hidden.constant_value() % 16:
            raise ValueError(f"hidden_size must be a multiple of 16, got {hidden.constant_value()}")
        launch = abi.copy_launch(n, hidden, e["shared_bytes"], div=trtp.cdiv)
        values = {"src_stride": hidden, "dst_stride": hidden, "hidden_size": hidden,
                  "dst_capacity": dst_in.shape_expr[0]}
        return e["entry"], ptx, launch_params(launch), extras(abi.COPY_ABI, values)

    @trtp.register("trtllm_mtp_carry::drafter_row_append")
    def drafter_row_append_desc(
        k_new: trtp.TensorDesc, v_new: trtp.TensorDesc, keys: trtp.TensorDesc,
        block_table: trtp.TensorDesc, inv_freq: trtp.TensorDesc, start_row: trtp.TensorDesc,
        k_cache_in: trtp.TensorDesc, v_cache_in: trtp.TensorDesc,
    ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        for name, d in (("v_new", v_new), ("k_cache", k_cache_in), ("v_cache", v_cache_in)):
            if d.dtype != k_new.dtype:
                raise ValueError(f"{name} dtype {d.dtype} differs from k_new dtype {k_new.dtype}")
        for name, d in (("keys", keys), ("block_table", block_table), ("start_row", start_row)):
            if d.dtype != trt.int32:
                raise ValueError(f"{name} must be int32, got {d.dtype}")
        if inv_freq.dtype != trt.float32:
            raise ValueError(f"inv_freq must be float32, got {inv_freq.dtype}")
        return k_cache_in.aliased(), v_cache_in.aliased()

    @trtp.aot_impl("trtllm_mtp_carry::drafter_row_append")
    def drafter_row_append_aot(
        k_new: trtp.TensorDesc, v_new: trtp.TensorDesc, keys: trtp.TensorDesc,
        block_table: trtp.TensorDesc, inv_freq: trtp.TensorDesc, start_row: trtp.TensorDesc,
        k_cache_in: trtp.TensorDesc, v_cache_in: trtp.TensorDesc,
        outputs: Tuple[trtp.TensorDesc], tactic: int,
    ) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]:
        hkv = _static(k_new.shape_expr[1], "num_kv_heads")
        hd = _static(k_new.shape_expr[2], "head_dim")
        if hd % 16:
            raise ValueError(f"head_dim must be a multiple of 16, got {hd}")
        e, ptx = kernel_for(config, "drafter_row_append", dtype_name(k_new, "k_new"), (hkv, hd))
        c = k_cache_in.shape_expr
        values = {"num_kv_heads": hkv, "head_dim": hd, "page_size": c[1],
                  "rotary_dim": inv_freq.shape_expr[0] * 2, "k_s0": hkv * hd, "k_s1": hd,
                  "v_s0": hkv * hd, "v_s1": hd, "max_blocks": block_table.shape_expr[0],
                  "num_blocks": c[0]}
        launch = abi.append_launch(k_new.shape_expr[0], e["shared_bytes"])
        return e["entry"], ptx, launch_params(launch), extras(abi.APPEND_ABI, values)
