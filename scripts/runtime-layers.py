#!/usr/bin/env python3
"""Checks that no file of runtime/src imports from a layer above its own.

Usage: scripts/runtime-layers.py [runtime/src]

The edges are those `scripts/import-cycles.py` counts (it also fails on any circle). The
layers, bottom up, as the crate documentation of `msa_runtime` states them:

  1 contract: the schedule contract and the pure host rules (contract, schedule, error,
    the CPU reference)
  2 backend: the `Backend` trait and its value types (backend, buffers)
  3 flow: the host flow, generic over `Backend` (ops, tasks, backward, schedule_build,
    aligned, forward, forward_kv, cp)
  4 cuda: the CUDA backend on cudarc (cuda, device, timed)
  5 api: the cudarc convenience API (views, each flow module's `stream` child; cp's is
    its NCCL binding)

Two kinds of upward edge are allowed, each named below with its reason. A file with no layer
is an error: add it to LAYERS.
"""

import re
import subprocess
import sys
from pathlib import Path

LAYERS = {
    "contract.rs": 1,
    "schedule.rs": 1,
    "error.rs": 1,
    "reference/": 1,
    "backend.rs": 2,
    "buffers.rs": 2,
    "ops.rs": 3,
    "tasks.rs": 3,
    "backward.rs": 3,
    "schedule_build.rs": 3,
    "aligned.rs": 3,
    "forward.rs": 3,
    "forward_kv.rs": 3,
    "forward/buffers.rs": 3,
    "cp.rs": 3,
    "cuda.rs": 4,
    "device.rs": 4,
    "timed.rs": 4,
    "views.rs": 5,
    "ops/stream.rs": 5,
    "tasks/stream.rs": 5,
    "backward/stream.rs": 5,
    "schedule_build/stream.rs": 5,
    "aligned/stream.rs": 5,
    "forward/stream.rs": 5,
    "cp/stream.rs": 5,
}

ALLOWED = {
    # `MsaBackward<B: Backend = CudaBackend>`: the default type parameter of a public type
    # (changing it would break every `MsaBackward` written without one); no flow code calls
    # the CUDA backend.
    ("backward.rs", "cuda.rs"),
}


def layer(f: str):
    if f in LAYERS:
        return LAYERS[f]
    for k, v in LAYERS.items():
        if k.endswith("/") and f.startswith(k):
            return v
    return None


def main() -> int:
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "runtime/src")
    script = Path(__file__).with_name("import-cycles.py")
    run = subprocess.run([sys.executable, str(script), str(src)], capture_output=True, text=True)
    bad = []
    if run.returncode != 0:
        bad.append("import circles:\n" + "\n".join(
            line for line in run.stdout.splitlines() if line.startswith("CIRCLE")))
    edges = re.findall(r"(?m)^(\S+) -> (\S+)$", run.stdout)
    for a, b in edges:
        if a == "lib.rs":
            continue  # the crate root declares and re-exports every module
        la, lb = layer(a), layer(b)
        for f, l in ((a, la), (b, lb)):
            if l is None and b != "lib.rs":
                bad.append(f"{f} has no layer: add it to LAYERS in {Path(__file__).name}")
        if la is None or lb is None or lb <= la:
            continue
        # A flow module re-exports its own `stream` child so that its public paths stay.
        if b == a.removesuffix(".rs") + "/stream.rs":
            continue
        if (a, b) in ALLOWED:
            continue
        bad.append(f"{a} (layer {la}) imports {b} (layer {lb})")
    for line in sorted(set(bad)):
        print(line)
    print(f"{len(edges)} edges, {len(set(bad))} layer violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
