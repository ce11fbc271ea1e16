#!/usr/bin/env python3
"""Times the MSA forward: ours (``msa_ptx``, ``msa_forward_sm90``), fla-core 0.6.0
``parallel_nsa_fwd`` and PyTorch FlexAttention's forward, in one process on identical tensors
(``baselines.Case``: randn bf16, the selections of ``msa_inputs.py``).

* ``ours``  ``kernel``: ``msa_ptx._forward`` (output allocation + ``msa_forward_sm90``) on a
            schedule and aligned K/V built once; ``run_forward``: the whole
            ``msa_ptx.run_forward`` (device schedule build, K/V alignment, the kernel).
* ``fla``   ``parallel_nsa_fwd`` (o and lse), block 128, varlen when there are several
            documents, autotuned on each case before timing.
* ``flex``  ``flex_attention`` (torch.compile) with ``return_lse=True`` in the folded layout
            and with the BlockMask and exact ``mask_mod`` of ``baselines.Flex`` (union of a
            128-row tile's 8 tokens' blocks, selected block + same document + causal); the
            block mask and the folding are built outside the timed region.

First every method runs a check case (T = 2048) against the fp32 reference of the exact
semantics (``baselines.reference``; ``o`` within seed-design 4.3, ``lse`` 1e-3 for ours and
flex) and against our output; on each timed case fla's and flex's ``o`` are compared with ours
too, so each timing is of the same computation. Timing: CUDA events around one call, 256 MiB L2
flush before each, median of --reps after 3 warm-up calls. Useful forward FLOP =
2*(128+128)*16*sum of keys attended (over the 4 index heads and all tokens).

    PYTHONPATH=<msa_ptx + fla-core site> python3 bench/forward_baselines.py \\
        --cases packed64k,doc8k,doc32k --methods ours,fla,flex --json $OUT/forward.json
"""
import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import baselines as bl  # noqa: E402
import msa_inputs as mi  # noqa: E402

LSE_TOL = 1e-3


def ours_setup(c):
    """{label: call}, out, lse of our forward."""
    import msa_ptx
    import torch

    cu = torch.tensor(c.cu, dtype=torch.int32, device=bl.DEV)
    q2k = c.q2k.contiguous()
    out, lse, schedule, ka, va = msa_ptx.run_forward(c.q, c.k, c.v, q2k, cu)

    def kernel():
        return msa_ptx._forward(c.q, ka, va, q2k, schedule)

    def whole():
        return msa_ptx.run_forward(c.q, c.k, c.v, q2k, cu)

    return {"kernel": kernel, "run_forward": whole}, out, lse


def fla_setup(fla, c):
    import torch

    fla.reset_autotune()
    varlen = len(c.docs) > 1
    bi = c.q2k.permute(1, 0, 2).contiguous().unsqueeze(0)          # [1,T,4,16], doc-local ids
    cu = torch.tensor(c.cu, dtype=torch.long, device=bl.DEV) if varlen else None
    tok = fla.prepare_token_indices(cu) if varlen else None
    q, k, v = (x.unsqueeze(0) for x in (c.q, c.k, c.v))

    def fwd():
        return fla.nsa.parallel_nsa_fwd(
            q=q, k=k, v=v, block_indices=bi, block_counts=mi.TOPK, block_size=128,
            scale=bl.SCALE, cu_seqlens_q=cu, cu_seqlens_k=cu, token_indices_q=tok)

    o, _lse = fwd()                                                 # autotunes
    return {"fla": fwd}, o[0], None


def flex_setup(flex, c):
    import torch

    bm, stats = flex.block_mask(c)
    T = c.T
    qf = bl.fold_q(c.q, T).contiguous()
    kf = bl.fold_kv(c, c.k)
    vf = bl.fold_kv(c, c.v)

    def fwd():
        return flex.fn(qf, kf, vf, block_mask=bm, scale=bl.SCALE, return_lse=True)

    try:
        out, lse = fwd()                                            # compiles this shape
    except Exception as exc:  # a torch without return_lse: time o alone, say so
        bl.log(f"  flex with return_lse failed ({type(exc).__name__}: {exc}); timing o only")
        stats["lse"] = "not returned"

        def fwd():
            return flex.fn(qf, kf, vf, block_mask=bm, scale=bl.SCALE)

        out, lse = fwd(), None
    torch.cuda.synchronize()
    o = bl.unfold_q(out, T)
    if lse is not None:
        lse = lse.reshape(4, T, 16).permute(1, 0, 2).reshape(T, 64)
    return {"flex": fwd}, o, lse, stats


def cmp_o(a, e):
    a, e = a.float(), e.float()
    d = a - e
    if not bool(a.isfinite().all().item()):
        return {"max_abs": math.inf, "l2_rel": math.inf}
    return {"max_abs": d.abs().max().item(), "l2_rel": (d.norm() / e.norm().clamp_min(1e-30)).item()}


def cmp_lse(a, e):
    """max-abs over rows finite in the reference; rows -inf there must be -inf here."""
    import torch

    fin = torch.isfinite(e)
    same_inf = bool(torch.equal(torch.isfinite(a), fin))
    err = (a[fin] - e[fin]).abs().max().item() if bool(fin.any().item()) else 0.0
    return {"max_abs": err, "same_empty_rows": same_inf, "ok": same_inf and err <= LSE_TOL}


def fmt(r):
    return f"{r['max_abs']:.3g}/{r['l2_rel']:.2g}" if "l2_rel" in r else f"{r['max_abs']:.3g}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="packed64k,doc8k,doc32k")
    ap.add_argument("--methods", default="ours,fla,flex")
    ap.add_argument("--check", default="check2doc_top4", help="check cases ('' for none)")
    ap.add_argument("--flex-cases", help="time flex only on these cases (default: all)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="write the report here (rewritten after each case)")
    a = ap.parse_args()
    import torch

    methods = a.methods.split(",")
    fla = bl.Fla() if "fla" in methods else None
    flex = bl.Flex() if "flex" in methods else None
    report = {"methods": methods, "reps": a.reps, "checks": {}, "cases": {}}
    if fla:
        report["fla_version"] = fla.version
    report["torch"] = torch.__version__

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(report, f, indent=1)

    flex_cases = a.flex_cases.split(",") if a.flex_cases else None

    def run_all(c, timed=False):
        """{method: (calls, o, lse, extra)}"""
        got = {}
        for m in methods:
            if m == "flex" and timed and flex_cases is not None and c.name not in flex_cases:
                continue
            try:
                if m == "ours":
                    calls, o, lse = ours_setup(c)
                    got[m] = (calls, o, lse, {})
                elif m == "fla":
                    calls, o, lse = fla_setup(fla, c)
                    got[m] = (calls, o, lse, {"configs": fla.configs()})
                elif m == "flex":
                    calls, o, lse, stats = flex_setup(flex, c)
                    got[m] = (calls, o, lse, {"stats": stats})
                else:
                    raise ValueError(f"unknown method {m}")
            except Exception as exc:  # a failing baseline is reported, the others still run
                bl.log(f"  {m} failed on {c.name}: {type(exc).__name__}: {exc}")
                got[m] = None
        return got

    for name in [x for x in a.check.split(",") if x]:
        docs, topk = mi.CHECK_CASES[name]
        c = bl.Case(name, docs, topk, mi.DEFAULT_SEED)
        ref = bl.reference(c)
        got = run_all(c)
        rec = {}
        for m, r in got.items():
            if r is None:
                rec[m] = "failed"
                continue
            _, o, lse, _ = r
            e = {"o_vs_ref": cmp_o(o, ref["o"])}
            t_abs, t_l2 = bl.TOL["o"]
            e["o_ok"] = e["o_vs_ref"]["max_abs"] <= t_abs and e["o_vs_ref"]["l2_rel"] <= t_l2
            if lse is not None:
                e["lse_vs_ref"] = cmp_lse(lse.float(), ref["lse"])
            if m != "ours" and got.get("ours"):
                e["o_vs_ours"] = cmp_o(o, got["ours"][1])
            rec[m] = e
            bl.log(f"check {name} {m}: o vs ref {fmt(e['o_vs_ref'])} {'ok' if e['o_ok'] else 'FAIL'}"
                   + (f"; lse vs ref {fmt(e['lse_vs_ref'])} {'ok' if e['lse_vs_ref']['ok'] else 'FAIL'}"
                      if "lse_vs_ref" in e else "")
                   + (f"; o vs ours {fmt(e['o_vs_ours'])}" if "o_vs_ours" in e else ""))
        report["checks"][name] = rec
        del got, ref
        save()

    flush = torch.empty(bl.FLUSH_BYTES, dtype=torch.uint8, device=bl.DEV)
    rows = []
    for name in a.cases.split(","):
        c = bl.Case(name, mi.CASES[name], mi.TOPK, mi.DEFAULT_SEED)
        flop = 2 * 256 * 16 * int(c.info["keys_attended"])
        got = run_all(c, timed=True)
        rec = {"T": c.T, "useful_flop": flop, "q2k_checksum": c.info.get("q2k_checksum")}
        for m, r in got.items():
            if r is None:
                rec[m] = "failed"
                continue
            calls, o, _lse, extra = r
            e = dict(extra)
            if m != "ours" and got.get("ours"):
                e["o_vs_ours"] = cmp_o(o, got["ours"][1])
            for label, fn in calls.items():
                s = bl.summary(bl.time_backward(fn, a.reps, 3, flush))
                s["tflops"] = flop / (s["ms_median"] * 1e-3) / 1e12
                e[label] = s
                bl.log(f"{name} {m} {label}: {s['ms_median']:.3f} ms, {s['tflops']:.1f} useful TFLOP/s"
                       + (f"; o vs ours {fmt(e['o_vs_ours'])}" if "o_vs_ours" in e else ""))
            rec[m] = e
        report["cases"][name] = rec
        del got, c
        torch.cuda.empty_cache()
        save()

        def ms(m, label):
            r = rec.get(m)
            return r[label]["ms_median"] if isinstance(r, dict) and label in r else None

        k = ms("ours", "kernel")
        cells = [name, str(rec["T"])]
        for m, label in (("ours", "kernel"), ("ours", "run_forward"), ("fla", "fla"), ("flex", "flex")):
            v = ms(m, label)
            cells.append("-" if v is None else f"{v:.3f} ({flop / (v * 1e-3) / 1e12:.0f})")
        for m, label in (("fla", "fla"), ("flex", "flex")):
            v = ms(m, label)
            cells.append("-" if v is None or k is None else f"{v / k:.2f}x")
        rows.append("| " + " | ".join(cells) + " |")
        bl.log(rows[-1])
    print("| case | T | ours kernel ms (TFLOP/s) | ours run_forward | fla | flex | fla / ours | flex / ours |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
