"""Summaries, paired ratios, the tables and the plot of a benchmark run.

Warm turns (a turn after the first of its session) are where the policies
differ; each policy's summary covers them, and its cold first turns are
summarised apart under `cold`. Replays before `first_measured` (the
warm-up) are printed in the per-turn table but left out of every summary.

Figures are medians with their p25-p75 spread; ratios between two policies
are medians of per-turn ratios over paired turns (same replay, session and
turn), see `stats.py`.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import combinations
from typing import Any

from ..core.outcome import OUTCOME_KINDS
from ..core.settings import format_bytes
from .driver import PolicyRun, TurnRecord
from .options import HOST_VARIANT
from .stats import Spread, paired_ratio

REFUSAL_KINDS = tuple(k for k in OUTCOME_KINDS if k not in ("adopted", "fault"))
"""Carry decisions that kept a warm turn from adopting rows (the runtime's counter names); a
`fault` (an exception inside the carry cost the turn its carry) is no refusal: `faults`."""

PAIRED_FIGURES = {"ttft": "ttft_ms", "acceptance": "acceptance", "accepted_per_step": "accepted_per_step",
                  "drafter_prep": "drafter_prep_ms"}


def _figure(stats: dict[str, Any], metric: str) -> float:
    """A turn's `metric`: a stats field, or accepted tokens per verify step (0 without steps)."""
    if metric == "accepted_per_step":
        steps = stats.get("verify_steps") or 0
        return stats.get("accepted", 0) / steps if steps else 0.0
    return float(stats[metric])


def variant_of(a: str, b: str) -> bool:
    """Whether policy `a` is a variant of `b` (`carry-fp8` of `carry`): its ratios are `a / b`."""
    return a.startswith(b + "-")


def _spread(prefix: str, values: Sequence[float]) -> dict[str, float | None]:
    s = Spread.of(values)
    return {f"{prefix}_median": s.median, f"{prefix}_p25": s.p25, f"{prefix}_p75": s.p75}


def summarize(turns: Sequence[TurnRecord], drafts: bool = True) -> dict[str, Any]:
    """Medians (p25-p75) per turn and pooled totals over `turns`.

    `acceptance_*` cover every turn of a policy that `drafts` (a turn whose
    drafter was turned off counts as 0, it is not left out) and are `None`
    for `off`; `acceptance_pooled` is accepted / drafted over all of them.
    """
    s = [t.stats for t in turns]
    drafted = sum(x["drafted"] for x in s)
    accepted = sum(x["accepted"] for x in s)
    steps = sum(x["verify_steps"] for x in s)
    kinds = Counter(x["outcome_kind"] for x in s)
    out: dict[str, Any] = {"turns": len(s)}
    out |= _spread("ttft_ms", [x["ttft_ms"] for x in s])
    out |= _spread("drafter_prep_ms", [x["drafter_prep_ms"] for x in s])
    out |= _spread("acceptance", [x["acceptance"] for x in s] if drafts else [])
    out["drafter_rows_computed_median"] = Spread.of([x["drafter_rows_computed"] for x in s]).median
    out |= _spread("target_computed", [x["prompt_tokens"] - x["reused_tokens"] for x in s])
    out["target_computed_total"] = sum(x["prompt_tokens"] - x["reused_tokens"] for x in s)
    out["recomputed_for_cap_total"] = sum(x.get("recomputed_for_cap", 0) for x in s)
    out["reused_tokens_median"] = Spread.of([x["reused_tokens"] for x in s]).median
    out["prompt_tokens_median"] = Spread.of([x["prompt_tokens"] for x in s]).median
    out["acceptance_pooled"] = accepted / drafted if drafted else None
    out["accepted_per_step"] = accepted / steps if steps else None
    out["output_tokens"] = sum(x["output_tokens"] for x in s)
    out["outcomes"] = dict(sorted(kinds.items()))
    out["adoption_rate"] = kinds.get("adopted", 0) / len(s) if s else None
    out["refusals"] = {k: kinds[k] for k in REFUSAL_KINDS if kinds.get(k)}
    # turns a fault inside the carry cost their carry, at any step (a kind stays admission's)
    out["faults"] = sum(1 for x in s if x.get("fault_step") or x["outcome_kind"] == "fault")
    misses = Counter(x.get("no_carry_reason") or "never_carried" for x in s
                     if x["outcome_kind"] == "no_carry")
    out["no_carry_reasons"] = dict(sorted(misses.items()))  # why no_carry: the session's entry was absent
    # where adopted turns' rows came from: this worker's own deposit, or another worker's (moved by a
    # pull or a drain: Dynamo workers report `rows_source`; every other front end's rows are local)
    sources = Counter(x.get("rows_source") or "local" for x in s if x["outcome_kind"] == "adopted")
    out["adopted_by_source"] = {k: sources.get(k, 0) for k in ("local", "remote")}
    out["sources_reported"] = any("rows_source" in x for x in s)
    return out


def _sum_evictions(runtimes: Sequence[dict[str, Any]]) -> dict[str, int]:
    """The runtime's `evictions` (carried entries that left unadopted, by cause), summed."""
    total: dict[str, int] = {}
    for d in runtimes:
        for cause, n in (d.get("evictions") or {}).items():
            total[cause] = total.get(cause, 0) + n
    return total


HOST_TIER_FIELDS = ("carry_host_memory_bytes", "hits_device", "hits_host", "demotions", "host_deposits",
                    "bytes_demoted",
                    "bytes_restored", "peak_device_bytes", "peak_host_bytes", "demote_ms", "restore_ms",
                    "restore_wait_ms")
"""`CarryStats` fields of the host tier the bench reports (peaks and the budget: the most over the
replays; the rest summed)."""

PAIRED_PEAKS = ("blocks_peak", "pool_blocks")
"""`PairedStats` fields that are levels (the most over the replays), not counts to sum."""


def _memory(runtimes: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pool sizes and the most blocks held over the measured replays (each replay is a fresh
    engine), and the `paired` policy's counters summed over them (`paired`, where it ran)."""
    out: dict[str, Any] = {}
    for name in ("drafter_blocks_peak", "target_blocks_peak", "drafter_blocks", "target_blocks"):
        values = [d[name] for d in runtimes if d.get(name) is not None]
        out[name] = max(values) if values else None
    shares = [d for d in runtimes if d.get("carry_share") and d.get("policy") == "carry"]
    if shares:  # common-prefix blocks shared between carried entries (CarryStats)
        out["carry_share"] = {
            "share_merges": sum(d.get("share_merges", 0) for d in shares),
            "share_mismatches": sum(d.get("share_mismatches", 0) for d in shares),
            "shared_blocks": max(d.get("shared_blocks", 0) for d in shares),
            "share_ms": sum(d.get("share_ms", 0.0) for d in shares),
            "deposits": sum(d.get("deposits", 0) for d in shares),
        }
    hosts = [d for d in runtimes if d.get("carry_host_memory_bytes") and d.get("policy") == "carry"]
    if hosts:  # the carry store's host tier (CarryStats): hits per tier, bytes and copy time
        out["host_tier"] = {k: (max if k.startswith("peak_") or k == "carry_host_memory_bytes" else sum)(
            d.get(k, 0) for d in hosts) for k in HOST_TIER_FIELDS}
    packs = [d for d in runtimes if d.get("pack_ms_each") or d.get("unpack_ms_each")]
    if packs:  # packed rows (fp8, nvfp4): each deposit packed, each adoption unpacked (wall ms)
        out["row_format"] = {"row_dtype": packs[-1].get("row_dtype"), "bytes_held_peak": max(
            d.get("peak_device_bytes", 0) for d in packs)}
        for what in ("pack", "unpack"):
            times = [x for d in packs for x in d.get(f"{what}_ms_each", [])]
            out["row_format"] |= {f"{what}s": len(times)} | _spread(f"{what}_ms", times)
    paired = [d["paired"] for d in runtimes if d.get("paired")]
    if paired:
        out["paired"] = {k: (max if k in PAIRED_PEAKS else sum)(p[k] for p in paired)
                         for k in paired[0] if k not in ("tree_blocks", "blocks_held")}
    return out


def measured(run: PolicyRun, first_measured: int) -> list[TurnRecord]:
    """The turns the summary covers: every replay from `first_measured` on."""
    return [t for t in run.turns if t.replay >= first_measured]


def summary_scope(runs: Sequence[PolicyRun], first_measured: int, repeat: int, per_replay: int,
                  partial: bool) -> str:
    """What the summary covers, for its header: `replays 1..4, warm-up replay 0 excluded` for a
    whole run; after Ctrl-C (`partial`) what really ran, counted in the per-turn table's rows
    (one per turn and policy, `per_replay` of them a replay): the whole replays and how many
    rows of the one interrupted, so a run stopped early in replay 1 never reads `replays 1..4`."""
    excluded = ", warm-up replay 0 excluded" if first_measured == 1 else ""
    if not partial:
        return f"replays {first_measured}..{repeat - 1}{excluded}"
    replays = [t.replay for r in runs for t in r.turns if t.replay >= first_measured]
    if not replays:
        return "partial: interrupted before any turn finished"
    last = max(replays)
    rows = replays.count(last)
    if first_measured == 0 and repeat > 1:  # stopped in the warm-up: it is all there is
        return (f"partial: interrupted in the warm-up, replay 0, after {rows} of its {per_replay} rows; "
                "those are summarised, nothing after them ran")
    end = last if rows >= per_replay else last - 1
    ran = [] if end < first_measured else [
        f"replay {end} whole" if end == first_measured else f"replays {first_measured}..{end} whole"]
    if rows < per_replay:
        ran.append(f"{rows} of the {per_replay} rows of replay {last}")
    return f"partial: interrupted; ran {' and '.join(ran)}{excluded}"


def warm_stats(run: PolicyRun, first_measured: int) -> dict[tuple[int, str, int], dict[str, Any]]:
    """The measured warm turns' stats by turn key (what paired ratios pair)."""
    return {t.key: t.stats for t in measured(run, first_measured) if t.turn > 0}


def policy_summary(run: PolicyRun, first_measured: int) -> dict[str, Any]:
    """One policy's block: warm-turn figures at the top, `cold`, throughput and evictions.

    `output_tokens_per_s` is every measured turn's output over the engine's
    busy time (submit + step) in those replays: the aggregate rate at the
    run's concurrency. `evictions` sums the runtime's evictions by cause
    (`CarryStats.evictions`) over the measured replays.
    """
    turns = measured(run, first_measured)
    drafts = run.policy != "off"
    out = summarize([t for t in turns if t.turn > 0], drafts)
    out["policy"] = run.policy
    out["cold"] = summarize([t for t in turns if t.turn == 0], drafts)
    busy = sum(s for r, s in run.busy_s.items() if r >= first_measured)
    tokens = sum(t.stats["output_tokens"] for t in turns)
    out["output_tokens_per_s"] = tokens / busy if busy > 0 else None
    runtimes = [d for r, d in sorted(run.runtime.items()) if r >= first_measured]
    out["evictions"] = _sum_evictions(runtimes)
    out |= _memory(runtimes)
    if runtimes:
        out["carry_armed"] = runtimes[-1].get("armed")
    return out


def paired(runs: Sequence[PolicyRun], first_measured: int) -> dict[str, dict[str, Any]]:
    """For each pair of policies `a/b` (in run order, except that a variant comes over its base:
    `carry-fp8/carry`), median and p25-p75 of per-turn `a / b` over the warm turns both
    completed; `None` with a reason in `null_reasons` where `b` was near zero. For a variant,
    `adopted_where_base_adopted` counts the warm turns it adopted of those its base adopted
    (`base_adopted`)."""
    warm = [warm_stats(r, first_measured) for r in runs]
    out: dict[str, dict[str, Any]] = {}
    for (i, a), (j, b) in combinations(enumerate(runs), 2):
        if variant_of(b.policy, a.policy):
            (i, a), (j, b) = (j, b), (i, a)
        keys = sorted(warm[i].keys() & warm[j].keys())
        entry: dict[str, Any] = {"pairs": len(keys)}
        reasons: dict[str, str] = {}
        if variant_of(a.policy, b.policy):
            base = [k for k in keys if warm[j][k]["outcome_kind"] == "adopted"]
            entry["base_adopted"] = len(base)
            entry["adopted_where_base_adopted"] = sum(warm[i][k]["outcome_kind"] == "adopted" for k in base)
        for name, metric in PAIRED_FIGURES.items():
            r = paired_ratio([_figure(warm[i][k], metric) for k in keys],
                             [_figure(warm[j][k], metric) for k in keys], metric, b.policy)
            entry[f"{name}_paired_median"] = r.spread.median
            entry[f"{name}_paired_p25"] = r.spread.p25
            entry[f"{name}_paired_p75"] = r.spread.p75
            if r.reason is not None:
                reasons[f"{name}_paired_median"] = r.reason
        entry["null_reasons"] = reasons
        out[f"{a.policy}/{b.policy}"] = entry
    return out


def outputs_identical(runs: Sequence[PolicyRun]) -> bool:
    """Whether every policy generated the same tokens for every turn they all completed."""
    keyed = [{t.key: t.output for t in run.turns} for run in runs]
    common = set.intersection(*(set(k) for k in keyed)) if keyed else set()
    return all(k[key] == keyed[0][key] for k in keyed[1:] for key in common)


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _policy_width(names: Iterable[str]) -> int:
    """The policy column's width: 8, or the longest name (`carry-fp8`)."""
    return max([8, *(len(n) for n in names)])


def _natural(name: str) -> tuple[tuple[int, str], ...]:
    """Sort key putting `s2` before `s10`."""
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"(\d+)", name) if p)


def turn_table(runs: Sequence[PolicyRun], first_measured: int) -> str:
    """One line per turn and policy, paired turns together; warm-up replays are marked `w`."""
    w = _policy_width(r.policy for r in runs)
    head = (f"{'rep':>4} {'sess':<6} {'turn':>4} {'policy':<{w}} {'prompt':>7} {'reused':>7} "
            f"{'rows':>6} {'prep ms':>8} {'ttft ms':>8} {'acc':>5}  outcome")
    lines = [head, "-" * len(head)]
    order = {r.policy: i for i, r in enumerate(runs)}
    rows = sorted(((t, run.policy) for run in runs for t in run.turns),
                  key=lambda x: (x[0].replay, _natural(x[0].session), x[0].turn, order[x[1]]))
    for t, policy in rows:
        s = t.stats
        rep = f"{t.replay}{'w' if t.replay < first_measured else ''}"
        acc = f"{s['acceptance']:>5.2f}" if s["drafted"] else f"{'-':>5}"
        lines.append(
            f"{rep:>4} {t.session:<6} {t.turn:>4} {policy:<{w}} {s['prompt_tokens']:>7} "
            f"{s['reused_tokens']:>7} {s['drafter_rows_computed']:>6} "
            f"{s['drafter_prep_ms']:>8.1f} {s['ttft_ms']:>8.1f} {acc}  {s['outcome']}"
        )
    return "\n".join(lines)


def _mid(s: dict[str, Any], prefix: str, fmt: str) -> str:
    return (f"{_f(s[f'{prefix}_median'], fmt)} "
            f"[{_f(s[f'{prefix}_p25'], fmt)}-{_f(s[f'{prefix}_p75'], fmt)}]")


def summary_table(summary: dict[str, dict[str, Any]]) -> str:
    """Warm-turn medians [p25-p75] per policy, then refusals and evictions where there were any."""
    w = _policy_width(summary)
    head = (f"{'policy':<{w}} {'turns':>5} {'warm TTFT ms':>22} {'drafter prep ms':>20} "
            f"{'rows':>6} {'acceptance':>19} {'adopted':>7} {'tok/s':>7}  outcomes")
    lines = [head, "-" * len(head)]
    notes = []
    for policy, s in summary.items():
        if not s.get("turns"):
            lines.append(f"{policy:<{w}} {0:>5}  (no warm turns measured)")
            continue
        outcomes = " ".join(f"{k}={v}" for k, v in s["outcomes"].items())
        adopted = _f(None if s["adoption_rate"] is None else 100 * s["adoption_rate"], ".0f")
        lines.append(
            f"{policy:<{w}} {s['turns']:>5} {_mid(s, 'ttft_ms', '.1f'):>22} "
            f"{_mid(s, 'drafter_prep_ms', '.1f'):>20} {_f(s['drafter_rows_computed_median'], '.0f'):>6} "
            f"{_mid(s, 'acceptance', '.3f'):>19} {adopted + '%':>7} "
            f"{_f(s['output_tokens_per_s'], '.1f'):>7}  {outcomes}"
        )
        if policy == "carry" and s.get("carry_armed") is False:
            notes.append("carry: not armed in this run (see `trtllm-mtp-carry info`): "
                         "its warm turns ran without carried rows")
        if s["refusals"]:
            notes.append(f"{policy}: refusals " + " ".join(f"{k}={v}" for k, v in s["refusals"].items()))
        if s.get("faults"):
            notes.append(f"{policy}: faults {s['faults']} (turns a fault inside the carry ran without it)")
        if s.get("sources_reported"):
            notes.append(f"{policy}: adopted by source " + " ".join(
                f"{k}={v}" for k, v in s["adopted_by_source"].items()))
        if s.get("no_carry_reasons"):
            notes.append(f"{policy}: no_carry by reason "
                         + " ".join(f"{k}={v}" for k, v in s["no_carry_reasons"].items()))
        flat = " ".join(f"{k}={v}" for k, v in s["evictions"].items() if v)
        if flat:
            notes.append(f"{policy}: evictions {flat}")
    return "\n".join(lines + notes)


def reuse_table(summary: dict[str, dict[str, Any]]) -> str:
    """Per policy on warm turns: target tokens the prefill computed (median [p25-p75] and
    total; where `paired` ran, `recomputed for cap`: of those, the ones its resume recomputed
    because the drafter tree capped it, a column only `paired` fills, so shown only with it),
    the most drafter and target blocks held; then the `carry` sharing line and the `paired`
    counters."""
    w = _policy_width(summary)
    capped = "paired" in summary
    cap_head = f" {'recomputed for cap':>18}" if capped else ""
    head = (f"{'policy':<{w}} {'target tokens computed':>24} {'total':>8}{cap_head} "
            f"{'drafter blocks peak':>20} {'target blocks peak':>19}")
    lines = [head, "-" * len(head)]
    notes = []
    for policy, s in summary.items():
        if not s.get("turns"):
            continue
        d_peak, d_all = s.get("drafter_blocks_peak"), s.get("drafter_blocks")
        t_peak, t_all = s.get("target_blocks_peak"), s.get("target_blocks")
        drafter = "-" if d_peak is None else f"{d_peak} of {d_all}"
        target = "-" if t_peak is None else f"{t_peak} of {t_all}"
        lines.append(f"{policy:<{w}} {_mid(s, 'target_computed', '.0f'):>24} "
                     f"{s['target_computed_total']:>8}"
                     + (f" {s['recomputed_for_cap_total']:>18}" if capped else "")
                     + f" {drafter:>20} {target:>19}")
        sh = s.get("carry_share")
        if sh and policy == "carry":
            # printed only with sharing on; the flag named is how to turn it off, not its state
            notes.append(
                f"{policy}: common-prefix block sharing on (--carry-share off gives each entry its "
                f"own copy): blocks merged into equal ones other entries hold {sh['share_merges']} "
                f"(bytes differed: {sh['share_mismatches']}), held by two or more entries at the end "
                f"{sh['shared_blocks']}, sharing took {sh['share_ms']:.1f} ms over {sh['deposits']} deposits")
        h = s.get("host_tier")
        if h and policy.startswith("carry"):  # carry-host (and any carry variant with a host tier)
            restores = h["hits_host"]
            notes.append(
                f"{policy}: host tier of {format_bytes(h['carry_host_memory_bytes'])}: adopted from device "
                f"{h['hits_device']}, from host {restores}; demoted {h['demotions']}, refused "
                f"deposits kept there {h.get('host_deposits', 0)} "
                f"({format_bytes(h['bytes_demoted'])}, {h['demote_ms']:.1f} ms), restored "
                f"{format_bytes(h['bytes_restored'])} in {h['restore_ms']:.1f} ms"
                + (f" ({h['restore_ms'] / restores:.2f} ms per restored turn)" if restores else "")
                + f", GPU wait {h['restore_wait_ms']:.1f} ms; peak device {format_bytes(h['peak_device_bytes'])}, "
                f"host {format_bytes(h['peak_host_bytes'])}")
        rf = s.get("row_format")
        if rf:
            notes.append(
                f"{policy}: rows stored {rf['row_dtype']}: {rf['packs']} deposits packed, "
                f"{_mid(rf, 'pack_ms', '.3f')} ms each; {rf['unpacks']} adoptions unpacked, "
                f"{_mid(rf, 'unpack_ms', '.3f')} ms each (median [p25-p75])")
        p = s.get("paired")
        if p:
            notes.append(
                f"{policy}: drafter tree hits {p['tree_hits']} of {p['warm_turns']} warm turns "
                f"({p['rows_from_tree']} rows), depth the tree lacked {p['depth_lost']}, target "
                f"tokens recomputed for the cap {p['tokens_recomputed_for_cap']}, tree evictions "
                f"{p['tree_evictions']}, blocks published {p['blocks_published']}")
    return "\n".join(lines + notes)


def ratio_lines(ratios: dict[str, dict[str, Any]]) -> list[str]:
    """The headline: paired medians [p25-p75] of TTFT and acceptance for each pair
    (drafter prep too where it has one); `n/a` with the reason where null."""
    lines = []
    for name, r in ratios.items():
        parts = []
        for fig in PAIRED_FIGURES:
            key = f"{fig}_paired_median"
            if r[key] is not None:
                parts.append(f"{fig} x{r[key]:#.3g} [{r[f'{fig}_paired_p25']:#.3g}-"
                             f"{r[f'{fig}_paired_p75']:#.3g}]")
            elif fig != "drafter_prep":
                parts.append(f"{fig} n/a ({r['null_reasons'].get(key, 'no pairs')})")
        if "base_adopted" in r:
            parts.append(f"adopted {r['adopted_where_base_adopted']} of the {r['base_adopted']} warm turns "
                         f"{name.split('/')[1]} adopted")
        lines.append(f"{name} ({r['pairs']} paired warm turns): " + ", ".join(parts))
    return lines


def plot(runs: Sequence[PolicyRun], path: str, first_measured: int) -> None:
    """Time to first token per measured turn, one series per policy; cold turns hollow,
    warm filled; each policy has its own marker and a small x offset so coinciding
    series stay visible (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'trtllm-mtp-carry[plot]'") from None
    markers = "osD^vP*X"
    keys = sorted({t.key for run in runs for t in measured(run, first_measured)})
    x_of = {k: i for i, k in enumerate(keys)}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(keys) + 2), 4.5))
    width = 0.5 / max(1, len(runs))
    for n, run in enumerate(runs):
        turns = sorted(measured(run, first_measured), key=lambda t: t.key)
        if not turns:
            continue
        offset = (n - (len(runs) - 1) / 2) * width
        xs = [x_of[t.key] + offset for t in turns]
        ys = [t.stats["ttft_ms"] for t in turns]
        marker = markers[n % len(markers)]
        line = ax.plot(xs, ys, linestyle=":", linewidth=1, marker=marker, markersize=0,
                       label=run.policy)[0]
        color = line.get_color()
        warm = [i for i, t in enumerate(turns) if t.turn > 0]
        cold = [i for i, t in enumerate(turns) if t.turn == 0]
        ax.scatter([xs[i] for i in warm], [ys[i] for i in warm], marker=marker, color=color, zorder=3)
        ax.scatter([xs[i] for i in cold], [ys[i] for i in cold], marker=marker, facecolors="none",
                   edgecolors=color, zorder=3)
    ax.set_xticks(range(len(keys)), [f"r{r} {s}/{t}" for r, s, t in keys], rotation=60, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (ms, log)")
    ax.set_xlabel("replay session/turn (hollow: cold first turn, filled: warm)")
    ax.set_title("Time to first token per turn, by drafter policy")
    ax.legend(handles=[plt.Line2D([], [], color=h.get_color(), marker=h.get_marker(), linestyle=":")
                       for h in ax.get_lines()], labels=[r.policy for r in runs if measured(r, first_measured)])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PREP_TARGET = 1.1
"""The carry's drafter prep over blind's for the same warm turns, at most (median of the paired
ratios): the carry adds adoption bookkeeping, never work that grows with the history."""

HOST_TTFT_TARGET = 1.05
"""`carry-host`'s warm TTFT over `carry`'s for the same turns, at most: a copy back from the host
tier overlaps the prefill, so adopting from host memory costs about what adopting on device does."""

TARGETS = (
    ("carry", "blind", "drafter_prep_ms", "drafter prep", PREP_TARGET),
    ("carry-fp8", "blind", "drafter_prep_ms", "drafter prep", PREP_TARGET),
    (HOST_VARIANT, "carry", "ttft_ms", "ttft", HOST_TTFT_TARGET),
)
"""(numerator, denominator, per-turn stat, label, target): the paired ratios `figure_lines` judges."""


def timing_basis_line(off_gpu: str | None, kernels: str) -> str:
    """What the prep figures mean, as a `FIGURE` INFO line: whether a kernel compile can fall
    inside a timed turn and which clock timed the prep. `off_gpu` as `figure_lines` takes it
    (None: this process ran the engine on CUDA); `kernels`: `ops.cuda_kernels()`. Only an
    in-process CUDA engine with the Triton backend compiles (every variant at engine start,
    `dataplane.warm`); the CPU runs torch ops, a server times its own prep."""
    if off_gpu == "a server":
        basis = "the server's engine warmed its kernels at its start and timed the drafter prep"
    elif off_gpu is not None:
        basis = f"torch ops on {off_gpu} (no kernel compiled); drafter prep timed with CPU wall time"
    else:
        warm = ("every Triton kernel variant compiled at engine start, before any timed turn"
                if kernels == "triton" else f"{kernels} kernels, compiled ahead of time")
        basis = f"{warm}; drafter prep timed with CUDA events on the stream its work runs on"
    return f"FIGURE\tbench timing basis\t{basis}\t-\tINFO"


def figure_lines(runs: Sequence[PolicyRun], first_measured: int, identical: bool,
                 off_gpu: str | None = None) -> list[str]:
    """The run's headline figures and its check as `FIGURE`/`CHECK` lines (tab-separated; the
    GPU smoke script collects them): each policy's warm-turn drafter prep (median [p25-p75],
    INFO), each `TARGETS` ratio whose two policies ran (median of the paired per-turn ratios
    [p25-p75], PASS at most its target, else MISS), and whether the outputs agree.

    The targets are a GPU's: with `off_gpu` (where the run was, e.g. `cpu`) a ratio is not
    judged, INFO, and its target says so (`<= 1.1x on a GPU, not judged on cpu`), as the
    GPU scripts' CPU figures are, so a CPU run never prints an expected MISS."""
    lines = []
    by_name = {r.policy: r for r in runs}
    for r in runs:
        s = Spread.of([x["drafter_prep_ms"] for x in warm_stats(r, first_measured).values()])
        if s.median is not None and s.p25 is not None and s.p75 is not None:
            lines.append(f"FIGURE\t{r.policy} drafter prep\t{s.median:.3f} ms [{s.p25:.3f}-{s.p75:.3f}] "
                         f"over {s.n} warm turns\t-\tINFO")
    for name, base, stat, label, target in TARGETS:
        if name not in by_name or base not in by_name:
            continue
        a, b = warm_stats(by_name[name], first_measured), warm_stats(by_name[base], first_measured)
        keys = sorted(a.keys() & b.keys())
        ratio = paired_ratio([a[k][stat] for k in keys], [b[k][stat] for k in keys], stat, base)
        s = ratio.spread
        title = f"{name} {label} / {base}"
        goal = f"<= {target}x" if off_gpu is None else f"<= {target}x on a GPU, not judged on {off_gpu}"
        if s.median is None:
            lines.append(f"FIGURE\t{title}\tn/a ({ratio.reason})\t{goal}\tINFO")
            continue
        adopted = sum(a[k]["outcome_kind"] == "adopted" for k in keys)
        verdict = "INFO" if off_gpu is not None else "PASS" if s.median <= target else "MISS"
        assert s.p25 is not None and s.p75 is not None
        lines.append(f"FIGURE\t{title}\t{s.median:.3f}x [{s.p25:.3f}-{s.p75:.3f}] over "
                     f"{s.n} paired warm turns ({adopted} adopted)\t{goal}\t{verdict}")
    turns = len(set.intersection(*({t.key for t in r.turns} for r in runs))) if runs else 0
    lines.append(f"CHECK\tbench outputs identical\t{'PASS' if identical else 'FAIL'}\t"
                 f"{turns} turns compared across {', '.join(r.policy for r in runs)}")
    return lines
