"""A plan as JSON-ready data and as the table `xlaopt plan` prints."""
from __future__ import annotations

import collections
import dataclasses

from xlaopt.planning.planner import Plan, Priced


def priced_json(plan: Plan, p: Priced, full_layout: bool = True) -> dict:
    layout = plan.layout_for(p.candidate).to_json()
    if not full_layout:  # the base rules, batch, model and topology are every candidate's: said once
        kept = ("mesh", "order", "execution") + (("rules",) if p.candidate.sequence_parallel else ())
        layout = {k: v for k, v in layout.items() if k in kept}
    out = {"candidate": str(p.candidate), "kind": p.candidate.kind, "layout": layout, "method": p.method,
           "step_time_s": p.step_time_s, "mfu": plan.mfu(p), "memory_per_device_bytes": p.memory_bytes,
           "analytic_step_time_s": p.analytic.step_time_s, "analytic_memory_per_device_bytes": p.analytic.memory_bytes,
           "reason": p.reason}
    if p.compiled is not None:
        out["compiler_notes"] = [n for n in p.compiled["notes"] if n.startswith("XLA, compiling")]
        out["compiled_memory_per_device_bytes"] = p.compiled["memory_per_device_bytes"]["peak_estimate"]
        out["exposed_comm_s"] = p.compiled["exposed_comm_s"]
    return out


def plan_json(plan: Plan) -> dict:
    b = plan.program.settings.batch
    rejected = collections.Counter(r.reason for r in plan.rejected)
    return {
        "model": plan.program.model.name, "topology": plan.topology.name, "devices": plan.topology.num_devices,
        "target": plan.program.target, "method": plan.method,
        "batch": {"global_batch": b.batch_size, "text_len": b.text_len, "gen_len": b.gen_len,
                  "row_tokens": b.text_len + b.gen_len},
        "attention": plan.program.execution.attention,
        "best": priced_json(plan, plan.best),
        "baseline": priced_json(plan, plan.baseline) if plan.baseline is not None else None,
        "best_speedup_over_baseline": (plan.baseline.step_time_s / plan.best.step_time_s
                                       if plan.baseline is not None else None),
        "candidates": _with_twins([dict(priced_json(plan, p, full_layout=False), rank=i)
                                   for i, p in enumerate(plan.ranked, 1)], plan.ranked),
        "unfit": [priced_json(plan, p, full_layout=False) for p in plan.unfit],
        "rejected": [{"reason": reason, "candidates": n} for reason, n in rejected.most_common()],
        "counts": {"space": len(plan.ranked) + len(plan.unfit) + len(plan.rejected), "fit": len(plan.ranked),
                   "unfit": len(plan.unfit), "rejected": len(plan.rejected),
                   "compiled": sum(p.compiled is not None for p in plan.ranked + plan.unfit)},
        "memory_model": plan.memory_model,
        "by_stages": _by_stages(plan),
        "seconds": plan.seconds,
    }


def _by_stages(plan: Plan) -> list[dict]:
    """For each pipeline stage count in the space, its best candidate that fits (rank, price and
    the reason against the best), or why none does."""
    out = []
    for pp in sorted({p.candidate.pp for p in plan.ranked + plan.unfit} | {r.candidate.pp for r in plan.rejected}):
        rank, best = next(((i, p) for i, p in enumerate(plan.ranked, 1) if p.candidate.pp == pp), (None, None))
        if best is not None:
            out.append({"stages": pp, "rank": rank, "candidate": str(best.candidate), "method": best.method,
                        "step_time_s": best.step_time_s, "reason": best.reason})
            continue
        unfit = [p for p in plan.unfit if p.candidate.pp == pp]
        why = (min(unfit, key=lambda p: p.memory_bytes).reason if unfit else
               collections.Counter(r.reason for r in plan.rejected if r.candidate.pp == pp).most_common(1)[0][0])
        out.append({"stages": pp, "rank": None, "reason": ("none fits: " if unfit else "none can be built: ") + why})
    return out


def _with_twins(rows: list[dict], ranked: list[Priced]) -> list[dict]:
    """Each row that differs from an earlier one only in its compute dtype and prices the same
    (fp16 against bf16 where nothing needs its loss scaling) gets `same_as`: the earlier row's
    candidate, which the ranking puts first (bf16, the simpler: no loss scale)."""
    seen: dict = {}
    for row, p in zip(rows, ranked):
        c = p.candidate
        key = (dataclasses.replace(c, compute_dtype="bfloat16"), p.step_time_s, p.memory_bytes)
        if key in seen:
            row["same_as"] = seen[key]
        else:
            seen[key] = row["candidate"]
    return rows


def format_plan(result: dict, rows: int = 12) -> str:
    gib = lambda x: f"{x / 2**30:,.1f}"
    b = result["batch"]
    lines = [f"plan {result['model']} on {result['topology']} ({result['devices']} devices), global batch "
             f"{b['global_batch']} rows of {b['row_tokens']:,} tokens, attention {result['attention']}; "
             f"best few priced {result['method']}"]
    shown = [c for c in result["candidates"] if "same_as" not in c][:rows]
    width = max([50] + [len(c["candidate"]) + 2 for c in shown])
    kind = max([14] + [len(c["kind"]) + 2 for c in shown])
    lines.append(f"{'#':>3}  {'layout':<{width}}{'kind':<{kind}}{'step s':>9}{'MFU':>7}{'GiB/dev':>9}  method    reason")
    for c in shown:
        lines.append(f"{c['rank']:>3}  {c['candidate']:<{width}}{c['kind']:<{kind}}{c['step_time_s']:>9.3f}"
                     f"{c['mfu'] * 100:>6.1f}%{gib(c['memory_per_device_bytes']):>9}  {c['method']:<9} {c['reason']}")
    twins = sum("same_as" in c for c in result["candidates"])
    if twins:
        lines.append(f"  (not shown: {twins} candidate(s) pricing the same as a better-ranked twin that differs only "
                     f"in compute dtype, fp16 where nothing needs its loss scaling; the JSON marks them `same_as`)")
    base, best = result["baseline"], result["best"]
    if base is None:
        lines.append(f"baseline (pure FSDP over {result['devices']} devices): cannot split the batch")
    else:
        lines.append(f"baseline (pure FSDP): {base['candidate']}: {base['step_time_s']:.3f} s ({base['method']}); "
                     f"best is {result['best_speedup_over_baseline']:.3f}x faster")
    n = result["counts"]
    lines.append(f"{n['space']} candidates: {n['fit']} fit, {n['unfit']} over memory, {n['rejected']} cannot be "
                 f"built, {n['compiled']} compiled; {result['seconds']:.1f} s")
    for c in result["candidates"] + result["unfit"]:
        lines += [f"  {c['candidate']}: {note}" for note in c.get("compiler_notes", ())]
    for r in result["rejected"][:4]:
        lines.append(f"  cannot build {r['candidates']}: {r['reason']}")
    if result["unfit"]:
        u = min(result["unfit"], key=lambda c: c["memory_per_device_bytes"])
        lines.append(f"  over memory {n['unfit']}, e.g. {u['candidate']}: {u['reason']}")
    stages = result.get("by_stages", [])
    for row in stages if len(stages) > 1 else ():
        lines.append(f"  {row['stages']} stage(s): " + (f"#{row['rank']} {row['candidate']}, {row['step_time_s']:.3f} s "
                                                       f"({row['method']}): {row['reason']}" if row["rank"] else
                                                       row["reason"]))
    lines.append(f"best: {best['candidate']} ({best['kind']}), {best['step_time_s']:.3f} s, MFU "
                 f"{best['mfu'] * 100:.1f}%, {gib(best['memory_per_device_bytes'])} GiB per device "
                 f"(analytic {gib(best['analytic_memory_per_device_bytes'])})")
    return "\n".join(lines)
