"""Summaries, ratios, the per-turn table, JSON and the plot of a benchmark run.

Warm turns (a turn after the first of its session) are where the policies
differ; the summary covers them, and the cold first turns are reported apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from statistics import mean
from typing import Any

from .replay import PolicyRun, TurnRecord


def summarize(turns: Sequence[TurnRecord]) -> dict[str, Any]:
    """Means and totals over `turns` (empty turns give zeros)."""
    if not turns:
        return {"turns": 0}
    s = [t.stats for t in turns]
    drafted = sum(x["drafted"] for x in s)
    accepted = sum(x["accepted"] for x in s)
    steps = sum(x["verify_steps"] for x in s)
    out_tokens = sum(x["output_tokens"] for x in s)
    busy_ms = sum(x["ttft_ms"] + x["decode_ms"] for x in s)
    return {
        "turns": len(s),
        "prompt_tokens": mean(x["prompt_tokens"] for x in s),
        "reused_tokens": mean(x["reused_tokens"] for x in s),
        "ttft_ms": mean(x["ttft_ms"] for x in s),
        "drafter_prep_ms": mean(x["drafter_prep_ms"] for x in s),
        "drafter_rows_computed": mean(x["drafter_rows_computed"] for x in s),
        "acceptance": accepted / drafted if drafted else 0.0,
        "accepted_per_step": accepted / steps if steps else 0.0,
        "tokens_per_s": out_tokens / (busy_ms / 1e3) if busy_ms else 0.0,
        "outcomes": dict(Counter(x["outcome_kind"] for x in s)),
    }


def summaries(run: PolicyRun) -> dict[str, Any]:
    """`{"warm": ..., "cold": ...}` summaries of one policy's run."""
    return {
        "warm": summarize([t for t in run.turns if t.turn > 0]),
        "cold": summarize([t for t in run.turns if t.turn == 0]),
    }


RATIO_KEYS = ("ttft_ms", "drafter_prep_ms", "drafter_rows_computed", "acceptance",
              "accepted_per_step", "tokens_per_s")


def ratios(summary: dict[str, dict[str, Any]], a: str, b: str) -> dict[str, float | None]:
    """`a / b` of each warm-turn figure, `None` where `b` is zero or a policy is missing."""
    if a not in summary or b not in summary:
        return {}
    wa, wb = summary[a]["warm"], summary[b]["warm"]
    return {k: (wa[k] / wb[k] if wb.get(k) else None) for k in RATIO_KEYS if k in wa}


def outputs_identical(runs: Sequence[PolicyRun]) -> bool:
    """Whether every policy generated the same tokens for every (session, turn)."""
    keyed = [{(t.session, t.turn): t.output for t in run.turns} for run in runs]
    return all(k == keyed[0] for k in keyed[1:])


def turn_table(runs: Sequence[PolicyRun]) -> str:
    """One line per turn and policy."""
    head = (f"{'policy':<8} {'sess':<5} {'turn':>4} {'prompt':>7} {'reused':>7} {'rows':>6} "
            f"{'prep ms':>8} {'ttft ms':>8} {'acc':>5}  outcome")
    lines = [head, "-" * len(head)]
    for run in runs:
        for t in sorted(run.turns, key=lambda t: (t.session, t.turn)):
            s = t.stats
            lines.append(
                f"{run.policy:<8} {t.session:<5} {t.turn:>4} {s['prompt_tokens']:>7} "
                f"{s['reused_tokens']:>7} {s['drafter_rows_computed']:>6} "
                f"{s['drafter_prep_ms']:>8.1f} {s['ttft_ms']:>8.1f} {s['acceptance']:>5.2f}  "
                f"{s['outcome']}"
            )
    return "\n".join(lines)


def summary_table(summary: dict[str, dict[str, Any]]) -> str:
    """Warm-turn summary per policy, and the carry ratios."""
    head = (f"{'policy':<8} {'warm ttft ms':>12} {'prep ms':>8} {'rows':>7} {'accept':>7} "
            f"{'acc/step':>8} {'tok/s':>7}  outcomes")
    lines = ["warm turns", head, "-" * len(head)]
    for policy, s in summary.items():
        w = s["warm"]
        if not w.get("turns"):
            continue
        outcomes = " ".join(f"{k}={v}" for k, v in sorted(w["outcomes"].items()))
        lines.append(
            f"{policy:<8} {w['ttft_ms']:>12.1f} {w['drafter_prep_ms']:>8.1f} "
            f"{w['drafter_rows_computed']:>7.0f} {w['acceptance']:>7.3f} "
            f"{w['accepted_per_step']:>8.2f} {w['tokens_per_s']:>7.1f}  {outcomes}"
        )
    for other in ("rebuild", "blind"):
        r = ratios(summary, "carry", other)
        if r:
            parts = [f"{k}={v:.3f}" if v is not None else f"{k}=n/a" for k, v in r.items()]
            lines.append(f"carry/{other}: " + " ".join(parts))
    return "\n".join(lines)


def plot(runs: Sequence[PolicyRun], path: str) -> None:
    """Per-turn drafter preparation time and acceptance, one line per policy (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'trtllm-mtp-carry[plot]'"
        ) from None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for run in runs:
        turns = sorted(run.turns, key=lambda t: (t.session, t.turn))
        labels = [f"{t.session}/{t.turn}" for t in turns]
        ax1.plot(labels, [t.stats["drafter_prep_ms"] for t in turns], marker="o", label=run.policy)
        ax2.plot(labels, [t.stats["acceptance"] for t in turns], marker="o", label=run.policy)
    ax1.set_ylabel("drafter prep (ms)")
    ax1.set_yscale("symlog")
    ax2.set_ylabel("acceptance")
    ax2.set_xlabel("session / turn")
    ax1.legend()
    ax1.set_title("MTP drafter context: carry vs rebuild vs blind")
    for label in ax2.get_xticklabels():
        label.set_rotation(60)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
