//! `bwd_preprocess`: `delta[t, h] = Σ_d O[t, h, d] · dO[t, h, d]` in fp32 (`docs/design.md` §3.2).
//!
//! Grid `[ceil(T/2)]`, 256 threads: one CTA reduces 128 consecutive rows `(t, h)` of the
//! `[T·64, 128]` inputs (two tokens), so that each CTA reads two contiguous 32 KiB spans. A
//! row is 128 bf16 = 256 bytes, read by 16 lanes with one 16-byte load each of O and dO; the
//! 16 partial sums meet in a butterfly over lane distances 1, 2, 4, 8. 256 threads cover 16
//! rows per pass; all 8 passes' loads are issued before the first sum (one CTA keeps 64 KiB
//! in flight), and rows past the end are loaded clamped and not stored.

use super::fixed_point::{self as fp, abs_bits};
use super::KernelDesc;
use crate::ptx::*;
use crate::target::Target;

/// The deterministic mode's preprocess (`docs/design.md` §3.8).
pub const DETERMINISTIC: KernelDesc = KernelDesc {
    name: "bwd_preprocess_det",
    about: "delta as bwd_preprocess, and the bounds of the deterministic mode's fixed-point units: per (t, group) a = max(|dO|_1, |delta|), and per group max |K|, |V|, |Q|, |dO|, a",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: describe_deterministic,
};

/// The preprocess kernel.
pub const DESC: KernelDesc = KernelDesc {
    name: "bwd_preprocess",
    about: "delta[t,h] = sum_d O[t,h,d]*dO[t,h,d] in fp32 from bf16 O and dO",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe,
};

const THREADS: u32 = 256;
/// Rows (tokens) one CTA covers.
pub const ROWS_PER_CTA: u32 = 128;
const LANES_PER_ROW: u32 = 16;
const ROWS_PER_PASS: u32 = THREADS / LANES_PER_ROW;
const HEADS: u32 = 64;
const HEAD_DIM: u32 = 128;

/// One lane's 16 bytes of a row.
type Words = [Reg<Bf16x2>; 4];

fn describe(b: &mut KernelBuilder) {
    b.grid("[ceil(num_tokens / 2), 1, 1]");
    let out_p = b.param_ptr("out", HostElem::Bf16, false);
    let dout_p = b.param_ptr("dout", HostElem::Bf16, false);
    let delta_p = b.param_ptr("delta", HostElem::F32, true);
    let tokens_p = b.param_u32("num_tokens");

    let out = b.ld_param_ptr(&out_p);
    let dout = b.ld_param_ptr(&dout_p);
    let delta = b.ld_param_ptr(&delta_p);
    let tokens = b.ld_param(&tokens_p);
    let tid = b.sreg(SReg::TidX);
    let block = b.sreg(SReg::CtaidX);

    // Rows (t, h) in memory order, t·64 + h: a CTA streams 32 KiB of each input.
    let rows = b.mul_lo(tokens, HEADS);
    let last = b.sub(rows, 1u32);
    let part = b.and(tid, LANES_PER_ROW - 1);
    let sub_row = b.shr(tid, 4u32);
    let first = b.mul_lo(block, ROWS_PER_CTA);
    let first = b.add(first, sub_row);
    // Byte offset of this lane's 8 elements inside a row.
    let lane_bytes = b.shl(part, 4u32);
    let lane_bytes = b.cvt::<U64, U32>(lane_bytes);
    let leader = b.setp(Cmp::Eq, part, 0u32);

    // Every load first (16 × 16 B per lane in flight): a row past the end loads the last row
    // instead (no branch around the loads), and its sum is not stored.
    let passes = ROWS_PER_CTA / ROWS_PER_PASS;
    let row_of: Vec<Reg<U32>> = (0..passes)
        .map(|pass| b.add(first, pass * ROWS_PER_PASS))
        .collect();
    let loads: Vec<(Words, Words)> = row_of
        .iter()
        .map(|&row| {
            let row = b.min(row, last);
            let row_bytes = b.mul_wide(row, HEAD_DIM * 2);
            let off = b.add(row_bytes, lane_bytes);
            let o_addr = b.add(out, off);
            let d_addr = b.add(dout, off);
            (
                b.ld_global_nc_v(&global(o_addr, 0)),
                b.ld_global_nc_v(&global(d_addr, 0)),
            )
        })
        .collect();
    for (&row, (o, d)) in row_of.iter().zip(loads) {
        let mut acc = b.mov::<F32>(0.0f32);
        for i in 0..4 {
            let (o_lo, o_hi) = b.bf16x2_to_f32(o[i]);
            let (d_lo, d_hi) = b.bf16x2_to_f32(d[i]);
            acc = b.fma(o_lo, d_lo, acc);
            acc = b.fma(o_hi, d_hi, acc);
        }
        for dist in [1u32, 2, 4, 8] {
            let other = b.shfl(Shfl::Bfly, acc, dist, 0x1f);
            acc = b.add(acc, other);
        }
        let live = b.setp(Cmp::Lt, row, rows);
        let store = b.and_pred(live, leader);
        let row_f32 = b.mul_wide(row, 4u32);
        let dst = b.add(delta, row_f32);
        b.predicated(store, false, |b| b.st(&global(dst, 0), acc));
    }
    b.ret();
}

/// Heads per KV group.
const GROUP_HEADS: u32 = 16;
/// KV groups.
const GROUPS: u32 = 4;

/// `bwd_preprocess_det`. Grid `[ceil(max(T, W)/128), 4 + 4]`, 256 threads: `blockIdx.y = g < 4`
/// covers 128 tokens of KV group `g`, each warp one token's 16 heads at a time (Δ as
/// [`DESC`], plus `‖dO‖₁`, `max|dO|` and `max|Q|` of each row), so that `a[t, g]` (the maximum
/// over the group's heads) meets in one warp and is stored, not reduced with atomics;
/// `blockIdx.y = 4 + g` reduce 128 rows of K and V of group `g`. The maxima of a CTA meet in
/// shared memory (integer max on the bits), and one thread folds them into the `bounds`
/// buffer, so its words see one atomic per CTA.
fn describe_deterministic(b: &mut KernelBuilder) {
    b.grid("[ceil(max(num_tokens, workspace_rows) / 128), 8, 1]");
    let out_p = b.param_ptr("out", HostElem::Bf16, false);
    let dout_p = b.param_ptr("dout", HostElem::Bf16, false);
    let q_p = b.param_ptr("q", HostElem::Bf16, false);
    let k_p = b.param_ptr("k_aligned", HostElem::Bf16, false);
    let v_p = b.param_ptr("v_aligned", HostElem::Bf16, false);
    let delta_p = b.param_ptr("delta", HostElem::F32, true);
    let rows_p = b.param_ptr("row_bounds", HostElem::I32, true);
    let bounds_p = b.param_ptr("bounds", HostElem::I32, true);
    let tokens_p = b.param_u32("num_tokens");
    let ws_p = b.param_u32("workspace_rows");
    let cta_max = b.shared_array("cta_max", 16, 16);

    let tid = b.sreg(SReg::TidX);
    let block = b.sreg(SReg::CtaidX);
    let y = b.sreg(SReg::CtaidY);
    let t0 = b.setp(Cmp::Eq, tid, 0u32);
    let maxima = b.shared_base(&cta_max);
    let tokens = b.ld_param(&tokens_p);
    let ws_rows = b.ld_param(&ws_p);
    let bounds = b.ld_param_ptr(&bounds_p);
    let is_kv = b.setp(Cmp::Ge, y, GROUPS);
    let limit = b.selp(ws_rows, tokens, is_kv);
    let start = b.mul_lo(block, ROWS_PER_CTA);
    let idle = b.setp(Cmp::Ge, start, limit);
    b.if_then(idle, "idle", |b| b.ret());
    b.predicated(t0, false, |b| {
        let z = b.mov::<U32>(0u32);
        b.st_v(&shared(maxima, 0), [z, z, z, z]);
    });
    b.bar_sync(0, None);
    // A butterfly of one value over lane distances `dists` (sum of f32 bits, or integer max).
    let reduce = |b: &mut KernelBuilder, v: Reg<U32>, add: bool, dists: &[u32]| -> Reg<U32> {
        let mut acc = v;
        for &dist in dists {
            let other = b.shfl(Shfl::Bfly, acc, dist, 0x1f);
            acc = if add {
                let x = b.bitcast::<F32, U32>(acc);
                let y = b.bitcast::<F32, U32>(other);
                let s = b.add(x, y);
                b.bitcast::<U32, F32>(s)
            } else {
                b.max(acc, other)
            };
        }
        acc
    };
    const ROW: [u32; 4] = [1, 2, 4, 8];
    const WARP: [u32; 5] = [1, 2, 4, 8, 16];
    let fold = |b: &mut KernelBuilder, word: u32, v: Reg<U32>, p: Reg<Pred>| {
        b.predicated(p, false, |b| {
            b.red::<U32, _>(AtomOp::Max, &shared(maxima, 4 * word as i64), v)
        });
    };
    let kv_half = b.label("kv_rows");
    b.bra_if(is_kv, &kv_half);

    b.comment("tokens of group y, a warp per token: delta, |dO|_1, a[t, y], max |dO|, max |Q|");
    {
        let out = b.ld_param_ptr(&out_p);
        let dout = b.ld_param_ptr(&dout_p);
        let q = b.ld_param_ptr(&q_p);
        let delta = b.ld_param_ptr(&delta_p);
        let row_bounds = b.ld_param_ptr(&rows_p);
        let g = y;
        let warp = b.shr(tid, 5u32);
        let lane = b.and(tid, 31u32);
        // Pass i of a token: lanes 0-15 read head 2i of the group, lanes 16-31 head 2i + 1,
        // 16 bytes each: 512 contiguous bytes per load.
        let half = b.shr(lane, 4u32);
        let part = b.and(lane, LANES_PER_ROW - 1);
        let lane_bytes = b.shl(lane, 4u32);
        let lane_bytes = b.cvt::<U64, U32>(lane_bytes);
        let leader = b.setp(Cmp::Eq, lane, 0u32);
        let stores_delta = b.setp(Cmp::Lt, part, GROUP_HEADS / 2);
        let first = b.add(start, warp);
        let g16 = b.shl(g, 4u32);
        let zero = b.mov::<U32>(0u32);
        let (q_max, o_max, a_max) = (b.mov::<U32>(zero), b.mov::<U32>(zero), b.mov::<U32>(zero));
        const WARPS: u32 = THREADS / 32;
        for pass in 0..ROWS_PER_CTA / WARPS {
            b.comment(&format!("token first + {}", pass * WARPS));
            let t = b.add(first, pass * WARPS);
            let live = b.setp(Cmp::Lt, t, tokens);
            // Warp-uniform: the whole warp skips a token past T, shuffles included.
            b.if_then(live, "token_done", |b| {
                let row0 = b.mad_lo(t, HEADS, g16);
                let row_bytes = b.mul_wide(row0, HEAD_DIM * 2);
                let off = b.add(row_bytes, lane_bytes);
                let o_addr = b.add(out, off);
                let d_addr = b.add(dout, off);
                let q_addr = b.add(q, off);
                let a_run = b.mov::<U32>(zero);
                let mine = b.mov::<U32>(zero);
                for i in 0..GROUP_HEADS / 2 {
                    let at = 512 * i as i64;
                    let o: [Reg<Bf16x2>; 4] = b.ld_global_nc_v(&global(o_addr, at));
                    let d: [Reg<Bf16x2>; 4] = b.ld_global_nc_v(&global(d_addr, at));
                    let qv: [Reg<Bf16x2>; 4] = b.ld_global_nc_v(&global(q_addr, at));
                    let mut acc = b.mov::<F32>(0.0f32);
                    let mut abs_sum = b.mov::<F32>(0.0f32);
                    for k in 0..4 {
                        let (o_lo, o_hi) = b.bf16x2_to_f32(o[k]);
                        let (d_lo, d_hi) = b.bf16x2_to_f32(d[k]);
                        let (q_lo, q_hi) = b.bf16x2_to_f32(qv[k]);
                        acc = b.fma(o_lo, d_lo, acc);
                        acc = b.fma(o_hi, d_hi, acc);
                        for x in [d_lo, d_hi] {
                            let a = abs_bits(b, x);
                            let m = b.max(o_max, a);
                            b.set(o_max, m);
                            let af = b.bitcast::<F32, U32>(a);
                            abs_sum = b.add(abs_sum, af);
                        }
                        for x in [q_lo, q_hi] {
                            let a = abs_bits(b, x);
                            let m = b.max(q_max, a);
                            b.set(q_max, m);
                        }
                    }
                    let dot = b.bitcast::<U32, F32>(acc);
                    let dot = reduce(b, dot, true, &ROW);
                    let l1 = b.bitcast::<U32, F32>(abs_sum);
                    let l1 = reduce(b, l1, true, &ROW);
                    // Lane `part == i` of each half keeps head 2i + half's delta.
                    let is_i = b.setp(Cmp::Eq, part, i);
                    let m = b.selp(dot, mine, is_i);
                    b.set(mine, m);
                    let dotf = b.bitcast::<F32, U32>(dot);
                    let dabs = abs_bits(b, dotf);
                    let a = b.max(l1, dabs);
                    let a = b.max(a_run, a);
                    b.set(a_run, a);
                }
                // delta[t, 16g + 2·part + half] from lanes part < 8: 64 contiguous bytes.
                let h = b.shl(part, 1u32);
                let h = b.add(h, half);
                let drow = b.add(row0, h);
                let dst = super::common::elem::<U32>(b, delta, drow);
                b.predicated(stores_delta, false, |b| b.st(&dst, mine));
                // Both halves' heads: a[t, g] in every lane.
                let a = reduce(b, a_run, false, &[16]);
                let tg = b.mad_lo(t, 4u32, g);
                let ra = super::common::elem::<U32>(b, row_bounds, tg);
                b.predicated(leader, false, |b| b.st(&ra, a));
                let m = b.max(a_max, a);
                b.set(a_max, m);
            });
        }
        let qm = reduce(b, q_max, false, &WARP);
        let om = reduce(b, o_max, false, &WARP);
        fold(b, 0, qm, leader);
        fold(b, 1, om, leader);
        fold(b, 2, a_max, leader);
        b.bar_sync(0, None);
        b.if_then(t0, "group_maxima", |b| {
            let m: [Reg<U32>; 4] = b.ld_v(&shared(maxima, 0));
            for (word, at) in [(0usize, fp::QMAX), (1, fp::DOMAX), (2, fp::AMAX)] {
                let i = b.add(g, at);
                let a = super::common::elem::<U32>(b, bounds, i);
                b.red::<U32, _>(AtomOp::Max, &a, m[word]);
            }
        });
        b.ret();
    }

    b.place(&kv_half);
    b.comment("key rows of group y - 64: max |K|, max |V|");
    {
        let k = b.ld_param_ptr(&k_p);
        let v = b.ld_param_ptr(&v_p);
        let g = b.sub(y, GROUPS);
        let part = b.and(tid, LANES_PER_ROW - 1);
        let sub_row = b.shr(tid, 4u32);
        let first = b.add(start, sub_row);
        let lane_bytes = b.shl(part, 4u32);
        let lane_bytes = b.cvt::<U64, U32>(lane_bytes);
        let leader = b.setp(Cmp::Eq, part, 0u32);
        for pass in 0..ROWS_PER_CTA / ROWS_PER_PASS {
            let r = b.add(first, pass * ROWS_PER_PASS);
            let live = b.setp(Cmp::Lt, r, ws_rows);
            let row = b.mad_lo(r, 4u32, g);
            let zero = b.mov::<U32>(0u32);
            let (km, vm) = (b.mov::<U32>(zero), b.mov::<U32>(zero));
            b.if_then(live, "kv_loaded", |b| {
                let row_bytes = b.mul_wide(row, HEAD_DIM * 2);
                let off = b.add(row_bytes, lane_bytes);
                let k_addr = b.add(k, off);
                let v_addr = b.add(v, off);
                let kv: [Reg<Bf16x2>; 4] = b.ld_global_nc_v(&global(k_addr, 0));
                let vv: [Reg<Bf16x2>; 4] = b.ld_global_nc_v(&global(v_addr, 0));
                let mut k_max = b.mov::<U32>(0u32);
                let mut v_max = b.mov::<U32>(0u32);
                for i in 0..4 {
                    let (k_lo, k_hi) = b.bf16x2_to_f32(kv[i]);
                    let (v_lo, v_hi) = b.bf16x2_to_f32(vv[i]);
                    for x in [k_lo, k_hi] {
                        let a = abs_bits(b, x);
                        k_max = b.max(k_max, a);
                    }
                    for x in [v_lo, v_hi] {
                        let a = abs_bits(b, x);
                        v_max = b.max(v_max, a);
                    }
                }
                b.set(km, k_max);
                b.set(vm, v_max);
            });
            let km = reduce(b, km, false, &ROW);
            let vm = reduce(b, vm, false, &ROW);
            let store = b.and_pred(live, leader);
            fold(b, 0, km, store);
            fold(b, 1, vm, store);
        }
        b.bar_sync(0, None);
        b.if_then(t0, "group_maxima", |b| {
            let m: [Reg<U32>; 4] = b.ld_v(&shared(maxima, 0));
            for (word, at) in [(0usize, fp::KMAX), (1, fp::VMAX)] {
                let i = b.add(g, at);
                let a = super::common::elem::<U32>(b, bounds, i);
                b.red::<U32, _>(AtomOp::Max, &a, m[word]);
            }
        });
    }
    b.ret();
}
