//! The schedule built on the device from a device block selection (issue 10): no host copy of
//! `q2k`, no host sync from `q2k` to the gradients, and nothing allocated after
//! [`ResidentSchedule::new`], so a build and a backward can be captured in a CUDA graph.
//!
//! # Sizing from shapes alone
//!
//! The host knows `T` (from `q2k [4, T, 16]`), the document count `D` (from
//! `cu_seqlens [D+1]`) and the workspace rows `W` of the aligned K/V buffers `[W, 4, 128]` the
//! caller scattered, but not the lengths. Every capacity comes from those three:
//! - CSR rows per head: `R = min(T, floor((T + 127·D)/128), W/128)`, since
//!   `Σ ceil(len_d/128) <= Σ (len_d + 127)/128` and every block holds a token. `row_ptr` is
//!   `[4, R+1]`; rows past the real count `Σ ceil(len_d/128)` are empty (they repeat the total).
//! - `q_indices [4, 16·T]`, as on the host; entries past each head's edges are `-1`.
//! - Work items: `4·R + ceil(64·T/queries_per_work)`, since a row of `c` edges gives
//!   `ceil(c/q) < c/q + 1` items and a head has at most `16·T` edges. Rows past `work_count`
//!   are zero.
//! - Entries (one per `(head, key block, query block)` with an edge, see
//!   `codegen::kernels::schedule_build`): at most `16·T` per head, since each has an edge. The
//!   entry lists, the row buckets and the entries' 128-bit query masks take `2·16·T`,
//!   `2·16·T` and `4·16·T` words per head; the row counters and starts `4·R` words per head.
//!   Nothing is quadratic: the scratch is about 8 times `q_indices` (2 GiB at `T = 2^20`).
//! - A row's bucket holds at most one entry per query block of its document, at most
//!   `ceil(T/128) <= 8192` for `T <= MAX_TOKENS`: the bits of the bitmap that orders it.
//!
//! `W` must be at least the dense layout `Σ ceil(len_d/128)·128` (checked on the device,
//! [`ScheduleError`] naming `workspace_rows` otherwise); rows past it are padding that no key
//! block names, and their dK/dV come back zero. A caller that knows only `T` and `D` can
//! allocate [`max_workspace_rows`].
//!
//! # Validation
//!
//! The device checks what [`build_schedule`](crate::schedule::build_schedule) checks, with the
//! same precedence, and records the first fault in the order the host would find it: a
//! malformed `cu_seqlens` (first entry not 0, a decrease, last entry not `T`), then a workspace
//! too small, then the first faulty `q2k[head, row, slot]` (id below `-1`, past the document's
//! end, after the query's own block, or repeated in the list). A flagged build sets
//! `work_count = 0`, so a backward launched on it walks no task and writes zero gradients.
//! [`ResidentSchedule::status`] (blocking) or [`ResidentSchedule::read_status`] (CUDA, a
//! non-blocking `poll`/`wait`) turn the flags into [`RuntimeError::ScheduleFlagged`], whose
//! [`ScheduleError`] is the one `build_schedule` returns for the same input.

use crate::backend::{bytes_of, from_bytes, Backend, Ptr, PtrMut, Span};
use crate::contract::{BLOCK_SIZE, MAX_TOKENS, NUM_INDEX_HEADS, QUERY_CHUNK, TOPK_BLOCKS};
use crate::error::RuntimeError;
use crate::kernels::{schedule_count, schedule_order, schedule_scatter};
use crate::schedule::{Schedule, ScheduleError, SelectionFault, METADATA_COLUMNS};
use crate::tasks::ScheduleRefs;
use std::ops::Range;

mod stream;
pub use stream::StatusReadback;

/// Largest `T` the device schedule build supports: the backward's own limit
/// [`crate::MAX_TOKENS`], one document or packed.
pub const MAX_BUILD_TOKENS: usize = MAX_TOKENS;

/// Key blocks per window of `schedule_count`'s selection mask (its shared array's size):
/// a query block of the `k`-th window sees `k + 1` passes, at most 8 for `T <= MAX_TOKENS`.
pub const COUNT_WINDOW: usize = 1024;

/// Words of the status block the kernels write (mirrors `codegen::kernels::schedule_build`).
pub const STATUS_WORDS: usize = 64;
/// Status flag: `cu_seqlens` is malformed.
pub const FLAG_CU_SEQLENS: i32 = 1;
/// Status flag: the dense workspace exceeds the `W` given.
pub const FLAG_WORKSPACE: i32 = 2;
/// Status flag: a `q2k` entry breaks the selection contract.
pub const FLAG_SELECTION: i32 = 4;

// Status word indices, mirrors of the codegen constants (a test compares them).
/// Status word: the flags.
pub const ST_FLAGS: usize = 0;
/// Status word: the first malformed `cu_seqlens` index.
pub const ST_CU_FAULT: usize = 1;
/// Status word: CSR rows `Σ ceil(len_d/128)`.
pub const ST_ROWS: usize = 3;
/// Status word: the selection fault's kind (1 below -1, 2 past the end, 3 after the own
/// block, 4 repeated).
pub const ST_KIND: usize = 7;
/// Status word: the faulty value.
pub const ST_VALUE: usize = 8;
/// Status word: the fault's context (block count, own block, first slot, previous offset).
pub const ST_AUX: usize = 9;
/// Status word: head of the faulty `q2k` entry.
pub const ST_HEAD: usize = 10;
/// Status word: compact query row of the faulty entry.
pub const ST_ROW: usize = 11;
/// Status word: slot of the faulty entry.
pub const ST_SLOT: usize = 12;

/// Region starts are rounded to 256 bytes (16-byte vector access everywhere).
const REGION_ALIGN_WORDS: usize = 64;

/// `W` for the largest dense layout `T` tokens in `D` documents can need:
/// `128·min(T, floor((T + 127·D)/128))`.
pub fn max_workspace_rows(num_tokens: usize, num_documents: usize) -> usize {
    BLOCK_SIZE * num_tokens.min((num_tokens + (BLOCK_SIZE - 1) * num_documents) / BLOCK_SIZE)
}

/// Every capacity of one device schedule build, from the shapes alone (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleBuildSizes {
    /// Tokens `T`.
    pub num_tokens: usize,
    /// Documents `D`.
    pub num_documents: usize,
    /// Workspace rows `W` of the aligned K/V buffers.
    pub workspace_rows: usize,
    /// Edges per work item (a positive multiple of 8).
    pub queries_per_work: usize,
    /// CSR rows per head `R` (the `row_ptr` stride is `R + 1`).
    pub rows_capacity: usize,
    /// Edge slots per head, `16·T`.
    pub edge_capacity: usize,
    /// Rows of `scheduler_metadata`.
    pub work_capacity: usize,
    /// Key blocks per window of `schedule_count`'s shared selection mask, a power of two up to
    /// [`COUNT_WINDOW`] (the default). Smaller windows give the same tables with more passes:
    /// tests lower it to run several windows on small inputs.
    pub count_window: usize,
}

impl ScheduleBuildSizes {
    /// Sizes a build of `q2k [4, T, 16]`, `cu_seqlens [D+1]` for K/V buffers of `W` rows.
    ///
    /// # Errors
    /// [`RuntimeError::Input`] naming the argument unless `1 <= T <= MAX_BUILD_TOKENS`, `D >= 1`,
    /// `W` is a positive multiple of 128 and `queries_per_work` a positive multiple of 8, and
    /// unless every region's index fits the kernels' 32-bit arithmetic.
    pub fn new(
        num_tokens: usize,
        num_documents: usize,
        workspace_rows: usize,
        queries_per_work: usize,
    ) -> Result<Self, RuntimeError> {
        if num_tokens == 0 || num_tokens > MAX_BUILD_TOKENS {
            return Err(RuntimeError::input(
                "q2k",
                format!("T = {num_tokens} tokens"),
                format!("1 <= T <= {MAX_BUILD_TOKENS} (MAX_TOKENS, the backward's limit)"),
            ));
        }
        if num_documents == 0 {
            return Err(RuntimeError::input(
                "cu_seqlens",
                "1 entry (0 documents)",
                "at least 2 entries (documents + 1)",
            ));
        }
        if workspace_rows == 0 || !workspace_rows.is_multiple_of(BLOCK_SIZE) {
            return Err(RuntimeError::input(
                "workspace_rows",
                workspace_rows,
                "a positive multiple of 128 (the rows of k_aligned/v_aligned)",
            ));
        }
        if queries_per_work == 0 || !queries_per_work.is_multiple_of(QUERY_CHUNK) {
            return Err(RuntimeError::input(
                "queries_per_work",
                queries_per_work,
                "a positive multiple of 8 (QUERY_CHUNK)",
            ));
        }
        let (t, d) = (num_tokens, num_documents);
        let rows = t
            .min((t + (BLOCK_SIZE - 1) * d) / BLOCK_SIZE)
            .min(workspace_rows / BLOCK_SIZE);
        let edge_capacity = TOPK_BLOCKS * t;
        let heads = NUM_INDEX_HEADS;
        let work_capacity = heads * rows + (heads * edge_capacity).div_ceil(queries_per_work);
        // Indices the kernels form in u32: head·16T + edge (q_indices, entries, buckets),
        // (head·T + t)·16 + slot, 6·item. With T <= 2^20 all but the last are below 2^26.
        let limit = u32::MAX as usize;
        for (what, words) in [
            ("q_indices", heads * edge_capacity),
            ("scheduler_metadata", 6 * work_capacity),
        ] {
            if words > limit || words > i32::MAX as usize {
                return Err(RuntimeError::input(
                    "schedule build",
                    format!("{what} of {words} words for T = {t}, D = {d}"),
                    "below 2^31 words",
                ));
            }
        }
        Ok(ScheduleBuildSizes {
            num_tokens,
            num_documents,
            workspace_rows,
            queries_per_work,
            rows_capacity: rows,
            edge_capacity,
            work_capacity,
            count_window: COUNT_WINDOW,
        })
    }
}

/// Word offsets of the regions of the one allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    row_ptr: usize,
    q_indices: usize,
    metadata: usize,
    work_count: usize,
    cu: usize,
    /// `cu_seqlens − query_rows.start` for the task build of a row-restricted schedule.
    cu_rows: usize,
    ws: usize,
    status: usize,
    doc_blocks: usize,
    doc_rank0: usize,
    doc_long: usize,
    long_blocks: usize,
    block_doc: usize,
    block_of_row: usize,
    counters: usize,
    bucket_starts: usize,
    item_offsets: usize,
    block_entries: usize,
    entries: usize,
    buckets: usize,
    masks: usize,
    words: usize,
}

impl Layout {
    fn new(z: &ScheduleBuildSizes) -> Self {
        let mut at = 0;
        let mut take = |len: usize| {
            let start = at;
            at = (at + len.max(1)).next_multiple_of(REGION_ALIGN_WORDS);
            start
        };
        let (h, r, d) = (NUM_INDEX_HEADS, z.rows_capacity, z.num_documents);
        Layout {
            row_ptr: take(h * (r + 1)),
            q_indices: take(h * z.edge_capacity),
            metadata: take(METADATA_COLUMNS.len() * z.work_capacity),
            work_count: take(1),
            cu: take(d + 1),
            cu_rows: take(d + 1),
            ws: take(d),
            status: take(STATUS_WORDS),
            doc_blocks: take(d),
            doc_rank0: take(d),
            doc_long: take(d),
            long_blocks: take(d),
            block_doc: take(4 * r),
            block_of_row: take(r),
            // u64 (entries << 32 | edges) per (head, row).
            counters: take(2 * h * r),
            bucket_starts: take(h * r),
            item_offsets: take(h * r),
            block_entries: take(2 * h * r),
            entries: take(2 * h * z.edge_capacity),
            buckets: take(2 * h * z.edge_capacity),
            // 128-bit query mask per entry, at the entry's list index.
            masks: take(4 * h * z.edge_capacity),
            words: at,
        }
    }
}

/// A schedule built on, and kept on, the device: the five arrays of `docs/design.md` §2.1 plus the
/// build's scratch and status, in one allocation made by [`ResidentSchedule::new`]. Rebuild it
/// from new inputs of the same shapes with [`ResidentSchedule::build`]; pass it to
/// [`MsaBackward::run_on`](crate::MsaBackward::run_on) or
/// [`run_backward`](crate::run_backward).
pub struct ResidentSchedule<B: Backend> {
    sizes: ScheduleBuildSizes,
    query_rows: Range<usize>,
    layout: Layout,
    base: u64,
    memory_space: u64,
    // Never read: it owns the memory `base` points into.
    #[allow(dead_code)]
    storage: B::Buffer,
}

impl<B: Backend> std::fmt::Debug for ResidentSchedule<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentSchedule")
            .field("sizes", &self.sizes)
            .field("query_rows", &self.query_rows)
            .field("base", &format_args!("{:#x}", self.base))
            .finish()
    }
}

/// The schedule's tables copied back to the host by [`ResidentSchedule::read_tables`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResidentTables {
    /// `row_ptr [4, R+1]` as stored (rows past the real count repeat each head's total).
    pub row_ptr: Vec<i32>,
    /// `q_indices [4, 16·T]`.
    pub q_indices: Vec<i32>,
    /// `scheduler_metadata [work_capacity, 6]`.
    pub scheduler_metadata: Vec<i32>,
    /// `work_count`.
    pub work_count: i32,
    /// `cu_seqlens [D+1]` (the build's copy).
    pub cu_seqlens: Vec<i32>,
    /// `document_workspace_starts [D]`.
    pub document_workspace_starts: Vec<i32>,
    /// CSR rows the lengths give, `Σ ceil(len_d/128)`.
    pub rows: usize,
}

impl ResidentTables {
    /// The tables as a validated host [`Schedule`]: `row_ptr` trimmed to the real rows,
    /// `scheduler_metadata` to `max(1, work_count)` rows, and `W` the dense layout. For an
    /// unflagged build this equals what [`build_schedule`](crate::build_schedule) returns.
    pub fn to_schedule(&self) -> Result<Schedule, ScheduleError> {
        let stride = self.row_ptr.len() / NUM_INDEX_HEADS;
        let rows = self.rows.min(stride.saturating_sub(1));
        let row_ptr = self
            .row_ptr
            .chunks_exact(stride.max(1))
            .flat_map(|h| h[..=rows].iter().copied())
            .collect();
        let cols = METADATA_COLUMNS.len();
        let items = (self.work_count.max(1) as usize).min(self.scheduler_metadata.len() / cols);
        Schedule::new(
            row_ptr,
            self.q_indices.clone(),
            self.scheduler_metadata[..items * cols].to_vec(),
            self.work_count,
            self.cu_seqlens.clone(),
            self.document_workspace_starts.clone(),
        )
    }
}

impl<B: Backend> ResidentSchedule<B> {
    /// Allocates the schedule and its scratch for `sizes` (the only allocation: everything
    /// after it is stream-ordered kernel work, so it is the `reserve` step before a capture).
    pub fn new(backend: &mut B, sizes: ScheduleBuildSizes) -> Result<Self, RuntimeError> {
        Self::allocate(backend, sizes, 0..sizes.num_tokens)
    }

    /// [`ResidentSchedule::new`] for the queries of the compact rows `rows` only, against
    /// every document's key blocks: a context-parallel rank's schedule (`crate::cp`), the
    /// device counterpart of [`build_schedule_for_rows`](crate::schedule::build_schedule_for_rows).
    /// Its builds read `q2k [4, rows.len(), 16]` (row `i` is compact row `rows.start + i`);
    /// the tables are those of the whole `cu_seqlens` with edges from `rows` only, and the
    /// backward's query-side buffers hold `rows`. `cu_seqlens` (on the host: the documents
    /// the builds will be given) fixes the row offset the task build applies.
    ///
    /// # Errors
    /// [`RuntimeError::Input`] when `rows` is empty or not inside `0..T`, or `cu_seqlens` does
    /// not hold `D + 1` values ending at `T`.
    pub fn new_for_rows(
        backend: &mut B,
        sizes: ScheduleBuildSizes,
        rows: Range<usize>,
        cu_seqlens: &[i32],
    ) -> Result<Self, RuntimeError> {
        let t = sizes.num_tokens;
        if rows.is_empty() || rows.end > t {
            return Err(RuntimeError::input(
                "rows",
                format!("{rows:?}"),
                format!("a non-empty range inside 0..{t} (T)"),
            ));
        }
        if cu_seqlens.len() != sizes.num_documents + 1 || cu_seqlens.last() != Some(&(t as i32)) {
            return Err(RuntimeError::input(
                "cu_seqlens",
                format!(
                    "{} values ending at {:?}",
                    cu_seqlens.len(),
                    cu_seqlens.last()
                ),
                format!(
                    "D + 1 = {} values ending at T = {t}",
                    sizes.num_documents + 1
                ),
            ));
        }
        let s = Self::allocate(backend, sizes, rows.clone())?;
        // The task build computes a task's row as cu_seqlens[doc] + q and uses cu_seqlens
        // otherwise only in differences, so it gets cu_seqlens − rows.start (wrapping as its
        // 32-bit adds do) for query-side buffers whose row 0 is compact row rows.start.
        let shifted: Vec<i32> = cu_seqlens
            .iter()
            .map(|&c| c.wrapping_sub(rows.start as i32))
            .collect();
        backend.upload(
            "device schedule rows",
            s.at(s.layout.cu_rows),
            bytes_of(&shifted),
        )?;
        Ok(s)
    }

    fn allocate(
        backend: &mut B,
        sizes: ScheduleBuildSizes,
        query_rows: Range<usize>,
    ) -> Result<Self, RuntimeError> {
        let layout = Layout::new(&sizes);
        let storage = backend.alloc("device schedule", 4 * layout.words)?;
        let base = backend.address(&storage);
        // The build's grid-wide handoff word (ST_READY) must start at 0; every build leaves
        // it at 0 again.
        backend.zero(
            "device schedule status",
            base + 4 * layout.status as u64,
            4 * STATUS_WORDS,
        )?;
        Ok(ResidentSchedule {
            sizes,
            query_rows,
            layout,
            base,
            memory_space: backend.memory_space(),
            storage,
        })
    }

    /// The sizes it was allocated for.
    pub fn sizes(&self) -> &ScheduleBuildSizes {
        &self.sizes
    }

    /// The compact rows whose queries it schedules (`0..T` unless made by
    /// [`ResidentSchedule::new_for_rows`]); the backward's query-side buffers hold them.
    pub fn query_rows(&self) -> Range<usize> {
        self.query_rows.clone()
    }

    /// The build's copy of `cu_seqlens [D+1]` on the device (the documents' compact
    /// boundaries, whatever the query rows).
    pub fn cu_seqlens_ptr(&self) -> Ptr<i32> {
        self.r(self.layout.cu)
    }

    /// The memory space (CUDA context or simulated device) it lives in.
    pub fn memory_space(&self) -> u64 {
        self.memory_space
    }

    fn at(&self, words: usize) -> u64 {
        self.base + 4 * words as u64
    }

    fn r(&self, words: usize) -> Ptr<i32> {
        Ptr::new(self.at(words))
    }

    fn w(&self, words: usize) -> PtrMut<i32> {
        PtrMut::new(self.at(words))
    }

    /// The status block `int32[64]` ([`STATUS_WORDS`]) on the device (word 0: the flags).
    pub fn status_ptr(&self) -> Ptr<i32> {
        self.r(self.layout.status)
    }

    /// The arrays and shape the task build reads: `rows` is the capacity `R` (its trailing
    /// rows are empty), the edge and work capacities those of [`ScheduleBuildSizes`];
    /// `cu_seqlens` is shifted by the first query row (see
    /// [`ResidentSchedule::new_for_rows`]).
    pub fn refs(&self) -> ScheduleRefs {
        let l = &self.layout;
        let cu = if self.query_rows.start == 0 {
            l.cu
        } else {
            l.cu_rows
        };
        ScheduleRefs {
            row_ptr: self.at(l.row_ptr),
            q_indices: self.at(l.q_indices),
            metadata: self.at(l.metadata),
            work_count: self.at(l.work_count),
            cu_seqlens: self.at(cu),
            ws_starts: self.at(l.ws),
            rows: self.sizes.rows_capacity,
            edge_capacity: self.sizes.edge_capacity,
            work_capacity: self.sizes.work_capacity,
            num_docs: self.sizes.num_documents,
        }
    }

    /// The kernels of the build, for loading ahead of a capture.
    pub fn kernels() -> [&'static crate::KernelSpec; 3] {
        [
            &schedule_count::KERNEL,
            &schedule_scatter::KERNEL,
            &schedule_order::KERNEL,
        ]
    }

    /// Issues the three build launches from device `q2k [4, T, 16]` (`[4, rows, 16]`, the
    /// [`ResidentSchedule::query_rows`], for a row-restricted schedule) and `cu_seqlens [D+1]`
    /// (int32). No host sync, no allocation, no copy: capturable. The inputs are read only
    /// by these launches (`cu_seqlens` is copied), so they may be reused once they finish.
    ///
    /// # Errors
    /// [`RuntimeError::Input`] for a length that does not match the sizes, a `q2k` base not
    /// 16-byte aligned, a `cu_seqlens` base not 4-byte aligned or a buffer of another memory
    /// space; load and launch errors from the backend. Faults in the inputs' *values* are
    /// not errors here: they are flagged on the device (see [`ResidentSchedule::status`]).
    pub fn build(
        &mut self,
        backend: &mut B,
        q2k: Span<i32>,
        cu_seqlens: Span<i32>,
    ) -> Result<(), RuntimeError> {
        let z = self.sizes;
        if backend.memory_space() != self.memory_space {
            return Err(RuntimeError::input(
                "backend",
                "another memory space",
                "the one the schedule was allocated in",
            ));
        }
        let rows = self.query_rows.clone();
        let q2k_len = NUM_INDEX_HEADS * rows.len() * TOPK_BLOCKS;
        if q2k.len != q2k_len {
            let expected = if rows.len() == z.num_tokens {
                format!("[4, T, 16] = {q2k_len} int32 (T = {})", z.num_tokens)
            } else {
                format!("[4, rows, 16] = {q2k_len} int32 (query rows {rows:?})")
            };
            return Err(RuntimeError::input(
                "q2k",
                format!("{} elements", q2k.len),
                expected,
            ));
        }
        if cu_seqlens.len != z.num_documents + 1 {
            return Err(RuntimeError::input(
                "cu_seqlens",
                format!("{} elements", cu_seqlens.len),
                format!("D + 1 = {} int32", z.num_documents + 1),
            ));
        }
        if !q2k.addr.is_multiple_of(16) || q2k.addr == 0 {
            return Err(RuntimeError::input(
                "q2k",
                format!("base address {:#x}", q2k.addr),
                "a 16-byte aligned device address",
            ));
        }
        if !cu_seqlens.addr.is_multiple_of(4) || cu_seqlens.addr == 0 {
            return Err(RuntimeError::input(
                "cu_seqlens",
                format!("base address {:#x}", cu_seqlens.addr),
                "a 4-byte aligned device address",
            ));
        }
        if !z.count_window.is_power_of_two() || z.count_window > COUNT_WINDOW {
            return Err(RuntimeError::input(
                "count_window",
                z.count_window,
                format!("a power of two <= {COUNT_WINDOW} (the selection mask's blocks)"),
            ));
        }
        for k in Self::kernels() {
            backend.load(k)?;
        }
        // Every value below fits u32: ScheduleBuildSizes::new bounded them.
        let u = |v: usize| v as u32;
        let l = self.layout;
        let rows_cap = u(z.rows_capacity);
        let block_grid = (rows_cap.max(1), NUM_INDEX_HEADS as u32, 1);
        let tokens = u(z.num_tokens);
        let launches = [
            (
                &schedule_count::KERNEL,
                block_grid,
                schedule_count::args(
                    cu_seqlens.ptr(),
                    self.w(l.cu),
                    self.w(l.ws),
                    self.w(l.status),
                    self.w(l.doc_blocks),
                    self.w(l.doc_rank0),
                    self.w(l.doc_long),
                    self.w(l.long_blocks),
                    self.w(l.block_doc),
                    self.w(l.block_of_row),
                    self.w(l.counters),
                    u(z.num_documents),
                    tokens,
                    u(z.workspace_rows / BLOCK_SIZE),
                    u(NUM_INDEX_HEADS * z.rows_capacity),
                    q2k.ptr(),
                    self.w(l.entries),
                    self.w(l.block_entries),
                    self.w(l.masks),
                    self.w(l.row_ptr),
                    self.w(l.bucket_starts),
                    self.w(l.item_offsets),
                    self.w(l.work_count),
                    rows_cap,
                    u(z.queries_per_work),
                    z.count_window.trailing_zeros(),
                    u(rows.start),
                    u(rows.len()),
                ),
            ),
            (
                &schedule_scatter::KERNEL,
                block_grid,
                schedule_scatter::args(
                    self.r(l.status),
                    self.r(l.block_doc),
                    self.r(l.block_of_row),
                    self.r(l.entries),
                    self.r(l.block_entries),
                    self.r(l.bucket_starts),
                    self.w(l.buckets),
                    self.r(l.row_ptr),
                    self.r(l.item_offsets),
                    self.w(l.q_indices),
                    self.w(l.metadata),
                    tokens,
                    rows_cap,
                    u(z.work_capacity),
                    u(z.queries_per_work),
                ),
            ),
            (
                &schedule_order::KERNEL,
                block_grid,
                schedule_order::args(
                    self.r(l.status),
                    self.r(l.counters),
                    self.r(l.bucket_starts),
                    self.r(l.buckets),
                    self.r(l.row_ptr),
                    self.r(l.block_of_row),
                    self.r(l.masks),
                    self.w(l.q_indices),
                    tokens,
                    rows_cap,
                ),
            ),
        ];
        for (kernel, grid, args) in &launches {
            // SAFETY: every region was carved by `Layout::new` from the sizes the scalars
            // come from; q2k and cu_seqlens were checked to hold [4, T, 16] and D+1 int32.
            unsafe { backend.launch(kernel, *grid, args) }?;
        }
        Ok(())
    }

    /// Waits for the build and returns its verdict: `Ok` for a valid input, else
    /// [`RuntimeError::ScheduleFlagged`] naming the first fault. Synchronizes.
    pub fn status(&self, backend: &mut B) -> Result<(), RuntimeError> {
        let bytes = backend.download(
            "schedule status",
            self.at(self.layout.status),
            4 * STATUS_WORDS,
        )?;
        let words: Vec<i32> = from_bytes(&bytes);
        decode_status(&words, &self.sizes)
    }

    /// Copies the tables back (for tests and inspection). Synchronizes.
    pub fn read_tables(&self, backend: &mut B) -> Result<ResidentTables, RuntimeError> {
        let l = self.layout;
        let z = self.sizes;
        let mut read = |what: &'static str, words: usize, len: usize| {
            backend
                .download(what, self.at(words), 4 * len)
                .map(|b| from_bytes::<i32>(&b))
        };
        let status = read("schedule status", l.status, STATUS_WORDS)?;
        Ok(ResidentTables {
            row_ptr: read(
                "row_ptr",
                l.row_ptr,
                NUM_INDEX_HEADS * (z.rows_capacity + 1),
            )?,
            q_indices: read("q_indices", l.q_indices, NUM_INDEX_HEADS * z.edge_capacity)?,
            scheduler_metadata: read(
                "scheduler_metadata",
                l.metadata,
                METADATA_COLUMNS.len() * z.work_capacity,
            )?,
            work_count: read("work_count", l.work_count, 1)?[0],
            cu_seqlens: read("cu_seqlens", l.cu, z.num_documents + 1)?,
            document_workspace_starts: read("document_workspace_starts", l.ws, z.num_documents)?,
            rows: status[ST_ROWS].max(0) as usize,
        })
    }
}

/// The verdict of a status block (see [`ResidentSchedule::status`]).
fn decode_status(s: &[i32], z: &ScheduleBuildSizes) -> Result<(), RuntimeError> {
    let flags = s[ST_FLAGS];
    let fault = if flags & FLAG_CU_SEQLENS != 0 {
        let (i, found, prev) = (s[ST_CU_FAULT] as usize, s[ST_VALUE], s[ST_AUX]);
        let field = format!("cu_seqlens[{i}]");
        if i == 0 {
            ScheduleError::Invalid {
                field,
                found: found.to_string(),
                expected: "0".into(),
            }
        } else if found < prev {
            ScheduleError::Invalid {
                field,
                found: found.to_string(),
                expected: format!(">= cu_seqlens[{}] = {prev} (non-decreasing)", i - 1),
            }
        } else {
            ScheduleError::Invalid {
                field,
                found: found.to_string(),
                expected: format!("T = {}, the tokens of q2k [4, T, 16]", z.num_tokens),
            }
        }
    } else if flags & FLAG_WORKSPACE != 0 {
        ScheduleError::Invalid {
            field: "workspace_rows".into(),
            found: z.workspace_rows.to_string(),
            expected: format!(
                ">= Σ ceil(len_d/128)·128 = {} (the aligned layout of cu_seqlens)",
                BLOCK_SIZE * s[ST_ROWS].max(0) as usize
            ),
        }
    } else if flags & FLAG_SELECTION != 0 {
        let aux = s[ST_AUX].max(0) as usize;
        let fault = match s[ST_KIND] {
            1 => SelectionFault::BelowPadding,
            2 => SelectionFault::PastDocumentEnd { num_blocks: aux },
            3 => SelectionFault::AfterOwnBlock { own_block: aux },
            _ => SelectionFault::Repeated { first_slot: aux },
        };
        ScheduleError::Selection {
            head: s[ST_HEAD].max(0) as usize,
            row: s[ST_ROW].max(0) as usize,
            slot: s[ST_SLOT].max(0) as usize,
            block: s[ST_VALUE],
            fault,
        }
    } else {
        return Ok(());
    };
    Err(RuntimeError::ScheduleFlagged(fault))
}
