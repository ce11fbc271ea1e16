#!/usr/bin/env python3
"""Times fla-core 0.6.0 ``parallel_nsa_fwd`` (o and lse) on the benchmark cases, with the same
selections as ``runtime/examples/bench_forward.rs`` (``msa_inputs.py``'s recipe), CUDA events
around one call, a 256 MiB L2 flush before each, median over --reps after autotuning.

    python3 bench/forward_fla.py --cases doc8k,packed64k --reps 20

Useful forward FLOP = 2*(128+128)*16*sum of keys attended (over the 4 index heads), as in
bench_forward.rs.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines as bl  # noqa: E402
import msa_inputs as mi  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="doc8k,packed64k")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    import torch

    fla = bl.Fla()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=bl.DEV)
    print("| case | T | fla parallel_nsa_fwd ms | useful TFLOP/s |")
    print("|---|---|---|---|")
    for name in a.cases.split(","):
        c = bl.Case(name, mi.CASES[name], mi.TOPK, mi.DEFAULT_SEED)
        keys = int(c.info["keys_attended"])
        fla.reset_autotune()
        varlen = len(c.docs) > 1
        bi = c.q2k.permute(1, 0, 2).contiguous().unsqueeze(0)
        cu = torch.tensor(c.cu, dtype=torch.long, device=bl.DEV) if varlen else None
        tok = fla.prepare_token_indices(cu) if varlen else None
        q, k, v = (x.unsqueeze(0) for x in (c.q, c.k, c.v))

        def fwd():
            return fla.nsa.parallel_nsa_fwd(
                q=q, k=k, v=v, block_indices=bi, block_counts=mi.TOPK, block_size=128,
                scale=bl.SCALE, cu_seqlens_q=cu, cu_seqlens_k=cu, token_indices_q=tok)

        ms = bl.summary(bl.time_backward(fwd, a.reps, 3, flush))["ms_median"]
        flop = 2 * 256 * 16 * keys
        print(f"| {name} | {c.T} | {ms:.3f} | {flop / (ms * 1e-3) / 1e12:.1f} |  (fla {fla.version}, {fla.configs()})", flush=True)


if __name__ == "__main__":
    main()
