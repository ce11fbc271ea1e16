//! The row kernels around `msa_forward_kv_sm90`: the reference `R` before the pass and the
//! combine after it. The combines take one 128-element row per 8 lanes, each lane two
//! 8-element chunks 64 apart (16-byte words); the bound one warp per 16 rows; the reference
//! one thread per row.
//!
//! - `fwd_kv_key_max`: `kmax2[b, g] = max ‖k‖²` over the 128 aligned K rows of key block `b`
//!   of KV head `g` (padding rows are zeros), by `red.max.u32` on the f32 bits (non-negative
//!   floats order as their bits). `kmax2 [W/128, 4]` is zeroed by the caller, or null (the
//!   exact reference needs no key maxima). With a non-null `vmax` word (the f16 pool) it also
//!   takes `max |v|` over all of V into it.
//! - `fwd_kv_bound`: `R[t, h] = scale·‖q[t, h]‖·max √kmax2[b, h/16]` over the blocks `b` that
//!   `q2k[h/16, t]` selects (one warp per token and KV head: its 16 rows share the selection), a Cauchy-Schwarz bound of the row's logits `S·scale` (0 for a
//!   row that selects nothing). Per block rather than per head, so that an outlier key raises
//!   only the bounds of the rows that selected its block. The square root is
//!   `exp2(lg2(x)/2)`: the pass is exact for any `R` that keeps the row's terms in range, so R
//!   need not be rounded right.
//! - `fwd_kv_probe` (the runtime's default reference): one warp per token and KV head
//!   computes `D = Q_g·K_repᵀ` (16 heads × 16 slots, sixteen `mma.sync.m16n8k16`), `K_rep`
//!   the first key of each selected block, the one key of a block that every row seeing the
//!   block sees. `R[row] = scale·max D − ln c₁` over the slots the row sees (a lower bound of
//!   its maximum, so its sum is at least about 1), with the f16 pool's `c₁ = 2^⌊log2(1 /
//!   max|v|)⌋` ([`PROBE_F16_SCALE_TARGET`]); `m_pool` gets the key of that bound, or 0 for a
//!   row that sees no block (the combine's empty-row test). No pass over the task tables:
//!   it reads Q once. Given `l_pool` it also zeroes the group's rows of it for the sum pass,
//!   in place of a memset (`o_pool` is zeroed by the task build's spare CTAs); it writes
//!   every row's `m_pool` word, so that pool needs none either.
//! - `fwd_kv_reference`: `R[row] = max − ln c` from the max pass's `m_pool` (0 for a row with
//!   no finite maximum, which the combine then writes empty or reports), the exact reference
//!   the runtime uses by default.
//! - The f16 pool (`fwd_kv_combine_f16`): the bound (or `fwd_kv_reference`) lowers every reference by
//!   `ln c`, `c = 2^⌊log2(8 / max|v|)⌋` (`f16_shift`), so that every term `exp(S·scale − R')·v`
//!   is at most `8e` and a row's sum of at most 2048 stays under f16's 65504. The combine
//!   undoes the shift in its window (`R − max ≥ −1`) and bounds `R' − max` by
//!   [`MAX_GAP_F16`] (widened by `−ln c` when `c < 1`), where f16's subnormal steps move `out`
//!   by at most about 1e-3; a row outside goes to the recompute pass with `R' = max − ln c`.
//! - `fwd_kv_combine`: `out = o/l` (bf16) and `lse = R + ln l`; a row with no key (`m_pool`
//!   untouched, or its maximum −∞, and a zero sum) gets `out = 0`, `lse = −∞`. A row whose
//!   maximum lies outside `[R − 60, R + 1]` (natural-log units: its terms may have lost range
//!   in f32), or with no maximum but a non-zero sum (a NaN went in), gets `out = 0`,
//!   `lse = NaN` for now. The first combine (`second = 0`) hands such a row to a recompute
//!   pass: its reference becomes its exact maximum, its `o` and `l` are zeroed, and
//!   `status[0]` counts it; every other row's reference becomes +∞, so that the recompute pass
//!   (`msa_forward_kv_sm90` gated on `status[0]`) adds only zeros to it. The second combine
//!   (`second = 1`, gated likewise) finishes the recomputed rows; one still bad (a NaN or an
//!   infinite logit) keeps `lse = NaN`, `out = 0` and is counted in `status[1]`.
//! - Under the probe (`window_on_sum = 1`) the combines judge a row by its sum instead:
//!   `ln(l/c) ∈ [−gap, ln PROBE_SUM_MAX]` (f16; `[−60, 80]` for f32), which bounds both the
//!   f16 overflow (`|o| ≤ l·max|v|`) and the subnormal loss without the row's maximum; a row
//!   outside is recomputed with `R' = lse − ln c₁`, so that its sum becomes `c₁`. A recompute
//!   reference that is not finite becomes f32::MAX, so that the second combine counts the
//!   row rather than passing it as settled.

use super::common;
use super::KernelDesc;
use crate::ptx::*;
use crate::target::Target;

const THREADS: u32 = 256;
/// Rows per CTA of `fwd_kv_reference`: one per thread.
pub const REFERENCE_ROWS_PER_CTA: u32 = THREADS;
/// Rows per CTA: one per warp.
pub const ROWS_PER_CTA: u32 = THREADS / 32;
/// Lanes per row of the combines: each takes two 8-element chunks of its row, 64 elements
/// apart, so that every load instruction of a warp reads whole 128-byte lines (f16) and each
/// thread has two loads in flight (one was too few to reach the H200's bandwidth).
const COMBINE_LANES_PER_ROW: u32 = 8;
/// Rows per CTA of the combines: one per 8 lanes (`COMBINE_LANES_PER_ROW`).
pub const COMBINE_ROWS_PER_CTA: u32 = THREADS / COMBINE_LANES_PER_ROW;
/// The widest gap `R − max` (natural-log units) the combine accepts: a row sums at most 2048
/// terms, each at least `exp(−gap)` of the largest, and f32's smallest normal is `exp(−87.3)`.
pub const MAX_GAP: f32 = 60.0;
/// The combine's grid cap per SM (it strides over the rows): 8 CTAs of 256 threads fill an
/// SM, 4 waves of them hide the loads' latency.
pub const COMBINE_MAX_CTAS_PER_SM: u32 = 32;
/// How far the row maximum may lie above `R` (rounding of a tight bound).
pub const MAX_EXCESS: f32 = 1.0;
/// The f16 pool's widest gap `R' − max` (its reference shifted, see `f16_shift`): a row's sum
/// `l' ≥ exp(−gap)`, and f16's subnormal step 2^-24 over at most 32 roundings then moves
/// `out = o'/l'` by at most `2^-20·exp(gap)`, 1.1e-3 at 7.
pub const MAX_GAP_F16: f32 = 7.0;
/// The f16 pool's scale bound: every sum `o'` stays below `2048 keys · e · 8 = 44540 < 65504`
/// with `c = 2^⌊log2(8 / max|v|)⌋`.
pub const F16_SCALE_TARGET: f32 = 8.0;

/// The probe's f16 pool scale target: `c = 2^⌊log2(1 / max|v|)⌋`, so that a row sum
/// `l = Σ exp(S·scale − R)` (at least about 1 at the probed key, `R` below the maximum) may grow
/// to [`PROBE_SUM_MAX`] relative to `c` before `o` nears f16's 65504.
pub const PROBE_F16_SCALE_TARGET: f32 = 1.0;
/// The combine's bound on `l / c` under the probe (f16 pool): `|o| ≤ l·max|v| ≤ 8·l/c`
/// (the combine's `c` is that of [`F16_SCALE_TARGET`]) stays under 60000 < 65504.
pub const PROBE_SUM_MAX: f32 = 7500.0;
/// The same bound for the f32 pool, as a natural log: `l ≤ e^80` keeps every sum finite.
pub const PROBE_SUM_MAX_F32_LN: f32 = 80.0;

/// `‖k‖²` maxima per KV head.
pub const KEY_MAX: KernelDesc = KernelDesc {
    name: "fwd_kv_key_max",
    about: "the largest squared key norm of each key block and KV head over the aligned K rows",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: describe_key_max,
};

/// The per-row reference.
pub const BOUND: KernelDesc = KernelDesc {
    name: "fwd_kv_bound",
    about: "per query row the Cauchy-Schwarz bound scale*|q|*max|k| of its logits over its selected blocks",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: describe_bound,
};

/// The probe's reference: a lower bound of each row's maximum from one key per selected block.
pub const PROBE: KernelDesc = KernelDesc {
    name: "fwd_kv_probe",
    about: "per query row a reference for the sum pass without a max pass: the largest \
            S*scale of the row against the first key of each selected block it sees (a lower \
            bound of its maximum), by mma.sync, lowered by ln c of the f16 pool at scale 1",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: describe_probe,
};

/// The exact reference from the max pass's row maxima.
pub const REFERENCE: KernelDesc = KernelDesc {
    name: "fwd_kv_reference",
    about:
        "per query row the sum pass's reference from the max pass: its exact maximum of S*scale, \
            lowered by the f16 pool's ln c (0 for a row without a finite maximum)",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: describe_reference,
};

/// The combine of the f16 pool.
pub const COMBINE_F16: KernelDesc = KernelDesc {
    name: "fwd_kv_combine_f16",
    about: "fwd_kv_combine for the f16 o_pool: the reference's shift from max|v| undone in the \
            window check and the recompute reference",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: |b| describe_combine(b, true, false),
};

/// The combine of the paired f16 pool (`l2_sides`): each row's two copies added.
pub const COMBINE_F16_PAIRED: KernelDesc = KernelDesc {
    name: "fwd_kv_combine_f16p",
    about: "fwd_kv_combine_f16 over the paired o_pool: each row's two copies (one homed in \
            each L2 partition, as the SW128 image of a warp's staging) added",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: |b| describe_combine(b, true, true),
};

/// The combine.
pub const COMBINE: KernelDesc = KernelDesc {
    name: "fwd_kv_combine",
    about: "out = o/l (bf16) and lse = R + ln l from the KV-parallel pass's pools; rows out of \
            the reference's range are handed to a recompute pass with their exact maximum",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: |b| describe_combine(b, false, false),
};

/// This thread's row (`ctaid·8 + warp`), its lane, and whether the row is inside `rows`.
fn row_lane(b: &mut KernelBuilder, rows_p: &ParamRef<U32>) -> (Reg<U32>, Reg<U32>, Reg<Pred>) {
    let tid = b.sreg(SReg::TidX);
    let cta = b.sreg(SReg::CtaidX);
    let warp = b.shr(tid, 5u32);
    let lane = b.and(tid, 31u32);
    let row = b.mad_lo(cta, ROWS_PER_CTA, warp);
    let rows = b.ld_param(rows_p);
    let inside = b.setp(Cmp::Lt, row, rows);
    (row, lane, inside)
}

/// The squared norm of the bf16 row at `base + 256·row`, summed over the warp (every lane
/// gets it).
fn row_norm2(b: &mut KernelBuilder, base: Reg<U64>, row: Reg<U32>, lane: Reg<U32>) -> Reg<F32> {
    let idx = b.mad_lo(row, 32u32, lane);
    let at = common::elem_bytes(b, base, idx, 8);
    let v: [Reg<Bf16x2>; 2] = b.ld_global_nc_v(&at);
    let mut acc = None;
    for w in v {
        let (lo, hi) = b.bf16x2_to_f32(w);
        for x in [lo, hi] {
            acc = Some(match acc {
                None => b.fmul(x, x),
                Some(a) => b.fma(x, x, a),
            });
        }
    }
    let mut s = acc.expect("four values");
    for d in [16u32, 8, 4, 2, 1] {
        let o = b.shfl(Shfl::Bfly, s, d, 0x1f);
        s = b.add(s, o);
    }
    s
}

/// `ln c` of the f16 pool's scale `c = 2^⌊log2(8 / max|v|)⌋` (clamped to `2^±60`) from the
/// word `vmax` (the bits of max|v| over V), or 0 when `vmax` is null (the f32 pool). The
/// bound subtracts it from R and the combine adds it back: both compute it the same way.
fn f16_shift(b: &mut KernelBuilder, vmax_p: &ParamRef<U64>) -> Reg<F32> {
    f16_shift_to(b, vmax_p, F16_SCALE_TARGET)
}

/// [`f16_shift`] for `c = 2^⌊log2(target / max|v|)⌋`.
fn f16_shift_to(b: &mut KernelBuilder, vmax_p: &ParamRef<U64>, target: f32) -> Reg<F32> {
    let shift = b.mov::<F32>(0.0f32);
    let raw = b.ld_param(vmax_p);
    let some = b.setp(Cmp::Ne, raw, 0u64);
    b.if_then(some, "f16_shift", |b| {
        let at = b.ld_param_ptr(vmax_p);
        let bits = b.ld::<U32, _>(&global(at, 0));
        let vmax = b.bitcast::<F32, U32>(bits);
        let lg = b.lg2_approx(vmax);
        let target = b.mov::<F32>(target.log2());
        let e = b.sub(target, lg);
        let e = b.floor_f32(e);
        let e = b.max(e, -60.0f32);
        let e = b.min(e, 60.0f32);
        let s = b.fmul(e, std::f32::consts::LN_2);
        b.set(shift, s);
    });
    shift
}

/// The row maximum (natural-log units of `S·scale`) from the pass's order-preserving key of
/// `max S·scale·log2e`, and whether the row has one: keys up to that of −∞ (0x007fffff) mean
/// no key (untouched, 0, or every key masked). Shared by the combine and the reference.
fn max_from_key(b: &mut KernelBuilder, key: Reg<U32>) -> (Reg<Pred>, Reg<F32>) {
    b.comment("the row maximum from its order-preserving key (log2 units)");
    let some = b.setp(Cmp::Gt, key, 0x007f_ffffu32);
    let sign = b.and(key, 0x8000_0000u32);
    let pos = b.setp(Cmp::Ne, sign, 0u32);
    let low = b.and(key, 0x7fff_ffffu32);
    let flipped = b.xor(key, u32::MAX);
    let bits = b.selp(low, flipped, pos);
    let m2 = b.bitcast::<F32, U32>(bits);
    (some, b.fmul(m2, std::f32::consts::LN_2))
}

fn describe_reference(b: &mut KernelBuilder) {
    b.grid("[ceil(T * 64 / 256), 1, 1]");
    let m_p = b.param_ptr("m_pool", HostElem::U32, false);
    let vmax_p = b.param_ptr("vmax", HostElem::U32, false);
    let r_p = b.param_ptr("reference", HostElem::F32, true);
    let rows_p = b.param_u32("rows");
    let tid = b.sreg(SReg::TidX);
    let cta = b.sreg(SReg::CtaidX);
    let row = b.mad_lo(cta, REFERENCE_ROWS_PER_CTA, tid);
    let rows = b.ld_param(&rows_p);
    let inside = b.setp(Cmp::Lt, row, rows);
    // The f16 pool's reference lies `ln c` lower, as the bound's (0 for the f32 pool).
    let shift = f16_shift(b, &vmax_p);
    b.if_then(inside, "reference", |b| {
        let mp = b.ld_param_ptr(&m_p);
        let at = common::elem::<U32>(b, mp, row);
        let key = b.ld::<U32, _>(&at);
        let (some, m) = max_from_key(b, key);
        // A finite maximum (NaN fails both comparisons); otherwise 0, and the combine decides
        // (an empty row, or a NaN or infinite logit it reports).
        let below = b.setp(Cmp::Lt, m, f32::INFINITY);
        let above = b.setp(Cmp::Gt, m, f32::NEG_INFINITY);
        let finite = b.and_pred(below, above);
        let ok = b.and_pred(some, finite);
        let r = b.sub(m, shift);
        let r = b.selp(r, 0.0f32, ok);
        let rp = b.ld_param_ptr(&r_p);
        let at = common::elem::<F32>(b, rp, row);
        b.st(&at, r);
    });
    b.ret();
}

fn describe_key_max(b: &mut KernelBuilder) {
    b.grid("[workspace_rows * 4 / 8, 1, 1]");
    let k_p = b.param_ptr("k_aligned", HostElem::Bf16, false);
    let kmax_p = b.param_ptr("kmax2", HostElem::U32, true);
    let v_p = b.param_ptr("v_aligned", HostElem::Bf16, false);
    let vmax_p = b.param_ptr("vmax", HostElem::U32, true);
    let rows_p = b.param_u32("rows");
    let (row, lane, inside) = row_lane(b, &rows_p);
    b.if_then(inside, "key", |b| {
        let lane0 = b.setp(Cmp::Eq, lane, 0u32);
        // The f16 pool's scale needs max|v| over all of V (a null `vmax`: not asked for).
        let raw = b.ld_param(&vmax_p);
        let want = b.setp(Cmp::Ne, raw, 0u64);
        b.if_then(want, "value_max", |b| {
            let v = b.ld_param_ptr(&v_p);
            let idx = b.mad_lo(row, 32u32, lane);
            let at = common::elem_bytes(b, v, idx, 8);
            let w: [Reg<Bf16x2>; 2] = b.ld_global_nc_v(&at);
            // |v| as f32 bits: a bf16 pair's halves shifted into the high bits, the sign
            // cleared; non-negative floats order as their bits (a NaN's lie above +∞).
            let mut m: Option<Reg<U32>> = None;
            for x in w {
                let x = b.bitcast::<U32, Bf16x2>(x);
                let lo = b.shl(x, 16u32);
                for y in [lo, x] {
                    let a = b.and(y, 0x7fff_0000u32);
                    m = Some(match m {
                        None => a,
                        Some(p) => b.max(p, a),
                    });
                }
            }
            let mut m = m.expect("four values");
            for d in [16u32, 8, 4, 2, 1] {
                let o = b.shfl(Shfl::Bfly, m, d, 0x1f);
                m = b.max(m, o);
            }
            // Every warp meets the same word: read it first and add only a larger value
            // (it only grows, so a stale read costs one redundant red), not 4·W reds in
            // a row on one address.
            b.if_then(lane0, "value_max_word", |b| {
                let vmax = b.ld_param_ptr(&vmax_p);
                let seen = b.ld::<U32, _>(&global(vmax, 0));
                let larger = b.setp(Cmp::Gt, m, seen);
                b.if_then(larger, "value_max_red", |b| {
                    b.red::<U32, _>(AtomOp::Max, &global(vmax, 0), m);
                });
            });
        });
        // The key maxima feed only the bound (a null `kmax2`: not asked for).
        let raw = b.ld_param(&kmax_p);
        let want = b.setp(Cmp::Ne, raw, 0u64);
        let key_lane = b.and_pred(want, lane0);
        let k = b.ld_param_ptr(&k_p);
        let n2 = b.mov::<F32>(0.0f32);
        b.if_then(want, "key_norm", |b| {
            let x = row_norm2(b, k, row, lane);
            b.set(n2, x);
        });
        b.if_then(key_lane, "key_max", |b| {
            // Aligned row `row / 4` of head `row % 4`: entry (row / 512)·4 + row % 4.
            let g = b.and(row, 3u32);
            let blk = b.shr(row, 9u32);
            let idx = b.mad_lo(blk, 4u32, g);
            let kmax = b.ld_param_ptr(&kmax_p);
            let bits = b.bitcast::<U32, F32>(n2);
            let at = common::elem::<U32>(b, kmax, idx);
            b.red::<U32, _>(AtomOp::Max, &at, bits);
        });
    });
    b.ret();
}

fn describe_bound(b: &mut KernelBuilder) {
    b.grid("[ceil(T * 4 / 8), 1, 1]");
    let q_p = b.param_ptr("q", HostElem::Bf16, false);
    let q2k_p = b.param_ptr("q2k", HostElem::I32, false);
    let cu_p = b.param_ptr("cu_seqlens", HostElem::I32, false);
    let ws_p = b.param_ptr("document_workspace_starts", HostElem::I32, false);
    let kmax_p = b.param_ptr("kmax2", HostElem::U32, false);
    let vmax_p = b.param_ptr("vmax", HostElem::U32, false);
    let r_p = b.param_ptr("reference", HostElem::F32, true);
    let groups_p = b.param_u32("groups");
    let tokens_p = b.param_u32("num_tokens");
    let docs_p = b.param_u32("num_docs");
    let blocks_p = b.param_u32("num_blocks");
    // One warp per (token, KV head): the 16 query heads of the group share its selection, so
    // the document search and the selection's block maxima are done once for all 16 rows.
    let (grp, lane, inside) = row_lane(b, &groups_p);
    b.if_then(inside, "bound", |b| {
        let t = b.shr(grp, 2u32);
        let g = b.and(grp, 3u32);
        b.comment("the 16 rows' squared norms; lane h keeps that of head 16g + h");
        let q = b.ld_param_ptr(&q_p);
        let row0 = b.shl(grp, 4u32);
        let mut n2 = b.mov::<F32>(0.0f32);
        for h in 0..16u32 {
            let row = b.add(row0, h);
            let x = row_norm2(b, q, row, lane);
            let mine = b.setp(Cmp::Eq, lane, h);
            n2 = b.selp(x, n2, mine);
        }
        b.comment("the largest block maximum among the group's 16 selections, lanes 0..16");
        let cu = b.ld_param_ptr(&cu_p);
        let d = common::doc_search(b, cu, &docs_p, t);
        let ws = b.ld_param_ptr(&ws_p);
        let first = common::load_u32(b, ws, d);
        let first = b.shr(first, 7u32);
        let k2 = b.mov::<U32>(0u32);
        let slot = b.setp(Cmp::Lt, lane, 16u32);
        b.if_then(slot, "selection", |b| {
            let tokens = b.ld_param(&tokens_p);
            let gt = b.mad_lo(g, tokens, t);
            let idx = b.mad_lo(gt, 16u32, lane);
            let q2k = b.ld_param_ptr(&q2k_p);
            let at = common::elem::<S32>(b, q2k, idx);
            let id = b.ld::<S32, _>(&at);
            // An id the schedule build would flag (past the workspace) reads nothing: such a
            // schedule has no task, so R does not matter, but the load must stay in bounds.
            let idu = b.bitcast::<U32, S32>(id);
            let blk = b.add(first, idu);
            let blocks = b.ld_param(&blocks_p);
            let chosen = b.setp(Cmp::Ge, id, 0i32);
            let inside = b.setp(Cmp::Lt, blk, blocks);
            let chosen = b.and_pred(chosen, inside);
            b.if_then(chosen, "block_max", |b| {
                let e = b.mad_lo(blk, 4u32, g);
                let kmax = b.ld_param_ptr(&kmax_p);
                let at = common::elem::<U32>(b, kmax, e);
                let v = b.ld::<U32, _>(&at);
                b.set(k2, v);
            });
        });
        // Non-negative floats order as their bits.
        let mut m = k2;
        for dd in [16u32, 8, 4, 2, 1] {
            let o = b.shfl(Shfl::Bfly, m, dd, 0x1f);
            m = b.max(m, o);
        }
        // The f16 pool's reference lies `ln c` lower (0 for the f32 pool).
        let shift = f16_shift(b, &vmax_p);
        b.if_then(slot, "store", |b| {
            let k2 = b.bitcast::<F32, U32>(m);
            let p = b.fmul(n2, k2);
            let lg = b.lg2_approx(p);
            let half = b.fmul(lg, 0.5f32);
            let norm = b.ex2_approx(half);
            let r = b.fmul(norm, common::SCALE);
            let r = b.sub(r, shift);
            let rp = b.ld_param_ptr(&r_p);
            let row = b.add(row0, lane);
            let at = common::elem::<F32>(b, rp, row);
            b.st(&at, r);
        });
    });
    b.ret();
}

fn describe_probe(b: &mut KernelBuilder) {
    b.grid("[ceil(T * 4 / 8), 1, 1]");
    let q_p = b.param_ptr("q", HostElem::Bf16, false);
    let k_p = b.param_ptr("k_aligned", HostElem::Bf16, false);
    let q2k_p = b.param_ptr("q2k", HostElem::I32, false);
    let cu_p = b.param_ptr("cu_seqlens", HostElem::I32, false);
    let ws_p = b.param_ptr("document_workspace_starts", HostElem::I32, false);
    let vmax_p = b.param_ptr("vmax", HostElem::U32, false);
    let r_p = b.param_ptr("reference", HostElem::F32, true);
    let m_p = b.param_ptr("m_pool", HostElem::U32, true);
    let groups_p = b.param_u32("groups");
    let tokens_p = b.param_u32("num_tokens");
    let docs_p = b.param_u32("num_docs");
    let blocks_p = b.param_u32("num_blocks");
    let l_p = b.param_ptr("l_pool", HostElem::F32, true);
    // One warp per (token, KV head): D[16 heads × 16 slots] = Q_g·K_repᵀ by sixteen
    // m16n8k16 (two n-tiles of 8 slots, eight k-steps). The warp takes part as a whole or
    // not at all (mma.sync is .aligned): the grid's last warps past `groups` skip it whole.
    let (grp, lane, inside) = row_lane(b, &groups_p);
    b.if_then(inside, "probe", |b| {
        let t = b.shr(grp, 2u32);
        let g = b.and(grp, 3u32);
        let quad = b.shr(lane, 2u32);
        let tq = b.and(lane, 3u32);
        b.comment(
            "this lane's slots quad and quad + 8: their blocks, and whether the row sees them",
        );
        let cu = b.ld_param_ptr(&cu_p);
        let d = common::doc_search(b, cu, &docs_p, t);
        let start = common::load_u32(b, cu, d);
        let pos = b.sub(t, start);
        let ws = b.ld_param_ptr(&ws_p);
        let first = common::load_u32(b, ws, d);
        let first = b.shr(first, 7u32);
        let tokens = b.ld_param(&tokens_p);
        let gt = b.mad_lo(g, tokens, t);
        let sel0 = b.shl(gt, 4u32);
        let q2k = b.ld_param_ptr(&q2k_p);
        let blocks = b.ld_param(&blocks_p);
        let kp = b.ld_param_ptr(&k_p);
        // The k-step order is free as long as A and B share it: lane (quad, tq) takes, per
        // 32 elements of d, the 16 bytes at 8·tq, so that each fragment pair is one v4 load.
        let mut b_frag: Vec<[Reg<U32>; 4]> = Vec::new();
        let mut seen = Vec::new();
        for nt in 0..2u32 {
            let slot = b.add(quad, 8 * nt);
            let idx = b.add(sel0, slot);
            let at = common::elem::<S32>(b, q2k, idx);
            let id = b.ld::<S32, _>(&at);
            let idu = b.bitcast::<U32, S32>(id);
            let blk = b.add(first, idu);
            let chosen = b.setp(Cmp::Ge, id, 0i32);
            let in_ws = b.setp(Cmp::Lt, blk, blocks);
            // Its first key (local 128·id) is the one key every row that sees the block sees.
            let key0 = b.shl(idu, 7u32);
            let visible = b.setp(Cmp::Le, key0, pos);
            let ok = b.and_pred(chosen, in_ws);
            let ok = b.and_pred(ok, visible);
            seen.push(b.ballot(ok));
            // A slot it does not see reads K row 0 (in bounds) and is masked below.
            let blk = b.selp(blk, 0u32, ok);
            let krow = b.shl(blk, 7u32);
            let krow = b.mad_lo(krow, 4u32, g);
            let kidx = b.mad_lo(krow, 16u32, tq);
            for kk in 0..4u32 {
                let at = common::elem_bytes(b, kp, kidx, 16);
                let at = at.offset(i64::from(64 * kk));
                b_frag.push(b.ld_global_nc_v::<U32, 4>(&at));
            }
        }
        b.comment("Q's rows quad and quad + 8 of the group's 16 heads");
        let qp = b.ld_param_ptr(&q_p);
        let row0 = b.shl(grp, 4u32);
        let mut a_frag: Vec<[[Reg<U32>; 4]; 2]> = Vec::new();
        let rows: Vec<Reg<U32>> = [0u32, 8]
            .iter()
            .map(|&h| {
                let r = b.add(row0, quad);
                b.add(r, h)
            })
            .collect();
        for kk in 0..4u32 {
            let pair: [[Reg<U32>; 4]; 2] = std::array::from_fn(|i| {
                let qidx = b.mad_lo(rows[i], 16u32, tq);
                let at = common::elem_bytes(b, qp, qidx, 16).offset(i64::from(64 * kk));
                b.ld_global_nc_v::<U32, 4>(&at)
            });
            a_frag.push(pair);
        }
        let zero = b.mov::<F32>(0.0f32);
        let mut acc = [[zero; 4]; 2];
        for kk in 0..4usize {
            for half in 0..2usize {
                let w = |x: Reg<U32>, b: &mut KernelBuilder| b.bitcast::<Bf16x2, U32>(x);
                let [lo, hi] = a_frag[kk];
                let a = [
                    w(lo[2 * half], b),
                    w(hi[2 * half], b),
                    w(lo[2 * half + 1], b),
                    w(hi[2 * half + 1], b),
                ];
                for nt in 0..2usize {
                    let kf = b_frag[4 * nt + kk];
                    let bb = [w(kf[2 * half], b), w(kf[2 * half + 1], b)];
                    acc[nt] = b.mma_m16n8k16_bf16(a, bb, acc[nt]);
                }
            }
        }
        b.comment("each head's largest logit over the slots it sees (lanes of a quad share rows)");
        let neg_inf = b.mov::<F32>(f32::NEG_INFINITY);
        let mut best = [neg_inf; 2];
        for (nt, d4) in acc.iter().enumerate() {
            for (i, &x) in d4.iter().enumerate() {
                // D[row][2tq + i % 2] of n-tile nt: slot 8·nt + 2·tq + i % 2, whose ballot
                // bit is lane 4·(2tq + i % 2).
                let col = b.shl(tq, 1u32);
                let col = b.add(col, (i % 2) as u32);
                let bit = b.shl(col, 2u32);
                let word = b.shr(seen[nt], bit);
                let word = b.and(word, 1u32);
                let ok = b.setp(Cmp::Ne, word, 0u32);
                let v = b.selp(x, neg_inf, ok);
                best[i / 2] = b.max(best[i / 2], v);
            }
        }
        for m in best.iter_mut() {
            for dd in [1u32, 2] {
                let o = b.shfl(Shfl::Bfly, *m, dd, 0x1f);
                *m = b.max(*m, o);
            }
        }
        let any = b.or(seen[0], seen[1]);
        let some = b.setp(Cmp::Ne, any, 0u32);
        // The pass's terms are `exp(S·scale − R)`, at least 1 at the probed key: the f16 pool
        // is scaled to max|v| = 1, not 8 as under the exact reference (see `PROBE_SUM_MAX`).
        let shift = f16_shift_to(b, &vmax_p, PROBE_F16_SCALE_TARGET);
        let lead = b.setp(Cmp::Eq, tq, 0u32);
        b.if_then(lead, "store", |b| {
            let rp = b.ld_param_ptr(&r_p);
            let mp = b.ld_param_ptr(&m_p);
            for (i, &m) in best.iter().enumerate() {
                let l = b.fmul(m, common::SCALE);
                let r = b.sub(l, shift);
                let r = b.selp(r, 0.0f32, some);
                let at = common::elem::<F32>(b, rp, rows[i]);
                b.st(&at, r);
                let l2 = b.fmul(m, common::SCALE_LOG2E);
                let key = super::forward_kv_sm90::order_key(b, l2);
                let key = b.selp(key, 0u32, some);
                let at = common::elem::<U32>(b, mp, rows[i]);
                b.st(&at, key);
            }
            let lp = b.ld_param(&l_p);
            let some = b.setp(Cmp::Ne, lp, 0u64);
            b.if_then(some, "zero_l", |b| {
                let lp = b.ld_param_ptr(&l_p);
                let zero = b.mov::<F32>(0.0f32);
                for &row in &rows {
                    let at = common::elem::<F32>(b, lp, row);
                    b.st(&at, zero);
                }
            });
        });
    });
    b.ret();
}

fn describe_combine(b: &mut KernelBuilder, f16: bool, paired: bool) {
    if paired && !f16 {
        return b.error("only the f16 pool is paired".into());
    }
    b.grid("[min(ceil(T * 64 / 32), COMBINE_MAX_CTAS_PER_SM * num_sms), 1, 1]");
    let o_p = if f16 {
        b.param_ptr("o_pool", HostElem::U16, true)
    } else {
        b.param_ptr("o_pool", HostElem::F32, true)
    };
    let l_p = b.param_ptr("l_pool", HostElem::F32, true);
    let m_p = b.param_ptr("m_pool", HostElem::U32, false);
    let r_p = b.param_ptr("reference", HostElem::F32, true);
    let out_p = b.param_ptr("out", HostElem::Bf16, true);
    let lse_p = b.param_ptr("lse", HostElem::F32, true);
    let status_p = b.param_ptr("status", HostElem::U32, true);
    let gate_p = b.param_ptr("gate", HostElem::U32, false);
    let vmax_p = if f16 {
        Some(b.param_ptr("vmax", HostElem::U32, false))
    } else {
        None
    };
    let second_p = b.param_u32("second");
    let on_sum_p = b.param_u32("window_on_sum");
    let rows_p = b.param_u32("rows");
    super::forward_kv_sm90::gate(b, &gate_p);
    let second = b.ld_param(&second_p);
    let second = b.setp(Cmp::Ne, second, 0u32);
    // The f16 pool's reference R' = R − ln c: the window is R − max in [−1, ..], and the
    // subnormal bound on R' − max, widened when c < 1 (its rows' sums are then large).
    let (shift, max_gap) = match &vmax_p {
        Some(v) => (f16_shift(b, v), MAX_GAP_F16),
        None => (b.mov::<F32>(0.0f32), MAX_GAP),
    };
    // Under the probe's reference (`window_on_sum`) the window is on the row sum instead:
    // `ln(l/c) ∈ [−max_gap, ln PROBE_SUM_MAX]`, and a recomputed row's reference is its
    // `lse` lowered by the probe's own shift.
    let on_sum = b.ld_param(&on_sum_p);
    let on_sum = b.setp(Cmp::Ne, on_sum, 0u32);
    let (probe_shift, sum_hi) = match &vmax_p {
        Some(v) => (
            f16_shift_to(b, v, PROBE_F16_SCALE_TARGET),
            PROBE_SUM_MAX.ln(),
        ),
        None => (b.mov::<F32>(0.0f32), PROBE_SUM_MAX_F32_LN),
    };
    let lo = b.mov::<F32>(-MAX_EXCESS);
    let lo_gap = b.sub(lo, shift);
    let zero_f = b.mov::<F32>(0.0f32);
    let neg_shift = b.sub(zero_f, shift);
    let widen = b.max(neg_shift, 0.0f32);
    let hi_gap = b.add(widen, max_gap);
    // Grid-stride over the rows: the runtime caps the grid, so that the gated second
    // combine costs a few thousand CTAs that return at once, not one per 8 rows.
    let tid = b.sreg(SReg::TidX);
    let cta = b.sreg(SReg::CtaidX);
    let ctas = b.sreg(SReg::NctaidX);
    // Lane group `tid / 8` takes a row; its lane `lane` the 8-element chunks `lane` and
    // `lane + 8` of it.
    let group = b.shr(tid, COMBINE_LANES_PER_ROW.trailing_zeros());
    let lane = b.and(tid, COMBINE_LANES_PER_ROW - 1);
    let lane0 = b.setp(Cmp::Eq, lane, 0u32);
    let row = b.mad_lo(cta, COMBINE_ROWS_PER_CTA, group);
    let stride = b.mul_lo(ctas, COMBINE_ROWS_PER_CTA);
    let rows = b.ld_param(&rows_p);
    // Lane 0's counts of the rows handed back and still bad, added to `status` once per
    // lane group at the end (one word taking a red per row would serialize millions of them).
    let handed = b.mov::<U32>(0u32);
    let unresolved = b.mov::<U32>(0u32);
    let next_row = b.label("next_row");
    let exit = b.label("exit");
    b.place(&next_row);
    let inside = b.setp(Cmp::Lt, row, rows);
    b.bra_unless(inside, &exit);
    let done = b.label("done");
    // The first combine reads every row's o: its loads go out first, so that their latency
    // overlaps the scalars' instead of following it. (The second reads only the rows it
    // takes, below.)
    let idx = b.mad_lo(row, 16u32, lane);
    let op = b.ld_param_ptr(&o_p);
    let chunk_bytes: i64 = if f16 { 16 } else { 32 };
    // The lane's chunks `lane` and `lane + 8`, each as 16-byte words. Paired (`o_pool` then
    // the pool's start, anchors first), head `h = row mod 16` of pair `ANCHORS + row / 16`:
    // chunk `k` of copy `c` is at `(2·pair + c)·4096 + (k / 8)·2048 + h·128 +
    // ((k mod 8) ^ (h mod 8))·16`, and the lane's words are copy 0's, then copy 1's.
    let o_words: Vec<GlobalAddr> = if paired {
        let pair = b.shr(row, 4u32);
        let pair = b.add(pair, super::l2_sides::ANCHORS);
        let chunk = b.shl(pair, 1u32);
        let h = b.and(row, 15u32);
        let sw = b.and(row, 7u32);
        let unit = b.xor(lane, sw);
        let unit16 = b.shl(unit, 4u32);
        let within = b.mad_lo(h, 128u32, unit16);
        let chunk_off = b.mul_wide(chunk, super::l2_sides::CHUNK_BYTES);
        let pa = b.add(op, chunk_off);
        let within = b.cvt::<U64, U32>(within);
        let pa = b.add(pa, within);
        let copy = i64::from(super::l2_sides::CHUNK_BYTES);
        // Copy `c`, then its SW128 box `k` of 64 d (half a copy).
        (0..2i64)
            .flat_map(|c| (0..2i64).map(move |k| copy * c + copy / 2 * k))
            .map(|off| global(pa, off))
            .collect()
    } else {
        let o_at = common::elem_bytes(b, op, idx, chunk_bytes as u32);
        (0..2)
            .flat_map(|c| (0..chunk_bytes / 16).map(move |w| 8 * chunk_bytes * c + 16 * w))
            .map(|off| o_at.offset(off))
            .collect()
    };
    let load_o = |b: &mut KernelBuilder| -> Vec<Reg<U32>> {
        o_words
            .iter()
            .flat_map(|at| b.ld_v::<U32, _, 4>(at))
            .collect()
    };
    let mut o_first = Vec::new();
    b.predicated(second, true, |b| o_first = load_o(b));
    let rp = b.ld_param_ptr(&r_p);
    let r_at = common::elem::<F32>(b, rp, row);
    let r = b.ld::<F32, _>(&r_at);
    let lp = b.ld_param_ptr(&l_p);
    let l_at = common::elem::<F32>(b, lp, row);
    let l = b.ld::<F32, _>(&l_at);
    let mp = b.ld_param_ptr(&m_p);
    let at = common::elem::<U32>(b, mp, row);
    let key = b.ld::<U32, _>(&at);
    // The second combine takes only the rows the first one handed to the recompute pass
    // (the others' references are +inf by then).
    let settled = b.setp(Cmp::Eq, r, f32::INFINITY);
    let skip = b.and_pred(second, settled);
    b.bra_if(skip, &done);
    let (some, m) = max_from_key(b, key);
    let gap = b.sub(r, m);
    let lo_ok = b.setp(Cmp::Ge, gap, lo_gap);
    let hi_ok = b.setp(Cmp::Le, gap, hi_gap);
    let l_ok = b.setp(Cmp::Gt, l, 0.0f32);
    let on_max = b.and_pred(lo_ok, hi_ok);
    let lg = b.lg2_approx(l);
    let ln_l = b.fmul(lg, std::f32::consts::LN_2);
    let rel = b.sub(ln_l, shift);
    let sum_lo_ok = b.setp(Cmp::Ge, rel, -max_gap);
    let sum_hi_ok = b.setp(Cmp::Le, rel, sum_hi);
    let on_l = b.and_pred(sum_lo_ok, sum_hi_ok);
    let by_sum = b.and_pred(on_l, on_sum);
    let by_max = b.not_pred(on_sum);
    let by_max = b.and_pred(on_max, by_max);
    let in_range = b.or_pred(by_sum, by_max);
    let in_range = b.and_pred(in_range, l_ok);
    let good = b.and_pred(some, in_range);
    // A NaN anywhere fails the ordered comparisons above: such a row counts as bad.
    let out_of_range = b.not_pred(in_range);
    let bad = b.and_pred(some, out_of_range);
    // A row with no maximum added only zeros, unless a NaN went in: then it is bad too.
    let none = b.not_pred(some);
    let l_zero = b.setp(Cmp::Eq, l, 0.0f32);
    let l_nonzero = b.not_pred(l_zero);
    let poisoned = b.and_pred(none, l_nonzero);
    let bad = b.or_pred(bad, poisoned);
    let inv = b.rcp_rn(l);
    let inv = b.selp(inv, 0.0f32, good);
    let row_lse = b.fma(lg, std::f32::consts::LN_2, r);
    let lse = b.selp(row_lse, f32::NEG_INFINITY, good);
    let lse = b.selp(f32::NAN, lse, bad);
    let o_second: Vec<Reg<U32>> = o_first.iter().map(|_| b.reg()).collect();
    b.if_then(second, "second_o", |b| {
        for (dst, w) in o_second.iter().zip(load_o(b)) {
            b.set(*dst, w);
        }
    });
    let raw: Vec<Reg<U32>> = o_first
        .iter()
        .zip(&o_second)
        .map(|(&a, &c)| b.selp(c, a, second))
        .collect();
    let o: Vec<Reg<F32>> = if f16 {
        let mut o: Vec<Reg<F32>> = raw
            .iter()
            .flat_map(|&w| {
                let h = b.bitcast::<F16x2, U32>(w);
                let (lo, hi) = b.f16x2_to_f32(h);
                [lo, hi]
            })
            .collect();
        if paired {
            // The second copy's 16 values after the first's.
            let second = o.split_off(16);
            o = o.iter().zip(&second).map(|(&x, &y)| b.add(x, y)).collect();
        }
        o
    } else {
        raw.iter().map(|&w| b.bitcast::<F32, U32>(w)).collect()
    };
    // Not `o·0` for a row that is not good: its `o` may hold NaN.
    let y: Vec<Reg<F32>> = o
        .iter()
        .map(|&x| {
            let v = b.fmul(x, inv);
            b.selp(v, 0.0f32, good)
        })
        .collect();
    let outp = b.ld_param_ptr(&out_p);
    let at = common::elem_bytes(b, outp, idx, 16);
    for (c, y) in y.chunks(8).enumerate() {
        let words: [Reg<U32>; 4] = std::array::from_fn(|i| {
            let w = b.cvt_bf16x2(y[2 * i + 1], y[2 * i]);
            b.bitcast::<U32, Bf16x2>(w)
        });
        b.st_v(&at.offset(128 * c as i64), words);
    }
    b.if_then(lane0, "lse", |b| {
        let lsp = b.ld_param_ptr(&lse_p);
        let at = common::elem::<F32>(b, lsp, row);
        b.st(&at, lse);
    });
    b.if_then(second, "second", |b| {
        b.comment("still out of range with its exact maximum as reference: counted");
        b.if_then(bad, "unresolved", |b| {
            b.if_then(lane0, "count_unresolved", |b| {
                let n = b.add(unresolved, 1u32);
                b.set(unresolved, n);
            });
        });
    });
    b.unless(second, "first", |b| {
        b.comment("hand a bad row to the recompute pass: R = its maximum, its sums zeroed");
        b.if_then(bad, "recompute", |b| {
            let z = b.mov::<F32>(0.0f32);
            let z4 = b.mov::<U32>(0u32);
            for at in &o_words {
                b.st_v(at, [z4, z4, z4, z4]);
            }
            b.if_then(lane0, "recompute_row", |b| {
                b.st(&l_at, z);
                // The f16 pool's recompute keeps its scale: R' = max − ln c (or, under the
                // probe, lse − its ln c). A reference that is not finite (an infinite logit,
                // or a sum that left f32) becomes f32::MAX: the second combine then counts
                // the row, where +inf would pass it as settled.
                let m_ref = b.sub(m, shift);
                let lse_ref = b.sub(row_lse, probe_shift);
                let new_r = b.selp(lse_ref, m_ref, on_sum);
                let diff = b.sub(new_r, new_r);
                let finite = b.setp(Cmp::Eq, diff, 0.0f32);
                let new_r = b.selp(new_r, f32::MAX, finite);
                b.st(&r_at, new_r);
                let n = b.add(handed, 1u32);
                b.set(handed, n);
            });
        });
        b.unless(bad, "settle", |b| {
            b.if_then(lane0, "settle_row", |b| b.st(&r_at, f32::INFINITY));
        });
    });
    b.place(&done);
    let row_next = b.add(row, stride);
    b.set(row, row_next);
    b.bra(&next_row);
    b.place(&exit);
    let sp = b.ld_param_ptr(&status_p);
    for (count, word) in [(handed, 0i64), (unresolved, 4)] {
        let any = b.setp(Cmp::Ne, count, 0u32);
        b.if_then(any, "count", |b| {
            b.red::<U32, _>(AtomOp::Add, &global(sp, word), count)
        });
    }
    b.ret();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_paired_combine_takes_the_f16_combines_parameters() {
        // The runtime launches `fwd_kv_combine_f16p` with `fwd_kv_combine_f16`'s binding.
        for target in [Target::Sm90a, Target::Sm100a] {
            let f16 = COMBINE_F16.build(target).unwrap();
            assert_eq!(f16.params, COMBINE_F16_PAIRED.build(target).unwrap().params);
        }
    }
}
