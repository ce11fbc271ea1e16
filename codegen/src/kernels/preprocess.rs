//! `bwd_preprocess`: `delta[t, h] = Σ_d O[t, h, d] · dO[t, h, d]` in fp32 (`docs/design.md` §3.2).
//!
//! Grid `[ceil(T/128), 64]`, 256 threads: one CTA reduces 128 rows of one head. A row is
//! 128 bf16 = 256 bytes, read by 16 lanes with one 16-byte load each of O and dO; the 16
//! partial sums meet in a butterfly over lane distances 1, 2, 4, 8. 256 threads cover 16 rows
//! per pass, so 8 passes cover the CTA's 128 rows; rows past T are skipped.

use super::KernelDesc;
use crate::ptx::*;
use crate::target::Target;

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

fn describe(b: &mut KernelBuilder) {
    b.grid("[ceil(num_tokens / 128), 64, 1]");
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
    let head = b.sreg(SReg::CtaidY);

    let part = b.and(tid, LANES_PER_ROW - 1);
    let sub_row = b.shr(tid, 4u32);
    let first = b.mul_lo(block, ROWS_PER_CTA);
    let first = b.add(first, sub_row);
    // Byte offset of this lane's 8 elements inside a (t, h) row.
    let lane_bytes = b.shl(part, 4u32);
    let lane_bytes = b.cvt::<U64, U32>(lane_bytes);
    let leader = b.setp(Cmp::Eq, part, 0u32);

    for pass in 0..ROWS_PER_CTA / ROWS_PER_PASS {
        b.comment(&format!("rows first + {}", pass * ROWS_PER_PASS));
        let t = b.add(first, pass * ROWS_PER_PASS);
        let live = b.setp(Cmp::Lt, t, tokens);
        // (t * 64 + head) is the row index of both O and dO, and the delta index.
        let row = b.mad_lo(t, HEADS, head);
        let sum = b.mov::<F32>(0.0f32);
        b.if_then(live, "row_loaded", |b| {
            let row_bytes = b.mul_wide(row, HEAD_DIM * 2);
            let off = b.add(row_bytes, lane_bytes);
            let o_addr = b.add(out, off);
            let d_addr = b.add(dout, off);
            let o: [Reg<Bf16x2>; 4] = b.ld_global_nc_v(&global(o_addr, 0));
            let d: [Reg<Bf16x2>; 4] = b.ld_global_nc_v(&global(d_addr, 0));
            let mut acc = b.mov::<F32>(0.0f32);
            for i in 0..4 {
                let (o_lo, o_hi) = b.bf16x2_to_f32(o[i]);
                let (d_lo, d_hi) = b.bf16x2_to_f32(d[i]);
                acc = b.fma(o_lo, d_lo, acc);
                acc = b.fma(o_hi, d_hi, acc);
            }
            b.set(sum, acc);
        });
        // The butterfly runs in every lane: a warp holds two rows, and when only the first
        // is below T the other half-warp must still take part in the full-mask shuffles.
        let mut acc = sum;
        for dist in [1u32, 2, 4, 8] {
            let other = b.shfl(Shfl::Bfly, acc, dist, 0x1f);
            acc = b.add(acc, other);
        }
        let store = b.and_pred(live, leader);
        let row_f32 = b.mul_wide(row, 4u32);
        let dst = b.add(delta, row_f32);
        b.predicated(store, false, |b| b.st(&global(dst, 0), acc));
    }
    b.ret();
}
