"""The AOT build: every PTX `.entry` is exactly the plugin ABI, assembles for every target, hashes hold."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
from plugin_helpers import ROOT, TARGETS

from trtllm_mtp_carry.kernels import abi
from trtllm_mtp_carry.kernels.build import load_manifest, pick_artifact
from trtllm_mtp_carry.kernels.ptx import assemble, entry_params, fix_abi

ABIS = {"hidden_row_copy": abi.COPY_ABI, "drafter_row_append": abi.APPEND_ABI}


def test_every_kernel_target_and_variant_is_built(abi_build):
    _, manifest = abi_build
    got = {(a["kernel"], a["variant"], a["target"]) for a in manifest["artifacts"]}
    assert got == {(k, v, t) for k in ABIS for v in ("a16", "any") for t in TARGETS}


def test_ptx_entry_parameters_are_the_abi_exactly(abi_build):
    out, manifest = abi_build
    for a in manifest["artifacts"]:
        kabi = ABIS[a["kernel"]]
        ptx = (out / a["ptx"]).read_text()
        assert f".target {a['target']}" in ptx
        params = entry_params(ptx, a["entry"])
        # count, order and types: pointers (.u64) for inputs/outputs, .u32 for int32 extras
        assert [ty for _, ty in params] == [p.ptx_type() for p in kabi.params]
        assert [name for name, _ in params] == [f"{a['entry']}_param_{i}" for i in range(len(params))]
        assert [p[0] for p in a["params"]] == kabi.names()
        assert a["entry_params"] == [p.ptx_type() for p in kabi.params]
        assert a["block"] == [abi.NUM_WARPS * 32, 1, 1]
        assert f".reqntid {abi.NUM_WARPS * 32}" in ptx  # the block the launch rule gives


def test_ptx_assembles_for_its_target_and_matches_the_cubin(abi_build):
    out, manifest = abi_build
    for a in manifest["artifacts"]:
        if a["variant"] != "a16":
            continue
        cubin = assemble((out / a["ptx"]).read_text(), a["target"])
        assert cubin[:4] == b"\x7fELF"
        assert hashlib.sha256(cubin).hexdigest() == a["cubin_sha256"]  # deterministic ptxas


def test_ptxas_refuses_a_target_the_ptx_was_not_built_for(abi_build):
    out, manifest = abi_build
    a = next(a for a in manifest["artifacts"] if a["target"] == "sm_121a")
    with pytest.raises(RuntimeError, match="ptxas -arch=sm_90a failed"):
        assemble((out / a["ptx"]).read_text(), "sm_90a")


def test_manifest_hashes_are_checked_at_load(abi_build, tmp_path):
    out, manifest = abi_build
    for a in manifest["artifacts"]:
        for kind in ("ptx", "cubin"):
            assert hashlib.sha256((out / a[kind]).read_bytes()).hexdigest() == a[f"{kind}_sha256"]
    copy = tmp_path / "m"
    copy.mkdir()
    for f in out.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    victim = manifest["artifacts"][0]["ptx"]
    (copy / victim).write_text((copy / victim).read_text() + "\n// edited\n")
    with pytest.raises(ValueError, match=f"{victim}: SHA-256 differs from manifest.json"):
        load_manifest(copy)


def test_pick_artifact_takes_the_smallest_tile_covering_the_shape(abi_build):
    out, _ = abi_build
    m = json.loads((out / "manifest.json").read_text())
    e = pick_artifact(m, "drafter_row_append", "bf16", "a16", "sm_121a", (2, 200))
    assert e is not None and e["constants"] == {"BLOCK_H": 2, "BLOCK_D": 256}
    assert pick_artifact(m, "drafter_row_append", "bf16", "a16", "sm_121a", (4, 256)) is None
    assert pick_artifact(m, "hidden_row_copy", "fp16", "a16", "sm_121a") is None


# ---- fix_abi on synthetic PTX -------------------------------------------------------------

def _ptx(params: list[str], body: str = "ret;") -> str:
    decl = ",\n".join(f"\t.param {p} k_param_{i}" for i, p in enumerate(params))
    return f".version 8.7\n.target sm_90a\n.visible .entry k(\n{decl}\n)\n.reqntid 128\n{{\n{body}\n}}\n"


TINY = abi.KernelABI("k", (abi.Param("x", "input", "*data"), abi.Param("n", "extra", "i32"),
                           abi.Param("y", "output", "*data")), (("y", "x"),))
PTR = ".u64 .ptr .global .align 1"


def test_fix_abi_drops_unused_trailing_scratch_parameters():
    fixed = fix_abi(_ptx([PTR, ".u32", PTR, PTR, PTR]), "k", TINY)
    assert entry_params(fixed, "k") == [("k_param_0", ".u64"), ("k_param_1", ".u32"),
                                        ("k_param_2", ".u64")]


def test_fix_abi_refuses_a_used_trailing_parameter():
    body = "ld.param.b64 %rd1, [k_param_3];\nret;"
    with pytest.raises(ValueError, match="trailing parameter k_param_3 is used"):
        fix_abi(_ptx([PTR, ".u32", PTR, PTR, PTR], body), "k", TINY)


def test_fix_abi_refuses_types_that_differ_from_the_abi():
    with pytest.raises(ValueError, match=r"parameter types \['.u64', '.u64', '.u64'\] differ"):
        fix_abi(_ptx([PTR, PTR, PTR, PTR, PTR]), "k", TINY)


def test_entry_params_names_a_missing_entry():
    with pytest.raises(ValueError, match="no .entry 'nope' in the PTX"):
        entry_params(_ptx([PTR]), "nope")


def test_builder_cli_bad_target_is_one_error_line_and_exit_2():
    proc = subprocess.run([sys.executable, str(ROOT / "builders" / "build_abi_kernels.py"),
                           "--targets", "sm_80", "--out", "/nonexistent"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "build_abi_kernels: error: target must look like sm_90a, sm_100a or sm_121a, got 'sm_80'")
    assert "Traceback" not in proc.stderr
