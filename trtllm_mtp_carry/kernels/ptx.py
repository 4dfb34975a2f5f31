"""PTX text tools: read an `.entry` parameter list, fix Triton's PTX to TensorRT's ABI, assemble.

What it is for: Triton (>= 3.3) appends two scratch-pointer parameters (global
and profile scratch) to every kernel it compiles; TensorRT's AOT plugins pass
exactly the inputs, int32 extras and outputs. `fix_abi` removes the trailing
scratch parameters, and refuses (ValueError) unless the kernel body never
references them and the remaining list matches the declared ABI, so a fixed
PTX is launchable by TensorRT as is. `assemble` runs a `ptxas` (Triton's wheel
ships `ptxas-blackwell`, CUDA 13.1) to prove the text is valid for a target and
to produce the cubin. No torch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .abi import KernelABI

__all__ = ["assemble", "entry_params", "find_ptxas", "fix_abi"]

_ENTRY = r"\.entry\s+{name}\s*\((?P<params>[^)]*)\)"
_PARAM = re.compile(r"\.param\s+(?P<ty>\.[us]\d+|\.b\d+)(?:\s+\.ptr[^,]*?)?\s+(?P<name>[\w$]+)\s*$")


def entry_params(ptx: str, entry: str) -> list[tuple[str, str]]:
    """`[(param_name, ptx_type)]` of `.entry entry(...)` in order; ValueError if absent."""
    m = re.search(_ENTRY.format(name=re.escape(entry)), ptx)
    if not m:
        raise ValueError(f"no .entry {entry!r} in the PTX")
    out = []
    for raw in m.group("params").split(","):
        raw = " ".join(raw.split())
        if not raw:
            continue
        pm = _PARAM.search(raw)
        if not pm:
            raise ValueError(f".entry {entry}: cannot parse parameter {raw!r}")
        out.append((pm.group("name"), pm.group("ty")))
    return out


def fix_abi(ptx: str, entry: str, abi: KernelABI) -> str:
    """Return `ptx` with Triton's trailing unused parameters removed, matching `abi` exactly.

    Raises ValueError when the parameter types differ from the ABI or when a removed
    parameter is referenced in the body (the kernel would need scratch memory).
    """
    params = entry_params(ptx, entry)
    want = [p.ptx_type() for p in abi.params]
    extra = params[len(want):]
    got = [ty for _, ty in params[: len(want)]]
    if got != want:
        raise ValueError(f"{entry}: parameter types {got} differ from the ABI's {want}")
    m = re.search(_ENTRY.format(name=re.escape(entry)), ptx)
    assert m is not None
    body = ptx[m.end():]
    for name, _ in extra:
        if re.search(rf"\[{re.escape(name)}\]|\b{re.escape(name)}\b", body):
            raise ValueError(f"{entry}: trailing parameter {name} is used by the kernel body")
    lines = [f"\t.param {ty} {'.ptr .global .align 1 ' if ty == '.u64' else ''}{name}"
             for name, ty in params[: len(want)]]
    header = f".entry {entry}(\n" + ",\n".join(lines) + "\n)"
    return ptx[: m.start()] + header + ptx[m.end():]


def find_ptxas() -> Path:
    """A `ptxas` that knows sm_90a, sm_100a and sm_121a: `$TRTLLM_MTP_CARRY_PTXAS`, else Triton's.

    Raises FileNotFoundError naming what was tried.
    """
    env = os.environ.get("TRTLLM_MTP_CARRY_PTXAS")
    tried = []
    if env:
        return Path(env)
    try:
        import triton

        bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        for name in ("ptxas-blackwell", "ptxas"):
            tried.append(str(bin_dir / name))
            if (bin_dir / name).exists():
                return bin_dir / name
    except ImportError:
        tried.append("triton (not installed)")
    which = shutil.which("ptxas")
    if which:
        return Path(which)
    raise FileNotFoundError(f"no ptxas found (tried {tried} and PATH); set TRTLLM_MTP_CARRY_PTXAS")


def assemble(ptx: str, target: str, ptxas: Path | None = None) -> bytes:
    """Assemble `ptx` for `target` (`sm_121a`...) with ptxas; return the cubin bytes.

    Raises RuntimeError with ptxas's message when it refuses the PTX.
    """
    exe = ptxas or find_ptxas()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        proc = subprocess.run([str(exe), f"-arch={target}", str(src), "-o", str(out)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"ptxas -arch={target} failed: {proc.stderr.strip()[-2000:]}")
        return out.read_bytes()
