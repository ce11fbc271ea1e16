#!/usr/bin/env python3
"""Merges bench/baselines.py's JSON and runtime/examples/bench.rs's JSON into one table
(standard library only).

    python3 bench/report.py BASELINES.json [MORE_BASELINES.json ...] [--ours OURS.json] [--markdown]

Several baseline files (e.g. from runs split over two device calls) are concatenated. Checks that
both sides ran the identical selection (same q2k checksum, cu_seqlens and keys attended per case)
and computes every fraction against the matmul ceiling measured in the same baselines run (for
our rows: that of the baselines file holding the case). "time / ours" = that row's backward time
divided by ours.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("baselines", nargs="+", help="JSON files written by bench/baselines.py")
    ap.add_argument("--ours", help="JSON written by runtime/examples/bench.rs --json")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args(argv)

    bases = []
    for path in args.baselines:
        with open(path) as fh:
            bases.append(json.load(fh))
    ours = {}
    ours_doc = None
    if args.ours:
        with open(args.ours) as fh:
            ours_doc = json.load(fh)
        ours = {c["name"]: c for c in ours_doc["cases"]}
    problems = []

    rows = []
    ceilings = []
    for base in bases:
        ceiling = base.get("matmul", {}).get("tflops")
        ceilings.append(ceiling)
        for case in base["cases"]:
            name = case["name"]
            o = ours.get(name)
            if o is not None:
                for key in ("q2k_checksum", "cu_seqlens", "keys_attended"):
                    if o.get(key) != case.get(key):
                        problems.append(f"{name}: {key} differs (baselines {case.get(key)!r}, ours {o.get(key)!r})")
            ms_ours = o.get("ms_median") if o else None
            for m, rec in case.get("methods", {}).items():
                if "ms_median" not in rec:
                    rows.append((name, rec.get("label", m), None, None, None, None,
                                 rec.get("error") or rec.get("skipped") or "not timed"))
                    continue
                note = []
                if not rec.get("check_passed"):
                    note.append("CHECK FAILED")
                if m == "flex":
                    note.append(f"union {rec['union_ratio']:.2f}x")
                if m == "sdpa":
                    note.append("dense FLOP")
                speed = rec["ms_median"] / ms_ours if ms_ours else None
                rows.append((name, rec["label"], rec["ms_median"], rec["useful_tflops"],
                             rec["useful_tflops"] / ceiling if ceiling else None, speed, ", ".join(note)))
            if o is not None and ms_ours is not None:
                useful = o["useful_flop"] / (ms_ours * 1e-3) / 1e12
                note = f"tile {o['tile_tflops']:.1f} TFLOP/s, {o['tile_tasks']} tasks"
                rows.append((name, "ours: msa_runtime::run_backward", ms_ours, useful,
                             useful / ceiling if ceiling else None, 1.0, note))
    seen = {c["name"] for b in bases for c in b["cases"]}
    for name, o in ours.items():
        if name not in seen and o.get("ms_median") is not None:
            useful = o["useful_flop"] / (o["ms_median"] * 1e-3) / 1e12
            rows.append((name, "ours: msa_runtime::run_backward", o["ms_median"], useful, None, 1.0,
                         "no baselines for this case"))

    def f(x, fmt):
        width = int(fmt.split(".")[0] or 0)
        return "-".rjust(width) if x is None else format(x, fmt)

    print("matmul ceiling: " + ", ".join(f(c, ".1f") for c in ceilings)
          + f" TFLOP/s on {bases[0]['environment'].get('gpu')}"
          + (f"; ours on {ours_doc.get('device')}" if ours_doc else ""))
    if args.markdown:
        print("| case | method | bwd ms | useful TFLOP/s | fraction of matmul | time / ours | note |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {f(r[2], '.3f')} | {f(r[3], '.1f')} | {f(r[4], '.3f')} | "
                  f"{f(r[5], '.2f')} | {r[6]} |")
    else:
        hdr = f"{'case':10s} {'method':34s} {'bwd ms':>9s} {'TFLOP/s':>8s} {'frac':>6s} {'t/ours':>7s}  note"
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            print(f"{r[0]:10s} {r[1]:34s} {f(r[2], '9.3f')} {f(r[3], '8.1f')} {f(r[4], '6.3f')} "
                  f"{f(r[5], '7.2f')}  {r[6]}")
    for p in problems:
        print("INPUT MISMATCH:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
