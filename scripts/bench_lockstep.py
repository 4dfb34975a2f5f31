"""What the tensor-parallel lockstep costs a warm turn: the carry's agreements, timed on real ranks.

A warm turn of a request the carry tracks makes four agreements (`trtllm/lockstep.py`): its
first sight (carry key and reused depth R), its adoption (the rows each rank can restore),
and at its free the deposit vote and the deposit's placement (`agree_all`). This script runs
exactly those four `Lockstep` calls, one warm turn after another, on N real rank processes
joined over gloo on 127.0.0.1 through the stand-in's `TorchDist` (an object all-gather, as
TensorRT-LLM's under `TLLM_DISABLE_MPI`; MPI's host collectives are not run here), and
prints rank 0's time per warm turn: median and p25-p75 over `--turns` after `--warmup`.

    python scripts/bench_lockstep.py --tp 2 4 --turns 300

It times the collectives alone: no pages are gathered or scattered (their cost is the
single-rank carry's, `scripts/trtllm_standin_bench.py`). Not TensorRT-LLM.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rank(rank: int, tp: int, port: int, warmup: int, turns: int, out: Path) -> None:
    import torch.distributed as dist

    from trtllm_mtp_carry.trtllm.lockstep import Lockstep
    from trtllm_mtp_carry.trtllm.standin.communicator import TorchDist
    from trtllm_mtp_carry.trtllm.standin.mapping import Mapping

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    lockstep = Lockstep(TorchDist(Mapping(world_size=tp, rank=rank, tp_size=tp)), tp, rank)
    times = []
    for i in range(warmup + turns):
        key = 1 + i
        t0 = time.perf_counter()
        lockstep.agree_first_sights([(key, 4096)])   # the batch's new request: key and R
        lockstep.agree_rows([4097])                   # its adoption: rows each rank restores, plus one
        lockstep.agree_deposit(key, 0, 4200)          # its free: the rows each rank gathered
        lockstep.agree_all(True)                      # the deposit placed on every rank
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        q = statistics.quantiles(times, n=4)
        out.write_text(f"{statistics.median(times) * 1e3:.3f} {q[0] * 1e3:.3f} {q[2] * 1e3:.3f} "
                       f"{lockstep.agreements}\n")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="tensor-parallel sizes (default 2 4)")
    p.add_argument("--turns", type=int, default=300, help="timed warm turns (default 300)")
    p.add_argument("--warmup", type=int, default=30, help="untimed warm turns first (default 30)")
    args = p.parse_args()
    for tp in args.tp:
        if tp < 2:
            p.error(f"--tp {tp}: the lockstep runs at 2 ranks or more")
    import tempfile

    import torch.multiprocessing as mp

    from trtllm_mtp_carry.serve.dynamo.launcher import free_port

    print(f"environment: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (gloo, 127.0.0.1)")
    print("| TP | the four agreements of a warm turn, ms (median [p25-p75]) | agreements |")
    print("|---|---|---:|")
    for tp in args.tp:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "rank0.txt"
            mp.start_processes(_rank, args=(tp, free_port(), args.warmup, args.turns, out), nprocs=tp,
                               start_method="spawn")
            med, p25, p75, n = out.read_text().split()
        print(f"| {tp} | {med} [{p25}-{p75}] | {n} |")


if __name__ == "__main__":
    main()
