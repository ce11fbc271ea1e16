//! The device schedule build: from a device block selection `q2k [4, T, 16]` and device
//! `cu_seqlens`, five launches write the schedule of `docs/design.md` §2.1 (`row_ptr`, `q_indices`,
//! `scheduler_metadata`, `work_count`, `document_workspace_starts`) with the tables the host
//! `build_schedule` gives, and validate the selection on the way, with no host sync.
//!
//! 1. [`DOCUMENTS`] (1 CTA): validates `cu_seqlens`, lays out the aligned workspace, numbers the
//!    CSR rows (level-major, round-robin across documents) and the `(row, query block)` pairs.
//! 2. [`COUNT`] (one CTA per (document block, head)): validates every id of the block's 128
//!    queries and counts, per (key block, query block), the queries that selected it.
//! 3. [`OFFSETS`] (one CTA per head): scans the pair counts into edge offsets, writes
//!    `row_ptr`, scans the work items per row; CTA 0 decodes the first fault for the host.
//! 4. [`FILL`] (as 2): writes every edge at `offset + rank`, the rank being the query's place
//!    among the block's queries that selected the same key block, so rows ascend.
//! 5. [`ITEMS`]: writes the work items (head-major, then row, then `q_begin`), `work_count`
//!    (0 when anything was flagged) and the `-1` tail of `q_indices`.
//!
//! Rows are numbered without a level loop: document `d`'s block `k` is row `rank0(d)` at
//! level 0, and `N0 + Σ_long (min(nb_j, k) − 1) + #{long j before d : nb_j > k}` at level
//! `k >= 1`, where `N0` counts the non-empty documents and "long" ones have two or more blocks.
//! Edges of a row come from query blocks `qb >= k` of the row's document in ascending order,
//! so an exclusive scan over the pairs `(head, row, qb)` in that order gives every edge's
//! place. All index arithmetic is `u32`; the host sizes every region from `T`, the document
//! count and `W` alone and rejects shapes whose indices would not fit.

use super::common::{
    div_ceil, load_if, load_u32, store_u32, tiled_scan, warp_inclusive_scan, SCAN_PER_THREAD,
    SCAN_THREADS,
};
use super::KernelDesc;
use crate::ptx::*;
use crate::target::Target;

/// Threads of the per-block kernels: one per query of a 128-query block.
pub const BLOCK_THREADS: u32 = 128;
/// Threads per CTA of [`ITEMS`].
pub const ITEM_THREADS: u32 = 256;
/// Block ids per list (`q2k` entries per query and head).
pub const TOPK: u32 = 16;
/// Key blocks a query block's selection mask can name: own block `< 2048`, so `T <= 2^18`.
pub const MAX_KEY_BLOCKS: u32 = 2048;

/// Words of the status block (the host reads it back; layout mirrored by the runtime).
pub const STATUS_WORDS: u32 = 32;
/// Status word: fault flags (`FLAG_*`).
pub const ST_FLAGS: u32 = 0;
/// Status word: the first malformed `cu_seqlens` index (atomic min; `i32::MAX` when none).
pub const ST_CU_FAULT: u32 = 1;
/// Status word: the first faulty `q2k` entry, `(head·T + row)·16 + slot` (atomic min).
pub const ST_SEL_FAULT: u32 = 2;
/// Status word: CSR rows `Σ ceil(len_d/128)`.
pub const ST_ROWS: u32 = 3;
/// Status word: non-empty documents.
pub const ST_NONEMPTY: u32 = 4;
/// Status word: documents of two or more blocks.
pub const ST_LONG: u32 = 5;
/// Status word: `(row, query block)` pairs per head.
pub const ST_PAIRS: u32 = 6;
/// Status word (decoded): the selection fault's kind (`KIND_*`).
pub const ST_KIND: u32 = 7;
/// Status word (decoded): the faulty value (`q2k` id, or `cu_seqlens[i]`).
pub const ST_VALUE: u32 = 8;
/// Status word (decoded): the fault's context (block count, own block, first slot, or
/// `cu_seqlens[i-1]`).
pub const ST_AUX: u32 = 9;
/// Status word (decoded): head of the faulty entry.
pub const ST_HEAD: u32 = 10;
/// Status word (decoded): compact query row of the faulty entry.
pub const ST_ROW: u32 = 11;
/// Status word (decoded): slot of the faulty entry.
pub const ST_SLOT: u32 = 12;
/// Status words 16..20: edges per head.
pub const ST_EDGES: u32 = 16;
/// Status words 20..24: work items per head.
pub const ST_ITEMS: u32 = 20;

/// Flag: `cu_seqlens` does not start at 0, decreases, or does not end at `T`.
pub const FLAG_CU_SEQLENS: u32 = 1;
/// Flag: the aligned workspace `Σ ceil(len/128)·128` exceeds the `W` the caller gave.
pub const FLAG_WORKSPACE: u32 = 2;
/// Flag: a `q2k` id breaks the selection contract.
pub const FLAG_SELECTION: u32 = 4;
/// Flag: more `(row, query block)` pairs than the host's bound (never expected: the bound is
/// proven; the flag keeps the build memory-safe if it were wrong).
pub const FLAG_PAIR_CAPACITY: u32 = 8;

/// Selection fault: id below `-1`.
pub const KIND_BELOW_PADDING: u32 = 1;
/// Selection fault: id at or past the document's block count.
pub const KIND_PAST_END: u32 = 2;
/// Selection fault: id after the query's own block.
pub const KIND_AFTER_OWN: u32 = 3;
/// Selection fault: id already in an earlier slot of the list.
pub const KIND_REPEATED: u32 = 4;

const TARGETS: &[Target] = &[Target::Sm90a, Target::Sm100a];

/// `schedule_documents`.
pub const DOCUMENTS: KernelDesc = KernelDesc {
    name: "schedule_documents",
    about: "validates cu_seqlens, lays out the workspace, numbers the CSR rows and their pairs",
    targets: TARGETS,
    threads: (SCAN_THREADS, 1, 1),
    describe: documents,
};

/// `schedule_count`.
pub const COUNT: KernelDesc = KernelDesc {
    name: "schedule_count",
    about: "validates q2k and counts the queries of each (key block, query block) pair",
    targets: TARGETS,
    threads: (BLOCK_THREADS, 1, 1),
    describe: count,
};

/// `schedule_offsets`.
pub const OFFSETS: KernelDesc = KernelDesc {
    name: "schedule_offsets",
    about: "pair counts to edge offsets, row_ptr, work items per row; decodes the first fault",
    targets: TARGETS,
    threads: (SCAN_THREADS, 1, 1),
    describe: offsets,
};

/// `schedule_fill`.
pub const FILL: KernelDesc = KernelDesc {
    name: "schedule_fill",
    about: "writes every CSR edge at its pair offset plus its rank in the query block",
    targets: TARGETS,
    threads: (BLOCK_THREADS, 1, 1),
    describe: fill,
};

/// `schedule_items`.
pub const ITEMS: KernelDesc = KernelDesc {
    name: "schedule_items",
    about: "writes scheduler_metadata, work_count and the -1 tail of q_indices",
    targets: TARGETS,
    threads: (ITEM_THREADS, 1, 1),
    describe: items,
};

/// `status[word]`.
fn status_addr(status: Reg<U64>, word: u32) -> GlobalAddr {
    global(status, 4 * i64::from(word))
}

/// Population count of a 32-bit word (SWAR: no `popc` needed in the simulator).
fn popc(b: &mut KernelBuilder, x: Reg<U32>) -> Reg<U32> {
    let h = b.shr(x, 1u32);
    let h = b.and(h, 0x5555_5555u32);
    let x = b.sub(x, h);
    let lo = b.and(x, 0x3333_3333u32);
    let hi = b.shr(x, 2u32);
    let hi = b.and(hi, 0x3333_3333u32);
    let x = b.add(lo, hi);
    let s = b.shr(x, 4u32);
    let x = b.add(x, s);
    let x = b.and(x, 0x0f0f_0f0fu32);
    let x = b.mul_lo(x, 0x0101_0101u32);
    b.shr(x, 24u32)
}

/// The last index `i < n` with `a[i] <= key` for a non-decreasing `a` with `a[0] <= key`.
fn last_le(b: &mut KernelBuilder, a: Reg<U64>, n: Reg<U32>, key: Reg<U32>) -> Reg<U32> {
    let lo = b.mov::<U32>(0u32);
    let hi = b.mov::<U32>(n);
    let top = b.label("search");
    let done = b.label("search_done");
    b.place(&top);
    let more = b.setp(Cmp::Lt, lo, hi);
    b.bra_unless(more, &done);
    let mid = b.add(lo, hi);
    let mid = b.shr(mid, 1u32);
    let v = load_u32(b, a, mid);
    let right = b.setp(Cmp::Le, v, key);
    let mid1 = b.add(mid, 1u32);
    let new_lo = b.selp(mid1, lo, right);
    let new_hi = b.selp(hi, mid, right);
    b.set(lo, new_lo);
    b.set(hi, new_hi);
    b.bra(&top);
    b.place(&done);
    let found = b.max(lo, 1u32);
    b.sub(found, 1u32)
}

/// [`common::cta_exclusive_scan`] of `N` values per thread at once: one set of barriers for
/// all `N`. `warp_totals` holds `N·32` words. Returns (exclusive prefixes, CTA totals).
fn cta_exclusive_scan_n<const N: usize>(
    b: &mut KernelBuilder,
    v: [Reg<U32>; N],
    tid: Reg<U32>,
    warp_totals: &SharedVar,
) -> ([Reg<U32>; N], [Reg<U32>; N]) {
    let lane = b.and(tid, 31u32);
    let warp = b.shr(tid, 5u32);
    let base = b.shared_base(warp_totals);
    let incl: [Reg<U32>; N] = std::array::from_fn(|i| warp_inclusive_scan(b, v[i], lane));
    let last = b.setp(Cmp::Eq, lane, 31u32);
    let warp4 = b.shl(warp, 2u32);
    let slot = b.add(base, warp4);
    for (i, &x) in incl.iter().enumerate() {
        b.predicated(last, false, |b| b.st(&shared(slot, 128 * i as i64), x));
    }
    b.bar_sync(0, None);
    let first_warp = b.setp(Cmp::Eq, warp, 0u32);
    b.if_then(first_warp, "warp_totals", |b| {
        let lane4 = b.shl(lane, 2u32);
        let mine = b.add(base, lane4);
        for i in 0..N {
            let t = b.ld::<U32, _>(&shared(mine, 128 * i as i64));
            let t = warp_inclusive_scan(b, t, lane);
            b.st(&shared(mine, 128 * i as i64), t);
        }
    });
    b.bar_sync(0, None);
    let ntid = b.sreg(SReg::NtidX);
    let warps = b.shr(ntid, 5u32);
    let last_warp = b.sub(warps, 1u32);
    let last4 = b.shl(last_warp, 2u32);
    let last_slot = b.add(base, last4);
    let has_prev = b.setp(Cmp::Gt, warp, 0u32);
    let mut before = Vec::new();
    let mut total = Vec::new();
    for i in 0..N {
        let off = 128 * i as i64;
        total.push(b.ld::<U32, _>(&shared(last_slot, off)));
        let prev = b.mov::<U32>(0u32);
        b.predicated(has_prev, false, |b| {
            let p = b.ld::<U32, _>(&shared(slot, off - 4));
            b.set(prev, p);
        });
        let ex = b.sub(incl[i], v[i]);
        before.push(b.add(prev, ex));
    }
    b.bar_sync(0, None);
    (
        std::array::from_fn(|i| before[i]),
        std::array::from_fn(|i| total[i]),
    )
}

/// [`common::tiled_scan`] of `N` values per entry (one scan's barriers for all of them):
/// `value` gives the entry's `N` values (zeros when not live), `store` gets the sums before it.
fn tiled_scan_n<const N: usize>(
    b: &mut KernelBuilder,
    n: Reg<U32>,
    tid: Reg<U32>,
    warp_totals: &SharedVar,
    value: impl Fn(&mut KernelBuilder, Reg<U32>, Reg<Pred>) -> [Reg<U32>; N],
    store: impl Fn(&mut KernelBuilder, Reg<U32>, Reg<Pred>, [Reg<U32>; N], [Reg<U32>; N]),
) -> [Reg<U32>; N] {
    let carry: [Reg<U32>; N] = std::array::from_fn(|_| b.mov::<U32>(0u32));
    let tile = SCAN_THREADS * SCAN_PER_THREAD;
    b.for_range(0u32, n, tile, "scan_tile", |b, tile_base| {
        let first = b.mad_lo(tid, SCAN_PER_THREAD, tile_base);
        let mut entries = Vec::new();
        let mut sum: [Reg<U32>; N] = std::array::from_fn(|_| b.mov::<U32>(0u32));
        for k in 0..SCAN_PER_THREAD {
            let i = b.add(first, k);
            let l = b.setp(Cmp::Lt, i, n);
            let v = value(b, i, l);
            for c in 0..N {
                sum[c] = b.add(sum[c], v[c]);
            }
            entries.push((i, l, v));
        }
        let (before, total) = cta_exclusive_scan_n(b, sum, tid, warp_totals);
        let mut running: [Reg<U32>; N] = std::array::from_fn(|c| b.add(carry[c], before[c]));
        for &(i, l, v) in &entries {
            store(b, i, l, running, v);
            running = std::array::from_fn(|c| b.add(running[c], v[c]));
        }
        for c in 0..N {
            let next = b.add(carry[c], total[c]);
            b.set(carry[c], next);
        }
    });
    carry
}

/// Address of the 16-byte record `i` at `base`.
fn common_elem16(b: &mut KernelBuilder, base: Reg<U64>, i: Reg<U32>) -> GlobalAddr {
    super::common::elem_bytes(b, base, i, 16)
}

/// `for i in (start..end).step_by(step)` with a register step (grid-stride loops).
fn strided(
    b: &mut KernelBuilder,
    start: Reg<U32>,
    end: Reg<U32>,
    step: Reg<U32>,
    body: impl FnOnce(&mut KernelBuilder, Reg<U32>),
) {
    let i = b.mov::<U32>(start);
    let top = b.label("strided");
    let done = b.label("strided_done");
    b.place(&top);
    let out = b.setp(Cmp::Ge, i, end);
    b.bra_if(out, &done);
    body(b, i);
    let next = b.add(i, step);
    b.set(i, next);
    b.bra(&top);
    b.place(&done);
}

/// Returns from the kernel when `status[FLAGS] & mask` is set. Every thread reads the same
/// word, so the exit is uniform and later barriers see the whole CTA.
fn exit_if_flagged(b: &mut KernelBuilder, status: Reg<U64>, mask: u32) {
    let flags = b.ld::<U32, _>(&status_addr(status, ST_FLAGS));
    let hit = b.and(flags, mask);
    let bad = b.setp(Cmp::Ne, hit, 0u32);
    b.if_then(bad, "flagged", |b| b.ret());
}

fn documents(b: &mut KernelBuilder) {
    b.grid("[1, 1, 1]");
    let cu_in_p = b.param_ptr("cu_seqlens", HostElem::I32, false);
    let cu_p = b.param_ptr("cu_copy", HostElem::I32, true);
    let ws_p = b.param_ptr("document_workspace_starts", HostElem::I32, true);
    let status_p = b.param_ptr("status", HostElem::I32, true);
    let nb_p = b.param_ptr("doc_blocks", HostElem::I32, true);
    let rank0_p = b.param_ptr("doc_rank0", HostElem::I32, true);
    let long_idx_p = b.param_ptr("doc_long_index", HostElem::I32, true);
    let long_nb_p = b.param_ptr("long_blocks", HostElem::I32, true);
    let blk_doc_p = b.param_ptr("block_record", HostElem::I32, true);
    let row_of_p = b.param_ptr("row_of_block", HostElem::I32, true);
    let block_of_p = b.param_ptr("block_of_row", HostElem::I32, true);
    let pair_p = b.param_ptr("row_pair_offset", HostElem::I32, true);
    let docs_p = b.param_u32("num_docs");
    let tokens_p = b.param_u32("num_tokens");
    let kblocks_p = b.param_u32("workspace_blocks");
    let pair_cap_p = b.param_u32("pair_capacity");
    let warp_totals = b.shared_array("warp_totals", 128, 16);
    let doc_totals = b.shared_array("doc_totals", 3 * 128, 16);
    // [first cu_seqlens fault, flags]: the kernel is one CTA, so its own fault bookkeeping
    // stays in shared memory and only the verdict goes to the status block.
    let verdict_var = b.shared_array("verdict", 16, 16);

    let cu_in = b.ld_param_ptr(&cu_in_p);
    let cu = b.ld_param_ptr(&cu_p);
    let ws = b.ld_param_ptr(&ws_p);
    let status = b.ld_param_ptr(&status_p);
    let nb_a = b.ld_param_ptr(&nb_p);
    let rank0_a = b.ld_param_ptr(&rank0_p);
    let long_idx_a = b.ld_param_ptr(&long_idx_p);
    let long_nb_a = b.ld_param_ptr(&long_nb_p);
    let docs = b.ld_param(&docs_p);
    let tokens = b.ld_param(&tokens_p);
    let kblocks = b.ld_param(&kblocks_p);
    let tid = b.sreg(SReg::TidX);
    let leader = b.setp(Cmp::Eq, tid, 0u32);
    let verdict = b.shared_base(&verdict_var);

    b.comment("reset the status block; a bad cu_seqlens[0] is fault index 0");
    b.if_then(leader, "reset", |b| {
        for w in 0..STATUS_WORDS {
            let v = if w == ST_CU_FAULT {
                i32::MAX as u32
            } else if w == ST_SEL_FAULT {
                u32::MAX
            } else {
                0
            };
            b.st::<U32, _>(&status_addr(status, w), v);
        }
        let c0 = b.ld::<U32, _>(&global(cu_in, 0));
        let bad = b.setp(Cmp::Ne, c0, 0u32);
        let first = b.selp::<U32>(0u32, i32::MAX as u32, bad);
        b.st::<U32, _>(&shared(verdict, 0), first);
        let last = b.mul_wide(docs, 4u32);
        let last_in = b.add(cu_in, last);
        let c_last = b.ld::<U32, _>(&global(last_in, 0));
        let last_out = b.add(cu, last);
        b.st::<U32, _>(&global(last_out, 0), c_last);
    });
    b.bar_sync(0, None);

    b.comment("one scan over the documents of (blocks, non-empty, long): workspace starts,");
    b.comment("the level-0 row of each document and the compacted list of long documents");
    let [rows, nonempty, long] = tiled_scan_n(
        b,
        docs,
        tid,
        &doc_totals,
        |b, d, live| {
            let out: [Reg<U32>; 3] = std::array::from_fn(|_| b.mov::<U32>(0u32));
            b.if_then(live, "doc", |b| {
                let c0 = load_u32(b, cu_in, d);
                let d1 = b.add(d, 1u32);
                let c1 = load_u32(b, cu_in, d1);
                store_u32(b, cu, d, c0);
                let c0s = b.bitcast::<S32, U32>(c0);
                let c1s = b.bitcast::<S32, U32>(c1);
                let len = b.sub(c1s, c0s);
                let neg = b.setp(Cmp::Lt, len, 0i32);
                b.if_then(neg, "decreasing", |b| {
                    b.red::<U32, _>(AtomOp::Min, &shared(verdict, 0), d1);
                });
                let len = b.max(len, 0i32);
                let len = b.bitcast::<U32, S32>(len);
                let nb = b.add(len, 127u32);
                let nb = b.shr(nb, 7u32);
                store_u32(b, nb_a, d, nb);
                b.set(out[0], nb);
                let has = b.setp(Cmp::Gt, nb, 0u32);
                let one = b.selp::<U32>(1u32, 0u32, has);
                b.set(out[1], one);
                let is_long = b.setp(Cmp::Gt, nb, 1u32);
                let one = b.selp::<U32>(1u32, 0u32, is_long);
                b.set(out[2], one);
            });
            out
        },
        |b, d, live, before, v| {
            b.if_then(live, "doc_store", |b| {
                let start = b.shl(before[0], 7u32);
                store_u32(b, ws, d, start);
                store_u32(b, rank0_a, d, before[1]);
                store_u32(b, long_idx_a, d, before[2]);
                let is_long = b.setp(Cmp::Ne, v[2], 0u32);
                b.if_then(is_long, "long_nb", |b| {
                    store_u32(b, long_nb_a, before[2], v[0]);
                });
            });
        },
    );
    b.bar_sync(0, None);
    b.if_then(leader, "totals", |b| {
        let last = b.mul_wide(docs, 4u32);
        let last = b.add(cu_in, last);
        let c_last = b.ld::<U32, _>(&global(last, 0));
        let wrong_t = b.setp(Cmp::Ne, c_last, tokens);
        let fault = b.ld::<U32, _>(&shared(verdict, 0));
        let at_end = b.min(fault, docs);
        let fault = b.selp(at_end, fault, wrong_t);
        b.st::<U32, _>(&status_addr(status, ST_CU_FAULT), fault);
        b.st::<U32, _>(&status_addr(status, ST_ROWS), rows);
        b.st::<U32, _>(&status_addr(status, ST_NONEMPTY), nonempty);
        b.st::<U32, _>(&status_addr(status, ST_LONG), long);
        let cu_bad = b.setp(Cmp::Ne, fault, i32::MAX as u32);
        let too_big = b.setp(Cmp::Gt, rows, kblocks);
        let f_cu = b.selp(FLAG_CU_SEQLENS, 0u32, cu_bad);
        let f_ws = b.selp(FLAG_WORKSPACE, 0u32, too_big);
        let flags = b.or(f_cu, f_ws);
        b.st::<U32, _>(&status_addr(status, ST_FLAGS), flags);
        b.st::<U32, _>(&shared(verdict, 4), flags);
    });
    b.bar_sync(0, None);
    // A malformed cu_seqlens or a workspace too small: the row tables would not fit.
    let flags = b.ld::<U32, _>(&shared(verdict, 4));
    let bad = b.setp(Cmp::Ne, flags, 0u32);
    b.if_then(bad, "flagged", |b| b.ret());

    b.comment("rows: document d's block k is row rank0(d) at level 0, else");
    b.comment("N0 + sum_long (min(nb_j, k) - 1) + #{long j before d : nb_j > k}");
    let blk_doc = b.ld_param_ptr(&blk_doc_p);
    let row_of = b.ld_param_ptr(&row_of_p);
    let block_of = b.ld_param_ptr(&block_of_p);
    let pair = b.ld_param_ptr(&pair_p);
    b.for_range(tid, rows, SCAN_THREADS, "rows", |b, f| {
        let start = b.shl(f, 7u32);
        let d = last_le(b, ws, docs, start);
        let ws_d = load_u32(b, ws, d);
        let first = b.shr(ws_d, 7u32);
        let k = b.sub(f, first);
        let nb = load_u32(b, nb_a, d);
        let row = load_u32(b, rank0_a, d);
        let upper = b.setp(Cmp::Gt, k, 0u32);
        b.if_then(upper, "upper_level", |b| {
            let mine = load_u32(b, long_idx_a, d);
            let acc = b.mov::<U32>(nonempty);
            b.for_range(0u32, long, 1, "long_docs", |b, j| {
                let nbj = load_u32(b, long_nb_a, j);
                let m = b.min(nbj, k);
                let m = b.sub(m, 1u32);
                let before = b.setp(Cmp::Lt, j, mine);
                let above = b.setp(Cmp::Gt, nbj, k);
                let both = b.and_pred(before, above);
                let extra = b.selp(1u32, 0u32, both);
                let a = b.add(acc, m);
                let a = b.add(a, extra);
                b.set(acc, a);
            });
            b.set(row, acc);
        });
        // The block's record (document, its first block, its start and length): the
        // per-block kernels get their document in one vector load.
        let cs = load_u32(b, cu, d);
        let d1 = b.add(d, 1u32);
        let ce = load_u32(b, cu, d1);
        let len = b.sub(ce, cs);
        let rec = common_elem16(b, blk_doc, f);
        b.st_v(&rec, [d, first, cs, len]);
        store_u32(b, row_of, f, row);
        store_u32(b, block_of, row, f);
        let pairs = b.sub(nb, k);
        store_u32(b, pair, row, pairs);
    });
    b.bar_sync(0, None);

    b.comment("pairs (row, query block qb >= k), rows in CSR order: exclusive scan in place");
    let pairs = tiled_scan(
        b,
        rows,
        tid,
        &warp_totals,
        |b, r, live| load_if(b, live, |b| load_u32(b, pair, r)),
        |b, r, live, before, _| {
            b.if_then(live, "pair_offset", |b| store_u32(b, pair, r, before));
        },
    );
    b.if_then(leader, "pairs", |b| {
        b.st::<U32, _>(&status_addr(status, ST_PAIRS), pairs);
        let cap = b.ld_param(&pair_cap_p);
        let over = b.setp(Cmp::Gt, pairs, cap);
        b.if_then(over, "pair_capacity", |b| {
            b.red::<U32, _>(
                AtomOp::Or,
                &status_addr(status, ST_FLAGS),
                FLAG_PAIR_CAPACITY,
            );
        });
    });
    b.ret();
}

/// What the per-block kernels share: the block's document, its query block `qb`, and the
/// shared selection masks `mask[k]` (128 bits: which of the block's queries selected `k`).
struct QueryBlock {
    head: Reg<U32>,
    qb: Reg<U32>,
    first_block: Reg<U32>,
    /// Document-local position of this thread's query.
    q: Reg<U32>,
    /// This thread's 16 ids, and whether each is a valid edge.
    ids: Vec<(Reg<U32>, Reg<Pred>)>,
    mask: Reg<U32>,
    tid: Reg<U32>,
}

struct BlockParams {
    q2k: ParamRef<U64>,
    status: ParamRef<U64>,
    blk_doc: ParamRef<U64>,
    row_of: ParamRef<U64>,
    pair: ParamRef<U64>,
    pair_counts: ParamRef<U64>,
    tokens: ParamRef<U32>,
    pair_cap: ParamRef<U32>,
}

fn block_params(b: &mut KernelBuilder, counts_written: bool) -> BlockParams {
    BlockParams {
        q2k: b.param_ptr("q2k", HostElem::I32, false),
        status: b.param_ptr("status", HostElem::I32, counts_written),
        blk_doc: b.param_ptr("block_record", HostElem::I32, false),
        row_of: b.param_ptr("row_of_block", HostElem::I32, false),
        pair: b.param_ptr("row_pair_offset", HostElem::I32, false),
        pair_counts: b.param_ptr("pair_counts", HostElem::I32, counts_written),
        tokens: b.param_u32("num_tokens"),
        pair_cap: b.param_u32("pair_capacity"),
    }
}

/// CTA `(f, head)`: document block `f` as a query block. Loads the 16 ids of each of its
/// queries, validates them when `validate` (raising the selection flag and recording the
/// first faulty entry) and builds the selection masks. Exits (uniformly) past the last
/// block or when an earlier step flagged anything.
fn query_block(b: &mut KernelBuilder, p: &BlockParams, validate: bool) -> QueryBlock {
    let mask_var = b.shared_array("mask", MAX_KEY_BLOCKS * 16, 16);
    let status = b.ld_param_ptr(&p.status);
    let f = b.sreg(SReg::CtaidX);
    let head = b.sreg(SReg::CtaidY);
    let tid = b.sreg(SReg::TidX);
    let exit_mask = if validate {
        FLAG_CU_SEQLENS | FLAG_WORKSPACE | FLAG_PAIR_CAPACITY
    } else {
        u32::MAX
    };
    // Flags (word 0) and rows (word 3) in one load; the exit is uniform per CTA.
    let [flags, _, _, rows]: [Reg<U32>; 4] = b.ld_v(&status_addr(status, ST_FLAGS));
    let hit = b.and(flags, exit_mask);
    let flagged = b.setp(Cmp::Ne, hit, 0u32);
    let past = b.setp(Cmp::Ge, f, rows);
    let done = b.or_pred(flagged, past);
    b.if_then(done, "block_done", |b| b.ret());

    let blk_doc = b.ld_param_ptr(&p.blk_doc);
    let rec = common_elem16(b, blk_doc, f);
    let [_, first_block, start, len]: [Reg<U32>; 4] = b.ld_v(&rec);
    let qb = b.sub(f, first_block);
    let nb = b.add(len, 127u32);
    let nb = b.shr(nb, 7u32);
    let q = b.mad_lo(qb, 128u32, tid);
    let live = b.setp(Cmp::Lt, q, len);

    b.comment("clear mask[0..=qb] (a query selects at most its own block qb)");
    let mask = b.shared_base(&mask_var);
    let qb1 = b.add(qb, 1u32);
    b.for_range(tid, qb1, BLOCK_THREADS, "clear", |b, k| {
        let off = b.shl(k, 4u32);
        let a = b.add(mask, off);
        let z = b.mov::<U32>(0u32);
        b.st_v(&shared(a, 0), [z, z, z, z]);
    });
    b.bar_sync(0, None);

    b.comment("load the 16 ids; padding (-1) and, when validating, faults are no edge");
    let tokens = b.ld_param(&p.tokens);
    let t = b.add(start, q);
    let ht = b.mad_lo(head, tokens, t);
    let lin0 = b.mul_lo(ht, TOPK);
    let q2k = b.ld_param_ptr(&p.q2k);
    let raw: Vec<Reg<U32>> = (0..TOPK).map(|_| b.mov::<U32>(u32::MAX)).collect();
    b.if_then(live, "load_ids", |b| {
        let base = b.mul_wide(lin0, 4u32);
        let base = b.add(q2k, base);
        for c in 0..4 {
            let v: [Reg<U32>; 4] = b.ld_v(&global(base, 16 * c as i64));
            for (i, r) in v.iter().enumerate() {
                b.set(raw[4 * c + i], *r);
            }
        }
    });
    let own = b.shr(q, 7u32);
    let first_fault = b.mov::<U32>(TOPK);
    let mut ids = Vec::new();
    for (s, &id) in raw.iter().enumerate() {
        let pad = b.setp(Cmp::Eq, id, u32::MAX);
        let ids_ = b.bitcast::<S32, U32>(id);
        let below = b.setp(Cmp::Lt, ids_, -1i32);
        let past_end = b.setp(Cmp::Ge, id, nb);
        let after = b.setp(Cmp::Gt, id, own);
        let mut bad = b.or_pred(below, past_end);
        bad = b.or_pred(bad, after);
        for &(prev, _) in ids.iter().take(s) {
            let same = b.setp(Cmp::Eq, id, prev);
            bad = b.or_pred(bad, same);
        }
        // `below` and `past_end` hold for -1 too (unsigned): padding is never a fault.
        let not_pad = b.setp(Cmp::Ne, id, u32::MAX);
        let fault = b.and_pred(bad, not_pad);
        let fault = b.and_pred(fault, live);
        // valid = live && !(bad || pad), through a select (there is no predicate not).
        let skip = b.or_pred(bad, pad);
        let keep = b.selp::<U32>(0u32, 1u32, skip);
        let valid = b.setp(Cmp::Ne, keep, 0u32);
        let valid = b.and_pred(valid, live);
        if validate {
            let cand = b.mov::<U32>(s as u32);
            let newf = b.min(first_fault, cand);
            let f2 = b.selp(newf, first_fault, fault);
            b.set(first_fault, f2);
        }
        ids.push((id, valid));
    }
    if validate {
        let faulted = b.setp(Cmp::Lt, first_fault, TOPK);
        b.if_then(faulted, "fault", |b| {
            let lin = b.add(lin0, first_fault);
            b.red::<U32, _>(AtomOp::Min, &status_addr(status, ST_SEL_FAULT), lin);
            b.red::<U32, _>(AtomOp::Or, &status_addr(status, ST_FLAGS), FLAG_SELECTION);
        });
    }

    b.comment("mask[id] |= bit of this query");
    let word = b.shr(tid, 5u32);
    let word4 = b.shl(word, 2u32);
    let lane = b.and(tid, 31u32);
    let one = b.mov::<U32>(1u32);
    let bit = b.shl(one, lane);
    for &(id, valid) in &ids {
        b.if_then(valid, "mask_set", |b| {
            let off = b.shl(id, 4u32);
            let a = b.add(mask, off);
            let a = b.add(a, word4);
            b.red::<U32, _>(AtomOp::Or, &shared(a, 0), bit);
        });
    }
    b.bar_sync(0, None);
    QueryBlock {
        head,
        qb,
        first_block,
        q,
        ids,
        mask,
        tid,
    }
}

/// Index of pair `(row of key block k, qb)` of `head` in the pair table.
fn pair_index(b: &mut KernelBuilder, p: &BlockParams, blk: &QueryBlock, k: Reg<U32>) -> Reg<U32> {
    let row_of = b.ld_param_ptr(&p.row_of);
    let pair = b.ld_param_ptr(&p.pair);
    let fk = b.add(blk.first_block, k);
    let row = load_u32(b, row_of, fk);
    let base = load_u32(b, pair, row);
    let dq = b.sub(blk.qb, k);
    let i = b.add(base, dq);
    let cap = b.ld_param(&p.pair_cap);
    b.mad_lo(blk.head, cap, i)
}

fn count(b: &mut KernelBuilder) {
    b.grid("[rows capacity, 4, 1]");
    let p = block_params(b, true);
    let blk = query_block(b, &p, true);
    let counts = b.ld_param_ptr(&p.pair_counts);
    b.comment("count[head, row(k), qb] = popc(mask[k]) for every k <= qb (zeros too)");
    let qb1 = b.add(blk.qb, 1u32);
    b.for_range(blk.tid, qb1, BLOCK_THREADS, "count", |b, k| {
        let off = b.shl(k, 4u32);
        let a = b.add(blk.mask, off);
        let w: [Reg<U32>; 4] = b.ld_v(&shared(a, 0));
        let mut n = popc(b, w[0]);
        for &x in &w[1..] {
            let c = popc(b, x);
            n = b.add(n, c);
        }
        let i = pair_index(b, &p, &blk, k);
        store_u32(b, counts, i, n);
    });
    b.ret();
}

fn fill(b: &mut KernelBuilder) {
    b.grid("[rows capacity, 4, 1]");
    let p = block_params(b, false);
    let q_indices_p = b.param_ptr("q_indices", HostElem::I32, true);
    let bases_var = b.shared_array("edge_base", MAX_KEY_BLOCKS * 4, 16);
    let blk = query_block(b, &p, false);
    let offsets = b.ld_param_ptr(&p.pair_counts);
    let q_indices = b.ld_param_ptr(&q_indices_p);
    let tokens = b.ld_param(&p.tokens);
    let edge_cap = b.mul_lo(tokens, TOPK);
    let head_base = b.mul_lo(blk.head, edge_cap);
    // The three dependent global lookups of a pair's offset, once per key block of the CTA
    // into shared memory, instead of once per (query, slot).
    b.comment("edge_base[k] = head base + offset of pair (row of k, qb), for k <= qb");
    let bases = b.shared_base(&bases_var);
    let qb1 = b.add(blk.qb, 1u32);
    b.for_range(blk.tid, qb1, BLOCK_THREADS, "bases", |b, k| {
        let i = pair_index(b, &p, &blk, k);
        let o = load_u32(b, offsets, i);
        let o = b.add(o, head_base);
        let off = b.shl(k, 2u32);
        let a = b.add(bases, off);
        b.st::<U32, _>(&shared(a, 0), o);
    });
    b.bar_sync(0, None);
    b.comment("edge place = offset[pair] + #(earlier queries of the block with the same id)");
    let word = b.shr(blk.tid, 5u32);
    let lane = b.and(blk.tid, 31u32);
    let one = b.mov::<U32>(1u32);
    let bit = b.shl(one, lane);
    let below_bit = b.sub(bit, 1u32);
    for &(id, valid) in &blk.ids {
        b.if_then(valid, "edge", |b| {
            let off = b.shl(id, 4u32);
            let a = b.add(blk.mask, off);
            let w: [Reg<U32>; 4] = b.ld_v(&shared(a, 0));
            let rank = b.mov::<U32>(0u32);
            for (i, &x) in w.iter().enumerate() {
                let before = b.setp(Cmp::Gt, word, i as u32);
                let mine = b.setp(Cmp::Eq, word, i as u32);
                let part = b.and(x, below_bit);
                let whole = b.selp(x, 0u32, before);
                let m = b.selp(part, whole, mine);
                let c = popc(b, m);
                let r = b.add(rank, c);
                b.set(rank, r);
            }
            let off = b.shl(id, 2u32);
            let a = b.add(bases, off);
            let o = b.ld::<U32, _>(&shared(a, 0));
            let e = b.add(o, rank);
            store_u32(b, q_indices, e, blk.q);
        });
    }
    b.ret();
}

fn offsets(b: &mut KernelBuilder) {
    b.grid("[4, 1, 1]");
    let q2k_p = b.param_ptr("q2k", HostElem::I32, false);
    let cu_p = b.param_ptr("cu_copy", HostElem::I32, false);
    let status_p = b.param_ptr("status", HostElem::I32, true);
    let nb_p = b.param_ptr("doc_blocks", HostElem::I32, false);
    let pair_p = b.param_ptr("row_pair_offset", HostElem::I32, false);
    let counts_p = b.param_ptr("pair_counts", HostElem::I32, true);
    let row_ptr_p = b.param_ptr("row_ptr", HostElem::I32, true);
    let item_off_p = b.param_ptr("item_offsets", HostElem::I32, true);
    let docs_p = b.param_u32("num_docs");
    let tokens_p = b.param_u32("num_tokens");
    let rows_cap_p = b.param_u32("rows_capacity");
    let pair_cap_p = b.param_u32("pair_capacity");
    let qpw_p = b.param_u32("queries_per_work");
    let warp_totals = b.shared_array("warp_totals", 128, 16);

    let status = b.ld_param_ptr(&status_p);
    let tid = b.sreg(SReg::TidX);
    let head = b.sreg(SReg::CtaidX);
    let tokens = b.ld_param(&tokens_p);
    let t0 = b.setp(Cmp::Eq, tid, 0u32);
    let h0 = b.setp(Cmp::Eq, head, 0u32);
    let decoder = b.and_pred(t0, h0);
    b.comment("CTA 0 thread 0: decode the first fault into the status block for the host");
    b.if_then(decoder, "decode", |b| {
        let flags = b.ld::<U32, _>(&status_addr(status, ST_FLAGS));
        let cu = b.ld_param_ptr(&cu_p);
        let cu_flag = b.and(flags, FLAG_CU_SEQLENS);
        let cu_bad = b.setp(Cmp::Ne, cu_flag, 0u32);
        b.if_then(cu_bad, "decode_cu", |b| {
            let i = b.ld::<U32, _>(&status_addr(status, ST_CU_FAULT));
            let v = load_u32(b, cu, i);
            let has_prev = b.setp(Cmp::Gt, i, 0u32);
            let prev = load_if(b, has_prev, |b| {
                let im1 = b.sub(i, 1u32);
                load_u32(b, cu, im1)
            });
            b.st::<U32, _>(&status_addr(status, ST_VALUE), v);
            b.st::<U32, _>(&status_addr(status, ST_AUX), prev);
        });
        let sel_flag = b.and(flags, FLAG_SELECTION);
        let sel_bad = b.setp(Cmp::Ne, sel_flag, 0u32);
        b.if_then(sel_bad, "decode_sel", |b| {
            let lin = b.ld::<U32, _>(&status_addr(status, ST_SEL_FAULT));
            let slot = b.and(lin, TOPK - 1);
            let ht = b.shr(lin, 4u32);
            let h = b.div(ht, tokens);
            let t = b.rem(ht, tokens);
            let q2k = b.ld_param_ptr(&q2k_p);
            let id = load_u32(b, q2k, lin);
            let docs = b.ld_param(&docs_p);
            let d = last_le(b, cu, docs, t);
            let start = load_u32(b, cu, d);
            let q = b.sub(t, start);
            let own = b.shr(q, 7u32);
            let nb_a = b.ld_param_ptr(&nb_p);
            let nb = load_u32(b, nb_a, d);
            let ids = b.bitcast::<S32, U32>(id);
            let below = b.setp(Cmp::Lt, ids, -1i32);
            let past = b.setp(Cmp::Ge, id, nb);
            let after = b.setp(Cmp::Gt, id, own);
            let first = b.mov::<U32>(0u32);
            let list = b.sub(lin, slot);
            b.for_range(0u32, slot, 1, "first_slot", |b, s| {
                let e = b.add(list, s);
                let v = load_u32(b, q2k, e);
                let same = b.setp(Cmp::Eq, v, id);
                let later = b.setp(Cmp::Eq, first, 0u32);
                let take = b.and_pred(same, later);
                let s1 = b.add(s, 1u32);
                let n = b.selp(s1, first, take);
                b.set(first, n);
            });
            // first holds slot + 1 of the first equal id (0: none; a fault is then past/after).
            let first_slot = b.max(first, 1u32);
            let first_slot = b.sub(first_slot, 1u32);
            let kind = b.mov::<U32>(KIND_REPEATED);
            let aux = b.mov::<U32>(first_slot);
            let k = b.selp(KIND_AFTER_OWN, kind, after);
            let a = b.selp(own, aux, after);
            let k = b.selp(KIND_PAST_END, k, past);
            let a = b.selp(nb, a, past);
            let k = b.selp(KIND_BELOW_PADDING, k, below);
            let a = b.selp(0u32, a, below);
            b.st::<U32, _>(&status_addr(status, ST_KIND), k);
            b.st::<U32, _>(&status_addr(status, ST_VALUE), id);
            b.st::<U32, _>(&status_addr(status, ST_AUX), a);
            b.st::<U32, _>(&status_addr(status, ST_HEAD), h);
            b.st::<U32, _>(&status_addr(status, ST_ROW), t);
            b.st::<U32, _>(&status_addr(status, ST_SLOT), slot);
        });
    });
    exit_if_flagged(b, status, u32::MAX);

    let rows = b.ld::<U32, _>(&status_addr(status, ST_ROWS));
    let pairs = b.ld::<U32, _>(&status_addr(status, ST_PAIRS));
    let pair_cap = b.ld_param(&pair_cap_p);
    let counts = b.ld_param_ptr(&counts_p);
    let pc_head = b.mul_lo(head, pair_cap);
    b.comment("edge offsets of the head's pairs: exclusive scan in place");
    let edges = tiled_scan(
        b,
        pairs,
        tid,
        &warp_totals,
        |b, i, live| {
            load_if(b, live, |b| {
                let j = b.add(pc_head, i);
                load_u32(b, counts, j)
            })
        },
        |b, i, live, before, _| {
            b.if_then(live, "edge_offset", |b| {
                let j = b.add(pc_head, i);
                store_u32(b, counts, j, before);
            });
        },
    );
    b.bar_sync(0, None);
    let t0 = b.setp(Cmp::Eq, tid, 0u32);
    b.if_then(t0, "edges", |b| {
        let w = b.add(head, ST_EDGES);
        let a = b.mul_wide(w, 4u32);
        let a = b.add(status, a);
        b.st::<U32, _>(&global(a, 0), edges);
    });

    b.comment("row_ptr[head, r] = offset of the row's first pair (rows past the last: total),");
    b.comment("and the work items per row, ceil(edges / queries_per_work): exclusive scan");
    let pair = b.ld_param_ptr(&pair_p);
    let row_ptr = b.ld_param_ptr(&row_ptr_p);
    let rows_cap = b.ld_param(&rows_cap_p);
    let stride = b.add(rows_cap, 1u32);
    let rp_head = b.mul_lo(head, stride);
    let qpw = b.ld_param(&qpw_p);
    let item_off = b.ld_param_ptr(&item_off_p);
    let io_head = b.mul_lo(head, rows_cap);
    // The first edge of row r, or the head's total past the last row.
    let row_start = |b: &mut KernelBuilder, r: Reg<U32>| {
        let v = b.mov::<U32>(edges);
        let inside = b.setp(Cmp::Lt, r, rows);
        b.if_then(inside, "row_first", |b| {
            let po = load_u32(b, pair, r);
            let j = b.add(pc_head, po);
            let o = load_u32(b, counts, j);
            b.set(v, o);
        });
        v
    };
    let items = tiled_scan(
        b,
        rows,
        tid,
        &warp_totals,
        |b, r, live| {
            load_if(b, live, |b| {
                let lo = row_start(b, r);
                let r1 = b.add(r, 1u32);
                let hi = row_start(b, r1);
                let i = b.add(rp_head, r);
                store_u32(b, row_ptr, i, lo);
                let c = b.sub(hi, lo);
                div_ceil(b, c, qpw)
            })
        },
        |b, r, live, before, _| {
            b.if_then(live, "item_offset", |b| {
                let i = b.add(io_head, r);
                store_u32(b, item_off, i, before);
            });
        },
    );
    let pad_from = b.add(rows, tid);
    b.for_range(pad_from, stride, SCAN_THREADS, "row_ptr_pad", |b, r| {
        let i = b.add(rp_head, r);
        store_u32(b, row_ptr, i, edges);
    });
    b.if_then(t0, "items", |b| {
        let w = b.add(head, ST_ITEMS);
        let a = b.mul_wide(w, 4u32);
        let a = b.add(status, a);
        b.st::<U32, _>(&global(a, 0), items);
    });
    b.ret();
}

fn items(b: &mut KernelBuilder) {
    b.grid("[ceil(work_capacity / 256), 1, 1]");
    let status_p = b.param_ptr("status", HostElem::I32, false);
    let blk_doc_p = b.param_ptr("block_record", HostElem::I32, false);
    let block_of_p = b.param_ptr("block_of_row", HostElem::I32, false);
    let row_ptr_p = b.param_ptr("row_ptr", HostElem::I32, false);
    let item_off_p = b.param_ptr("item_offsets", HostElem::I32, false);
    let q_indices_p = b.param_ptr("q_indices", HostElem::I32, true);
    let metadata_p = b.param_ptr("scheduler_metadata", HostElem::I32, true);
    let work_count_p = b.param_ptr("work_count", HostElem::I32, true);
    let tokens_p = b.param_u32("num_tokens");
    let rows_cap_p = b.param_u32("rows_capacity");
    let work_cap_p = b.param_u32("work_capacity");
    let qpw_p = b.param_u32("queries_per_work");

    let status = b.ld_param_ptr(&status_p);
    let tid = b.sreg(SReg::TidX);
    let cta = b.sreg(SReg::CtaidX);
    let j = b.mad_lo(cta, ITEM_THREADS, tid);
    let flags = b.ld::<U32, _>(&status_addr(status, ST_FLAGS));
    let clean = b.setp(Cmp::Eq, flags, 0u32);
    let mut bases = Vec::new();
    let total = b.mov::<U32>(0u32);
    for h in 0..4 {
        let n = b.ld::<U32, _>(&status_addr(status, ST_ITEMS + h));
        bases.push(b.mov::<U32>(total));
        let t = b.add(total, n);
        b.set(total, t);
    }
    // A flagged schedule has no work: the backward then walks no task and writes zeros.
    let total = b.selp(total, 0u32, clean);
    let leader = b.setp(Cmp::Eq, j, 0u32);
    b.if_then(leader, "work_count", |b| {
        let wc = b.ld_param_ptr(&work_count_p);
        b.st::<U32, _>(&global(wc, 0), total);
    });

    let work_cap = b.ld_param(&work_cap_p);
    let metadata = b.ld_param_ptr(&metadata_p);
    let ctas = b.sreg(SReg::NctaidX);
    let threads = b.mul_lo(ctas, ITEM_THREADS);
    let warps = b.shr(threads, 5u32);
    let lane = b.and(tid, 31u32);
    let warp = b.shr(j, 5u32);

    b.comment("one warp per (head, row): its lanes write the row's items");
    b.if_then(clean, "items", |b| {
        let rows = b.ld::<U32, _>(&status_addr(status, ST_ROWS));
        let pairs = b.mul_lo(rows, 4u32);
        let rows_cap = b.ld_param(&rows_cap_p);
        let stride = b.add(rows_cap, 1u32);
        let qpw = b.ld_param(&qpw_p);
        let item_off = b.ld_param_ptr(&item_off_p);
        let row_ptr = b.ld_param_ptr(&row_ptr_p);
        let block_of = b.ld_param_ptr(&block_of_p);
        let blk_doc = b.ld_param_ptr(&blk_doc_p);
        strided(b, warp, pairs, warps, |b, hr| {
            let head = b.div(hr, rows);
            let row = b.rem(hr, rows);
            let base = b.mov::<U32>(0u32);
            for (h, &bh) in bases.iter().enumerate().skip(1) {
                let is = b.setp(Cmp::Eq, head, h as u32);
                let v = b.selp(bh, base, is);
                b.set(base, v);
            }
            let io = b.mad_lo(head, rows_cap, row);
            let first = load_u32(b, item_off, io);
            let first = b.add(first, base);
            let rp = b.mad_lo(head, stride, row);
            let lo = load_u32(b, row_ptr, rp);
            let rp1 = b.add(rp, 1u32);
            let hi = load_u32(b, row_ptr, rp1);
            let c = b.sub(hi, lo);
            let n = div_ceil(b, c, qpw);
            let f = load_u32(b, block_of, row);
            let rec = common_elem16(b, blk_doc, f);
            let [d, fb, _, _]: [Reg<U32>; 4] = b.ld_v(&rec);
            let k = b.sub(f, fb);
            b.for_range(lane, n, 32, "row_items", |b, m| {
                let q_begin = b.mul_lo(m, qpw);
                let left = b.sub(c, q_begin);
                let q_count = b.min(left, qpw);
                let it = b.add(first, m);
                let at = b.mul_lo(it, 6u32);
                for (col, v) in [head, row, q_begin, q_count, d, k].into_iter().enumerate() {
                    let i = b.add(at, col as u32);
                    store_u32(b, metadata, i, v);
                }
            });
        });
    });

    b.comment("metadata rows past work_count: zero");
    let from = b.add(total, j);
    strided(b, from, work_cap, threads, |b, e| {
        let at = b.mul_lo(e, 6u32);
        for col in 0..6u32 {
            let i = b.add(at, col);
            store_u32(b, metadata, i, 0u32);
        }
    });

    b.comment("q_indices past each head's last edge: -1");
    b.if_then(clean, "tail", |b| {
        let tokens = b.ld_param(&tokens_p);
        let edge_cap = b.mul_lo(tokens, TOPK);
        let q_indices = b.ld_param_ptr(&q_indices_p);
        for h in 0..4 {
            let used = b.ld::<U32, _>(&status_addr(status, ST_EDGES + h));
            let from = b.add(used, j);
            let head_base = b.mul_lo(edge_cap, h);
            strided(b, from, edge_cap, threads, |b, e| {
                let i = b.add(head_base, e);
                store_u32(b, q_indices, i, u32::MAX);
            });
        }
    });
    b.ret();
}
