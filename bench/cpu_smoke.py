#!/usr/bin/env python3
"""CPU smoke test of bench/baselines.py's plumbing (needs torch, no GPU; fla is not exercised).

Checks at small sizes, on the CPU:
* the FlexAttention block lists (union / full / partial per 128-row folded tile and 128-key
  workspace block) against the tile-level truth derived from the fp32 reference mask;
* FlexAttention (eager; --compile for torch.compile) forward in the folded, aligned layout
  against the fp32 reference of the exact MSA semantics (FlexAttention has no CPU backward; the
  gradients go through the same fold/unfold maps, which are checked by a round trip);
* the dense per-document SDPA path (math backend) against the same reference on a selection that
  covers every causal block;
* with --fla: fla's parallel_nsa forward and backward wiring (block_indices layout, varlen
  token/chunk indices, single-document path) in fp32 through the Triton interpreter
  (TRITON_INTERPRET=1; autotuning stubbed to the first config; needs numpy < 2.3, whose int()
  of a one-element array the interpreter relies on). Slow: a few minutes.

    python3 bench/cpu_smoke.py [--compile] [--fla]
"""

from __future__ import annotations

import argparse
import os
import sys

if "--fla" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines as B  # noqa: E402
import msa_inputs as mi  # noqa: E402


def tile_truth(c, allowed):
    """any / all of the reference mask over each (index head, 8-token tile, workspace block)."""
    import torch

    T, nqt, nbw = c.T, c.T // 8, c.W // 128
    # keys as workspace rows: dense [4, T, W] with padding rows never allowed
    ws = torch.zeros(4, T, c.W, dtype=torch.bool)
    ws[:, :, c.ws_pos] = allowed
    per = ws.view(4, nqt, 8, nbw, 128)
    return per.any(dim=(2, 4)), per.all(dim=4).all(dim=2)


def reference_mask(c):
    import torch

    T = c.T
    sel = c.selected()
    lblk = (c.lpos // 128).view(1, 1, T).expand(4, T, T)
    allowed = sel.gather(2, lblk)
    ar = torch.arange(T)
    return allowed & (c.doc_id[:, None] == c.doc_id[None, :]) & (ar[None, :] <= ar[:, None])


def check_fla():
    """fla through the Triton interpreter, fp32 inputs (the interpreter has no bf16)."""
    import gc

    from triton.runtime.autotuner import Autotuner

    fla = B.Fla()
    for obj in gc.get_objects():
        if isinstance(obj, Autotuner):
            obj.do_bench = lambda fn, quantiles=None: [1.0, 1.0, 1.0]   # no device to time on
    failures = 0
    for name, docs, topk in [("2doc_top2", [600, 424], 2), ("1doc_top3", [640], 3)]:
        c = B.Case(name, docs, topk, mi.DEFAULT_SEED)
        for a in ("q", "k", "v", "do"):
            setattr(c, a, getattr(c, a).float())
        ref = B.reference(c)
        fla.reset_autotune()
        bwd, result, extra = fla.setup(c)
        res, _ = B.compare(result(bwd()), ref, tol=False)
        ok = all(v["max_abs"] < 1e-3 and v["l2_rel"] < 1e-5 for v in res.values())
        print(f"{name:11s} fla (interpreter, fp32, varlen={extra['varlen']}) {'ok' if ok else 'FAIL'} "
              f"{B.fmt_cmp(res)}")
        failures += not ok
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="torch.compile flex (CPU inductor)")
    ap.add_argument("--fla", action="store_true", help="also run fla through the Triton interpreter")
    args = ap.parse_args()
    import torch
    from torch.nn.attention import SDPBackend

    B.DEV = "cpu"
    torch.manual_seed(0)
    failures = 0
    flex = B.Flex(compile=args.compile)
    cases = [
        ("2doc_top3", [300, 212], 3),       # blocks straddle 128-aligned stream blocks
        ("3doc_top2", [260, 8, 500], 2),    # a document shorter than a tile
        ("1doc_top16", [640], 16),          # everything selected: full blocks exist
        ("1doc_top4", [1024], 4),
    ]
    for name, docs, topk in cases:
        c = B.Case(name, docs, topk, mi.DEFAULT_SEED)
        ref = B.reference(c)
        allowed = reference_mask(c)
        counts, full, partial = flex.block_lists(c)
        any_t, all_t = tile_truth(c, allowed)
        union = full | partial
        ok_lists = bool(torch.equal(union, any_t)) and bool((full <= all_t).all())
        print(f"{name:11s} T={c.T:5d} W={c.W:5d} block lists {'ok' if ok_lists else 'MISMATCH'} "
              f"(union {int(union.sum())} pairs, full {int(full.sum())}, truth-full {int(all_t.sum())})")
        failures += not ok_lists
        # FlexAttention has no CPU backward: the forward checks layout, block mask and mask_mod
        # (the gradients use the same fold/unfold maps, checked by the round trip)
        _, result, stats = flex.setup(c, grad=False)
        res, ok = B.compare(result(None), ref)
        ok = ok and stats["fold_roundtrip_ok"]
        print(f"{'':11s} flex fwd {'ok' if ok else 'FAIL'} {B.fmt_cmp(res)}; union ratio "
              f"{stats['union_ratio']:.2f}; fold round trip {stats['fold_roundtrip_ok']}")
        failures += not ok
        if c.info["keys_attended"] == 4 * c.info["dense_causal_keys_per_head"]:
            s = B.Sdpa()
            s.candidates = lambda: [(SDPBackend.MATH, True), (SDPBackend.MATH, False)]
            got, errors = s.pick(c)
            if got is None:
                print(f"{'':11s} sdpa: no backend: {errors}")
                failures += 1
            else:
                res, ok = B.compare(got, ref)
                print(f"{'':11s} sdpa {'ok' if ok else 'FAIL'} {B.fmt_cmp(res)} [{s.backend}, gqa={s.gqa}]")
                failures += not ok
    if args.fla:
        failures += check_fla()
    print("PASS" if failures == 0 else f"{failures} FAILURE(S)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
