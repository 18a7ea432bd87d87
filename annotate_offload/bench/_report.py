"""Markdown tables and the PNG chart of the activation benchmark (ratios first, ms as context)."""

from __future__ import annotations

import math

from annotate_offload.bench._timing import GiB
from annotate_offload.bench._workloads import W1_FLOOR_RATIO, W1_TRL_SPEEDUP, W2_BASELINE_RATIO

__all__ = ["format_report", "targets", "write_png"]


def _gib(nbytes) -> str:
    """Bytes as ``"8.61 GiB"``, or ``"12.3 MiB"`` below 0.1 GiB (tiny runs)."""
    if nbytes is None:
        return "-"
    if abs(nbytes) < 0.1 * GiB:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / GiB:.2f} GiB"


def _x(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}x"


def _ms(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


# Note [W2's memory limit]: issue 7 asks W2 to save at least 0.9 x 2/8 of the baseline's activation
# memory (peak minus start), assuming the two offloaded layers hold 2/8 of it. On the H200 that is
# 0.9 x 2/8 x 8.89 = 2.00 GiB, but the two layers save 2.00 GiB in all (saved-tensor hook count):
# the baseline's peak also holds ~0.9 GiB of backward transients that no saved-tensor offload
# removes. Of those 2.00 GiB, 64 MiB is the workload's input, which the caller holds through the
# step, so offloading it frees nothing. The reachable limit is the hook count minus that input;
# the bench applies the issue's own 0.9 to it and prints it as the limit line after a failed
# literal line (benchmarks/NOTES.md, "W2's memory target is at the physical limit").
def targets(report) -> list:
    """Issue-7 targets for the report's workload as ``(text, passed)``; ``passed`` is ``None``
    when it cannot be judged (``--tiny``, or a row missing)."""
    w, best, base = report.workload, report.best_ours, report.baseline
    if report.tiny:
        return [(f"{w.target} (not judged: --tiny has no timing claims)", None)]
    if best is None:
        return [(f"{w.target} (not judged: no annotate_offload row ran)", None)]
    out = []
    if w.name == "W1":
        r = best.times.step / report.floor_ms
        out.append((f"step <= {W1_FLOOR_RATIO:.2f} x copy floor: {r:.2f}x ({best.name})", r <= W1_FLOOR_RATIO))
        trl = report.peer("OffloadActivations")
        if trl is None:
            out.append(("vs TRL OffloadActivations: not judged (not importable)", None))
        else:
            speed = trl.times.step / best.times.step
            out.append((f">= {W1_TRL_SPEEDUP}x faster than {trl.detail}: {speed:.2f}x", speed >= W1_TRL_SPEEDUP))
            if best.times.peak_bytes is not None and trl.times.peak_bytes is not None:
                ok = best.times.peak_bytes <= trl.times.peak_bytes
                out.append(
                    (f"activation memory <= TRL's: {_gib(best.times.peak_bytes)} vs {_gib(trl.times.peak_bytes)}", ok)
                )
    else:
        r = best.times.step / base.times.step
        out.append((f"step <= {W2_BASELINE_RATIO:.2f} x baseline: {r:.3f}x ({best.name})", r <= W2_BASELINE_RATIO))
        if base.times.peak_bytes is not None and best.times.peak_bytes is not None:
            need = 0.9 * w.offload / w.layers * base.times.peak_bytes
            saved = base.times.peak_bytes - best.times.peak_bytes
            out.append(
                (
                    f"activation memory saved >= 0.9 x {w.offload}/{w.layers} of baseline's: "
                    f"{_gib(saved)} saved, {_gib(need)} needed",
                    saved >= need,
                )
            )
            limit = report.saved_bytes - report.held_bytes
            if saved < need and 0 < limit < need:
                # Note [W2's memory limit]: the target assumes the offloaded layers hold their share
                # (2/8) of the baseline's activation memory; the hook count says what they hold
                out.append(
                    (
                        f"limit instead: the {w.offload} offloaded layers save {_gib(report.saved_bytes)} "
                        f"(saved-tensor hook count)"
                        + (f", {_gib(report.held_bytes)} of it the input the caller holds," if report.held_bytes else ",")
                        + f" so no activation offload frees more than {_gib(limit)}; "
                        f"saved >= 0.9 x that: {_gib(saved)} = {saved / limit:.2f}x of it",
                        saved >= 0.9 * limit,
                    )
                )
    return out


def format_report(report) -> str:
    """The workload's markdown section: header facts, the ratio table, ours-vs-peers, targets."""
    w, base, bw = report.workload, report.baseline, report.bandwidth
    lines = [f"## {w.describe()}", ""]
    if report.tiny:
        lines += ["**--tiny: CPU smoke run, tiny shapes; the numbers carry no timing claims.**", ""]
    lines += [
        f"- device: {report.device}; torch {report.torch_version}",
        f"- command: `{report.command}`",
        f"- copy bandwidth ({'pinned, ' if bw.pinned else 'host-to-host, '}{_gib(bw.nbytes)} copies): "
        f"D2H {bw.d2h_gbps:.1f} GB/s, H2D {bw.h2d_gbps:.1f} GB/s",
    ]
    f, d2h, b, h2d = report.floor_terms()
    lines += [
        f"- offloaded bytes per step: {_gib(report.floor_bytes)} ({report.floor_bytes_source}); "
        f"saved-tensor hook count of the {w.offload} offloaded layers: {_gib(report.saved_bytes)}",
        f"- copy floor = max(T_fwd, bytes/BW_d2h) + max(T_bwd, bytes/BW_h2d) = max({f:.1f}, {d2h:.1f}) + "
        f"max({b:.1f}, {h2d:.1f}) = **{report.floor_ms:.1f} ms** ({_x(report.floor_ms / base.times.step)} baseline)",
        "",
        "| method | step / baseline | step / floor | act. mem / baseline | step ms | fwd ms | bwd ms "
        "| act. mem | peak mem | D2H/step | bit-exact | config |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report.results:
        if r.times is None:
            lines.append(f"| {r.name} | - | - | - | - | - | - | - | - | - | - | {r.error} |")
            continue
        t = r.times
        lines.append(
            f"| {r.name} | {_x(t.step / base.times.step)} | {_x(t.step / report.floor_ms)} "
            f"| {_x(_ratio(t.peak_bytes, base.times.peak_bytes))} | {t.step:.1f} | {t.fwd:.1f} | {t.bwd:.1f} "
            f"| {_gib(t.peak_bytes)} | {_gib(t.peak_total_bytes)} | {_gib(r.offloaded_bytes)} | {r.exact} | {r.detail} |"
        )
    best = report.best_ours
    peers = report.ran("peer")
    if best is not None and peers:
        lines += [
            "",
            f"annotate_offload (fastest: {best.name}) against each peer:",
            "",
            "| peer | speed-up (peer step / ours) | ours act. mem / peer's |",
            "|---|---|---|",
        ]
        for p in peers:
            mem = _ratio(best.times.peak_bytes, p.times.peak_bytes)
            lines.append(f"| {p.name} | {_x(p.times.step / best.times.step)} | {_x(mem)} |")
    lines += ["", "Targets (issue 7):", ""]
    for text, ok in targets(report):
        mark = "n/a" if ok is None else ("PASS" if ok else "FAIL")
        lines.append(f"- [{mark}] {text}")
    lines += ["", "Peers: " + "; ".join(report.peers)]
    if report.profile_files:
        lines += ["", "Profile: " + ", ".join(report.profile_files)]
    return "\n".join(lines) + "\n"


def write_png(reports, path: str) -> bool:
    """Bar chart of step time and activation memory relative to the baseline, one row of
    panels per workload. Returns ``False`` (and writes nothing) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    fig, axes = plt.subplots(len(reports), 2, figsize=(12, 0.5 + 3.2 * len(reports)), squeeze=False)
    for row, report in zip(axes, reports):
        rows = report.ran()
        names = [r.name for r in rows]
        base = report.baseline.times
        steps = [r.times.step / base.step for r in rows]
        colors = ["gray" if r.kind == "baseline" else "tab:blue" if r.kind == "ours" else "tab:orange" for r in rows]
        row[0].barh(names, steps, color=colors)
        row[0].axvline(report.floor_ms / base.step, color="k", linestyle="--", label="copy floor")
        row[0].set_xlabel("step time / baseline")
        row[0].legend(loc="lower right")
        row[0].invert_yaxis()
        title = report.workload.describe() + (" [tiny]" if report.tiny else "")
        row[0].set_title(title, fontsize=8, loc="left")
        if base.peak_bytes:
            mems = [(r.times.peak_bytes or 0) / base.peak_bytes for r in rows]
            row[1].barh(names, mems, color=colors)
            row[1].invert_yaxis()
            row[1].set_xlabel("activation memory / baseline")
        else:
            row[1].text(0.5, 0.5, "no allocator statistics on CPU", ha="center", va="center")
            row[1].set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
