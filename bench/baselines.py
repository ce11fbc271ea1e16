#!/usr/bin/env python3
"""Times the backward of public baselines for the MSA backward on one GPU (bench/README.md).

Baselines, all on identical inputs (q [T,64,128], k/v [T,4,128] bf16 randn, dO randn, the random
top-16 selection of bench/msa_inputs.py):

* ``fla``   fla-core 0.6.0 ``parallel_nsa_bwd`` (KV-parallel dK/dV over a CSR of selecting
            queries + query-parallel dQ), block size 128, our q2k as ``block_indices``
            [1,T,4,16]; varlen (cu_seqlens) when there are several documents.
* ``flex``  PyTorch FlexAttention (torch.compile, Triton backend), folded layout: the 16 query
            heads of a group moved into the sequence axis ([1,4,16T,128], one 128-row Q tile =
            8 tokens x 16 heads), K/V in the 128-aligned workspace layout [1,4,W,128]; BlockMask
            from kv-block lists at 128x128 granularity (union of the tile's 8 tokens' blocks,
            with "full" blocks split off) and an exact mask_mod (selected block, same
            document, causal).
* ``sdpa``  dense reference point: one causal ``scaled_dot_product_attention`` per document
            (i.e. exactly document-masked causal attention), cuDNN backend if it runs, else
            flash, else memory-efficient; dense FLOP.

Every baseline is first checked against an fp32 PyTorch autograd reference of the exact MSA
semantics on small cases (T = 2048) with the tolerances of seed-design 4.3; fla is re-checked
after it has autotuned on each timed case (its autotune key ignores T, so the check runs with
the very config that is timed). Then the backward alone is timed: the forward runs once, then
``torch.autograd.grad(..., retain_graph=True)`` (fla: ``parallel_nsa_bwd``) is timed with CUDA
events, median of --reps runs after --warmup runs, L2 flushed (256 MiB write) before each run.

Run from the repository root on the GPU machine, e.g.:
    PYTHONUNBUFFERED=1 python3 bench/baselines.py --json $OUT/baselines.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msa_inputs as mi  # noqa: E402

SCALE = 128 ** -0.5
# seed-design 4.3 tolerances: (max-abs, L2-rel)
TOL = {"o": (0.025, 0.006), "dq": (0.035, 0.007), "dk": (0.075, 0.007), "dv": (0.1, 0.007)}
TILE_FLOP = 5 * 2 * 128 ** 3
MATMUL_N = 8192
FLUSH_BYTES = 256 << 20

T0 = time.time()
# Device of every tensor; bench/cpu_smoke.py sets "cpu" to exercise the plumbing without a GPU.
DEV = "cuda"


def log(msg):
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# Cases on the GPU

class Case:
    """One case: the selection (numpy recipe), its layouts, and random bf16 tensors."""

    def __init__(self, name, docs, topk, seed, q2k_dir=None):
        import torch

        self.name = name
        self.docs = list(docs)
        self.topk = topk
        if q2k_dir:
            # the selection from raw files (the Rust bench's --write-inputs): numpy's recipe
            # needs a [T, blocks] key matrix per head, too slow and large past ~128K tokens
            q2k_np, cu = mi.read_inputs(q2k_dir, name, docs)
            self.info, q2k_np, self.cu = mi.describe_q2k(name, docs, seed, topk, q2k_np, cu)
            self.info["selection_from"] = q2k_dir
        else:
            self.info, q2k_np, self.cu = mi.describe(name, docs, seed, topk)
        self.q2k_np = q2k_np
        self.T = T = self.cu[-1]
        dev = DEV
        self.q2k = torch.from_numpy(q2k_np).to(dev)                     # [4,T,16] int32
        doc_id = torch.empty(T, dtype=torch.long)
        lpos = torch.empty(T, dtype=torch.long)
        starts, self.W = mi.workspace_layout(self.cu)
        ws_doc = torch.empty(T, dtype=torch.long)
        for d in range(len(self.docs)):
            s, e = self.cu[d], self.cu[d + 1]
            doc_id[s:e] = d
            lpos[s:e] = torch.arange(e - s)
            ws_doc[s:e] = starts[d]
        self.doc_id = doc_id.to(dev)
        self.lpos = lpos.to(dev)
        self.ws_doc_start = ws_doc.to(dev)                              # workspace row of doc start
        self.ws_pos = (ws_doc + lpos).to(dev)                           # workspace row of token
        self.nbmax = max((n + 127) // 128 for n in self.docs)
        g = torch.Generator(device=dev)
        g.manual_seed(seed + 1)
        bf = torch.bfloat16
        self.q = torch.randn(T, 64, 128, generator=g, device=dev, dtype=bf)
        self.k = torch.randn(T, 4, 128, generator=g, device=dev, dtype=bf)
        self.v = torch.randn(T, 4, 128, generator=g, device=dev, dtype=bf)
        self.do = torch.randn(T, 64, 128, generator=g, device=dev, dtype=bf)

    def selected(self):
        """sel[h, t, b]: token t (index head h) selected its document-local block b; [4,T,nbmax]."""
        import torch

        idx = self.q2k.long().clone()
        idx[idx < 0] = self.nbmax
        sel = torch.zeros(4, self.T, self.nbmax + 1, dtype=torch.bool, device=DEV)
        sel.scatter_(2, idx, True)
        return sel[..., : self.nbmax].contiguous()


def reference(c):
    """fp32 autograd reference of the exact MSA semantics (seed-design 1.4): O, its LSE
    [T,64] and dQ/dK/dV for dO = c.do."""
    import torch

    T = c.T
    sel = c.selected()
    lblk = (c.lpos // 128).view(1, 1, T).expand(4, T, T)
    allowed = sel.gather(2, lblk)                                       # [g, t, s]: block of s selected by t
    ar = torch.arange(T, device=DEV)
    allowed &= (c.doc_id[:, None] == c.doc_id[None, :]) & (ar[None, :] <= ar[:, None])
    qf = c.q.float().requires_grad_()
    kf = c.k.float().requires_grad_()
    vf = c.v.float().requires_grad_()
    qg = qf.view(T, 4, 16, 128).permute(1, 2, 0, 3)                    # [4,16,T,128]
    s = torch.einsum("gjtd,gsd->gjts", qg, kf.permute(1, 0, 2)) * SCALE
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    og = torch.einsum("gjts,gsd->gjtd", p, vf.permute(1, 0, 2))
    o = og.permute(2, 0, 1, 3).reshape(T, 64, 128)
    dq, dk, dv = torch.autograd.grad(o, (qf, kf, vf), c.do.float())
    lse = torch.logsumexp(s.detach(), dim=-1).permute(2, 0, 1).reshape(T, 64)  # natural log
    return {"o": o.detach(), "dq": dq, "dk": dk, "dv": dv, "lse": lse}


def compare(got, ref, tol=True):
    """max-abs and L2-rel of each tensor in `got` against `ref` (float)."""
    import torch

    out, ok = {}, True
    for key in ("o", "dq", "dk", "dv"):
        if key not in got or key not in ref:
            continue
        a, e = got[key].float(), ref[key].float()
        diff = a - e
        finite = bool(torch.isfinite(a).all().item())
        max_abs = diff.abs().max().item() if finite else math.inf
        l2 = (diff.norm() / e.norm().clamp_min(1e-30)).item() if finite else math.inf
        entry = {"max_abs": max_abs, "l2_rel": l2}
        if tol:
            t_abs, t_l2 = TOL[key]
            entry["tol"] = [t_abs, t_l2]
            entry["ok"] = finite and max_abs <= t_abs and l2 <= t_l2
            ok = ok and entry["ok"]
        out[key] = entry
    return out, ok


def fmt_cmp(res):
    return " ".join(f"{k}:{v['max_abs']:.3g}/{v['l2_rel']:.2g}{'' if v.get('ok', True) else '(FAIL)'}"
                    for k, v in res.items())


# ---------------------------------------------------------------------------------------------
# Timing

def time_backward(fn, reps, warmup, flush):
    """CUDA-event times (ms) of `fn` after `warmup` untimed calls; `flush` (a tensor) is
    overwritten before each timed call, outside the timed region."""
    import torch

    for _ in range(warmup):
        r = fn()
        del r
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        r = fn()
        ends[i].record()
        del r
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def summary(samples):
    xs = sorted(samples)
    n = len(xs)
    med = xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
    return {"ms_median": med, "ms_min": xs[0], "ms_max": xs[-1], "samples_ms": [round(x, 4) for x in samples]}


def matmul_ceiling(reps):
    import torch

    g = torch.Generator(device=DEV)
    g.manual_seed(7)
    a = torch.randn(MATMUL_N, MATMUL_N, generator=g, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(MATMUL_N, MATMUL_N, generator=g, device=DEV, dtype=torch.bfloat16)
    c = torch.empty(MATMUL_N, MATMUL_N, device=DEV, dtype=torch.bfloat16)
    ms = time_backward(lambda: torch.mm(a, b, out=c), max(reps, 30), 5, None)
    s = summary(ms)
    s["tflops"] = 2 * MATMUL_N ** 3 / (s["ms_median"] * 1e-3) / 1e12
    del a, b, c
    return s


# ---------------------------------------------------------------------------------------------
# Baselines. Each `setup(case)` runs the forward once and returns (bwd, result): `bwd()` runs
# the backward and returns its raw gradients; `result(grads)` maps them to compact
# {o, dq [T,64,128], dk, dv [T,4,128]} for checking.

class Fla:
    key = "fla"
    label = "fla parallel_nsa_bwd, block 128"

    def __init__(self):
        # Autotune results must not be cached on disk: the timed config is re-tuned per case.
        os.environ["FLA_CACHE_RESULTS"] = "0"
        import fla
        from fla.ops.nsa import parallel as nsa
        from fla.ops.utils import prepare_chunk_indices, prepare_token_indices

        self.version = getattr(fla, "__version__", "?")
        self.nsa = nsa
        self.prepare_chunk_indices = prepare_chunk_indices
        self.prepare_token_indices = prepare_token_indices

    def tuners(self):
        out = {}
        for name in ("parallel_nsa_fwd_kernel", "parallel_nsa_bwd_kernel_dq", "parallel_nsa_bwd_kernel_dkv"):
            obj = getattr(self.nsa, name, None)
            for _ in range(5):
                if obj is None or hasattr(obj, "configs"):
                    break
                obj = getattr(obj, "fn", None)
            if obj is not None and hasattr(obj, "cache"):
                out[name] = obj
        return out

    def reset_autotune(self):
        for t in self.tuners().values():
            if hasattr(t, "cache_results"):
                t.cache_results = False
            t.cache.clear()

    def configs(self):
        return {name: str(getattr(t, "best_config", None)) for name, t in self.tuners().items()}

    def setup(self, c):
        import torch

        varlen = len(c.docs) > 1
        bi = c.q2k.permute(1, 0, 2).contiguous().unsqueeze(0)          # [1,T,4,16], doc-local ids
        cu = torch.tensor(c.cu, dtype=torch.long, device=DEV) if varlen else None
        tok = self.prepare_token_indices(cu) if varlen else None
        chunks = self.prepare_chunk_indices(cu, 128) if varlen else None
        q, k, v, do = (x.unsqueeze(0) for x in (c.q, c.k, c.v, c.do))
        o, lse = self.nsa.parallel_nsa_fwd(
            q=q, k=k, v=v, block_indices=bi, block_counts=mi.TOPK, block_size=128, scale=SCALE,
            cu_seqlens_q=cu, cu_seqlens_k=cu, token_indices_q=tok)

        def bwd():
            return self.nsa.parallel_nsa_bwd(
                q=q, k=k, v=v, o=o, lse=lse, do=do, block_indices=bi, block_counts=mi.TOPK,
                block_size=128, scale=SCALE, cu_seqlens=cu, token_indices=tok, chunk_indices=chunks)

        def result(grads):
            dq, dk, dv = grads
            return {"o": o[0], "dq": dq[0], "dk": dk[0], "dv": dv[0]}

        return bwd, result, {"varlen": varlen}


def fold_q(x, T):
    """[T,64,128] -> [1,4,16T,128]: row t*16+j of group g is query head 16g+j of token t."""
    return x.view(T, 4, 16, 128).permute(1, 0, 2, 3).reshape(1, 4, 16 * T, 128)


def unfold_q(x, T):
    return x.reshape(4, T, 16, 128).permute(1, 0, 2, 3).reshape(T, 64, 128)


def fold_kv(c, x):
    """Compact [T,4,128] -> aligned workspace layout [1,4,W,128], zero padding rows."""
    import torch

    al = torch.zeros(c.W, 4, 128, dtype=x.dtype, device=DEV)
    al[c.ws_pos] = x
    return al.permute(1, 0, 2).reshape(1, 4, c.W, 128)


class Flex:
    key = "flex"
    label = "FlexAttention, folded layout"

    def __init__(self, compile=True):
        import torch
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        for attr in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, attr):
                setattr(torch._dynamo.config, attr, 256)
        self.BlockMask = BlockMask
        # Without torch.compile the backward is a math fallback that materialises the scores
        # (pytorch #182611): only for bench/cpu_smoke.py.
        self.fn = torch.compile(flex_attention, dynamic=False) if compile else flex_attention

    @staticmethod
    def block_lists(c):
        """(counts, full, partial) over [4, T/8 tiles, W/128 workspace blocks]: how many of a
        tile's 8 tokens selected the block; blocks every row of the tile attends entirely;
        the other blocks of the union."""
        import torch

        T, W = c.T, c.W
        if T % 8:
            raise ValueError("the folded layout needs T % 8 == 0")
        nqt, nbw = T // 8, W // 128
        dev = DEV
        gid = c.q2k.long()
        valid = gid >= 0
        gblk = (c.ws_doc_start // 128)[None, :, None] + gid             # workspace block
        tile = torch.arange(T, device=dev) // 8
        flat = (torch.arange(4, device=dev)[:, None, None] * nqt + tile[None, :, None]) * nbw + gblk
        counts = torch.zeros(4 * nqt * nbw, dtype=torch.int32, device=dev)
        counts.index_add_(0, flat[valid], torch.ones(int(valid.sum().item()), dtype=torch.int32, device=dev))
        counts = counts.view(4, nqt, nbw)
        same_doc = c.doc_id[0::8] == c.doc_id[7::8]
        first_pos = c.ws_pos[0::8]
        block_end = (torch.arange(nbw, device=dev) + 1) * 128 - 1
        # full: all 8 tokens selected it, one document, every key at or before the first token
        full = (counts == 8) & same_doc[None, :, None] & (block_end[None, None, :] <= first_pos[None, :, None])
        partial = (counts > 0) & ~full
        return counts, full, partial

    def block_mask(self, c):
        """BlockMask over (folded Q [16T], aligned KV [W]) at 128x128, plus its statistics."""
        import torch

        T, W = c.T, c.W
        nqt = T // 8
        counts, full, partial = self.block_lists(c)

        def ordered(m):
            num = m.sum(-1, dtype=torch.int32)
            idx = torch.argsort(m.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
            return num.unsqueeze(0).contiguous(), idx.unsqueeze(0).contiguous()

        kv_num, kv_idx = ordered(partial)
        f_num, f_idx = ordered(full)
        sel = c.selected()                                              # [4, T, nbmax]
        qpos = c.ws_pos.to(torch.int32)
        dstart = c.ws_doc_start.to(torch.int32)
        nbmax = c.nbmax

        def mask_mod(b, h, q_idx, kv_idx):
            t = q_idx // 16
            ds = dstart[t]
            lb = torch.clamp((kv_idx - ds) // 128, 0, nbmax - 1)
            return sel[h, t, lb] & (kv_idx >= ds) & (kv_idx <= qpos[t])

        bm = self.BlockMask.from_kv_blocks(
            kv_num, kv_idx, f_num, f_idx, BLOCK_SIZE=(128, 128), mask_mod=mask_mod,
            seq_lengths=(16 * T, W))
        pairs = int((counts > 0).sum().item())
        stats = {
            "tile_pairs": pairs,
            "full_pairs": int(full.sum().item()),
            "union_ratio": pairs / (4 * nqt) / mi.TOPK,   # mean blocks per 128-row tile / 16
            "executed_flop": pairs * TILE_FLOP,
        }
        return bm, stats

    def setup(self, c, grad=True):
        import torch

        T, W = c.T, c.W
        sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        bm, stats = self.block_mask(c)
        sync()
        stats["blockmask_ms"] = (time.perf_counter() - t0) * 1e3

        def unfold_kv(x):
            return x.reshape(4, W, 128).permute(1, 0, 2)[c.ws_pos]

        qf = fold_q(c.q, T).detach().requires_grad_(grad)
        kf = fold_kv(c, c.k).detach().requires_grad_(grad)
        vf = fold_kv(c, c.v).detach().requires_grad_(grad)
        dof = fold_q(c.do, T).contiguous()
        out = self.fn(qf, kf, vf, block_mask=bm, scale=SCALE)
        stats["fold_roundtrip_ok"] = bool(torch.equal(unfold_q(qf.detach(), T), c.q)) and bool(
            torch.equal(unfold_kv(kf.detach()), c.k))

        def bwd():
            return torch.autograd.grad(out, (qf, kf, vf), dof, retain_graph=True)

        def result(grads):
            if grads is None:                                           # forward only
                return {"o": unfold_q(out.detach(), T)}
            dq, dk, dv = grads
            return {"o": unfold_q(out.detach(), T), "dq": unfold_q(dq, T), "dk": unfold_kv(dk), "dv": unfold_kv(dv)}

        return bwd, result, stats


class Sdpa:
    key = "sdpa"
    label = "dense SDPA, causal per document"

    def __init__(self):
        self.backend = None
        self.gqa = True

    def candidates(self):
        from torch.nn.attention import SDPBackend

        return [(b, gqa) for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                   SDPBackend.EFFICIENT_ATTENTION) for gqa in (True, False)]

    def setup(self, c):
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        leaves, outs, dos = [], [], []
        for d in range(len(c.docs)):
            s, e = c.cu[d], c.cu[d + 1]
            qd = c.q[s:e].transpose(0, 1).unsqueeze(0).contiguous().requires_grad_()
            kd = c.k[s:e].transpose(0, 1).unsqueeze(0)
            vd = c.v[s:e].transpose(0, 1).unsqueeze(0)
            if not self.gqa:
                kd, vd = kd.repeat_interleave(16, dim=1), vd.repeat_interleave(16, dim=1)
            kd = kd.contiguous().requires_grad_()
            vd = vd.contiguous().requires_grad_()
            with sdpa_kernel([self.backend]):
                od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=SCALE,
                                                    enable_gqa=self.gqa)
            leaves += [qd, kd, vd]
            outs.append(od)
            dos.append(c.do[s:e].transpose(0, 1).unsqueeze(0).contiguous())

        def bwd():
            return torch.autograd.grad(outs, leaves, dos, retain_graph=True)

        def result(grads):
            def kv(x):
                x = x[0]
                if not self.gqa:
                    x = x.view(4, 16, x.shape[1], 128).sum(1)
                return x.transpose(0, 1)
            o = torch.cat([od[0].detach().transpose(0, 1) for od in outs])
            dq = torch.cat([grads[3 * d][0].transpose(0, 1) for d in range(len(outs))])
            dk = torch.cat([kv(grads[3 * d + 1]) for d in range(len(outs))])
            dv = torch.cat([kv(grads[3 * d + 2]) for d in range(len(outs))])
            return {"o": o, "dq": dq, "dk": dk, "dv": dv}

        return bwd, result, {"backend": str(self.backend), "enable_gqa": self.gqa}

    def pick(self, c):
        """First (backend, enable_gqa) that runs forward + backward on case c."""
        import torch

        errors = []
        for backend, gqa in self.candidates():
            self.backend, self.gqa = backend, gqa
            try:
                bwd, result, _ = self.setup(c)
                res = result(bwd())
                if DEV == "cuda":
                    torch.cuda.synchronize()
                return res, errors
            except Exception as exc:  # noqa: BLE001 - any failure means: try the next backend
                errors.append(f"{backend} gqa={gqa}: {type(exc).__name__}: {str(exc)[:200]}")
        self.backend = None
        return None, errors


# ---------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(mi.TIMED_CASES), help="comma list of " + ", ".join(mi.CASES))
    ap.add_argument("--methods", default="fla,flex,sdpa", help="comma list of fla, flex, sdpa")
    ap.add_argument("--reps", type=int, default=20, help="timed runs per method and case (>= 20 advised)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs first (after compile/autotune)")
    ap.add_argument("--seed", type=int, default=mi.DEFAULT_SEED)
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "baselines.json"),
                    help="output JSON path (default $OUT/baselines.json, else ./baselines.json)")
    ap.add_argument("--inputs-dir", default="/tmp/msa_bench_inputs",
                    help="where to write <case>.q2k.i32 / .cu_seqlens.i32 / .npz ('' = do not write)")
    ap.add_argument("--no-flush", action="store_true", help="do not flush L2 before each timed run")
    ap.add_argument("--strict", action="store_true", help="do not time a method whose check failed")
    ap.add_argument("--no-xcheck", action="store_true", help="skip comparing flex with fla on the timed cases")
    ap.add_argument("--q2k-from", default="",
                    help="read each timed case's q2k/cu_seqlens from DIR/<case>.q2k.i32 and .cu_seqlens.i32 "
                         "(the Rust bench's --write-inputs) instead of the numpy recipe, which is too slow "
                         "past ~128K tokens")
    ap.add_argument("--fla-tune-once", action="store_true",
                    help="autotune fla on the first timed case only and keep those configs for the later "
                         "cases (its autotune key ignores T; saves minutes of tuning at 1M tokens); the "
                         "check cases then run once, on those configs")
    args = ap.parse_args(argv)

    cases = [x for x in args.cases.split(",") if x]
    methods = [x for x in args.methods.split(",") if x]
    for x in cases:
        if x not in mi.CASES:
            sys.exit(f"unknown case {x!r}; known: {', '.join(mi.CASES)}")
    for x in methods:
        if x not in ("fla", "flex", "sdpa"):
            sys.exit(f"unknown method {x!r}")

    import torch
    import triton

    if not torch.cuda.is_available():
        print("no CUDA device visible to torch; nothing to time")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    props = torch.cuda.get_device_properties(0)
    report = {
        "environment": {
            "gpu": torch.cuda.get_device_name(0),
            "sms": props.multi_processor_count,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton.__version__,
        },
        "settings": {
            "reps": args.reps, "warmup": args.warmup, "l2_flush": not args.no_flush, "seed": args.seed,
            "timing": "CUDA events around the backward only (forward run once before); median",
            "useful_flop": "10*128*sum_(t,h) keys attended (64 query heads); dense: causal keys per document",
        },
        "checks": {},
        "cases": [],
    }
    env = report["environment"]
    log(f"{env['gpu']} ({env['sms']} SMs), torch {env['torch']}, triton {env['triton']}, cuda {env['cuda']}")

    def save():
        if args.json:
            d = os.path.dirname(os.path.abspath(args.json))
            os.makedirs(d, exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    flush = None if args.no_flush else torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=DEV)

    mm = matmul_ceiling(args.reps)
    report["matmul"] = {"n": MATMUL_N, **mm}
    ceiling = mm["tflops"]
    log(f"matmul ceiling {MATMUL_N}^3 bf16: {ceiling:.1f} TFLOP/s ({mm['ms_median']:.3f} ms)")
    save()

    # -- small cases and the fp32 reference ----------------------------------------------------
    checks = {}
    for name, (docs, topk) in mi.CHECK_CASES.items():
        c = Case(name, docs, topk, args.seed)
        checks[name] = (c, reference(c))
    torch.cuda.empty_cache()
    log(f"references of the check cases ({', '.join(checks)}) done")

    def run_checks(method_key, obj, names):
        res_all, ok_all = {}, True
        for nm in names:
            c, ref = checks[nm]
            bwd, result, _ = obj.setup(c)
            res, ok = compare(result(bwd()), ref)
            res_all[nm] = res
            ok_all = ok_all and ok
            log(f"  check {method_key:5s} {nm:16s} {'ok  ' if ok else 'FAIL'} {fmt_cmp(res)}")
        res_all["passed"] = ok_all
        return res_all, ok_all

    impl = {}
    passed = {}

    def failed(method, exc):
        import traceback

        traceback.print_exc()
        msg = f"{type(exc).__name__}: {exc}"[:2000]
        log(f"  {method}: ERROR {msg[:300]}")
        report["checks"][method] = {"passed": False, "error": msg}
        passed[method] = False
        save()

    if "fla" in methods:
        try:
            impl["fla"] = Fla()
            env["fla"] = impl["fla"].version
        except Exception as exc:  # noqa: BLE001 - e.g. the wheel is not installed
            failed("fla", exc)
    if "flex" in methods:
        try:
            impl["flex"] = Flex()
            log("checking flex (compiles the T=2048 shape)")
            report["checks"]["flex"], passed["flex"] = run_checks(
                "flex", impl["flex"], ["check2doc_top16", "check2doc_top4"])
            save()
        except Exception as exc:  # noqa: BLE001 - still try to time it
            failed("flex", exc)
    if "sdpa" in methods:
        s = Sdpa()
        c, ref = checks["check2doc_top16"]
        # the dense document-causal mask equals this case's selection (all blocks selected)
        assert c.info["keys_attended"] == 4 * c.info["dense_causal_keys_per_head"], "check case is not dense"
        got, errors = s.pick(c)
        if got is None:
            log("sdpa: no backend ran: " + "; ".join(errors))
            report["checks"]["sdpa"] = {"passed": False, "errors": errors}
            passed["sdpa"] = False
        else:
            res, ok = compare(got, ref)
            report["checks"]["sdpa"] = {"check2doc_top16": res, "passed": ok, "backend": str(s.backend),
                                        "enable_gqa": s.gqa, "skipped_backends": errors}
            passed["sdpa"] = ok
            log(f"  check sdpa  check2doc_top16  {'ok  ' if ok else 'FAIL'} {fmt_cmp(res)} "
                f"[{s.backend}, enable_gqa={s.gqa}]")
            impl["sdpa"] = s
        save()

    # -- timed cases ------------------------------------------------------------------------------
    rows = []
    for name in cases:
        c = Case(name, mi.CASES[name], mi.TOPK, args.seed, q2k_dir=args.q2k_from or None)
        info = dict(c.info)
        if args.inputs_dir:
            mi.write_inputs(args.inputs_dir, name, c.q2k_np, c.cu, args.seed, mi.TOPK)
        log(f"case {name}: T={c.T}, {len(c.docs)} doc(s), W={c.W}, keys attended {info['keys_attended']}, "
            f"useful {info['useful_flop'] / 1e12:.3f} TFLOP, q2k checksum {info['q2k_checksum']}")
        entry = {**info, "workspace_rows": c.W, "methods": {}}
        report["cases"].append(entry)
        fla_grads = None
        for m in methods:
            if m not in impl:
                entry["methods"][m] = {"label": m, "error": "not available: " + str(report["checks"].get(m))[:500]}
                continue
            obj = impl[m]
            rec = {"label": obj.label}
            try:
                if m == "fla":
                    tuned = bool(getattr(obj, "tuned_once", False))
                    if not (args.fla_tune_once and tuned):
                        obj.reset_autotune()
                    obj.tuned_once = True
                    rec["autotuned_here"] = not (args.fla_tune_once and tuned)
                    bwd, result, extra = obj.setup(c)
                    r = bwd()                                           # autotunes at this size
                    del r
                    torch.cuda.synchronize()
                    rec["configs"] = obj.configs()
                    log(f"  fla configs: {rec['configs']}")
                    if rec["autotuned_here"] or rec["configs"] != getattr(obj, "checked_configs", None):
                        rec["check"], ok = run_checks("fla", obj, list(mi.CHECK_CASES))
                        obj.checked_configs, obj.checked_ok = rec["configs"], ok
                    else:
                        # --fla-tune-once: the configs checked on an earlier case, unchanged
                        ok = obj.checked_ok
                        rec["check"] = {"passed": ok, "same_configs_as_checked": True}
                    rec["check_passed"] = ok
                    if obj.configs() != rec["configs"]:
                        rec["warning"] = "autotune config changed during the check"
                else:
                    ok = passed.get(m, False)
                    rec["check_passed"] = ok
                    bwd, result, extra = obj.setup(c)
                rec.update(extra)
                if args.strict and not ok:
                    rec["skipped"] = "check failed (--strict)"
                    log(f"  {m}: skipped, check failed")
                    entry["methods"][m] = rec
                    continue
                samples = time_backward(bwd, args.reps, args.warmup, flush)
                rec.update(summary(samples))
                ms = rec["ms_median"]
                if m == "sdpa":
                    dense_flop = 10 * 128 * 64 * info["dense_causal_keys_per_head"]
                    rec["dense_flop"] = dense_flop
                    rec["useful_tflops"] = dense_flop / (ms * 1e-3) / 1e12
                    rec["flop_basis"] = "dense causal per document"
                    rec["msa_useful_tflops_equiv"] = info["useful_flop"] / (ms * 1e-3) / 1e12
                else:
                    rec["useful_tflops"] = info["useful_flop"] / (ms * 1e-3) / 1e12
                    rec["flop_basis"] = "MSA useful (selected causal keys)"
                if m == "flex":
                    rec["executed_tflops"] = rec["executed_flop"] / (ms * 1e-3) / 1e12
                rec["fraction_of_ceiling"] = rec["useful_tflops"] / ceiling
                # cross-check on the timed case itself (fla vs flex, both sparse)
                if not args.no_xcheck and m in ("fla", "flex"):
                    got = {k: v.detach() for k, v in result(bwd()).items()}
                    if m == "fla":
                        fla_grads = got
                    elif fla_grads is not None:
                        rec["xcheck_vs_fla"], _ = compare(got, fla_grads, tol=False)
                        log(f"  flex vs fla on {name}: {fmt_cmp(rec['xcheck_vs_fla'])}")
                    del got
                log(f"  {m:5s} bwd {ms:9.3f} ms (min {rec['ms_min']:.3f}), {rec['useful_tflops']:7.1f} TFLOP/s "
                    f"({rec['flop_basis']}), {rec['fraction_of_ceiling']:.3f} of matmul"
                    + (f", union {rec['union_ratio']:.2f}x, executed {rec['executed_tflops']:.1f} TFLOP/s"
                       if m == "flex" else ""))
                rows.append((name, m, rec))
            except Exception as exc:  # noqa: BLE001 - record and go on with the next method
                import traceback

                traceback.print_exc()
                rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                log(f"  {m}: ERROR {rec['error'][:300]}")
            entry["methods"][m] = rec
            bwd = result = None
            save()
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - a sticky CUDA error; later methods record theirs
                log(f"  after {m}: {type(exc).__name__}: {str(exc)[:300]}")
        del fla_grads, c

    # -- table ------------------------------------------------------------------------------------
    print()
    print(f"matmul ceiling ({MATMUL_N}^3 bf16): {ceiling:.1f} TFLOP/s; {args.reps} timed runs, median")
    hdr = f"{'case':10s} {'method':34s} {'bwd ms':>9s} {'min ms':>9s} {'TFLOP/s':>8s} {'frac':>6s} {'check':>6s}  note"
    print(hdr)
    print("-" * len(hdr))
    for name, m, rec in rows:
        note = ""
        if m == "flex":
            note = f"union {rec['union_ratio']:.2f}x, executed {rec['executed_tflops']:.1f} TFLOP/s"
        elif m == "sdpa":
            note = f"dense FLOP; {rec['backend'].split('.')[-1]}, gqa={rec['enable_gqa']}"
        elif m == "fla":
            note = "varlen" if rec.get("varlen") else "single doc"
        print(f"{name:10s} {rec['label']:34s} {rec['ms_median']:9.3f} {rec['ms_min']:9.3f} "
              f"{rec['useful_tflops']:8.1f} {rec['fraction_of_ceiling']:6.3f} "
              f"{'ok' if rec.get('check_passed') else 'FAIL':>6s}  {note}")
    save()
    if args.json:
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
