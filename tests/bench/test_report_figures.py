"""The bench's FIGURE/CHECK lines (`--figures`): drafter prep per policy and over blind's."""

from test_report import turn

from trtllm_mtp_carry.bench.driver import PolicyRun
from trtllm_mtp_carry.bench.report import (
    HOST_TTFT_TARGET,
    PREP_TARGET,
    figure_lines,
    timing_basis_line,
)


def _runs(carry_preps, blind_preps, fp8_preps=None, outputs=(1, 2)):
    runs = [PolicyRun("carry"), PolicyRun("blind")]
    if fp8_preps is not None:
        runs.insert(1, PolicyRun("carry-fp8"))
    preps = {"carry": carry_preps, "blind": blind_preps, "carry-fp8": fp8_preps}
    for run in runs:
        kind = "blind" if run.policy == "blind" else "adopted"
        run.turns.append(turn(0, "s0", 0, 100.0, kind="prefill", prep=50.0))  # cold: left out
        run.turns += [turn(0, "s0", t + 1, 10.0, kind=kind, prep=p,
                           out=outputs if run.policy == "carry" else (1, 2))
                      for t, p in enumerate(preps[run.policy])]
    return runs


def test_carry_prep_over_blind_is_the_median_of_the_paired_ratios_and_passes_at_the_target():
    lines = figure_lines(_runs([2.0, 4.4, 3.0], [2.0, 4.0, 3.0]), 0, identical=True)
    assert lines == [
        "FIGURE\tcarry drafter prep\t3.000 ms [2.500-3.700] over 3 warm turns\t-\tINFO",
        "FIGURE\tblind drafter prep\t3.000 ms [2.500-3.500] over 3 warm turns\t-\tINFO",
        "FIGURE\tcarry drafter prep / blind\t1.000x [1.000-1.050] over 3 paired warm turns (3 adopted)"
        f"\t<= {PREP_TARGET}x\tPASS",
        "CHECK\tbench outputs identical\tPASS\t4 turns compared across carry, blind",
    ]


def test_a_carry_prep_above_the_target_is_a_miss_and_carry_fp8_gets_its_own_line():
    lines = figure_lines(_runs([5.4, 5.4], [4.1, 4.1], fp8_preps=[4.1, 4.5]), 0, identical=False)
    ratio = 5.4 / 4.1
    assert lines[3] == (f"FIGURE\tcarry drafter prep / blind\t{ratio:.3f}x [{ratio:.3f}-{ratio:.3f}] over 2 "
                        f"paired warm turns (2 adopted)\t<= {PREP_TARGET}x\tMISS")
    fp8 = sorted([1.0, 4.5 / 4.1])
    assert lines[4] == (f"FIGURE\tcarry-fp8 drafter prep / blind\t{(fp8[0] + fp8[1]) / 2:.3f}x "
                        f"[{fp8[0] + (fp8[1] - fp8[0]) / 4:.3f}-{fp8[0] + 3 * (fp8[1] - fp8[0]) / 4:.3f}] "
                        f"over 2 paired warm turns (2 adopted)\t<= {PREP_TARGET}x\tPASS")
    assert lines[5] == "CHECK\tbench outputs identical\tFAIL\t3 turns compared across carry, carry-fp8, blind"


def test_without_blind_there_is_no_ratio_and_a_zero_blind_prep_is_named():
    only_carry = figure_lines([_runs([2.0], [1.0])[0]], 0, identical=True)
    assert [line.split("\t")[1] for line in only_carry] == ["carry drafter prep", "bench outputs identical"]
    zero = figure_lines(_runs([2.0], [0.0]), 0, identical=True)
    assert zero[2] == ("FIGURE\tcarry drafter prep / blind\tn/a (blind has drafter_prep_ms at or near zero "
                       f"(<= 0.05) on 1 of 1 turns)\t<= {PREP_TARGET}x\tINFO")


def test_carry_host_ttft_over_carry_is_judged_against_its_own_target():
    runs = _runs([2.0, 2.0], [1.0, 1.0])[:1]  # carry only: no blind, no prep ratio
    host = PolicyRun("carry-host")
    host.turns.append(turn(0, "s0", 0, 100.0, kind="prefill", prep=50.0))
    host.turns += [turn(0, "s0", 1, 10.4, kind="adopted", prep=2.0), turn(0, "s0", 2, 11.0, kind="adopted", prep=2.0)]
    lines = figure_lines(runs + [host], 0, identical=True)
    # carry's warm ttft is 10.0 on both turns (`_runs`): ratios 1.04 and 1.10, median 1.07
    assert lines[2] == (f"FIGURE\tcarry-host ttft / carry\t1.070x [1.055-1.085] over 2 paired warm turns "
                        f"(2 adopted)\t<= {HOST_TTFT_TARGET}x\tMISS")


def test_off_a_gpu_a_ratio_is_not_judged_and_its_target_says_it_is_a_gpus():
    # on a CPU the carry's bookkeeping outweighs blind's: the 1.1x target would read MISS
    lines = figure_lines(_runs([5.4, 5.4], [4.1, 4.1]), 0, identical=True, off_gpu="cpu")
    ratio = 5.4 / 4.1
    assert lines[2] == (f"FIGURE\tcarry drafter prep / blind\t{ratio:.3f}x [{ratio:.3f}-{ratio:.3f}] over 2 "
                        f"paired warm turns (2 adopted)\t<= {PREP_TARGET}x on a GPU, not judged on cpu\tINFO")
    zero = figure_lines(_runs([2.0], [0.0]), 0, identical=True, off_gpu="a server")
    assert zero[2].endswith(f"\t<= {PREP_TARGET}x on a GPU, not judged on a server\tINFO")


def test_the_bench_on_a_cpu_prints_no_miss_with_figures(capsys):
    from trtllm_mtp_carry.cli import main

    assert main(["bench", "--sessions", "1", "--turns", "2", "--history", "300", "--new-span", "16",
                 "--max-new-tokens", "4", "--repeat", "1", "--policies", "carry,blind", "--figures",
                 "--no-progress"]) == 0
    figures = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FIGURE")]
    ratio = [line for line in figures if "/ blind" in line]
    assert len(ratio) == 1 and ratio[0].endswith(f"\t<= {PREP_TARGET}x on a GPU, not judged on cpu\tINFO")
    assert not any(line.endswith("MISS") for line in figures)
    # the CPU engine runs torch ops: no Triton compile to warm, prep on the CPU's clock
    assert figures[-1] == ("FIGURE\tbench timing basis\ttorch ops on cpu (no kernel compiled); drafter "
                           "prep timed with CPU wall time\t-\tINFO")


def test_the_timing_basis_claims_a_warm_up_only_where_this_process_compiles_kernels():
    cuda = "; drafter prep timed with CUDA events on the stream its work runs on\t-\tINFO"
    assert timing_basis_line(None, "triton") == (
        "FIGURE\tbench timing basis\tevery Triton kernel variant compiled at engine start, before any "
        "timed turn" + cuda)
    assert timing_basis_line(None, "aot") == (
        "FIGURE\tbench timing basis\taot kernels, compiled ahead of time" + cuda)
    assert timing_basis_line("a server", "triton") == (
        "FIGURE\tbench timing basis\tthe server's engine warmed its kernels at its start and timed the "
        "drafter prep\t-\tINFO")
