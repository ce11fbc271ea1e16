//! The device task build (`docs/design.md` §2.2–§2.4): four launches turn the schedule into the
//! CTA-walk task tables, in locality order, with no host sync.
//!
//! 1. [`SCAN_WORK`]: inclusive prefix of `ceil(q_count/8)` per work item into `task_ends`,
//!    `num_work = clamp(work_count, 0, work_capacity)`, descriptor words 5–7, bins cleared;
//!    per document its window shift and the exclusive prefix of its bins (`doc_windows`).
//! 2. [`ASSIGN_SEGMENTS`]: one thread per forward-order task: decodes it (binary search over
//!    `task_ends`), computes its locality segment and folds it into the bins with atomics,
//!    and into its chunk's total with one atomic per warp and chunk.
//!    The segment of a task of index head `h`, document `d`, key block `k` (document-local)
//!    whose first query is `q` (document-local) is
//!    `h·bins_per_head + base[d] + (q >> shift[d])·blocks[d] + k`: per head, documents in
//!    order, windows of `2^shift[d]` queries, then key blocks (the runtime's `Locality`).
//! 3. [`SCAN_BINS`]: exclusive scan of the bin counts, [`BIN_CHUNK`] bins per CTA, each CTA
//!    starting from the task counts of the chunks before it (`bin_chunk_totals`, which step 2
//!    adds up); flags non-contiguous segments.
//! 4. [`SCATTER_TABLES`]: writes `task_meta`, `task_qrows`, `task_qpos`; thread 0 writes the
//!    CTA-walk descriptor words 0–4 with the same rule as the host contract.
//!
//! All index arithmetic is `u32`: the host rejects schedules whose counts do not fit `i32`.

use super::common::{
    self, div_ceil, elem, load_if, load_u32, store_u32, tiled_scan, tiled_scan_range,
    SCAN_PER_THREAD,
};
use super::KernelDesc;
use crate::ptx::*;
use crate::target::Target;

/// Host contract mirror: rows at or below this use [`ROWS_PER_CTA_SMALL`].
pub const ROWS_PER_CTA_SWITCH: u32 = 2400;
/// Host contract mirror: rows per CTA of a small walk.
pub const ROWS_PER_CTA_SMALL: u32 = 4;
/// Host contract mirror: rows per CTA of a large walk.
pub const ROWS_PER_CTA_LARGE: u32 = 64;
/// Queries per task (one task row = 8 query slots).
pub const QUERY_CHUNK: u32 = 8;
/// Descriptor flag: more tasks than capacity; no rows are walked.
pub const FLAG_CAPACITY_OVERFLOW: u32 = 1;
/// Descriptor flag: a segment's tasks are not consecutive; tables stay in source order.
pub const FLAG_NONCONTIGUOUS_SEGMENTS: u32 = 2;

/// Threads of the scans' CTAs.
pub const SCAN_THREADS: u32 = common::SCAN_THREADS;
/// Bins per CTA of [`SCAN_BINS`] (one scan tile), and per word of `bin_chunk_totals`
/// (host contract mirror: `tasks::BIN_CHUNK`).
pub const BIN_CHUNK: u32 = SCAN_THREADS * SCAN_PER_THREAD;
const BIN_CHUNK_LOG2: u32 = BIN_CHUNK.trailing_zeros();
/// `task_assign_segments`' chunk of a lane past the tasks (no bin index reaches it).
const NO_CHUNK: u32 = u32::MAX;
const _: () = assert!(BIN_CHUNK.is_power_of_two());
/// Threads per CTA of the per-task launches.
pub const TASK_THREADS: u32 = 256;

const TARGETS: &[Target] = &[Target::Sm90a, Target::Sm100a];

/// `scan_work`.
pub const SCAN_WORK: KernelDesc = KernelDesc {
    name: "task_scan_work",
    about: "prefix of ceil(q_count/8) per work item, clamped work count, bins cleared",
    targets: TARGETS,
    threads: (SCAN_THREADS, 1, 1),
    describe: scan_work,
};

/// `assign_segments`.
pub const ASSIGN_SEGMENTS: KernelDesc = KernelDesc {
    name: "task_assign_segments",
    about: "decodes each forward-order task and folds its locality segment into the bins",
    targets: TARGETS,
    threads: (TASK_THREADS, 1, 1),
    describe: assign_segments,
};

/// `scan_bins`.
pub const SCAN_BINS: KernelDesc = KernelDesc {
    name: "task_scan_bins",
    about: "exclusive scan of the bin counts, a chunk of BIN_CHUNK bins per CTA, and the non-contiguous-segments flag",
    targets: TARGETS,
    threads: (SCAN_THREADS, 1, 1),
    describe: scan_bins,
};

/// `scatter_tables`.
pub const SCATTER_TABLES: KernelDesc = KernelDesc {
    name: "task_scatter_tables",
    about: "writes task_meta/qrows/qpos in locality order and the CTA-walk descriptor",
    targets: TARGETS,
    threads: (TASK_THREADS, 1, 1),
    describe: scatter_tables,
};

/// The scans' spare CTAs: the scan runs on CTAs `0 .. scan_ctas`, and the CTAs after them zero
/// `zero_words` 16-byte words at `zero` (null: none) with a grid stride meanwhile, run `then`,
/// and return.
/// A buffer the next kernels accumulate into (the KV forward's `o_pool`) is zeroed on SMs the
/// scan leaves idle, where a memset or a later kernel would take them from other work.
fn spare_ctas_zero(
    b: &mut KernelBuilder,
    scan_ctas: Reg<U32>,
    zero_p: &ParamRef<U64>,
    words_p: &ParamRef<U32>,
    then: impl FnOnce(&mut KernelBuilder),
) {
    let cta = b.sreg(SReg::CtaidX);
    let spare = b.setp(Cmp::Ge, cta, scan_ctas);
    b.if_then(spare, "spare_cta", |b| {
        common::zero_words_strided(b, zero_p, words_p, "spare_zero", |b| {
            let ctas = b.sreg(SReg::NctaidX);
            let tid = b.sreg(SReg::TidX);
            let helper = b.sub(cta, scan_ctas);
            let first = b.mad_lo(helper, SCAN_THREADS, tid);
            let helpers = b.sub(ctas, scan_ctas);
            (first, b.mul_lo(helpers, SCAN_THREADS))
        });
        then(b);
        b.ret();
    });
}

/// Every CTA of the grid clears its grid-stride share of the bins: count 0, first
/// `INT32_MAX`, last −1. Capped windows (`Locality::max_window_log2`) make millions of bins,
/// which one CTA would clear for milliseconds.
fn clear_bins(
    b: &mut KernelBuilder,
    (count_p, first_p, last_p): (&ParamRef<U64>, &ParamRef<U64>, &ParamRef<U64>),
    chunks_p: &ParamRef<U64>,
    bins_p: &ParamRef<U32>,
) {
    let count = b.ld_param_ptr(count_p);
    let first = b.ld_param_ptr(first_p);
    let last = b.ld_param_ptr(last_p);
    let totals = b.ld_param_ptr(chunks_p);
    let bins = b.ld_param(bins_p);
    let cta = b.sreg(SReg::CtaidX);
    let ctas = b.sreg(SReg::NctaidX);
    let tid = b.sreg(SReg::TidX);
    let start = b.mad_lo(cta, SCAN_THREADS, tid);
    let stride = b.mul_lo(ctas, SCAN_THREADS);
    b.for_range(start, bins, stride, "clear_bins", |b, i| {
        store_u32(b, count, i, 0u32);
        store_u32(b, first, i, i32::MAX as u32);
        store_u32(b, last, i, u32::MAX);
    });
    let chunks = div_ceil(b, bins, BIN_CHUNK);
    b.for_range(start, chunks, stride, "clear_chunks", |b, i| {
        store_u32(b, totals, i, 0u32);
    });
}

fn scan_work(b: &mut KernelBuilder) {
    b.grid("[1 + spare CTAs (0 without a buffer to zero), 1, 1]");
    let metadata_p = b.param_ptr("scheduler_metadata", HostElem::I32, false);
    let work_count_p = b.param_ptr("work_count", HostElem::I32, false);
    let desc_p = b.param_ptr("desc", HostElem::I32, true);
    let task_ends_p = b.param_ptr("task_ends", HostElem::I32, true);
    let count_p = b.param_ptr("bin_count", HostElem::I32, true);
    let first_p = b.param_ptr("bin_first", HostElem::I32, true);
    let last_p = b.param_ptr("bin_last", HostElem::I32, true);
    let chunks_p = b.param_ptr("bin_chunk_totals", HostElem::I32, true);
    let cu_p = b.param_ptr("cu_seqlens", HostElem::I32, false);
    let windows_p = b.param_ptr("doc_windows", HostElem::I32, true);
    let cap_p = b.param_u32("work_capacity");
    let bins_p = b.param_u32("bins");
    let docs_p = b.param_u32("num_docs");
    let min_log2_p = b.param_u32("min_window_log2");
    let blocks_log2_p = b.param_u32("blocks_log2");
    let max_log2_p = b.param_u32("max_window_log2");
    let zero_p = b.param_ptr("zero", HostElem::U32, true);
    let zero_words_p = b.param_u32("zero_words");
    let warp_totals = b.shared_array("warp_totals", 128, 16);
    let bin_arrays = (&count_p, &first_p, &last_p);
    let one = b.mov::<U32>(1u32);
    spare_ctas_zero(b, one, &zero_p, &zero_words_p, |b| {
        clear_bins(b, bin_arrays, &chunks_p, &bins_p)
    });

    let metadata = b.ld_param_ptr(&metadata_p);
    let work_count = b.ld_param_ptr(&work_count_p);
    let desc = b.ld_param_ptr(&desc_p);
    let task_ends = b.ld_param_ptr(&task_ends_p);
    let cap = b.ld_param(&cap_p);
    let tid = b.sreg(SReg::TidX);

    b.comment("num_work = clamp(work_count, 0, work_capacity)");
    let wc = b.ld::<S32, _>(&global(work_count, 0));
    let wc = b.max(wc, 0i32);
    let wc = b.bitcast::<U32, S32>(wc);
    let num_work = b.min(wc, cap);

    b.comment("task_ends[w] = sum over items <= w of ceil(q_count / 8)");
    let total = tiled_scan(
        b,
        num_work,
        tid,
        &warp_totals,
        |b, i, live| {
            load_if(b, live, |b| {
                let field = b.mad_lo(i, 6u32, 3u32);
                let q_count = load_u32(b, metadata, field);
                div_ceil(b, q_count, QUERY_CHUNK)
            })
        },
        |b, i, live, before, v| {
            b.if_then(live, "store_end", |b| {
                let end = b.add(before, v);
                store_u32(b, task_ends, i, end);
            });
        },
    );
    let leader = b.setp(Cmp::Eq, tid, 0u32);
    b.if_then(leader, "desc", |b| {
        b.st::<U32, _>(&global(desc, 20), num_work);
        b.st::<U32, _>(&global(desc, 24), total);
        b.st::<U32, _>(&global(desc, 28), 0u32);
    });

    b.comment("per document: doc_windows[2d] = bins before it, doc_windows[2d+1] = window shift");
    let cu = b.ld_param_ptr(&cu_p);
    let windows = b.ld_param_ptr(&windows_p);
    let num_docs = b.ld_param(&docs_p);
    let min_log2 = b.ld_param(&min_log2_p);
    let blocks_log2 = b.ld_param(&blocks_log2_p);
    let max_log2 = b.ld_param(&max_log2_p);
    // The block, window and bin counts of document `d`; the shift is
    // min(max(min_log2, ceil(log2(blocks << blocks_log2))), max_log2).
    let doc_bins = |b: &mut KernelBuilder, d: Reg<U32>| {
        let start = load_u32(b, cu, d);
        let d1 = b.add(d, 1u32);
        let end = load_u32(b, cu, d1);
        let len = b.sub(end, start);
        let blocks = div_ceil(b, len, 128u32);
        let one = b.max(blocks, 1u32);
        let need = b.shl(one, blocks_log2);
        let shift = common::ceil_log2(b, need);
        let shift = b.max(shift, min_log2);
        let shift = b.min(shift, max_log2);
        let window = b.mov::<U32>(1u32);
        let window = b.shl(window, shift);
        let wins = div_ceil(b, len, window);
        (b.mul_lo(wins, blocks), shift)
    };
    let doc_total = tiled_scan(
        b,
        num_docs,
        tid,
        &warp_totals,
        |b, i, live| load_if(b, live, |b| doc_bins(b, i).0),
        |b, i, live, before, _| {
            b.if_then(live, "store_doc", |b| {
                let (_, shift) = doc_bins(b, i);
                let at = b.shl(i, 1u32);
                store_u32(b, windows, at, before);
                let at = b.add(at, 1u32);
                store_u32(b, windows, at, shift);
            });
        },
    );
    b.if_then(leader, "doc_total", |b| {
        let at = b.shl(num_docs, 1u32);
        store_u32(b, windows, at, doc_total);
    });

    b.comment("clear CTA 0's share of the bins: count 0, first INT32_MAX, last -1");
    clear_bins(b, bin_arrays, &chunks_p, &bins_p);
    b.ret();
}

/// Loads the decode inputs shared by the per-task kernels' parameters.
struct TaskParams {
    q_indices: Reg<U64>,
    cu_seqlens: Reg<U64>,
    ws_starts: Reg<U64>,
    edge_capacity: Reg<U32>,
}

fn assign_segments(b: &mut KernelBuilder) {
    b.grid("[ceil(capacity / 256), 1, 1]");
    let metadata_p = b.param_ptr("scheduler_metadata", HostElem::I32, false);
    let row_ptr_p = b.param_ptr("row_ptr", HostElem::I32, false);
    let q_indices_p = b.param_ptr("q_indices", HostElem::I32, false);
    let cu_p = b.param_ptr("cu_seqlens", HostElem::I32, false);
    let ws_p = b.param_ptr("document_workspace_starts", HostElem::I32, false);
    let desc_p = b.param_ptr("desc", HostElem::I32, false);
    let task_ends_p = b.param_ptr("task_ends", HostElem::I32, false);
    let segments_p = b.param_ptr("segments", HostElem::I32, true);
    let decode_p = b.param_ptr("decode", HostElem::I32, true);
    let count_p = b.param_ptr("bin_count", HostElem::I32, true);
    let first_p = b.param_ptr("bin_first", HostElem::I32, true);
    let last_p = b.param_ptr("bin_last", HostElem::I32, true);
    let chunks_p = b.param_ptr("bin_chunk_totals", HostElem::I32, true);
    let windows_p = b.param_ptr("doc_windows", HostElem::I32, false);
    let rows_p = b.param_u32("rows");
    let edge_cap_p = b.param_u32("edge_capacity");
    let cap_p = b.param_u32("capacity");
    let per_head_p = b.param_u32("bins_per_head");

    let tid = b.sreg(SReg::TidX);
    let cta = b.sreg(SReg::CtaidX);
    let j = b.mad_lo(cta, TASK_THREADS, tid);
    let desc = b.ld_param_ptr(&desc_p);
    let num_work = b.ld::<U32, _>(&global(desc, 20));
    let total = b.ld::<U32, _>(&global(desc, 24));
    let cap = b.ld_param(&cap_p);
    let limit = b.min(total, cap);
    let live = b.setp(Cmp::Lt, j, limit);
    // This task's chunk of bins; `NO_CHUNK` on a lane past the tasks.
    let my_chunk = b.mov::<U32>(NO_CHUNK);
    b.if_then(live, "task_done", |b| {
        let task_ends = b.ld_param_ptr(&task_ends_p);
        b.comment("work item w: the first with task_ends[w] > j (lower bound)");
        let lo = b.mov::<U32>(0u32);
        let hi = b.mov::<U32>(num_work);
        let top = b.label("search");
        let done = b.label("search_done");
        b.place(&top);
        let more = b.setp(Cmp::Lt, lo, hi);
        b.bra_unless(more, &done);
        let mid = b.add(lo, hi);
        let mid = b.shr(mid, 1u32);
        let end = load_u32(b, task_ends, mid);
        let right = b.setp(Cmp::Le, end, j);
        let mid1 = b.add(mid, 1u32);
        let new_lo = b.selp(mid1, lo, right);
        let new_hi = b.selp(hi, mid, right);
        b.set(lo, new_lo);
        b.set(hi, new_hi);
        b.bra(&top);
        b.place(&done);
        let w = lo;
        let has_prev = b.setp(Cmp::Gt, w, 0u32);
        let prev = load_if(b, has_prev, |b| {
            let wm1 = b.sub(w, 1u32);
            load_u32(b, task_ends, wm1)
        });
        let local = b.sub(j, prev);

        let metadata = b.ld_param_ptr(&metadata_p);
        let md0 = b.mul_lo(w, 6u32);
        let field = |b: &mut KernelBuilder, c: u32| {
            let i = b.add(md0, c);
            load_u32(b, metadata, i)
        };
        let head = field(b, 0);
        let row = field(b, 1);
        let q_begin = field(b, 2);
        let q_count = field(b, 3);
        let doc = field(b, 4);
        let local_kblock = field(b, 5);

        let skip = b.mul_lo(local, QUERY_CHUNK);
        let left = b.sub(q_count, skip);
        let valid = b.min(left, QUERY_CHUNK);
        let row_ptr = b.ld_param_ptr(&row_ptr_p);
        let rows = b.ld_param(&rows_p);
        let stride = b.add(rows, 1u32);
        let rp_idx = b.mad_lo(head, stride, row);
        let rp = load_u32(b, row_ptr, rp_idx);
        let edge_start = b.add(rp, q_begin);
        let edge_start = b.add(edge_start, skip);

        let p = task_params(b, &q_indices_p, &cu_p, &ws_p, &edge_cap_p);
        let edge = b.mad_lo(head, p.edge_capacity, edge_start);
        let q0 = load_u32(b, p.q_indices, edge);
        let ws = load_u32(b, p.ws_starts, doc);
        let kb = b.shr(ws, 7u32);
        let kblock = b.add(kb, local_kblock);
        // The document's blocks, window shift and first bin (scan_work's doc_windows).
        let start = load_u32(b, p.cu_seqlens, doc);
        let doc1 = b.add(doc, 1u32);
        let end = load_u32(b, p.cu_seqlens, doc1);
        let len = b.sub(end, start);
        let blocks = div_ceil(b, len, 128u32);
        let windows = b.ld_param_ptr(&windows_p);
        let at = b.shl(doc, 1u32);
        let doc_base = load_u32(b, windows, at);
        let at = b.add(at, 1u32);
        let shift = load_u32(b, windows, at);
        let window = b.shr(q0, shift);
        let per_head = b.ld_param(&per_head_p);
        let seg = b.mad_lo(head, per_head, doc_base);
        let seg = b.mad_lo(window, blocks, seg);
        let seg = b.add(seg, local_kblock);

        let segments = b.ld_param_ptr(&segments_p);
        store_u32(b, segments, j, seg);
        let decode = b.ld_param_ptr(&decode_p);
        let head_kblock = b.shl(head, 24u32);
        let head_kblock = b.or(head_kblock, kblock);
        let a = common::elem_bytes(b, decode, j, 16);
        b.st_v(&a, [valid, edge_start, doc, head_kblock]);

        let count = b.ld_param_ptr(&count_p);
        let first = b.ld_param_ptr(&first_p);
        let last = b.ld_param_ptr(&last_p);
        let js = b.bitcast::<S32, U32>(j);
        let a = elem::<U32>(b, count, seg);
        b.red::<U32, _>(AtomOp::Add, &a, 1u32);
        let a = elem::<S32>(b, first, seg);
        b.red::<S32, _>(AtomOp::Min, &a, js);
        let a = elem::<S32>(b, last, seg);
        b.red::<S32, _>(AtomOp::Max, &a, js);
        let chunk = b.shr(seg, BIN_CHUNK_LOG2);
        b.set(my_chunk, chunk);
    });
    // The chunk totals, which scan_bins's later CTAs start from, added per warp: few chunks
    // hold many tasks (two at packed64k), and one red.add per task into them serialised in
    // L2 (0.04 → 0.36 ms). Lane 0 adds the count of the lanes in its chunk; a lane in another
    // chunk adds 1. The whole warp is here again, and lane 0 is live whenever any lane is (the
    // live lanes are a prefix: j grows with the lane).
    let totals = b.ld_param_ptr(&chunks_p);
    let lane = b.and(tid, 31u32);
    let c0 = b.shfl(Shfl::Idx, my_chunk, 0u32, 31);
    let same = b.setp(Cmp::Eq, my_chunk, c0);
    let with0 = b.ballot(same);
    let n0 = b.popc(with0);
    let is0 = b.setp(Cmp::Eq, lane, 0u32);
    let c0_live = b.setp(Cmp::Ne, c0, NO_CHUNK);
    let lead = b.and_pred(is0, c0_live);
    b.if_then(lead, "chunk_lead_done", |b| {
        let a = elem::<U32>(b, totals, c0);
        b.red::<U32, _>(AtomOp::Add, &a, n0);
    });
    let mine_live = b.setp(Cmp::Ne, my_chunk, NO_CHUNK);
    let other = b.not_pred(same);
    let alone = b.and_pred(other, mine_live);
    b.if_then(alone, "chunk_own_done", |b| {
        let a = elem::<U32>(b, totals, my_chunk);
        b.red::<U32, _>(AtomOp::Add, &a, 1u32);
    });
    b.ret();
}

fn task_params(
    b: &mut KernelBuilder,
    q_indices: &ParamRef<U64>,
    cu: &ParamRef<U64>,
    ws: &ParamRef<U64>,
    edge_cap: &ParamRef<U32>,
) -> TaskParams {
    TaskParams {
        q_indices: b.ld_param_ptr(q_indices),
        cu_seqlens: b.ld_param_ptr(cu),
        ws_starts: b.ld_param_ptr(ws),
        edge_capacity: b.ld_param(edge_cap),
    }
}

fn scan_bins(b: &mut KernelBuilder) {
    b.grid("[ceil(bins / BIN_CHUNK) + spare CTAs (0 without a buffer to zero), 1, 1]");
    let count_p = b.param_ptr("bin_count", HostElem::I32, false);
    let first_p = b.param_ptr("bin_first", HostElem::I32, false);
    let last_p = b.param_ptr("bin_last", HostElem::I32, false);
    let chunks_p = b.param_ptr("bin_chunk_totals", HostElem::I32, false);
    let offset_p = b.param_ptr("bin_offset", HostElem::I32, true);
    let desc_p = b.param_ptr("desc", HostElem::I32, true);
    let bins_p = b.param_u32("bins");
    let zero_p = b.param_ptr("zero", HostElem::U32, true);
    let zero_words_p = b.param_u32("zero_words");
    let warp_totals = b.shared_array("warp_totals", 128, 16);
    let bins = b.ld_param(&bins_p);
    let chunks = div_ceil(b, bins, BIN_CHUNK);
    spare_ctas_zero(b, chunks, &zero_p, &zero_words_p, |_| {});

    let count = b.ld_param_ptr(&count_p);
    let first = b.ld_param_ptr(&first_p);
    let last = b.ld_param_ptr(&last_p);
    let offset = b.ld_param_ptr(&offset_p);
    let desc = b.ld_param_ptr(&desc_p);
    let totals = b.ld_param_ptr(&chunks_p);
    let tid = b.sreg(SReg::TidX);
    let cta = b.sreg(SReg::CtaidX);
    b.comment("this CTA's chunk starts after the tasks of the chunks before it");
    let before = b.mov::<U32>(0u32);
    b.for_range(tid, cta, SCAN_THREADS, "chunks_before", |b, i| {
        let t = load_u32(b, totals, i);
        let sum = b.add(before, t);
        b.set(before, sum);
    });
    let (_, base) = common::cta_exclusive_scan(b, before, tid, &warp_totals);
    let lo = b.mul_lo(cta, BIN_CHUNK);
    let hi = b.add(lo, BIN_CHUNK);
    let hi = b.min(hi, bins);
    // Branch-free loads (the index clamped into the bins, bins >= 1), so that a tile's loads
    // issue together: behind per-bin branches each waited for the one before, and a scan of
    // millions of bins (capped windows) took milliseconds.
    let last_bin = b.sub(bins, 1u32);
    let split_any = b.mov::<U32>(0u32);
    tiled_scan_range(
        b,
        (lo, hi, bins),
        base,
        tid,
        &warp_totals,
        |b, i, live| {
            let at = b.min(i, last_bin);
            let c = load_u32(b, count, at);
            let f = load_u32(b, first, at);
            let l = load_u32(b, last, at);
            let c = b.selp(c, 0u32, live);
            // A segment whose tasks are not one run in forward order cannot be placed by
            // `offset + (task - first)`: flag it (below), and the tables keep source order.
            let span = b.sub(l, f);
            let span = b.add(span, 1u32);
            let differs = b.xor(span, c);
            let nonempty = b.setp(Cmp::Gt, c, 0u32);
            let differs = b.selp(differs, 0u32, nonempty);
            let any = b.or(split_any, differs);
            b.set(split_any, any);
            c
        },
        |b, i, live, before, _| {
            b.if_then(live, "store_offset", |b| store_u32(b, offset, i, before));
        },
    );
    let flag = b.setp(Cmp::Ne, split_any, 0u32);
    b.if_then(flag, "flag", |b| {
        b.red::<U32, _>(AtomOp::Or, &global(desc, 28), FLAG_NONCONTIGUOUS_SEGMENTS);
    });
    b.ret();
}

fn scatter_tables(b: &mut KernelBuilder) {
    b.grid("[ceil(capacity / 256), 1, 1]");
    let q_indices_p = b.param_ptr("q_indices", HostElem::I32, false);
    let cu_p = b.param_ptr("cu_seqlens", HostElem::I32, false);
    let ws_p = b.param_ptr("document_workspace_starts", HostElem::I32, false);
    let desc_p = b.param_ptr("desc", HostElem::I32, true);
    let segments_p = b.param_ptr("segments", HostElem::I32, false);
    let decode_p = b.param_ptr("decode", HostElem::I32, false);
    let first_p = b.param_ptr("bin_first", HostElem::I32, false);
    let offset_p = b.param_ptr("bin_offset", HostElem::I32, false);
    let meta_p = b.param_ptr("task_meta", HostElem::I32, true);
    let qrows_p = b.param_ptr("task_qrows", HostElem::I32, true);
    let qpos_p = b.param_ptr("task_qpos", HostElem::I32, true);
    let edge_cap_p = b.param_u32("edge_capacity");
    let cap_p = b.param_u32("capacity");
    let sms_p = b.param_u32("num_sms");

    let tid = b.sreg(SReg::TidX);
    let cta = b.sreg(SReg::CtaidX);
    let j = b.mad_lo(cta, TASK_THREADS, tid);
    let desc = b.ld_param_ptr(&desc_p);
    let total = b.ld::<U32, _>(&global(desc, 24));
    let flags = b.ld::<U32, _>(&global(desc, 28));
    let cap = b.ld_param(&cap_p);
    let overflow = b.setp(Cmp::Gt, total, cap);

    b.comment("thread 0 writes the CTA-walk descriptor (words 0-4) and the overflow flag");
    let leader = b.setp(Cmp::Eq, j, 0u32);
    b.if_then(leader, "walk", |b| {
        let n = b.selp(0u32, total, overflow);
        let r = common::rows_per_cta(
            b,
            n,
            ROWS_PER_CTA_SWITCH,
            ROWS_PER_CTA_SMALL,
            ROWS_PER_CTA_LARGE,
        );
        let sms = b.ld_param(&sms_p);
        let (full, tail, grid) = common::chunk_map(b, n, r, sms);
        b.st_v(&global(desc, 0), [n, r, full, tail]);
        b.st::<U32, _>(&global(desc, 16), grid);
        let over = b.selp(FLAG_CAPACITY_OVERFLOW, 0u32, overflow);
        let f = b.or(flags, over);
        b.st::<U32, _>(&global(desc, 28), f);
    });

    let in_range = b.setp(Cmp::Lt, j, total);
    let fits = b.setp(Cmp::Le, total, cap);
    let live = b.and_pred(in_range, fits);
    b.if_then(live, "task_done", |b| {
        let segments = b.ld_param_ptr(&segments_p);
        let seg = load_u32(b, segments, j);
        let split = b.and(flags, FLAG_NONCONTIGUOUS_SEGMENTS);
        let first = b.ld_param_ptr(&first_p);
        let offset = b.ld_param_ptr(&offset_p);
        let row = b.mov::<U32>(j);
        let grouped = b.setp(Cmp::Eq, split, 0u32);
        b.if_then(grouped, "grouped", |b| {
            let f = load_u32(b, first, seg);
            let o = load_u32(b, offset, seg);
            let r = b.sub(j, f);
            let r = b.add(r, o);
            b.set(row, r);
        });

        let p = task_params(b, &q_indices_p, &cu_p, &ws_p, &edge_cap_p);
        let decode = b.ld_param_ptr(&decode_p);
        let a = common::elem_bytes(b, decode, j, 16);
        let [valid, edge_start, doc, head_kblock]: [Reg<U32>; 4] = b.ld_v(&a);
        let head = b.shr(head_kblock, 24u32);
        let kblock = b.and(head_kblock, (1u32 << 24) - 1);

        let meta = b.ld_param_ptr(&meta_p);
        let zero = b.mov::<U32>(0u32);
        let a = common::elem_bytes(b, meta, row, 16);
        b.st_v(&a, [zero, head, kblock, valid]);

        let cu = load_u32(b, p.cu_seqlens, doc);
        let ws = load_u32(b, p.ws_starts, doc);
        let edge0 = b.mad_lo(head, p.edge_capacity, edge_start);
        let mut qrow = Vec::new();
        let mut qpos = Vec::new();
        for s in 0..QUERY_CHUNK {
            let has = b.setp(Cmp::Gt, valid, s);
            let qi = load_if(b, has, |b| {
                let e = b.add(edge0, s);
                load_u32(b, p.q_indices, e)
            });
            let r = b.add(cu, qi);
            let q = b.add(ws, qi);
            qrow.push(b.selp(r, u32::MAX, has));
            qpos.push(b.selp(q, u32::MAX, has));
        }
        let qrows = b.ld_param_ptr(&qrows_p);
        let qpos_base = b.ld_param_ptr(&qpos_p);
        for (base, v) in [(qrows, &qrow), (qpos_base, &qpos)] {
            let a = common::elem_bytes(b, base, row, 32);
            b.st_v(&a, [v[0], v[1], v[2], v[3]]);
            b.st_v(&a.offset(16), [v[4], v[5], v[6], v[7]]);
        }
    });
    b.ret();
}
