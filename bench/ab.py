#!/usr/bin/env python3
"""Alternating A/B rounds of `bench` binaries (builds of `runtime/examples/bench.rs` at
different commits) on the same cases, in one GPU session, and one table of the results.

    python3 bench/ab.py --rounds 2 --cases doc8k,doc32k,packed64k old=PATH new=PATH ...
    python3 bench/ab.py --summarize DIR          # the table again from the JSON files

Each round runs every variant once, in the order given (`bench --cases C --reps R --warmup W
--json DIR/<variant>_r<round>.json`), so slow drifts of the clock or the temperature fall on
all variants alike. The table has, per case and variant, the useful TFLOP/s of each round
and the ratio of the rounds' mean to the first variant's: one table for the host-schedule
calls (`bench`'s `ms` column) and one for the device-schedule path (`dev_ms`: the schedule
built on the device, then the backward; no upload), which compares the kernels alone when
the variants differ in the upload. Variants must see the same selections: the table refuses
cases whose q2k checksums differ between files.
"""
import argparse
import json
import os
import subprocess
import sys


def run(args):
    os.makedirs(args.out, exist_ok=True)
    variants = []
    for v in args.variants:
        name, sep, path = v.partition("=")
        if not sep or not name or not path:
            sys.exit(f"variant {v!r}: expected NAME=PATH")
        variants.append((name, path))
    for r in range(1, args.rounds + 1):
        for name, path in variants:
            out = os.path.join(args.out, f"{name}_r{r}.json")
            cmd = [path, "--cases", args.cases, "--reps", str(args.reps), "--warmup",
                   str(args.warmup), "--json", out]
            print(f"== {name} round {r}: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, check=True)
    return [n for n, _ in variants]


def load(directory, names):
    """{path: {variant: {case: [(round, useful TFLOP/s, checksum)]}}} from
    DIR/<variant>_r<k>.json, for the paths "host" and "device" (absent where the file has no
    device-path time)."""
    got = {}
    for f in sorted(os.listdir(directory)):
        stem, ext = os.path.splitext(f)
        name, sep, rnd = stem.rpartition("_r")
        if ext != ".json" or not sep or not rnd.isdigit():
            continue
        if names and name not in names:
            continue
        with open(os.path.join(directory, f)) as fh:
            d = json.load(fh)
        for c in d.get("cases", []):
            rates = {"host": c["useful_tflops"]}
            dev_ms = c.get("device_path_ms_median")
            if dev_ms:
                rates["device"] = c["useful_flop"] / (dev_ms * 1e-3) / 1e12
            for path, rate in rates.items():
                got.setdefault(path, {}).setdefault(name, {}).setdefault(c["name"], []).append(
                    (int(rnd), rate, c["q2k_checksum"]))
    return got


def tables(got, order):
    """The host-path table, then the device-path one where the files have it."""
    if not got.get("host"):
        sys.exit("no <variant>_r<round>.json files")
    out = []
    for path, title in (("host", "host schedule (`ms`)"), ("device", "device schedule (`dev_ms`)")):
        if got.get(path):
            out.append(f"{title}:\n\n" + table(got[path], order))
    return "\n\n".join(out) + (
        "\n\nuseful TFLOP/s per round; in brackets the mean of the rounds over the first "
        "variant's.")


def table(got, order):
    names = order or sorted(got)
    cases = []
    for n in names:
        for c in got.get(n, {}):
            if c not in cases:
                cases.append(c)
    lines = ["| case | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in cases:
        sums = {(n, x[2]) for n in names for x in got.get(n, {}).get(c, [])}
        if len({s for _, s in sums}) > 1:
            sys.exit(f"case {c}: the variants timed different selections ({sorted(sums)})")
        base = None
        cells = []
        for n in names:
            runs = sorted(got.get(n, {}).get(c, []))
            if not runs:
                cells.append("–")
                continue
            mean = sum(t for _, t, _ in runs) / len(runs)
            base = mean if base is None else base
            vals = " / ".join(f"{t:.1f}" for _, t, _ in runs)
            cells.append(vals if n == names[0] else f"{vals} ({mean / base:.3f})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="*", help="NAME=PATH of a bench binary, in run order")
    ap.add_argument("--cases", default="doc8k,doc32k,packed64k")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=os.environ.get("OUT", "ab"), help="folder of the JSON files")
    ap.add_argument("--summarize", metavar="DIR", help="only print the table of DIR's files")
    a = ap.parse_args(argv)
    if a.summarize:
        print(tables(load(a.summarize, None), None))
        return
    if not a.variants:
        ap.error("give at least one NAME=PATH")
    names = run(a)
    print(tables(load(a.out, set(names)), names))


if __name__ == "__main__":
    main()
