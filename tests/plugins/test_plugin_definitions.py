"""The plugin definitions' logic, run against a stand-in for `tensorrt.plugin` (no libnvinfer here).

The stand-in records what `@trtp.register` / `@trtp.aot_impl` receive and plays
shape expressions with ints, so these tests pin what the plugins hand TensorRT:
the aliased output, the kernel name and PTX from the build, the launch rule's
grid/block, and the int32 extras in ABI order with their values. The real API
is exercised by the engine test where tensorrt is importable.
"""

from __future__ import annotations

import sys
import types

import pytest

from trtllm_mtp_carry.kernels import abi
from trtllm_mtp_carry.plugins import definitions


class Expr(int):
    """A constant shape expression."""

    is_fake = False
    is_constant = True

    def constant_value(self) -> int:
        return int(self)


class Desc:
    def __init__(self, dtype, *shape):
        self.dtype, self.shape_expr = dtype, [Expr(s) for s in shape]

    def aliased(self):
        return ("aliased", self)


class LaunchParams:
    pass


@pytest.fixture
def trtp(monkeypatch):
    fake_trt = types.SimpleNamespace(bfloat16="bf16", float16="fp16", float32="fp32", int32="i32")
    monkeypatch.setitem(sys.modules, "tensorrt", fake_trt)
    reg: dict = {}
    mod = types.SimpleNamespace(
        TensorDesc=Desc, KernelLaunchParams=LaunchParams, SymIntExprs=types.SimpleNamespace(
            from_tuple=list), SymInt32=int, cdiv=lambda a, b: -(-a // b),
        register=lambda pid: lambda f: reg.setdefault(("register", pid), f),
        aot_impl=lambda pid: lambda f: reg.setdefault(("aot", pid), f),
        registry=reg,
    )
    return mod


def test_copy_plugin_aliases_the_store_and_launches_the_abi(trtp, abi_build):
    out, manifest = abi_build
    definitions.define(trtp, {"kernel_dir": out, "target": "sm_121a"})
    desc = trtp.registry[("register", "trtllm_mtp_carry::hidden_row_copy")]
    src, row, store = Desc("bf16", 7, 2048), Desc("i32", 1), Desc("bf16", 4096, 2048)
    assert desc(src, row, store) == ("aliased", store)
    with pytest.raises(ValueError, match="src dtype fp16 differs from dst dtype bf16"):
        desc(Desc("fp16", 7, 2048), row, store)
    name, ptx, lp, extras = trtp.registry[("aot", "trtllm_mtp_carry::hidden_row_copy")](
        src, row, store, (store,), 0)
    e = next(a for a in manifest["artifacts"] if (a["kernel"], a["variant"], a["target"])
             == ("hidden_row_copy", "a16", "sm_121a"))
    assert name == e["entry"] and ptx == (out / e["ptx"]).read_text()
    assert (lp.grid_x, lp.grid_y, lp.grid_z) == (7, 2, 1)
    assert (lp.block_x, lp.block_y, lp.block_z) == (128, 1, 1) and lp.shared_mem == 0
    assert extras == [2048, 2048, 2048, 4096]  # src_stride, dst_stride, hidden_size, dst_capacity
    with pytest.raises(ValueError, match="hidden_size must be a multiple of 16, got 40"):
        trtp.registry[("aot", "trtllm_mtp_carry::hidden_row_copy")](
            Desc("bf16", 7, 40), row, Desc("bf16", 9, 40), (store,), 0)


def test_append_plugin_aliases_both_caches_and_passes_extras_in_abi_order(trtp, abi_build):
    out, manifest = abi_build
    definitions.define(trtp, {"kernel_dir": out, "target": "sm_90a"})
    pid = "trtllm_mtp_carry::drafter_row_append"
    k = Desc("bf16", 5, 2, 256)
    ins = [k, Desc("bf16", 5, 2, 256), Desc("i32", 5), Desc("i32", 16), Desc("fp32", 32),
           Desc("i32", 1), Desc("bf16", 64, 32, 2, 256), Desc("bf16", 64, 32, 2, 256)]
    assert trtp.registry[("register", pid)](*ins) == (("aliased", ins[6]), ("aliased", ins[7]))
    bad = list(ins)
    bad[2] = Desc("fp32", 5)
    with pytest.raises(ValueError, match="keys must be int32, got fp32"):
        trtp.registry[("register", pid)](*bad)
    name, ptx, lp, extras = trtp.registry[("aot", pid)](*ins, tuple(ins[6:]), 0)
    e = next(a for a in manifest["artifacts"] if (a["kernel"], a["variant"], a["target"])
             == ("drafter_row_append", "a16", "sm_90a"))
    assert name == e["entry"] and ".target sm_90a" in ptx
    assert (lp.grid_x, lp.grid_y, lp.grid_z) == (5, 1, 1) and lp.block_x == 128
    assert dict(zip(abi.APPEND_ABI.names("extra"), extras, strict=True)) == {
        "num_kv_heads": 2, "head_dim": 256, "page_size": 32, "rotary_dim": 64,
        "k_s0": 512, "k_s1": 256, "v_s0": 512, "v_s1": 256, "max_blocks": 16, "num_blocks": 64}


def test_append_plugin_names_a_missing_build(trtp, abi_build):
    out, _ = abi_build
    definitions.define(trtp, {"kernel_dir": out, "target": "sm_121a"})
    ins = [Desc("bf16", 5, 4, 256), Desc("bf16", 5, 4, 256), Desc("i32", 5), Desc("i32", 16),
           Desc("fp32", 32), Desc("i32", 1), Desc("bf16", 64, 32, 4, 256), Desc("bf16", 64, 32, 4, 256)]
    with pytest.raises(ValueError, match=r"no a16 drafter_row_append build for dtype=bf16 "
                                         r"target=sm_121a covering num_kv_heads, head_dim = \(4, 256\)"):
        trtp.registry[("aot", "trtllm_mtp_carry::drafter_row_append")](*ins, tuple(ins[6:]), 0)
