//! `kv_to_aligned` and `kv_from_aligned`: the runtime's own moves between compact K/V rows
//! `[T, 4, 128]` and the aligned workspace layout `[W, 4, 128]` (`docs/design.md` §1.5).
//!
//! Why the runtime owns this layout instead of the main kernels ignoring padding: a key block
//! is always loaded as a full 128-row TMA tile, padding rows included. The causal mask removes
//! their probabilities, but only after `S = Q·Kᵀ` and `dP = dO·Vᵀ` have read them, and the dQ
//! GEMM `dS·K` multiplies the (zero) masked `dS` by the padding rows of K: a NaN or Inf there
//! turns into NaN through `0·NaN` however well the softmax is masked. Immunity would need a
//! pass that zeroes the padding rows of every staged K/V tile in shared memory, in both main
//! kernels, on their critical path. Writing the padding once per call, here, costs one copy of
//! K and V and leaves the main kernels as they are.
//!
//! Both kernels read a per-key-block table `block_rows [W/128, 2]` u32: the compact row of the
//! block's first row, and how many of its 128 rows are real (the rest are padding). Rows are
//! 1024 bytes (4 heads × 128 bf16); each thread moves one 16-byte quarter-head, so a CTA of
//! 256 threads covers 4 rows. Grid `[W/4, 2]`: `blockIdx.y` 0 moves K, 1 moves V.
//!
//! - `kv_to_aligned` writes every aligned row: a copy of its compact row, or zeros for
//!   padding. It never reads the destination, so its old contents (NaN, garbage) are gone.
//! - `kv_from_aligned` copies the real rows back to compact `[T, 4, 128]` and ignores the
//!   padding rows.

use super::KernelDesc;
use crate::ptx::*;
use crate::target::Target;

/// The compact → aligned pack.
pub const TO_ALIGNED: KernelDesc = KernelDesc {
    name: "kv_to_aligned",
    about: "packs compact K/V rows into the zero-padded aligned workspace layout",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: describe_to_aligned,
};

/// The aligned → compact gather.
pub const FROM_ALIGNED: KernelDesc = KernelDesc {
    name: "kv_from_aligned",
    about: "gathers the real rows of aligned dK/dV back into compact rows",
    targets: &[Target::Sm90a, Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: describe_from_aligned,
};

const THREADS: u32 = 256;
/// Bytes of one `[4, 128]` bf16 row.
const ROW_BYTES: u32 = 1024;
/// Workspace rows one CTA covers: 64 threads of 16 bytes per row.
pub const ROWS_PER_CTA: u32 = THREADS / (ROW_BYTES / 16);
/// Bytes of one `block_rows` entry.
const ENTRY_BYTES: u32 = 8;

/// Per-thread addressing shared by both directions.
struct Lane {
    /// The aligned row this thread moves part of.
    row: Reg<U32>,
    /// Whether the row is a real one (not padding) and inside the workspace.
    real: Reg<Pred>,
    /// Whether the row lies inside the workspace at all.
    inside: Reg<Pred>,
    /// The compact row (meaningful only when `real`).
    compact: Reg<U32>,
    /// Byte offset of this thread's 16 bytes inside a row.
    lane_bytes: Reg<U64>,
    /// `blockIdx.y == 1`: the V half of the grid.
    is_v: Reg<Pred>,
}

fn lane(b: &mut KernelBuilder, table_p: &ParamRef<U64>, rows_p: &ParamRef<U32>) -> Lane {
    let tid = b.sreg(SReg::TidX);
    let block = b.sreg(SReg::CtaidX);
    let which = b.sreg(SReg::CtaidY);
    let is_v = b.setp(Cmp::Eq, which, 1u32);
    let sub = b.shr(tid, 6u32);
    let quarter = b.and(tid, 63u32);
    let row = b.mad_lo(block, ROWS_PER_CTA, sub);
    let ws_rows = b.ld_param(rows_p);
    let inside = b.setp(Cmp::Lt, row, ws_rows);
    // Rows past W (never, for the grid the runtime launches) read the table of block 0.
    let safe_row = b.selp(row, 0u32, inside);
    let kblock = b.shr(safe_row, 7u32);
    let in_block = b.and(safe_row, 127u32);
    let table = b.ld_param_ptr(table_p);
    let entry = b.mul_wide(kblock, ENTRY_BYTES);
    let entry = b.add(table, entry);
    let first: Reg<U32> = b.ld(&global(entry, 0));
    let count: Reg<U32> = b.ld(&global(entry, 4));
    let zero = b.mov::<U32>(0u32);
    let inside_count = b.selp(count, zero, inside);
    let real = b.setp(Cmp::Lt, in_block, inside_count);
    let compact = b.add(first, in_block);
    let lane_bytes = b.mul_wide(quarter, 16u32);
    Lane {
        row,
        real,
        inside,
        compact,
        lane_bytes,
        is_v,
    }
}

/// `base + row·1024 + lane_bytes`.
fn row_address(b: &mut KernelBuilder, base: Reg<U64>, row: Reg<U32>, lane: Reg<U64>) -> Reg<U64> {
    let off = b.mul_wide(row, ROW_BYTES);
    let off = b.add(off, lane);
    b.add(base, off)
}

fn describe_to_aligned(b: &mut KernelBuilder) {
    b.grid("[workspace_rows / 4, 2, 1]");
    let k_p = b.param_ptr("k", HostElem::Bf16, false);
    let v_p = b.param_ptr("v", HostElem::Bf16, false);
    let table_p = b.param_ptr("block_rows", HostElem::U32, false);
    let k_aligned_p = b.param_ptr("k_aligned", HostElem::Bf16, true);
    let v_aligned_p = b.param_ptr("v_aligned", HostElem::Bf16, true);
    let rows_p = b.param_u32("workspace_rows");

    let l = lane(b, &table_p, &rows_p);
    let done = b.label("done");
    b.bra_unless(l.inside, &done);
    let k_aligned = b.ld_param_ptr(&k_aligned_p);
    let v_aligned = b.ld_param_ptr(&v_aligned_p);
    let dst_base = b.selp(v_aligned, k_aligned, l.is_v);
    let dst = row_address(b, dst_base, l.row, l.lane_bytes);
    let pad = b.label("pad");
    b.bra_unless(l.real, &pad);
    b.comment("a real row: copy its compact row");
    {
        let k = b.ld_param_ptr(&k_p);
        let v = b.ld_param_ptr(&v_p);
        let src_base = b.selp(v, k, l.is_v);
        let src = row_address(b, src_base, l.compact, l.lane_bytes);
        let x: [Reg<U32>; 4] = b.ld_global_nc_v(&global(src, 0));
        b.st_v(&global(dst, 0), x);
        b.ret();
    }
    b.place(&pad);
    b.comment("a padding row: zeros, whatever the buffer held");
    {
        let z = b.mov::<U32>(0u32);
        b.st_v(&global(dst, 0), [z, z, z, z]);
    }
    b.place(&done);
    b.ret();
}

fn describe_from_aligned(b: &mut KernelBuilder) {
    b.grid("[workspace_rows / 4, 2, 1]");
    let dk_aligned_p = b.param_ptr("dk_aligned", HostElem::Bf16, false);
    let dv_aligned_p = b.param_ptr("dv_aligned", HostElem::Bf16, false);
    let table_p = b.param_ptr("block_rows", HostElem::U32, false);
    let dk_p = b.param_ptr("dk", HostElem::Bf16, true);
    let dv_p = b.param_ptr("dv", HostElem::Bf16, true);
    let rows_p = b.param_u32("workspace_rows");

    let l = lane(b, &table_p, &rows_p);
    b.if_then(l.real, "done", |b| {
        let dk_aligned = b.ld_param_ptr(&dk_aligned_p);
        let dv_aligned = b.ld_param_ptr(&dv_aligned_p);
        let src_base = b.selp(dv_aligned, dk_aligned, l.is_v);
        let src = row_address(b, src_base, l.row, l.lane_bytes);
        let dk = b.ld_param_ptr(&dk_p);
        let dv = b.ld_param_ptr(&dv_p);
        let dst_base = b.selp(dv, dk, l.is_v);
        let dst = row_address(b, dst_base, l.compact, l.lane_bytes);
        let x: [Reg<U32>; 4] = b.ld_global_nc_v(&global(src, 0));
        b.st_v(&global(dst, 0), x);
    });
    b.ret();
}
