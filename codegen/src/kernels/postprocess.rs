//! `bwd_postprocess`: one launch finishes all three gradients (`docs/design.md` §3.6).
//!
//! - `blockIdx.y == 0` de-interleaves the bf16 dQ pool `[T, 32, 128, 2]` (element
//!   `(t, hp, d, e) = dQ[t, 2hp+e, d]`) into `dq [T, 64, 128]`. A pool row (one head pair) is
//!   256 elements; 16 lanes take 16 elements each, so a CTA covers 16 pool rows. Each lane
//!   splits its 8 (d, e) pairs into two runs of 8 consecutive d with a byte permute and writes
//!   them with two 16-byte stores, one per head.
//!
//!   Pool row `(t, hp)` and its two output rows `dq[t, 2hp..2hp+2]` are the same 512 bytes at
//!   the same offset, so `dq_pool` may be `dq` itself (the backward passes one buffer for both,
//!   `docs/design.md` §3.6): the CTA loads all its rows with coherent loads, meets at a
//!   barrier, and only then stores. Every CTA touches only its own rows. Either the two
//!   buffers are the same or they are disjoint.
//! - `blockIdx.y == 1` casts the fp32 dK then dV pools `[W, 4, 128]` to bf16 with
//!   round-to-nearest-even, 2048 elements per CTA (8 per thread). `W·512` is a multiple of
//!   2048 because W is a multiple of 128.
//!
//! Grid `[max(2·T, W/2), 2]`, 256 threads; CTAs past their half's work return at once.

use super::common;
use super::fixed_point as fp;
use super::KernelDesc;
use crate::ptx::*;
use crate::target::Target;

/// The deterministic mode's postprocess (`docs/design.md` §3.8).
pub const DETERMINISTIC: KernelDesc = KernelDesc {
    name: "bwd_postprocess_det",
    about: "decodes the deterministic mode's fixed-point pools: the 64-bit dQ head-pair pool into dq, the 64-bit dK/dV pools into bf16 dk, dv",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: describe_deterministic,
};

/// The postprocess kernel.
pub const DESC: KernelDesc = KernelDesc {
    name: "bwd_postprocess",
    about: "de-interleaves the bf16 dQ pool into dq (in place when they are one buffer) and casts the fp32 dK/dV pools to bf16",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe,
};

const THREADS: u32 = 256;
/// dQ pool rows (head pairs) per CTA.
pub const DQ_ROWS_PER_CTA: u32 = THREADS / 16;
/// fp32 pool elements per CTA.
pub const KV_ELEMS_PER_CTA: u32 = THREADS * 8;

fn describe(b: &mut KernelBuilder) {
    b.grid("[max(2 * num_tokens, workspace_rows / 2), 2, 1]");
    let dq_pool_p = b.param_ptr("dq_pool", HostElem::Bf16, false);
    let dk_pool_p = b.param_ptr("dk_pool", HostElem::F32, false);
    let dv_pool_p = b.param_ptr("dv_pool", HostElem::F32, false);
    let dq_p = b.param_ptr("dq", HostElem::Bf16, true);
    let dk_p = b.param_ptr("dk", HostElem::Bf16, true);
    let dv_p = b.param_ptr("dv", HostElem::Bf16, true);
    let tokens_p = b.param_u32("num_tokens");
    let ws_rows_p = b.param_u32("workspace_rows");

    let tid = b.sreg(SReg::TidX);
    let block = b.sreg(SReg::CtaidX);
    let which = b.sreg(SReg::CtaidY);
    let is_dq = b.setp(Cmp::Eq, which, 0u32);
    let kv_half = b.label("kv_half");
    b.bra_unless(is_dq, &kv_half);

    b.comment("dQ: de-interleave head pairs");
    {
        let pool = b.ld_param_ptr(&dq_pool_p);
        let dq = b.ld_param_ptr(&dq_p);
        let tokens = b.ld_param(&tokens_p);
        let rows = b.mul_lo(tokens, 32u32);
        let sub = b.shr(tid, 4u32);
        let lane = b.and(tid, 15u32);
        let row = b.mad_lo(block, DQ_ROWS_PER_CTA, sub);
        let live = b.setp(Cmp::Lt, row, rows);
        b.if_then(live, "dq_done", |b| {
            // Pool row `row` = (t, hp); this lane holds d in [8·lane, 8·lane + 8), both heads.
            let row_bytes = b.mul_wide(row, 512u32);
            let lane_bytes = b.mul_wide(lane, 32u32);
            let src = b.add(row_bytes, lane_bytes);
            let src = b.add(pool, src);
            // Coherent loads: with dq_pool == dq this CTA's stores overwrite these bytes.
            let w0: [Reg<Bf16x2>; 4] = b.ld_v(&global(src, 0));
            let w1: [Reg<Bf16x2>; 4] = b.ld_v(&global(src, 16));
            let w = [w0[0], w0[1], w0[2], w0[3], w1[0], w1[1], w1[2], w1[3]];
            let even: [Reg<Bf16x2>; 4] =
                std::array::from_fn(|i| b.prmt(w[2 * i], w[2 * i + 1], common::PRMT_LOW_HALVES));
            let odd: [Reg<Bf16x2>; 4] =
                std::array::from_fn(|i| b.prmt(w[2 * i], w[2 * i + 1], common::PRMT_HIGH_HALVES));
            // dq row (t, 2hp) starts at 2·row·256 bytes; head 2hp+1 follows 256 bytes later.
            let head_bytes = b.mul_wide(row, 512u32);
            let lane_out = b.mul_wide(lane, 16u32);
            let dst = b.add(head_bytes, lane_out);
            let dst = b.add(dq, dst);
            // Every lane of the CTA has read its row before any lane overwrites it (in place).
            // `live` is uniform over the CTA: 32·T rows is a multiple of the 16 per CTA.
            b.bar_sync(0, None);
            b.st_v(&global(dst, 0), even);
            b.st_v(&global(dst, 256), odd);
        });
        b.ret();
    }

    b.place(&kv_half);
    b.comment("dK/dV: fp32 pools to bf16");
    let pools = KvParams {
        dk_pool: &dk_pool_p,
        dv_pool: &dv_pool_p,
        dk: &dk_p,
        dv: &dv_p,
        ws_rows: &ws_rows_p,
    };
    kv_half_to_bf16(b, &pools, block, tid, |b, src, elem, _| {
        let src_off = b.mul_wide(elem, 4u32);
        let src = b.add(src, src_off);
        let a: [Reg<F32>; 4] = b.ld_global_nc_v(&global(src, 0));
        let c: [Reg<F32>; 4] = b.ld_global_nc_v(&global(src, 16));
        [a[0], a[1], a[2], a[3], c[0], c[1], c[2], c[3]]
    });
    b.ret();
}

/// `bwd_postprocess_det`: grid `[max(T, W/2), 2]`. `blockIdx.y == 0`: CTA `t` decodes token
/// `t`'s 8192 pool values (`fixed_point::dq_word`): thread `(g, quad, c)` reads the 8 words of
/// `d` in `[8c, 8c + 8)`, scales them by the row's unit and writes its four heads with one
/// 16-byte store each. The pool is a workspace of its own, so nothing runs in place.
/// `blockIdx.y == 1`: 2048 dK/dV pool elements per CTA, each times its group's unit.
fn describe_deterministic(b: &mut KernelBuilder) {
    b.grid("[max(num_tokens, workspace_rows / 2), 2, 1]");
    let dq_pool_p = b.param_ptr("dq_pool", HostElem::F32, false);
    let dk_pool_p = b.param_ptr("dk_pool", HostElem::I32, false);
    let dv_pool_p = b.param_ptr("dv_pool", HostElem::I32, false);
    let rows_p = b.param_ptr("row_bounds", HostElem::I32, false);
    let bounds_p = b.param_ptr("bounds", HostElem::I32, false);
    let dq_p = b.param_ptr("dq", HostElem::Bf16, true);
    let dk_p = b.param_ptr("dk", HostElem::Bf16, true);
    let dv_p = b.param_ptr("dv", HostElem::Bf16, true);
    let tokens_p = b.param_u32("num_tokens");
    let ws_rows_p = b.param_u32("workspace_rows");

    let tid = b.sreg(SReg::TidX);
    let block = b.sreg(SReg::CtaidX);
    let which = b.sreg(SReg::CtaidY);
    let bounds = b.ld_param_ptr(&bounds_p);
    let is_dq = b.setp(Cmp::Eq, which, 0u32);
    let kv_half = b.label("kv_half");
    b.bra_unless(is_dq, &kv_half);

    b.comment("dQ: fixed-point head quads to bf16 rows");
    {
        let pool = b.ld_param_ptr(&dq_pool_p);
        let dq = b.ld_param_ptr(&dq_p);
        let row_bounds = b.ld_param_ptr(&rows_p);
        let tokens = b.ld_param(&tokens_p);
        let live = b.setp(Cmp::Lt, block, tokens);
        b.if_then(live, "dq_done", |b| {
            // Token `block`; thread (g, quad, c) holds d in [8c, 8c + 8) of the group's heads
            // dq_quad_head(quad, 0..4).
            let t = block;
            let g = b.shr(tid, 6u32);
            let quad = b.shr(tid, 4u32);
            let quad = b.and(quad, 3u32);
            let c = b.and(tid, 15u32);
            let tg = b.mad_lo(t, 4u32, g);
            let a = super::common::load_u32(b, row_bounds, tg);
            let factor = fp::dq_factor(b, bounds, g);
            let unit = fp::dq_unit(b, a, factor);
            let d0 = b.shl(c, 3u32);
            let word = fp::dq_word(b, t, g, quad, d0);
            let src = super::common::elem::<F32>(b, pool, word);
            // heads[e][k]: head dq_quad_head(quad, e) at d0 + k.
            let mut heads: [Vec<Reg<F32>>; 4] = std::array::from_fn(|_| Vec::new());
            for k in 0..8i64 {
                let w: [Reg<F32>; 4] = b.ld_global_nc_v(&src.offset(16 * k));
                for (e, x) in w.into_iter().enumerate() {
                    heads[e].push(b.fmul(x, unit));
                }
            }
            let g16 = b.shl(g, 4u32);
            for (e, vals) in heads.iter().enumerate() {
                let h = b.add(g16, fp::dq_quad_head(0, e as u32));
                let quad2 = b.shl(quad, 1u32);
                let h = b.add(h, quad2);
                let row = b.mad_lo(t, 64u32, h);
                let at = b.mad_lo(row, 128u32, d0);
                let dst = super::common::elem::<Bf16>(b, dq, at);
                let packed: [Reg<Bf16x2>; 4] =
                    std::array::from_fn(|i| b.cvt_bf16x2(vals[2 * i + 1], vals[2 * i]));
                b.st_v(&dst, packed);
            }
        });
        b.ret();
    }

    b.place(&kv_half);
    b.comment("dK/dV: fixed-point pools to bf16");
    let pools = KvParams {
        dk_pool: &dk_pool_p,
        dv_pool: &dv_pool_p,
        dk: &dk_p,
        dv: &dv_p,
        ws_rows: &ws_rows_p,
    };
    kv_half_to_bf16(b, &pools, block, tid, |b, src, elem, second| {
        // Element (row, g, d): the thread's 8 elements share one group.
        let g = b.shr(elem, 7u32);
        let g = b.and(g, 3u32);
        let ((dk_unit, _), (dv_unit, _)) = fp::kv_units(b, bounds, g);
        let unit = b.selp(dv_unit, dk_unit, second);
        let src_off = b.mul_wide(elem, 8u32);
        let src = b.add(src, src_off);
        let mut v = Vec::new();
        for quarter in 0..4i64 {
            let w: [Reg<U64>; 2] = b.ld_global_nc_v(&global(src, 16 * quarter));
            for x in w {
                v.push(fp::from_fixed64(b, x, unit));
            }
        }
        std::array::from_fn(|i| v[i])
    });
    b.ret();
}

/// The parameters of a dK/dV half: the two pools, the two outputs and `W`.
struct KvParams<'a> {
    dk_pool: &'a ParamRef<U64>,
    dv_pool: &'a ParamRef<U64>,
    dk: &'a ParamRef<U64>,
    dv: &'a ParamRef<U64>,
    ws_rows: &'a ParamRef<U32>,
}

/// The dK/dV half of both postprocesses (`blockIdx.y == 1`): CTA `block` takes 2048 elements
/// of the dK pool, then of the dV pool (`W / 4` CTAs each; the rest return), each thread 8
/// consecutive elements from `element`; `load(b, pool, first element, is_dv)` reads and
/// scales them to f32, and they are stored as bf16 with round-to-nearest-even.
fn kv_half_to_bf16(
    b: &mut KernelBuilder,
    p: &KvParams,
    block: Reg<U32>,
    tid: Reg<U32>,
    load: impl FnOnce(&mut KernelBuilder, Reg<U64>, Reg<U32>, Reg<Pred>) -> [Reg<F32>; 8],
) {
    let ws_rows = b.ld_param(p.ws_rows);
    // CTAs per pool: W·4·128 / 2048 = W / 4.
    let per_pool = b.shr(ws_rows, 2u32);
    let second = b.setp(Cmp::Ge, block, per_pool);
    let total = b.shl(per_pool, 1u32);
    let live = b.setp(Cmp::Lt, block, total);
    b.if_then(live, "kv_done", |b| {
        let dk_pool = b.ld_param_ptr(p.dk_pool);
        let dv_pool = b.ld_param_ptr(p.dv_pool);
        let dk = b.ld_param_ptr(p.dk);
        let dv = b.ld_param_ptr(p.dv);
        let src_base = b.selp(dv_pool, dk_pool, second);
        let dst_base = b.selp(dv, dk, second);
        let skip = b.selp(per_pool, 0u32, second);
        let local = b.sub(block, skip);
        let elem = b.mul_lo(local, KV_ELEMS_PER_CTA);
        let elem = b.mad_lo(tid, 8u32, elem);
        let v = load(b, src_base, elem, second);
        let dst_off = b.mul_wide(elem, 2u32);
        let dst = b.add(dst_base, dst_off);
        let packed: [Reg<Bf16x2>; 4] =
            std::array::from_fn(|i| b.cvt_bf16x2(v[2 * i + 1], v[2 * i]));
        b.st_v(&global(dst, 0), packed);
    });
}
