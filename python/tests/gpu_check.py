#!/usr/bin/env python3
"""GPU check and benchmark of the installed msa_ptx wheel, in one script (python/README.md).

1. Gradients of ``msa_ptx.run_backward`` against the fp32 PyTorch reference of
   ``bench/baselines.py`` within the seed tolerances (seed-design §4.3: dQ 0.035/0.007,
   dK 0.075/0.007, dV 0.1/0.007 max-abs/L2-rel), on the device-built and the host-built
   schedule; non-contiguous and misaligned inputs; a side stream; the forward with each
   algorithm (`out` within 0.025/0.006, `lse` within 1e-3 of the reference, empty rows exact)
   and the autograd Function on it; a flagged selection (ValueError, zero gradients); errors
   on real tensors; the context-parallel entry points on a one-rank NCCL group.
2. The backward timed against fla's ``parallel_nsa_bwd`` on the same inputs in the same run
   (``bench/baselines.py``'s cases, timing and fla setup), and the forward with each
   algorithm.

Exits non-zero if any check fails. Run from the repository root with the wheel importable:
    python3 python/tests/gpu_check.py --json $OUT/python-h200.json
"""

import argparse
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))
import baselines as bl  # noqa: E402
import msa_inputs as mi  # noqa: E402

import torch  # noqa: E402

import msa_ptx  # noqa: E402

T0 = time.time()
FAILURES = []


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def expect(ok, what):
    log(("ok   " if ok else "FAIL ") + what)
    if not ok:
        FAILURES.append(what)


def raises(exc, fn, what):
    try:
        fn()
    except exc as e:
        expect(True, f"{what}: {type(e).__name__}: {str(e)[:160]}")
        return
    except Exception as e:  # noqa: BLE001
        expect(False, f"{what}: {type(e).__name__} instead of {exc.__name__}: {e}")
        return
    expect(False, f"{what}: no error")


def ours(c, ref, schedule, q=None, **kw):
    """run_backward on the case, compact gradients and their comparison with `ref`."""
    k_aligned, v_aligned = msa_ptx.to_aligned(c.k, c.v, schedule)
    out, lse = ref["o"].bfloat16(), ref["lse"]
    dq, dka, dva = msa_ptx.run_backward(c.q if q is None else q, k_aligned, v_aligned, c.do,
                                        lse, out, schedule, **kw)
    dk, dv = msa_ptx.from_aligned(dka, dva, schedule)
    pad = torch.ones(dka.shape[0], dtype=torch.bool, device=dka.device)
    pad[msa_ptx._aligned_rows(schedule, dka.device)] = False
    padding_zero = bool((dka[pad] == 0).all() and (dva[pad] == 0).all())
    res, ok = bl.compare({"dq": dq, "dk": dk, "dv": dv}, ref)
    return res, ok and padding_zero, padding_zero, (dq, dk, dv)


def check_case(name, docs, topk, seed, report):
    c = bl.Case(name, docs, topk, seed)
    ref = bl.reference(c)
    cu = torch.tensor(c.cu, dtype=torch.int32, device="cuda")
    entry = {"docs": docs, "topk": topk, "T": c.T}
    dev_sched = msa_ptx.build_schedule(c.q2k, cu)
    for path, sched in (("device", dev_sched),
                        ("host", msa_ptx.build_schedule(c.q2k.cpu(), cu.cpu()))):
        res, ok, pad, _ = ours(c, ref, sched)
        sched.check()
        entry[path] = res
        expect(ok, f"{name} {path} schedule: {bl.fmt_cmp(res)} padding rows zero: {pad}")
    # The deterministic mode: within tolerance, and two calls give the same bits.
    res, ok, _, g1 = ours(c, ref, dev_sched, deterministic=True)
    _, _, _, g2 = ours(c, ref, dev_sched, deterministic=True)
    same = all(torch.equal(a, b) for a, b in zip(g1, g2))
    entry["deterministic"] = res
    expect(ok and same, f"{name} deterministic: {bl.fmt_cmp(res)}; two calls bitwise equal: {same}")
    # A non-contiguous q (head-major storage) and a misaligned one (2-byte offset): copied.
    q_nc = torch.empty(64, c.T, 128, dtype=torch.bfloat16, device="cuda").transpose(0, 1)
    q_nc.copy_(c.q)
    buf = torch.empty(c.q.numel() + 8, dtype=torch.bfloat16, device="cuda")
    q_mis = buf[1:1 + c.q.numel()].view(c.T, 64, 128)
    q_mis.copy_(c.q)
    for label, q in (("non-contiguous q", q_nc), ("misaligned q", q_mis)):
        res, ok, _, _ = ours(c, ref, dev_sched, q=q)
        entry[label] = res
        expect(ok, f"{name} {label} (contiguous {q.is_contiguous()}, data_ptr % 16 = "
                   f"{q.data_ptr() % 16}): {bl.fmt_cmp(res)}")
    # A side stream: the work goes there; its own workspace entry appears.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        res, ok, _, _ = ours(c, ref, msa_ptx.build_schedule(c.q2k, cu))
    torch.cuda.current_stream().wait_stream(side)
    keys = [k for k, _, _ in msa_ptx.workspace_cache()]
    entry["side stream"] = res
    expect(ok and (0, side.cuda_stream) in keys,
           f"{name} side stream: {bl.fmt_cmp(res)}; cached workspaces {keys}")
    # The forward against the fp32 reference's O and LSE: each algorithm ("auto" takes the
    # Q-parallel one at these lengths, so both kernels run by name too).
    for algorithm in msa_ptx.FORWARD_ALGORITHMS:
        out, lse, fsched, _, _ = msa_ptx.run_forward(c.q, c.k, c.v, c.q2k, cu,
                                                     algorithm=algorithm)
        fsched.check()
        finite = torch.isfinite(ref["lse"])                 # rows with at least one key
        got, want = out.float()[finite], ref["o"][finite]
        o_err = (got - want).abs().max().item() if finite.any() else 0.0
        o_rel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item() \
            if finite.any() else 0.0
        lse_err = (lse[finite] - ref["lse"][finite]).abs().max().item() if finite.any() else 0.0
        empty_ok = bool((lse[~finite] == float("-inf")).all()) and bool((out[~finite] == 0).all())
        entry[f"forward {algorithm}"] = {"out_max_abs": o_err, "out_l2_rel": o_rel,
                                         "lse_max_abs": lse_err, "empty_rows_exact": empty_ok}
        expect(o_err <= 0.025 and o_rel <= 0.006 and lse_err <= 1e-3 and empty_ok,
               f"{name} forward {algorithm}: out max-abs {o_err:.3g} L2-rel {o_rel:.3g}, "
               f"lse max-abs {lse_err:.3g}, empty rows exact {empty_ok}")
    keys = msa_ptx.forward_workspace_cache()
    expect((0, torch.cuda.current_stream().cuda_stream) in keys,
           f"{name} the KV forward's workspace is cached per stream: {keys}")
    # The autograd Function: our forward (each algorithm), then loss.backward() runs our
    # backward.
    for algorithm in ("auto", "kv_parallel"):
        q, k, v = (x.detach().clone().requires_grad_() for x in (c.q, c.k, c.v))
        out = msa_ptx.msa_attention(q, k, v, c.q2k, cu, algorithm=algorithm)
        out.backward(c.do)
        res, ok = bl.compare({"dq": q.grad, "dk": k.grad, "dv": v.grad}, ref)
        entry[f"autograd {algorithm}"] = res
        expect(ok, f"{name} autograd Function ({algorithm} forward) backward: {bl.fmt_cmp(res)}")
    report["checks"][name] = entry
    return c, ref


def check_errors(c, ref):
    cu = torch.tensor(c.cu, dtype=torch.int32, device="cuda")
    sched = msa_ptx.build_schedule(c.q2k, cu)
    ka, va = msa_ptx.to_aligned(c.k, c.v, sched)
    lse, out = ref["lse"], ref["o"].bfloat16()
    raises(TypeError, lambda: msa_ptx.run_backward(c.q.half(), ka, va, c.do, lse, out, sched),
           "fp16 q")
    raises(ValueError, lambda: msa_ptx.run_backward(c.q, ka[:-128], va, c.do, lse, out, sched),
           "k_aligned one block short")
    raises(NotImplementedError,
           lambda: msa_ptx.run_backward(c.q, ka, va, c.do, lse, out.cpu(), sched), "cpu out")
    raises(NotImplementedError, lambda: msa_ptx.require_sm100("cuda:0"), "require_sm100 on 9.0")
    raises(ValueError, lambda: msa_ptx.msa_attention(c.q, c.k, c.v, c.q2k, cu, deterministic=True,
                                                     algorithm="kv_parallel"),
           "the KV forward in deterministic mode")
    # A selection the device flags: block 1 of the first query (after its own block 0).
    bad = c.q2k.clone()
    bad[0, 0, 1] = 1
    flagged = msa_ptx.build_schedule(bad, cu)
    dq, dka, dva = msa_ptx.run_backward(c.q, ka, va, c.do, lse, out, flagged)
    raises(ValueError, flagged.check, "flagged selection")
    expect(bool((dq == 0).all() and (dka == 0).all() and (dva == 0).all()),
           "flagged selection: zero gradients")


def check_cp(report):
    """The context-parallel entry points on a one-rank NCCL group (one GPU): the forward equals
    run_forward bit for bit (the same kernel on the same rows), the backward matches the fp32
    reference, and a layout of another group size is a ValueError before any collective."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    c = bl.Case("cp_packed", [1000, 3000, 2500, 1692], 16, 20261202)
    ref = bl.reference(c)
    cu = torch.tensor(c.cu, dtype=torch.int32, device="cuda")
    layout = msa_ptx.cp_layout(cu)
    sched = msa_ptx.build_schedule(c.q2k, cu)
    ka, va = msa_ptx.to_aligned(c.k, c.v, sched)
    ks, vs = msa_ptx.cp_slice(ka, layout, 0), msa_ptx.cp_slice(va, layout, 0)
    # A CPU q2k: the rank's schedule validated on the host.
    out, lse, cp_sched = msa_ptx.cp_forward(c.q, ks, vs, c.q2k.cpu(), layout)
    out1, lse1, _, _, _ = msa_ptx.run_forward(c.q, c.k, c.v, c.q2k, cu)
    same = torch.equal(out, out1) and torch.equal(lse, lse1)
    expect(same, f"cp_forward on one rank equals run_forward bit for bit: {same}")
    dq, dks, dvs = msa_ptx.cp_backward(c.q, ks, vs, c.do, lse, out, layout, cp_sched)
    w = layout.workspace_rows
    dk, dv = msa_ptx.from_aligned(dks[:w], dvs[:w], sched)
    res, ok = bl.compare({"dq": dq, "dk": dk, "dv": dv}, ref)
    report["checks"]["cp_one_rank"] = res
    expect(ok, f"cp_backward on one rank (NCCL): {bl.fmt_cmp(res)}")
    # The rank's schedule built on the device from a CUDA q2k (no host copy).
    out_d, lse_d, dev_sched = msa_ptx.cp_forward(c.q, ks, vs, c.q2k, layout)
    dev_sched.check()
    same = torch.equal(out_d, out1) and torch.equal(lse_d, lse1)
    expect(same and type(dev_sched).__name__ == "CPRankSchedule",
           f"cp_forward on a device rank schedule ({type(dev_sched).__name__}) equals "
           f"run_forward bit for bit: {same}")
    dq, dks, dvs = msa_ptx.cp_backward(c.q, ks, vs, c.do, lse_d, out_d, layout, dev_sched)
    dk, dv = msa_ptx.from_aligned(dks[:w], dvs[:w], sched)
    res, ok = bl.compare({"dq": dq, "dk": dk, "dv": dv}, ref)
    report["checks"]["cp_one_rank_device_schedule"] = res
    expect(ok, f"cp_backward on the device rank schedule: {bl.fmt_cmp(res)}")
    expect(msa_ptx.cp_backward_status() is None,
           "cp_backward_status after an unflagged device rank schedule: None")
    bad = c.q2k.clone()
    bad[0, 0, 1] = 1
    out_b, lse_b, bad_sched = msa_ptx.cp_forward(c.q, ks, vs, bad, layout)
    raises(ValueError, bad_sched.check, "a flagged selection on a device rank schedule")
    expect(bool((out_b == 0).all()) and bool((lse_b == float("-inf")).all()),
           "a flagged device rank schedule: every row empty (out 0, lse -inf)")
    msa_ptx.cp_backward(c.q, ks, vs, c.do, lse_b, out_b, layout, bad_sched)
    raises(ValueError, msa_ptx.cp_backward_status,
           "cp_backward_status after a flagged rank schedule (rank 0)")
    two = msa_ptx.CPLayout(c.cu, 2)
    raises(ValueError, lambda: msa_ptx.cp_backward(c.q, ks, vs, c.do, lse, out, two, cp_sched),
           "cp_backward with a two-rank layout in a one-rank group")
    dist.destroy_process_group()


def bench(names, reps, warmup, report):
    fla = bl.Fla()
    flush = torch.empty(bl.FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    for name in names:
        c = bl.Case(name, mi.CASES[name], mi.TOPK, mi.DEFAULT_SEED)
        info = c.info
        cu = torch.tensor(c.cu, dtype=torch.int32, device="cuda")
        schedule = msa_ptx.build_schedule(c.q2k, cu)
        ka, va = msa_ptx.to_aligned(c.k, c.v, schedule)
        fla_bwd, _, _ = fla.setup(c)
        # The time does not depend on O's and LSE's values: randn O, a finite LSE.
        out = torch.randn_like(c.q)
        lse = torch.full((c.T, 64), 8.0, device="cuda")
        schedule.check()

        def ours_bwd():
            return msa_ptx.run_backward(c.q, ka, va, c.do, lse, out, schedule)

        t_ours = bl.summary(bl.time_backward(ours_bwd, reps, warmup, flush))
        t_fla = bl.summary(bl.time_backward(fla_bwd, reps, warmup, flush))
        useful = info["useful_flop"]
        row = {"case": name, "T": c.T, "q2k_checksum": info["q2k_checksum"], "ours": t_ours,
               "fla": t_fla, "fla_over_ours": t_fla["ms_median"] / t_ours["ms_median"],
               "ours_useful_tflops": useful / (t_ours["ms_median"] * 1e-3) / 1e12}
        # The forward as msa_attention runs it, each algorithm (the same timing: L2 flushed,
        # events read after one final sync). Useful forward FLOP per (query head, key) is
        # 2·(128 + 128), against the backward's 10·128 (`msa_inputs.useful_flop`).
        fwd_useful = useful * 4 / 10
        for algorithm in msa_ptx.FORWARD_ALGORITHMS:
            def ours_fwd(a=algorithm):
                return msa_ptx._forward(c.q, ka, va, c.q2k, schedule, a)

            t = bl.summary(bl.time_backward(ours_fwd, reps, warmup, flush))
            row[f"forward {algorithm}"] = t
            log(f"bench {name}: msa_ptx forward ({algorithm}) {t['ms_median']:.3f} ms, "
                f"{fwd_useful / (t['ms_median'] * 1e-3) / 1e12:.0f} useful TFLOP/s")
        report["bench"].append(row)
        log(f"bench {name}: msa_ptx.run_backward {t_ours['ms_median']:.3f} ms, fla "
            f"{t_fla['ms_median']:.3f} ms, fla/ours {row['fla_over_ours']:.2f}x"
            + f", ours {row['ours_useful_tflops']:.0f} useful TFLOP/s")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "python-h200.json"))
    ap.add_argument("--bench", default="doc8k", help="comma list of bench cases ('' = none)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    report = {"environment": {
        "python": platform.python_version(), "glibc": os.confstr("CS_GNU_LIBC_VERSION"),
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0), "msa_ptx": msa_ptx.__file__,
        "capability": msa_ptx.sm_capability(0), "sms": msa_ptx.sm_count("cuda:0"),
    }, "checks": {}, "bench": []}
    log(json.dumps(report["environment"]))
    msa_ptx.require_supported(torch.device("cuda", 0))
    c = ref = None
    for name, docs, topk in (("packed_tiny", [127, 129, 1, 2, 3, 5, 128], 16),
                             ("check2doc_top4", [700, 1348], 4),
                             ("doc2177_top16", [2177], 16)):
        c, ref = check_case(name, docs, topk, 20261201, report)
    check_errors(c, ref)
    check_cp(report)
    del c, ref
    torch.cuda.empty_cache()
    names = [x for x in args.bench.split(",") if x]
    if names:
        bench(names, args.reps, args.warmup, report)
    report["failures"] = FAILURES
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    log(f"{len(FAILURES)} failed" if FAILURES else "all checks passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
