//! The device schedule build: from a device block selection `q2k [4, T, 16]` and device
//! `cu_seqlens`, three launches write the schedule of `docs/design.md` §2.1 (`row_ptr`,
//! `q_indices`, `scheduler_metadata`, `work_count`, `document_workspace_starts`) with the tables
//! the host `build_schedule` gives, and validate the selection on the way, with no host sync.
//! Work and memory are linear in `T` for every `T <= MAX_TOKENS = 2^20`, one document or packed.
//!
//! An *entry* is one `(head, key block k, query block qb)` with at least one edge: the `c >= 1`
//! queries of block `qb` that selected `k`, as a 128-bit query mask. A query block names at
//! most 2048 entries, so a head has at most `16·T`. The CSR row of `k` lists its edges by
//! ascending query, i.e. its entries by ascending `qb`, each entry's queries ascending. The
//! build is a counting sort of the entries by row that restores the `qb` order inside each row:
//!
//! 1. [`COUNT`] (one CTA per (document block, head)). CTA (0, 0) first does the documents step
//!    (validates `cu_seqlens`, resets the status block, clears the row counters, lays out the
//!    aligned workspace, scans the documents for their level-0 rows and the list of long
//!    documents) and publishes `ST_READY`; the other CTAs wait for it (CTA 0 is dispatched
//!    first, so the wait always ends; the simulator runs CTAs in order). Then every CTA finds
//!    its block's document (a binary search of the workspace starts); the CTAs of head 0 also
//!    number its row (below) and record it. Every CTA validates the 16 ids of its 128 queries
//!    and finds the block's entries with a shared selection mask over windows of [`WINDOW`]
//!    key blocks (at most 8 passes at `T = 2^20`). The lowest query of an entry writes it to
//!    the block's list, which is the block's own `16·128` slots of the head's `16·T` (no
//!    allocation), with its 128-bit mask beside it unless it has a single edge (then the
//!    entry carries that query: with random top-16 at large `T` almost every entry is one
//!    edge, and moves 2 words instead of 6). One 64-bit atomic per entry adds
//!    `(1 entry, c edges)` to its key block's counter and returns the entry's slot in the row.
//!    The CTA that finishes last (an atomic counter of finished CTAs, no waiting) scans the
//!    counters of all four heads in row order into `row_ptr`, the row starts of the entry
//!    buckets and the work items per row, decodes the first fault and writes `work_count` (0
//!    when anything was flagged).
//! 2. [`SCATTER`]: puts every entry into its row's bucket at its slot (any order), and writes
//!    the work items (head-major, then row, then `q_begin`), the `-1` tail of `q_indices` and
//!    the zero tail of `scheduler_metadata`.
//! 3. [`ORDER`] (one CTA per (row, head)): a row's bucket holds at most one entry per query
//!    block of one document, so at most [`MAX_BUCKET`] distinct `qb`: a bitmap of them gives
//!    each entry its place in `qb` order (the set bits below its own), no comparison sort.
//!    A scan of the edge counts in that order gives entry `(k, qb)` its start
//!    `row_ptr + Σ_{qb' < qb} c(k, qb')`, and the entry's queries (the set bits of its mask,
//!    ascending, or its one query) are written there, one entry per thread.
//!
//! The slots the atomics hand out and the order of the entry lists vary from run to run; the
//! tables do not: every position in them comes from a count or a sort by a unique key.
//!
//! Rows are numbered without a level loop: document `d`'s block `k` is row `rank0(d)` at
//! level 0, and `N0 + Σ_long (min(nb_j, k) − 1) + #{long j before d : nb_j > k}` at level
//! `k >= 1`, where `N0` counts the non-empty documents and "long" ones have two or more blocks.
//! (That sum is a reduction over the long documents by the block's CTA of head 0: linear in
//! `T` for a bounded number of long documents, as in every benchmark case; `T/129` long
//! documents of two blocks would make it quadratic in the worst case.)
//! All index arithmetic is `u32`; the host sizes every region from `T`, the document count and
//! `W` alone and rejects shapes whose indices would not fit.
//!
//! [`COUNT`] reads the selection of the compact rows `query_first .. query_first +
//! query_rows` only (`q2k [4, query_rows, 16]`); the other queries select nothing. With `0`
//! and `T` that is the whole build; a context-parallel rank passes its token rows, and gets
//! its local schedule against every document's key blocks. Faults are recorded, and named,
//! at the query's compact row.

use super::common::{div_ceil, load_if, load_u32, store_u32, warp_inclusive_scan, SCAN_PER_THREAD};
use super::KernelDesc;
use crate::ptx::ir::Label;
use crate::ptx::*;
use crate::target::Target;

/// Threads of the per-block kernels: one per query of a 128-query block.
pub const BLOCK_THREADS: u32 = 128;
/// Threads per CTA of [`ORDER`].
pub const ORDER_THREADS: u32 = 256;
/// Block ids per list (`q2k` entries per query and head).
pub const TOPK: u32 = 16;
/// Key blocks of one window of [`COUNT`]'s shared selection mask: the most its
/// `window_bits` parameter may ask for (`2^window_bits` blocks). The runtime passes 10; tests
/// pass less to run several windows at sizes the simulator affords.
pub const WINDOW: u32 = 1024;
/// Largest bucket [`ORDER`] orders (the bits of its query-block bitmap): a row's entries come
/// from distinct query blocks of one document, at most `ceil(T/128) <= 8192` for `T <= 2^20`.
pub const MAX_BUCKET: u32 = 8192;
/// Entries a [`COUNT`] thread handles per pass of its entry loop.
const ENTRY_BATCH: u32 = 4;
/// Bits of an entry's second word holding its slot in the row; the count (1..=128) follows.
const SLOT_BITS: u32 = 13;
/// Shift of the entry's lowest query (0..128) in its second word, after the slot and count.
const QUERY_SHIFT: u32 = 21;

/// Words of the status block (the host reads it back; layout mirrored by the runtime): two
/// 128-byte lines, the second for the two handoff words every CTA hits.
pub const STATUS_WORDS: u32 = 64;
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
/// Status word: [`COUNT`] CTAs finished (the last one scans the rows).
pub const ST_DONE: u32 = 40;
/// Status word: 1 once [`COUNT`]'s CTA (0, 0) has done the documents step (the other CTAs poll
/// it; it has a line of its own, so the polling does not queue CTA (0, 0)'s stores to the status
/// words); its last CTA sets it back to 0, so it is 0 between builds.
pub const ST_READY: u32 = 32;

/// Flag: `cu_seqlens` does not start at 0, decreases, or does not end at `T`.
pub const FLAG_CU_SEQLENS: u32 = 1;
/// Flag: the aligned workspace `Σ ceil(len/128)·128` exceeds the `W` the caller gave.
pub const FLAG_WORKSPACE: u32 = 2;
/// Flag: a `q2k` id breaks the selection contract.
pub const FLAG_SELECTION: u32 = 4;

/// Selection fault: id below `-1`.
pub const KIND_BELOW_PADDING: u32 = 1;
/// Selection fault: id at or past the document's block count.
pub const KIND_PAST_END: u32 = 2;
/// Selection fault: id after the query's own block.
pub const KIND_AFTER_OWN: u32 = 3;
/// Selection fault: id already in an earlier slot of the list.
pub const KIND_REPEATED: u32 = 4;

const TARGETS: &[Target] = &[Target::Sm90a, Target::Sm100a];

/// `schedule_count`.
pub const COUNT: KernelDesc = KernelDesc {
    name: "schedule_count",
    about: "validates q2k, lists each query block's entries and counts them per row; the last CTA scans the rows",
    targets: TARGETS,
    threads: (BLOCK_THREADS, 1, 1),
    describe: count,
};

/// `schedule_scatter`.
pub const SCATTER: KernelDesc = KernelDesc {
    name: "schedule_scatter",
    about: "puts every entry into its row's bucket; writes scheduler_metadata and the table tails",
    targets: TARGETS,
    threads: (BLOCK_THREADS, 1, 1),
    describe: scatter,
};

/// `schedule_order`.
pub const ORDER: KernelDesc = KernelDesc {
    name: "schedule_order",
    about:
        "orders each row's entries by query block, scans their edge counts and writes their queries",
    targets: TARGETS,
    threads: (ORDER_THREADS, 1, 1),
    describe: order,
};

/// `status[word]`.
fn status_addr(status: Reg<U64>, word: u32) -> GlobalAddr {
    global(status, 4 * i64::from(word))
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

/// [`common::tiled_scan`] of `N` values per entry (one scan's barriers for all of them) for a
/// CTA of `threads` threads owning `per_thread` entries each per tile: `value` gives the
/// entry's `N` values (zeros when not live), `store` gets the sums before it.
fn tiled_scan_n<const N: usize>(
    b: &mut KernelBuilder,
    shape: (u32, u32),
    n: Reg<U32>,
    tid: Reg<U32>,
    warp_totals: &SharedVar,
    value: impl Fn(&mut KernelBuilder, Reg<U32>, Reg<Pred>) -> [Reg<U32>; N],
    store: impl Fn(&mut KernelBuilder, Reg<U32>, Reg<Pred>, [Reg<U32>; N], [Reg<U32>; N]),
) -> [Reg<U32>; N] {
    tiled_scan_then(b, shape, n, tid, warp_totals, value, store, |_, _| {})
}

/// [`tiled_scan_n`] that runs `tile_done(tile_base)` after each tile's stores (uniformly, by
/// every thread).
#[allow(clippy::too_many_arguments)]
fn tiled_scan_then<const N: usize>(
    b: &mut KernelBuilder,
    (threads, per_thread): (u32, u32),
    n: Reg<U32>,
    tid: Reg<U32>,
    warp_totals: &SharedVar,
    value: impl Fn(&mut KernelBuilder, Reg<U32>, Reg<Pred>) -> [Reg<U32>; N],
    store: impl Fn(&mut KernelBuilder, Reg<U32>, Reg<Pred>, [Reg<U32>; N], [Reg<U32>; N]),
    tile_done: impl Fn(&mut KernelBuilder, Reg<U32>),
) -> [Reg<U32>; N] {
    let carry: [Reg<U32>; N] = std::array::from_fn(|_| b.mov::<U32>(0u32));
    let tile = threads * per_thread;
    b.for_range(0u32, n, tile, "scan_tile", |b, tile_base| {
        let first = b.mad_lo(tid, per_thread, tile_base);
        let mut entries = Vec::new();
        let mut sum: [Reg<U32>; N] = std::array::from_fn(|_| b.mov::<U32>(0u32));
        for k in 0..per_thread {
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
        tile_done(b, tile_base);
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

/// The parameters of the documents step (the first ones of [`COUNT`]).
struct DocParams {
    cu_in: ParamRef<U64>,
    cu: ParamRef<U64>,
    ws: ParamRef<U64>,
    status: ParamRef<U64>,
    nb: ParamRef<U64>,
    rank0: ParamRef<U64>,
    long_idx: ParamRef<U64>,
    long_nb: ParamRef<U64>,
    blk_doc: ParamRef<U64>,
    block_of: ParamRef<U64>,
    ctr: ParamRef<U64>,
    docs: ParamRef<U32>,
    tokens: ParamRef<U32>,
    kblocks: ParamRef<U32>,
    counters: ParamRef<U32>,
}

fn doc_params(b: &mut KernelBuilder) -> DocParams {
    DocParams {
        cu_in: b.param_ptr("cu_seqlens", HostElem::I32, false),
        cu: b.param_ptr("cu_copy", HostElem::I32, true),
        ws: b.param_ptr("document_workspace_starts", HostElem::I32, true),
        status: b.param_ptr("status", HostElem::I32, true),
        nb: b.param_ptr("doc_blocks", HostElem::I32, true),
        rank0: b.param_ptr("doc_rank0", HostElem::I32, true),
        long_idx: b.param_ptr("doc_long_index", HostElem::I32, true),
        long_nb: b.param_ptr("long_blocks", HostElem::I32, true),
        blk_doc: b.param_ptr("block_record", HostElem::I32, true),
        block_of: b.param_ptr("block_of_row", HostElem::I32, true),
        ctr: b.param_ptr("row_counters", HostElem::I32, true),
        docs: b.param_u32("num_docs"),
        tokens: b.param_u32("num_tokens"),
        kblocks: b.param_u32("workspace_blocks"),
        counters: b.param_u32("row_counter_count"),
    }
}

/// The documents step, run by CTA (0, 0) of [`COUNT`] (`threads` threads) before it publishes
/// `ST_READY`: validates `cu_seqlens`, resets the status block (all but `ST_READY`), clears
/// the row counters, lays out the workspace and numbers the rows. A malformed `cu_seqlens` or
/// a workspace too small branches to `exit` once the flags are stored.
fn documents_step(b: &mut KernelBuilder, p: &DocParams, threads: u32, exit: &Label) {
    let (cu_in_p, cu_p, ws_p, status_p, nb_p) = (&p.cu_in, &p.cu, &p.ws, &p.status, &p.nb);
    let (rank0_p, long_idx_p, long_nb_p) = (&p.rank0, &p.long_idx, &p.long_nb);
    let ctr_p = &p.ctr;
    let (docs_p, tokens_p, kblocks_p, counters_p) = (&p.docs, &p.tokens, &p.kblocks, &p.counters);
    let doc_totals = b.shared_array("doc_totals", 3 * 128, 16);
    // [first cu_seqlens fault, flags]: the step is one CTA, so its own fault bookkeeping
    // stays in shared memory and only the verdict goes to the status block.
    let verdict_var = b.shared_array("verdict", 16, 16);

    let cu_in = b.ld_param_ptr(cu_in_p);
    let cu = b.ld_param_ptr(cu_p);
    let ws = b.ld_param_ptr(ws_p);
    let status = b.ld_param_ptr(status_p);
    let nb_a = b.ld_param_ptr(nb_p);
    let rank0_a = b.ld_param_ptr(rank0_p);
    let long_idx_a = b.ld_param_ptr(long_idx_p);
    let long_nb_a = b.ld_param_ptr(long_nb_p);
    let docs = b.ld_param(docs_p);
    let tokens = b.ld_param(tokens_p);
    let kblocks = b.ld_param(kblocks_p);
    let tid = b.sreg(SReg::TidX);
    let leader = b.setp(Cmp::Eq, tid, 0u32);
    let verdict = b.shared_base(&verdict_var);

    b.comment("clear the (entries, edges) counters of every (head, row) the build may use");
    let ctr = b.ld_param_ptr(ctr_p);
    let counters = b.ld_param(counters_p);
    b.for_range(tid, counters, threads, "clear_counters", |b, i| {
        let a = super::common::elem_bytes(b, ctr, i, 8);
        b.st::<U64, _>(&a, 0u64);
    });

    b.comment("reset the status block; a bad cu_seqlens[0] is fault index 0");
    // cu_seqlens[D], read once by the leader (it checks it against T after the scan).
    let c_last = b.mov::<U32>(0u32);
    b.if_then(leader, "reset", |b| {
        for w in (0..STATUS_WORDS).filter(|&w| w != ST_READY) {
            let v = if w == ST_CU_FAULT {
                i32::MAX as u32
            } else if w == ST_SEL_FAULT {
                u32::MAX
            } else {
                0
            };
            b.st::<U32, _>(&status_addr(status, w), v);
        }
        let last = b.mul_wide(docs, 4u32);
        let last_in = b.add(cu_in, last);
        let c0 = b.ld::<U32, _>(&global(cu_in, 0));
        let c = b.ld::<U32, _>(&global(last_in, 0));
        b.set(c_last, c);
        let bad = b.setp(Cmp::Ne, c0, 0u32);
        let first = b.selp::<U32>(0u32, i32::MAX as u32, bad);
        b.st::<U32, _>(&shared(verdict, 0), first);
        let last_out = b.add(cu, last);
        b.st::<U32, _>(&global(last_out, 0), c);
    });
    b.bar_sync(0, None);

    b.comment("one scan over the documents of (blocks, non-empty, long): workspace starts,");
    b.comment("the level-0 row of each document and the compacted list of long documents");
    let [rows, nonempty, long] = tiled_scan_n(
        b,
        (threads, SCAN_PER_THREAD),
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
    b.bra_if(bad, exit);
}

/// The block a per-block CTA `(f, head)` works on, from its record.
struct Block {
    qb: Reg<U32>,
    first_block: Reg<U32>,
    /// Compact start of the block's document.
    start: Reg<U32>,
    /// Tokens of the block's document.
    len: Reg<U32>,
    tid: Reg<U32>,
}

fn block_of_cta(b: &mut KernelBuilder, blk_doc: Reg<U64>) -> Block {
    let f = b.sreg(SReg::CtaidX);
    let tid = b.sreg(SReg::TidX);
    let rec = common_elem16(b, blk_doc, f);
    let [_, first_block, start, len]: [Reg<U32>; 4] = b.ld_v(&rec);
    let qb = b.sub(f, first_block);
    Block {
        qb,
        first_block,
        start,
        len,
        tid,
    }
}

/// Thread 0 of the last [`COUNT`] CTA: the first fault, decoded into the status block.
#[allow(clippy::too_many_arguments)] // the tables the decode reads, and q2k's rows
fn decode_fault(
    b: &mut KernelBuilder,
    status: Reg<U64>,
    q2k: Reg<U64>,
    cu: Reg<U64>,
    nb_a: Reg<U64>,
    docs: Reg<U32>,
    tokens: Reg<U32>,
    (qfirst, qrows): (Reg<U32>, Reg<U32>),
) {
    let flags = b.ld::<U32, _>(&status_addr(status, ST_FLAGS));
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
        // The entry's index in q2k, which holds rows query_first.. only (a fault is
        // recorded only for a row it holds).
        let t_local = b.sub(t, qfirst);
        let hl = b.mad_lo(h, qrows, t_local);
        let row_local = b.mul_lo(hl, TOPK);
        let lin_local = b.add(row_local, slot);
        let id = load_u32(b, q2k, lin_local);
        let d = last_le(b, cu, docs, t);
        let start = load_u32(b, cu, d);
        let q = b.sub(t, start);
        let own = b.shr(q, 7u32);
        let nb = load_u32(b, nb_a, d);
        let ids = b.bitcast::<S32, U32>(id);
        let below = b.setp(Cmp::Lt, ids, -1i32);
        let past = b.setp(Cmp::Ge, id, nb);
        let after = b.setp(Cmp::Gt, id, own);
        let first = b.mov::<U32>(0u32);
        let list = row_local;
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
}

/// `(lo, hi)` halves of a 64-bit counter.
fn halves(b: &mut KernelBuilder, v: Reg<U64>) -> (Reg<U32>, Reg<U32>) {
    let lo = b.cvt::<U32, U64>(v);
    let h = b.shr(v, 32u32);
    let hi = b.cvt::<U32, U64>(h);
    (lo, hi)
}

/// What numbers block `k` of a document: its level-0 row `rank0(d)`, the non-empty documents
/// `N0`, and this thread's part of `Σ_long (min(nb_j, k) − 1) + #{long j before d : nb_j > k}`.
struct RowNumber {
    k: Reg<U32>,
    level0: Reg<U32>,
    nonempty: Reg<U32>,
    acc: Reg<U32>,
}

/// The CTA of head 0 numbers block `f`'s row (`rank0(d)` at level 0, else `N0` plus the CTA
/// sum of `acc`) and records both for the later kernels: the block's record (document, its
/// first block, its start and length, so that they get their document in one vector load) and
/// `block_of_row[row] = f`.
fn record_block(
    b: &mut KernelBuilder,
    p: &DocParams,
    f: Reg<U32>,
    row: &RowNumber,
    record: [Reg<U32>; 4],
    warp_totals: &SharedVar,
) {
    let tid = b.sreg(SReg::TidX);
    let (_, [sum]) = cta_exclusive_scan_n::<1>(b, [row.acc], tid, warp_totals);
    let upper = b.add(row.nonempty, sum);
    let at0 = b.setp(Cmp::Eq, row.k, 0u32);
    let r = b.selp(row.level0, upper, at0);
    let t0 = b.setp(Cmp::Eq, tid, 0u32);
    b.if_then(t0, "record", |b| {
        let blk_doc = b.ld_param_ptr(&p.blk_doc);
        let rec = common_elem16(b, blk_doc, f);
        b.st_v(&rec, record);
        let block_of = b.ld_param_ptr(&p.block_of);
        store_u32(b, block_of, r, f);
    });
}

/// [`COUNT`]'s CTA `(f, head)` after the documents step: block `f`'s document by a search of
/// the workspace starts (the blocks are spread over all CTAs, none does them serially); the
/// CTAs of head 0 also number the block's row and record both for the later kernels. Uniform
/// per CTA (the row's sum over long documents is a CTA reduction).
fn own_block(
    b: &mut KernelBuilder,
    p: &DocParams,
    status: Reg<U64>,
    f: Reg<U32>,
    head: Reg<U32>,
    warp_totals: &SharedVar,
) -> Block {
    let tid = b.sreg(SReg::TidX);
    let ws = b.ld_param_ptr(&p.ws);
    let cu = b.ld_param_ptr(&p.cu);
    let docs = b.ld_param(&p.docs);
    let start = b.shl(f, 7u32);
    let d = last_le(b, ws, docs, start);
    let ws_d = load_u32(b, ws, d);
    let first = b.shr(ws_d, 7u32);
    let k = b.sub(f, first);
    let cs = load_u32(b, cu, d);
    let d1 = b.add(d, 1u32);
    let ce = load_u32(b, cu, d1);
    let len = b.sub(ce, cs);
    let head0 = b.setp(Cmp::Eq, head, 0u32);
    b.if_then(head0, "number_row", |b| {
        b.comment("document d's block k is row rank0(d) at level 0, else");
        b.comment("N0 + sum_long (min(nb_j, k) - 1) + #{long j before d : nb_j > k}");
        let rank0 = b.ld_param_ptr(&p.rank0);
        let long_idx = b.ld_param_ptr(&p.long_idx);
        let long_nb = b.ld_param_ptr(&p.long_nb);
        let [nonempty, long]: [Reg<U32>; 2] = b.ld_v(&status_addr(status, ST_NONEMPTY));
        let mine = load_u32(b, long_idx, d);
        let acc = b.mov::<U32>(0u32);
        b.for_range(tid, long, BLOCK_THREADS, "long_docs", |b, j| {
            let nbj = load_u32(b, long_nb, j);
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
        let level0 = load_u32(b, rank0, d);
        let row = RowNumber {
            k,
            level0,
            nonempty,
            acc,
        };
        record_block(b, p, f, &row, [d, first, cs, len], warp_totals);
    });
    Block {
        qb: k,
        first_block: first,
        start: cs,
        len,
        tid,
    }
}

/// Waits (thread 0 polling) until [`COUNT`]'s CTA (0, 0) has published `ST_READY`; then the
/// documents step's stores are visible to the whole CTA.
fn wait_documents(b: &mut KernelBuilder, status: Reg<U64>, t0: Reg<Pred>) {
    b.if_then(t0, "spin", |b| {
        let top = b.label("spin");
        b.place(&top);
        let v = b.atom::<U32, _>(AtomOp::Or, &status_addr(status, ST_READY), 0u32);
        let not_yet = b.setp(Cmp::Eq, v, 0u32);
        b.bra_if(not_yet, &top);
        b.fence_acq_rel_gpu();
    });
    b.bar_sync(0, None);
    b.fence_acq_rel_gpu();
}

/// [`own_block`] without waiting, for at most [`BLOCK_THREADS`] documents: the CTA lays them
/// out itself (thread `d` loads document `d`'s offsets; one scan gives the workspace starts,
/// the level-0 ranks and the row count) with the documents step's checks, so that no index
/// it computes leaves its buffers when `cu_seqlens` is malformed. Sets `blk` and `works`
/// (1 when the inputs are sound and the block is a real one); the CTAs of head 0 also number
/// the block's row and record both, as in [`own_block`].
fn local_block(
    b: &mut KernelBuilder,
    p: &DocParams,
    f: Reg<U32>,
    head: Reg<U32>,
    blk: &Block,
    works: Reg<U32>,
    warp_totals: &SharedVar,
) {
    let tid = blk.tid;
    let cu_in = b.ld_param_ptr(&p.cu_in);
    let docs = b.ld_param(&p.docs);
    let tokens = b.ld_param(&p.tokens);
    let kblocks = b.ld_param(&p.kblocks);
    let live = b.setp(Cmp::Lt, tid, docs);
    let c0 = load_if(b, live, |b| load_u32(b, cu_in, tid));
    let c1 = load_if(b, live, |b| {
        let d1 = b.add(tid, 1u32);
        load_u32(b, cu_in, d1)
    });
    // The documents step's checks: cu_seqlens[0] = 0, no decrease, cu_seqlens[D] = T.
    let c0s = b.bitcast::<S32, U32>(c0);
    let c1s = b.bitcast::<S32, U32>(c1);
    let len_s = b.sub(c1s, c0s);
    let decrease = b.setp(Cmp::Lt, len_s, 0i32);
    let t0 = b.setp(Cmp::Eq, tid, 0u32);
    let start_bad = b.setp(Cmp::Ne, c0, 0u32);
    let start_bad = b.and_pred(start_bad, t0);
    let docs1 = b.max(docs, 1u32);
    let last_doc = b.sub(docs1, 1u32);
    let is_last = b.setp(Cmp::Eq, tid, last_doc);
    let end_bad = b.setp(Cmp::Ne, c1, tokens);
    let end_bad = b.and_pred(end_bad, is_last);
    let bad = b.or_pred(decrease, start_bad);
    let bad = b.or_pred(bad, end_bad);
    let bad = b.and_pred(bad, live);
    let len = b.max(len_s, 0i32);
    let len = b.bitcast::<U32, S32>(len);
    let nb = b.add(len, 127u32);
    let nb = b.shr(nb, 7u32);
    let has = b.setp(Cmp::Gt, nb, 0u32);
    let is_long = b.setp(Cmp::Gt, nb, 1u32);
    let v_has = b.selp::<U32>(1u32, 0u32, has);
    let v_long = b.selp::<U32>(1u32, 0u32, is_long);
    let v_bad = b.selp::<U32>(1u32, 0u32, bad);
    let ([first, rank0, _, _], [rows, nonempty, _, faults]) =
        cta_exclusive_scan_n::<4>(b, [nb, v_has, v_long, v_bad], tid, warp_totals);
    let sound = b.setp(Cmp::Eq, faults, 0u32);
    let fits = b.setp(Cmp::Le, rows, kblocks);
    let real = b.setp(Cmp::Lt, f, rows);
    let ok = b.and_pred(sound, fits);
    let ok = b.and_pred(ok, real);
    let w = b.selp::<U32>(1u32, 0u32, ok);
    b.set(works, w);

    b.comment("the document holding block f: [first block, rank0, start, length, index]");
    let rec_var = b.shared_array("local_document", 32, 16);
    let rec = b.shared_base(&rec_var);
    let end = b.add(first, nb);
    let from = b.setp(Cmp::Le, first, f);
    let until = b.setp(Cmp::Lt, f, end);
    let mine = b.and_pred(from, until);
    let mine = b.and_pred(mine, live);
    b.if_then(mine, "my_document", |b| {
        b.st_v(&shared(rec, 0), [first, rank0, c0, len]);
        b.st::<U32, _>(&shared(rec, 16), tid);
    });
    b.bar_sync(0, None);
    b.if_then(ok, "block", |b| {
        let [first_d, rank0_d, start_d, len_d]: [Reg<U32>; 4] = b.ld_v(&shared(rec, 0));
        let d = b.ld::<U32, _>(&shared(rec, 16));
        let k = b.sub(f, first_d);
        for (r, v) in [
            (blk.qb, k),
            (blk.first_block, first_d),
            (blk.start, start_d),
            (blk.len, len_d),
        ] {
            b.set(r, v);
        }
        let head0 = b.setp(Cmp::Eq, head, 0u32);
        b.if_then(head0, "number_row", |b| {
            b.comment("as in own_block: rank0(d) at level 0, else");
            b.comment("N0 + sum_long (min(nb_j, k) - 1) + #{long j before d : nb_j > k}");
            let m = b.min(nb, k);
            let m = b.max(m, 1u32);
            let m = b.sub(m, 1u32);
            let before = b.setp(Cmp::Lt, tid, d);
            let above = b.setp(Cmp::Gt, nb, k);
            let both = b.and_pred(before, above);
            let extra = b.selp(1u32, 0u32, both);
            let acc = b.add(m, extra);
            let long_live = b.and_pred(is_long, live);
            let acc = b.selp(acc, 0u32, long_live);
            let row = RowNumber {
                k,
                level0: rank0_d,
                nonempty,
                acc,
            };
            record_block(b, p, f, &row, [d, first_d, start_d, len_d], warp_totals);
        });
    });
}

fn count(b: &mut KernelBuilder) {
    b.grid("[rows capacity, 4, 1]");
    let dp = doc_params(b);
    let (cu_p, status_p, nb_p) = (&dp.cu, &dp.status, &dp.nb);
    let (block_of_p, ctr_p) = (&dp.block_of, &dp.ctr);
    let (docs_p, tokens_p) = (&dp.docs, &dp.tokens);
    let q2k_p = b.param_ptr("q2k", HostElem::I32, false);
    let entries_p = b.param_ptr("entries", HostElem::I32, true);
    let info_p = b.param_ptr("block_entries", HostElem::I32, true);
    let masks_p = b.param_ptr("entry_masks", HostElem::I32, true);
    let row_ptr_p = b.param_ptr("row_ptr", HostElem::I32, true);
    let bstart_p = b.param_ptr("bucket_starts", HostElem::I32, true);
    let item_off_p = b.param_ptr("item_offsets", HostElem::I32, true);
    let work_count_p = b.param_ptr("work_count", HostElem::I32, true);
    let rows_cap_p = b.param_u32("rows_capacity");
    let qpw_p = b.param_u32("queries_per_work");
    let window_bits_p = b.param_u32("window_bits");
    // The compact rows `q2k` holds: row `i` of `q2k [4, query_rows, 16]` is query
    // `query_first + i` (a context-parallel rank's rows; 0 and T on one device). The other
    // queries select nothing, as if their rows were all -1.
    let qfirst_p = b.param_u32("query_first");
    let qrows_p = b.param_u32("query_rows");
    let mask_var = b.shared_array("mask", WINDOW * 16, 16);
    let elist_var = b.shared_array("entry_list", BLOCK_THREADS * TOPK * 4, 16);
    // [entries of the block, their list base, last CTA]
    let misc_var = b.shared_array("misc", 16, 16);
    let warp_totals = b.shared_array("warp_totals", 13 * 128, 16);

    let status = b.ld_param_ptr(status_p);
    let tokens = b.ld_param(tokens_p);
    let rows_cap = b.ld_param(&rows_cap_p);
    let edge_cap = b.mul_lo(tokens, TOPK);
    let f = b.sreg(SReg::CtaidX);
    let head = b.sreg(SReg::CtaidY);
    let tid = b.sreg(SReg::TidX);
    let misc = b.shared_base(&misc_var);
    // Everything the handoff after `finish` reads is defined before the skip.
    let t0 = b.setp(Cmp::Eq, tid, 0u32);
    let q2k = b.ld_param_ptr(&q2k_p);
    let (qfirst, qrows) = (b.ld_param(&qfirst_p), b.ld_param(&qrows_p));
    let ctr = b.ld_param_ptr(ctr_p);

    b.comment("grid-wide handoff: CTA (0, 0) does the documents step and publishes ST_READY;");
    b.comment("every CTA waits for it before its first atomic (CTA 0 is dispatched first, so");
    b.comment("the wait always ends)");
    let fh = b.or(f, head);
    let first_cta = b.setp(Cmp::Eq, fh, 0u32);
    b.if_then(first_cta, "documents", |b| {
        let published = b.label("documents_published");
        documents_step(b, &dp, BLOCK_THREADS, &published);
        b.place(&published);
        b.bar_sync(0, None);
        b.if_then(t0, "publish", |b| {
            b.fence_acq_rel_gpu();
            b.atom::<U32, _>(AtomOp::Exch, &status_addr(status, ST_READY), 1u32);
        });
    });

    // With few documents every CTA lays them out itself and does its whole shared-memory
    // part (the ids, their checks, the entries) before it waits; with many, it waits first
    // and reads the documents step's tables.
    let docs = b.ld_param(&dp.docs);
    let few = b.setp(Cmp::Le, docs, BLOCK_THREADS);
    let blk = Block {
        qb: b.mov::<U32>(0u32),
        first_block: b.mov::<U32>(0u32),
        start: b.mov::<U32>(0u32),
        len: b.mov::<U32>(0u32),
        tid,
    };
    let works = b.mov::<U32>(0u32);
    b.if_then(few, "local_documents", |b| {
        local_block(b, &dp, f, head, &blk, works, &warp_totals);
    });
    b.unless(few, "shared_documents", |b| {
        wait_documents(b, status, t0);
        // Flags (word 0) and rows (word 3) in one load; the skip is uniform per CTA.
        let [flags, _, _, rows]: [Reg<U32>; 4] = b.ld_v(&status_addr(status, ST_FLAGS));
        let hit = b.and(flags, FLAG_CU_SEQLENS | FLAG_WORKSPACE);
        let flagged = b.setp(Cmp::Ne, hit, 0u32);
        let past = b.setp(Cmp::Ge, f, rows);
        let skip = b.or_pred(flagged, past);
        let w = b.selp::<U32>(0u32, 1u32, skip);
        b.set(works, w);
        let go = b.setp(Cmp::Ne, w, 0u32);
        b.if_then(go, "own_block", |b| {
            let o = own_block(b, &dp, status, f, head, &warp_totals);
            for (r, v) in [
                (blk.qb, o.qb),
                (blk.first_block, o.first_block),
                (blk.start, o.start),
                (blk.len, o.len),
            ] {
                b.set(r, v);
            }
        });
    });
    // A selection fault of another CTA does not stop this one: its entries are still
    // counted, and the flag zeroes work_count at the end.
    let go = b.setp(Cmp::Ne, works, 0u32);
    let finish = b.label("finish");
    b.bra_unless(go, &finish);

    let nb = b.add(blk.len, 127u32);
    let nb = b.shr(nb, 7u32);
    let q = b.mad_lo(blk.qb, 128u32, tid);
    let live = b.setp(Cmp::Lt, q, blk.len);
    let mask = b.shared_base(&mask_var);
    let elist = b.shared_base(&elist_var);

    b.comment("clear the mask window and the entry counter");
    b.for_range(tid, WINDOW, BLOCK_THREADS, "clear", |b, k| {
        let off = b.shl(k, 4u32);
        let a = b.add(mask, off);
        let z = b.mov::<U32>(0u32);
        b.st_v(&shared(a, 0), [z, z, z, z]);
    });
    b.predicated(t0, false, |b| b.st::<U32, _>(&shared(misc, 0), 0u32));

    b.comment("load the 16 ids of a query q2k holds; padding (-1) and faults are no edge");
    let t = b.add(blk.start, q);
    // Faults are recorded at the query's index in a whole [4, T, 16] selection.
    let ht = b.mad_lo(head, tokens, t);
    let lin0 = b.mul_lo(ht, TOPK);
    let t_local = b.sub(t, qfirst); // wraps below query_first: then >= query_rows
    let held = b.setp(Cmp::Lt, t_local, qrows);
    let load = b.and_pred(live, held);
    let raw: Vec<Reg<U32>> = (0..TOPK).map(|_| b.mov::<U32>(u32::MAX)).collect();
    b.if_then(load, "load_ids", |b| {
        let hl = b.mad_lo(head, qrows, t_local);
        let lin_local = b.mul_lo(hl, TOPK);
        let base = b.mul_wide(lin_local, 4u32);
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
    let mut ids: Vec<(Reg<U32>, Reg<Pred>)> = Vec::new();
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
        let cand = b.mov::<U32>(s as u32);
        let newf = b.min(first_fault, cand);
        let f2 = b.selp(newf, first_fault, fault);
        b.set(first_fault, f2);
        ids.push((id, valid));
    }
    b.bar_sync(0, None);

    b.comment("per window of key blocks: mask[id] |= bit of this query; the edge of the lowest");
    b.comment("query with that id creates the entry: its id and count in the shared list, its");
    b.comment("128-bit query mask at the same list index in entry_masks");
    // The block's list: its queries' own 16 slots of the head's 16·T, [16·t0, 16·(t0 + 128)),
    // so no allocation is needed (a block has at most one entry per valid edge).
    let t_first = b.mad_lo(blk.qb, 128u32, blk.start);
    let eb = b.mul_lo(t_first, TOPK);
    let head_entries = b.mul_lo(head, edge_cap);
    let list_base = b.add(head_entries, eb);
    let masks = b.ld_param_ptr(&masks_p);
    let word = b.shr(tid, 5u32);
    let word4 = b.shl(word, 2u32);
    let lane = b.and(tid, 31u32);
    let one = b.mov::<U32>(1u32);
    let bit = b.shl(one, lane);
    let below_bit = b.sub(bit, 1u32);
    let tid24 = b.shl(tid, 24u32);
    let ranks: Vec<Reg<U32>> = (0..TOPK).map(|_| b.mov::<U32>(0u32)).collect();
    let window_bits = b.ld_param(&window_bits_p);
    let window = b.shl(one, window_bits);
    let local_mask = b.sub(window, 1u32);
    let windows = b.shr(blk.qb, window_bits);
    let windows = b.add(windows, 1u32);
    b.for_range(0u32, windows, 1, "window", |b, w| {
        let in_window: Vec<(Reg<Pred>, Reg<U32>)> = ids
            .iter()
            .map(|&(id, valid)| {
                let wi = b.shr(id, window_bits);
                let same = b.setp(Cmp::Eq, wi, w);
                let p = b.and_pred(valid, same);
                let local = b.and(id, local_mask);
                let off = b.shl(local, 4u32);
                let a = b.add(mask, off);
                (p, a)
            })
            .collect();
        for &(p, a) in &in_window {
            b.if_then(p, "mask_set", |b| {
                let a = b.add(a, word4);
                b.red::<U32, _>(AtomOp::Or, &shared(a, 0), bit);
            });
        }
        b.bar_sync(0, None);
        for (s, (&(p, a), &(id, _))) in in_window.iter().zip(&ids).enumerate() {
            b.if_then(p, "rank", |b| {
                let m: [Reg<U32>; 4] = b.ld_v(&shared(a, 0));
                let rank = b.mov::<U32>(0u32);
                let total = b.mov::<U32>(0u32);
                for (i, &x) in m.iter().enumerate() {
                    let before = b.setp(Cmp::Gt, word, i as u32);
                    let mine = b.setp(Cmp::Eq, word, i as u32);
                    let part = b.and(x, below_bit);
                    let whole = b.selp(x, 0u32, before);
                    let sel = b.selp(part, whole, mine);
                    let c = b.popc(sel);
                    let r = b.add(rank, c);
                    b.set(rank, r);
                    let c = b.popc(x);
                    let n = b.add(total, c);
                    b.set(total, n);
                }
                b.set(ranks[s], rank);
                let leader = b.setp(Cmp::Eq, rank, 0u32);
                b.if_then(leader, "entry", |b| {
                    // (id, count, this lowest query): a single edge needs nothing more.
                    let j = b.atom::<U32, _>(AtomOp::Add, &shared(misc, 0), 1u32);
                    let c = b.shl(total, 16u32);
                    let e = b.or(id, c);
                    let e = b.or(e, tid24);
                    let j4 = b.shl(j, 2u32);
                    let at = b.add(elist, j4);
                    b.st::<U32, _>(&shared(at, 0), e);
                    let several = b.setp(Cmp::Gt, total, 1u32);
                    b.if_then(several, "entry_mask", |b| {
                        let gi = b.add(list_base, j);
                        let ma = common_elem16(b, masks, gi);
                        b.st_v(&ma, m);
                    });
                });
            });
        }
        b.bar_sync(0, None);
        for (&(p, a), &rank) in in_window.iter().zip(&ranks) {
            // Every read of this window's mask is behind the barrier above.
            let leader = b.setp(Cmp::Eq, rank, 0u32);
            let clear = b.and_pred(p, leader);
            b.if_then(clear, "unmask", |b| {
                let z = b.mov::<U32>(0u32);
                b.st_v(&shared(a, 0), [z, z, z, z]);
            });
        }
        b.bar_sync(0, None);
    });

    b.if_then(few, "wait_documents", |b| wait_documents(b, status, t0));
    // The status block is reset by now.
    let faulted = b.setp(Cmp::Lt, first_fault, TOPK);
    b.if_then(faulted, "fault", |b| {
        let lin = b.add(lin0, first_fault);
        b.red::<U32, _>(AtomOp::Min, &status_addr(status, ST_SEL_FAULT), lin);
        b.red::<U32, _>(AtomOp::Or, &status_addr(status, ST_FLAGS), FLAG_SELECTION);
    });

    b.comment("the block's entries: a slot in their row");
    let n = b.ld::<U32, _>(&shared(misc, 0));
    let info = b.ld_param_ptr(&info_p);
    b.if_then(t0, "list", |b| {
        let i = b.mad_lo(head, rows_cap, f);
        let at = super::common::elem_bytes(b, info, i, 8);
        b.st_v(&at, [eb, n]);
    });
    let entries = b.ld_param_ptr(&entries_p);
    // ENTRY_BATCH entries per thread and pass, each step for all of them before the next
    // (row lookups, then the atomics), so their round trips overlap.
    let n1 = b.max(n, 1u32);
    let last_entry = b.sub(n1, 1u32);
    b.for_range(tid, n, BLOCK_THREADS * ENTRY_BATCH, "entries", |b, j0| {
        let mut batch = Vec::new();
        for k in 0..ENTRY_BATCH {
            let j = b.add(j0, BLOCK_THREADS * k);
            let live = b.setp(Cmp::Lt, j, n);
            let jc = b.min(j, last_entry);
            let j4 = b.shl(jc, 2u32);
            let at = b.add(elist, j4);
            let e = b.ld::<U32, _>(&shared(at, 0));
            let id = b.and(e, 0xffffu32);
            let c = b.shr(e, 16u32);
            let c = b.and(c, 0xffu32);
            let q = b.shr(e, 24u32);
            // Counters, bucket starts and entries go by key block (its row is numbered by
            // another CTA of this launch).
            let fk = b.add(blk.first_block, id);
            batch.push((j, live, c, fk, q));
        }
        let mut slots = Vec::new();
        for &(_, live, c, fk, _) in &batch {
            let bi = b.mad_lo(head, rows_cap, fk);
            let c64 = b.cvt::<U64, U32>(c);
            let inc = b.add(c64, 1u64 << 32);
            let ca = super::common::elem_bytes(b, ctr, bi, 8);
            let old = b.mov::<U64>(0u64);
            b.predicated(live, false, |b| {
                let o = b.atom::<U64, _>(AtomOp::Add, &ca, inc);
                b.set(old, o);
            });
            slots.push(old);
        }
        for (&(j, live, c, fk, q), &old) in batch.iter().zip(&slots) {
            let (_, slot) = halves(b, old);
            let c13 = b.shl(c, SLOT_BITS);
            let sc = b.or(slot, c13);
            let q21 = b.shl(q, QUERY_SHIFT);
            let sc = b.or(sc, q21);
            let gi = b.add(list_base, j);
            b.predicated(live, false, |b| {
                let ea = super::common::elem_bytes(b, entries, gi, 8);
                b.st_v(&ea, [fk, sc]);
            });
        }
    });

    b.place(&finish);
    b.comment("grid-wide handoff: the CTA that finishes last scans the rows");
    b.bar_sync(0, None);
    b.if_then(t0, "done", |b| {
        b.fence_acq_rel_gpu();
        let done = b.atom::<U32, _>(AtomOp::Add, &status_addr(status, ST_DONE), 1u32);
        let gx = b.sreg(SReg::NctaidX);
        let ctas = b.shl(gx, 2u32);
        let last = b.sub(ctas, 1u32);
        let is_last = b.setp(Cmp::Eq, done, last);
        let v = b.selp(1u32, 0u32, is_last);
        b.st::<U32, _>(&shared(misc, 8), v);
    });
    b.bar_sync(0, None);
    let last = b.ld::<U32, _>(&shared(misc, 8));
    let not_last = b.setp(Cmp::Eq, last, 0u32);
    b.if_then(not_last, "not_last", |b| b.ret());
    b.fence_acq_rel_gpu();
    // Every CTA has passed its wait: the next build starts from ST_READY = 0.
    b.if_then(t0, "unpublish", |b| {
        b.st::<U32, _>(&status_addr(status, ST_READY), 0u32);
    });

    let cu = b.ld_param_ptr(cu_p);
    let nb_a = b.ld_param_ptr(nb_p);
    let docs = b.ld_param(docs_p);
    b.if_then(t0, "decode", |b| {
        decode_fault(b, status, q2k, cu, nb_a, docs, tokens, (qfirst, qrows));
    });
    let flags = b.ld::<U32, _>(&status_addr(status, ST_FLAGS));
    let work_count = b.ld_param_ptr(&work_count_p);
    b.if_then(t0, "no_work", |b| {
        b.st::<U32, _>(&global(work_count, 0), 0u32)
    });
    let hit = b.and(flags, FLAG_CU_SEQLENS | FLAG_WORKSPACE);
    let bad = b.setp(Cmp::Ne, hit, 0u32);
    b.if_then(bad, "bad_documents", |b| b.ret());

    b.comment("row_ptr, bucket starts and item offsets of all four heads: one scan of the");
    b.comment("counters (12 values per row), so the serial tail has one set of barriers");
    let rows = b.ld::<U32, _>(&status_addr(status, ST_ROWS));
    let qpw = b.ld_param(&qpw_p);
    let row_ptr = b.ld_param_ptr(&row_ptr_p);
    let bstart = b.ld_param_ptr(&bstart_p);
    let item_off = b.ld_param_ptr(&item_off_p);
    let stride = b.add(rows_cap, 1u32);
    let rows1 = b.max(rows, 1u32);
    let last_row = b.sub(rows1, 1u32);
    let block_of = b.ld_param_ptr(block_of_p);
    // Two rows per thread and tile: the 12 values per row stay in registers. The counters
    // and bucket starts go by key block, row_ptr and the item offsets by row.
    let totals = tiled_scan_n::<13>(
        b,
        (BLOCK_THREADS, 2),
        rows,
        tid,
        &warp_totals,
        // Unpredicated loads at a clamped row (rows >= 1 here), zero when not live.
        |b, r, live| {
            let rc = b.min(r, last_row);
            let fb = load_u32(b, block_of, rc);
            let mut out = Vec::new();
            for h in 0..4u32 {
                let i = b.mad_lo(rows_cap, h, fb);
                let a = super::common::elem_bytes(b, ctr, i, 8);
                let v = b.ld::<U64, _>(&a);
                let (e, n) = halves(b, v);
                let w = div_ceil(b, e, qpw);
                for x in [e, n, w] {
                    out.push(b.selp(x, 0u32, live));
                }
            }
            // The 13th value only carries the row's block to the store (its sums are unused).
            out.push(fb);
            std::array::from_fn(|k| out[k])
        },
        |b, r, live, before, v| {
            b.if_then(live, "row_store", |b| {
                let fb = v[12];
                for h in 0..4u32 {
                    let i = b.mad_lo(stride, h, r);
                    let k = 3 * h as usize;
                    store_u32(b, row_ptr, i, before[k]);
                    let i = b.mad_lo(rows_cap, h, fb);
                    store_u32(b, bstart, i, before[k + 1]);
                    let i = b.mad_lo(rows_cap, h, r);
                    store_u32(b, item_off, i, before[k + 2]);
                }
            });
        },
    );
    let all_items = b.mov::<U32>(0u32);
    for h in 0..4u32 {
        let edges = totals[3 * h as usize];
        let items = totals[3 * h as usize + 2];
        let rp_head = b.mul_lo(stride, h);
        let pad_from = b.add(rows, tid);
        b.for_range(pad_from, stride, BLOCK_THREADS, "row_ptr_pad", |b, r| {
            let i = b.add(rp_head, r);
            store_u32(b, row_ptr, i, edges);
        });
        b.if_then(t0, "head_totals", |b| {
            b.st::<U32, _>(&status_addr(status, ST_EDGES + h), edges);
            b.st::<U32, _>(&status_addr(status, ST_ITEMS + h), items);
        });
        let s = b.add(all_items, items);
        b.set(all_items, s);
    }
    // A flagged schedule has no work: the backward then walks no task and writes zeros.
    let clean = b.setp(Cmp::Eq, flags, 0u32);
    let wc = b.selp(all_items, 0u32, clean);
    b.if_then(t0, "work_count", |b| {
        b.st::<U32, _>(&global(work_count, 0), wc)
    });
    b.ret();
}

fn scatter(b: &mut KernelBuilder) {
    b.grid("[rows capacity, 4, 1]");
    let status_p = b.param_ptr("status", HostElem::I32, false);
    let blk_doc_p = b.param_ptr("block_record", HostElem::I32, false);
    let block_of_p = b.param_ptr("block_of_row", HostElem::I32, false);
    let entries_p = b.param_ptr("entries", HostElem::I32, false);
    let info_p = b.param_ptr("block_entries", HostElem::I32, false);
    let bstart_p = b.param_ptr("bucket_starts", HostElem::I32, false);
    let buckets_p = b.param_ptr("buckets", HostElem::I32, true);
    let row_ptr_p = b.param_ptr("row_ptr", HostElem::I32, false);
    let item_off_p = b.param_ptr("item_offsets", HostElem::I32, false);
    let q_indices_p = b.param_ptr("q_indices", HostElem::I32, true);
    let metadata_p = b.param_ptr("scheduler_metadata", HostElem::I32, true);
    let tokens_p = b.param_u32("num_tokens");
    let rows_cap_p = b.param_u32("rows_capacity");
    let work_cap_p = b.param_u32("work_capacity");
    let qpw_p = b.param_u32("queries_per_work");

    let status = b.ld_param_ptr(&status_p);
    let tid = b.sreg(SReg::TidX);
    let f = b.sreg(SReg::CtaidX);
    let head = b.sreg(SReg::CtaidY);
    let gx = b.sreg(SReg::NctaidX);
    let cta = b.mad_lo(head, gx, f);
    let j = b.mad_lo(cta, BLOCK_THREADS, tid);
    let ctas = b.shl(gx, 2u32);
    let threads = b.mul_lo(ctas, BLOCK_THREADS);
    let tokens = b.ld_param(&tokens_p);
    let edge_cap = b.mul_lo(tokens, TOPK);
    let rows_cap = b.ld_param(&rows_cap_p);
    let [flags, _, _, rows]: [Reg<U32>; 4] = b.ld_v(&status_addr(status, ST_FLAGS));
    let clean = b.setp(Cmp::Eq, flags, 0u32);
    let mut bases = Vec::new();
    let total = b.mov::<U32>(0u32);
    for h in 0..4 {
        let n = b.ld::<U32, _>(&status_addr(status, ST_ITEMS + h));
        bases.push(b.mov::<U32>(total));
        let t = b.add(total, n);
        b.set(total, t);
    }
    let total = b.selp(total, 0u32, clean);

    let work_cap = b.ld_param(&work_cap_p);
    let metadata = b.ld_param_ptr(&metadata_p);
    let warps = b.shr(threads, 5u32);
    let lane = b.and(tid, 31u32);
    let warp = b.shr(j, 5u32);

    b.comment("work items: one warp per (head, row), its lanes write the row's items");
    b.if_then(clean, "items", |b| {
        let pairs = b.mul_lo(rows, 4u32);
        let stride = b.add(rows_cap, 1u32);
        let qpw = b.ld_param(&qpw_p);
        let item_off = b.ld_param_ptr(&item_off_p);
        let row_ptr = b.ld_param_ptr(&row_ptr_p);
        let block_of = b.ld_param_ptr(&block_of_p);
        let blk_doc = b.ld_param_ptr(&blk_doc_p);
        strided(b, warp, pairs, warps, |b, hr| {
            let h = b.div(hr, rows);
            let row = b.rem(hr, rows);
            let base = b.mov::<U32>(0u32);
            for (k, &bh) in bases.iter().enumerate().skip(1) {
                let is = b.setp(Cmp::Eq, h, k as u32);
                let v = b.selp(bh, base, is);
                b.set(base, v);
            }
            let io = b.mad_lo(h, rows_cap, row);
            let first = load_u32(b, item_off, io);
            let first = b.add(first, base);
            let rp = b.mad_lo(h, stride, row);
            let lo = load_u32(b, row_ptr, rp);
            let rp1 = b.add(rp, 1u32);
            let hi = load_u32(b, row_ptr, rp1);
            let c = b.sub(hi, lo);
            let n = div_ceil(b, c, qpw);
            let fb = load_u32(b, block_of, row);
            let rec = common_elem16(b, blk_doc, fb);
            let [d, first_block, _, _]: [Reg<U32>; 4] = b.ld_v(&rec);
            let k = b.sub(fb, first_block);
            b.for_range(lane, n, 32, "row_items", |b, m| {
                let q_begin = b.mul_lo(m, qpw);
                let left = b.sub(c, q_begin);
                let q_count = b.min(left, qpw);
                let it = b.add(first, m);
                let at = b.mul_lo(it, 6u32);
                for (col, v) in [h, row, q_begin, q_count, d, k].into_iter().enumerate() {
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

    b.comment(
        "the block's entries into their rows' buckets: (qb | count << 16, query or list index)",
    );
    let past = b.setp(Cmp::Ge, f, rows);
    b.unless(clean, "flagged", |b| b.ret());
    b.if_then(past, "past", |b| b.ret());
    let blk_doc = b.ld_param_ptr(&blk_doc_p);
    let blk = block_of_cta(b, blk_doc);
    let info = b.ld_param_ptr(&info_p);
    let i = b.mad_lo(head, rows_cap, f);
    let at = super::common::elem_bytes(b, info, i, 8);
    let [eb, n]: [Reg<U32>; 2] = b.ld_v(&at);
    let entries = b.ld_param_ptr(&entries_p);
    let bstart = b.ld_param_ptr(&bstart_p);
    let buckets = b.ld_param_ptr(&buckets_p);
    let head_base = b.mul_lo(head, edge_cap);
    let list_base = b.add(head_base, eb);
    b.for_range(blk.tid, n, BLOCK_THREADS, "entries", |b, j| {
        let gi = b.add(list_base, j);
        let ea = super::common::elem_bytes(b, entries, gi, 8);
        let [fk, sc]: [Reg<U32>; 2] = b.ld_v(&ea);
        let slot = b.and(sc, (1u32 << SLOT_BITS) - 1);
        let c = b.shr(sc, SLOT_BITS);
        let c = b.and(c, 0xffu32);
        let q = b.shr(sc, QUERY_SHIFT);
        let bi = b.mad_lo(head, rows_cap, fk);
        let bs = load_u32(b, bstart, bi);
        let di = b.add(head_base, bs);
        let di = b.add(di, slot);
        let c16 = b.shl(c, 16u32);
        let key = b.or(blk.qb, c16);
        // A single edge carries its query, more carry the list index of their mask.
        let li = b.add(eb, j);
        let single = b.setp(Cmp::Eq, c, 1u32);
        let x = b.selp(q, li, single);
        let da = super::common::elem_bytes(b, buckets, di, 8);
        b.st_v(&da, [key, x]);
    });
    b.ret();
}

fn order(b: &mut KernelBuilder) {
    const _: () = assert!(
        ORDER_THREADS * 32 == MAX_BUCKET,
        "one bitmap word per thread"
    );
    b.grid("[rows capacity, 4, 1]");
    let status_p = b.param_ptr("status", HostElem::I32, false);
    let ctr_p = b.param_ptr("row_counters", HostElem::I32, false);
    let bstart_p = b.param_ptr("bucket_starts", HostElem::I32, false);
    let buckets_p = b.param_ptr("buckets", HostElem::I32, false);
    let row_ptr_p = b.param_ptr("row_ptr", HostElem::I32, false);
    let block_of_p = b.param_ptr("block_of_row", HostElem::I32, false);
    let masks_p = b.param_ptr("entry_masks", HostElem::I32, false);
    let q_indices_p = b.param_ptr("q_indices", HostElem::I32, true);
    let tokens_p = b.param_u32("num_tokens");
    let rows_cap_p = b.param_u32("rows_capacity");
    let keys_var = b.shared_array("sorted", MAX_BUCKET * 4, 16);
    let bits_var = b.shared_array("qb_bits", MAX_BUCKET / 8, 16);
    let below_var = b.shared_array("qb_below", MAX_BUCKET / 8, 16);
    let starts_var = b.shared_array("entry_starts", ORDER_THREADS * SCAN_PER_THREAD * 4, 16);
    let warp_totals = b.shared_array("warp_totals", 128, 16);

    let status = b.ld_param_ptr(&status_p);
    let tid = b.sreg(SReg::TidX);
    let row = b.sreg(SReg::CtaidX);
    let head = b.sreg(SReg::CtaidY);
    let rows_cap = b.ld_param(&rows_cap_p);
    // The row's block and start are loaded with the status (in bounds for every row of the
    // grid; used only when the row is live), so the round trips overlap.
    let block_of = b.ld_param_ptr(&block_of_p);
    let fb = load_u32(b, block_of, row);
    let stride = b.add(rows_cap, 1u32);
    let rp = b.mad_lo(head, stride, row);
    let row_ptr = b.ld_param_ptr(&row_ptr_p);
    let row_start = load_u32(b, row_ptr, rp);
    let [flags, _, _, rows]: [Reg<U32>; 4] = b.ld_v(&status_addr(status, ST_FLAGS));
    let flagged = b.setp(Cmp::Ne, flags, 0u32);
    let past = b.setp(Cmp::Ge, row, rows);
    let done = b.or_pred(flagged, past);
    b.if_then(done, "row_done", |b| b.ret());

    let tokens = b.ld_param(&tokens_p);
    let edge_cap = b.mul_lo(tokens, TOPK);
    let bi = b.mad_lo(head, rows_cap, fb);
    let ctr = b.ld_param_ptr(&ctr_p);
    let ca = super::common::elem_bytes(b, ctr, bi, 8);
    let cv = b.ld::<U64, _>(&ca);
    let (_, n) = halves(b, cv);
    let bstart = b.ld_param_ptr(&bstart_p);
    let bs = load_u32(b, bstart, bi);
    let head_base = b.mul_lo(head, edge_cap);
    let first = b.add(head_base, bs);
    let buckets = b.ld_param_ptr(&buckets_p);
    let keys = b.shared_base(&keys_var);
    let bits = b.shared_base(&bits_var);
    let below = b.shared_base(&below_var);
    // The bucket record's first word, (qb | count << 16).
    let key_of = |b: &mut KernelBuilder, i: Reg<U32>| {
        let di = b.add(first, i);
        let da = super::common::elem_bytes(b, buckets, di, 8);
        b.ld::<U32, _>(&da)
    };

    b.comment("the bucket's query blocks are distinct: a bitmap of them, and each entry's place");
    b.comment("in qb order is the number of set bits below its own (no comparison sort)");
    let tid4 = b.shl(tid, 2u32);
    let my_bits = b.add(bits, tid4);
    b.st::<U32, _>(&shared(my_bits, 0), 0u32);
    b.bar_sync(0, None);
    b.for_range(tid, n, ORDER_THREADS, "mark", |b, i| {
        let w = key_of(b, i);
        let qb = b.and(w, 0xffffu32);
        let w = b.shr(qb, 5u32);
        let w4 = b.shl(w, 2u32);
        let a = b.add(bits, w4);
        let sh = b.and(qb, 31u32);
        let one = b.mov::<U32>(1u32);
        let bit = b.shl(one, sh);
        b.red::<U32, _>(AtomOp::Or, &shared(a, 0), bit);
    });
    b.bar_sync(0, None);
    let word = b.ld::<U32, _>(&shared(my_bits, 0));
    let c = b.popc(word);
    let ([before], _) = cta_exclusive_scan_n::<1>(b, [c], tid, &warp_totals);
    let my_below = b.add(below, tid4);
    b.st::<U32, _>(&shared(my_below, 0), before);
    b.bar_sync(0, None);
    b.for_range(tid, n, ORDER_THREADS, "place", |b, i| {
        let wq = key_of(b, i);
        let qb = b.and(wq, 0xffffu32);
        let w = b.shr(qb, 5u32);
        let w4 = b.shl(w, 2u32);
        let a = b.add(bits, w4);
        let x = b.ld::<U32, _>(&shared(a, 0));
        let a = b.add(below, w4);
        let p = b.ld::<U32, _>(&shared(a, 0));
        let sh = b.and(qb, 31u32);
        let one = b.mov::<U32>(1u32);
        let bit = b.shl(one, sh);
        let lower = b.sub(bit, 1u32);
        let x = b.and(x, lower);
        let r = b.popc(x);
        let r = b.add(p, r);
        // The sorted list holds (slot, count): the scan needs no global load.
        let cnt = b.shr(wq, 16u32);
        let cnt = b.shl(cnt, SLOT_BITS);
        let key = b.or(i, cnt);
        let r4 = b.shl(r, 2u32);
        let a = b.add(keys, r4);
        b.st::<U32, _>(&shared(a, 0), key);
    });
    b.bar_sync(0, None);

    b.comment("entry start = row_ptr + edges of the row's earlier query blocks (a scan in qb");
    b.comment("order); then per tile, one entry per thread, the entry's queries go there");
    // n >= 1: the row has a CTA only if rows > row, and an empty row scans nothing.
    let n1 = b.max(n, 1u32);
    let last = b.sub(n1, 1u32);
    let masks = b.ld_param_ptr(&masks_p);
    let q_indices = b.ld_param_ptr(&q_indices_p);
    let starts = b.shared_base(&starts_var);
    let record = |b: &mut KernelBuilder, i: Reg<U32>| {
        let i4 = b.shl(i, 2u32);
        let a = b.add(keys, i4);
        let key = b.ld::<U32, _>(&shared(a, 0));
        let slot = b.and(key, (1u32 << SLOT_BITS) - 1);
        let di = b.add(first, slot);
        super::common::elem_bytes(b, buckets, di, 8)
    };
    let tile = ORDER_THREADS * SCAN_PER_THREAD;
    const _: () = assert!((ORDER_THREADS * SCAN_PER_THREAD).is_power_of_two());
    let at_row = b.add(head_base, row_start);
    tiled_scan_then::<1>(
        b,
        (ORDER_THREADS, SCAN_PER_THREAD),
        n,
        tid,
        &warp_totals,
        // Counts from the sorted list at a clamped index; dead entries count 0.
        |b, i, live| {
            let ic = b.min(i, last);
            let i4 = b.shl(ic, 2u32);
            let a = b.add(keys, i4);
            let key = b.ld::<U32, _>(&shared(a, 0));
            let c = b.shr(key, SLOT_BITS);
            [b.selp(c, 0u32, live)]
        },
        |b, i, live, before, _| {
            b.if_then(live, "entry_start", |b| {
                let e = b.and(i, tile - 1);
                let e4 = b.shl(e, 2u32);
                let a = b.add(starts, e4);
                let s = b.add(at_row, before[0]);
                b.st::<U32, _>(&shared(a, 0), s);
            });
        },
        // A single edge is one store by its entry's thread; the queries of an entry with
        // several go out as its warp's coalesced stores, four per entry (one per mask word),
        // instead of one serial store per query. A row of at most ORDER_THREADS entries (short
        // documents: few entries, many queries each) spreads them round-robin over the warps
        // (thread (w, l) takes entry 8·l + w); a longer one (mostly single edges) keeps entry
        // `tid`, so that neighbouring lanes store to neighbouring places.
        |b, tile_base| {
            b.bar_sync(0, None);
            let warp = b.shr(tid, 5u32);
            let lane = b.and(tid, 31u32);
            let one = b.mov::<U32>(1u32);
            let lane_bit = b.shl(one, lane);
            let lanes_below = b.sub(lane_bit, 1u32);
            let spread = b.mad_lo(lane, ORDER_THREADS / 32, warp);
            let short_row = b.setp(Cmp::Le, n, ORDER_THREADS);
            let spread = b.selp(spread, tid, short_row);
            // Every thread runs the same SCAN_PER_THREAD passes, so the warp stays converged
            // for its votes and shuffles.
            b.for_range(spread, tile, ORDER_THREADS, "entry_queries", |b, e| {
                let i = b.add(tile_base, e);
                let live = b.setp(Cmp::Lt, i, n);
                let pos = b.mov::<U32>(0u32);
                let q0 = b.mov::<U32>(0u32);
                let count = b.mov::<U32>(0u32);
                let m: [Reg<U32>; 4] = std::array::from_fn(|_| b.mov::<U32>(0u32));
                b.if_then(live, "entry_live", |b| {
                    let da = record(b, i);
                    let [w, x]: [Reg<U32>; 2] = b.ld_v(&da);
                    let e4 = b.shl(e, 2u32);
                    let a = b.add(starts, e4);
                    let p = b.ld::<U32, _>(&shared(a, 0));
                    b.set(pos, p);
                    let qb = b.and(w, 0xffffu32);
                    let q = b.shl(qb, 7u32);
                    b.set(q0, q);
                    let c = b.shr(w, 16u32);
                    b.set(count, c);
                    let single = b.setp(Cmp::Eq, c, 1u32);
                    b.if_then(single, "single_edge", |b| {
                        let q = b.add(q0, x);
                        store_u32(b, q_indices, pos, q);
                    });
                    b.unless(single, "entry_mask", |b| {
                        let gi = b.add(head_base, x);
                        let ma = common_elem16(b, masks, gi);
                        let v: [Reg<U32>; 4] = b.ld_v(&ma);
                        for (r, x) in m.iter().zip(v) {
                            b.set(*r, x);
                        }
                    });
                });
                let several = b.setp(Cmp::Gt, count, 1u32);
                let pending = b.ballot(several);
                let top = b.label("warp_entries");
                let out = b.label("warp_entries_done");
                b.place(&top);
                let empty = b.setp(Cmp::Eq, pending, 0u32);
                b.bra_if(empty, &out);
                b.comment("the lowest pending lane's entry, by the whole warp");
                let zero = b.mov::<U32>(0u32);
                let neg = b.sub(zero, pending);
                let low = b.and(pending, neg);
                let low1 = b.sub(low, 1u32);
                let src = b.popc(low1);
                let rest = b.xor(pending, low);
                b.set(pending, rest);
                let at = b.shfl(Shfl::Idx, pos, src, 31);
                let base_q = b.shfl(Shfl::Idx, q0, src, 31);
                for (k, &word) in m.iter().enumerate() {
                    let x = b.shfl(Shfl::Idx, word, src, 31);
                    let below = b.and(x, lanes_below);
                    let rank = b.popc(below);
                    let mine = b.and(x, lane_bit);
                    let set = b.setp(Cmp::Ne, mine, 0u32);
                    b.if_then(set, "query_bit", |b| {
                        let p = b.add(at, rank);
                        let q = b.add(base_q, lane);
                        let q = b.add(q, 32 * k as u32);
                        store_u32(b, q_indices, p, q);
                    });
                    if k + 1 < m.len() {
                        let c = b.popc(x);
                        let next = b.add(at, c);
                        b.set(at, next);
                    }
                }
                b.bra(&top);
                b.place(&out);
            });
        },
    );
    b.ret();
}
