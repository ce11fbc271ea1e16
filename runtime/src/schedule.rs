//! `Schedule`: the forward-derived metadata the backward reads (`docs/design.md` §2.1), and a CPU
//! builder of it from a block selection `q2k` (`docs/design.md` §1.3, §2.1).
//!
//! The schedule is validated once, when it is built, so everything downstream (the task build,
//! the kernels) can take it as given: every edge a valid work item covers names a query inside
//! its document, at or after the selected block, and no edge is covered twice.

use std::fmt;
use std::ops::Range;

use crate::contract::{BLOCK_SIZE, MAX_TOKENS, NUM_INDEX_HEADS, QUERY_CHUNK, TOPK_BLOCKS};

/// Columns of one `scheduler_metadata` row, in order (see [`WorkItem`]).
pub const METADATA_COLUMNS: [&str; 6] = [
    "index_head",
    "row_linear",
    "q_begin",
    "q_count",
    "document_ordinal",
    "document_local_kblock",
];

/// Why a `q2k` entry breaks the selection contract (`docs/design.md` §1.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SelectionFault {
    /// The id is below `-1`; `-1` is the only negative id (padding).
    BelowPadding,
    /// The id is at or past the document's block count.
    PastDocumentEnd {
        /// Blocks of the query's document, `ceil(len/128)`.
        num_blocks: usize,
    },
    /// The id is after the query's own block; selection is causal.
    AfterOwnBlock {
        /// The query's own document-local block, `(t − doc_start)/128`.
        own_block: usize,
    },
    /// The id already appears earlier in the same query's 16-entry list.
    Repeated {
        /// The slot holding the first occurrence.
        first_slot: usize,
    },
}

impl fmt::Display for SelectionFault {
    /// Writes what the contract expects instead of the faulty id.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SelectionFault::BelowPadding => write!(f, "a block id >= 0, or -1 for padding"),
            SelectionFault::PastDocumentEnd { num_blocks } => {
                write!(f, "a block id < {num_blocks} (the document's block count)")
            }
            SelectionFault::AfterOwnBlock { own_block } => {
                write!(f, "a block id <= {own_block} (the query's own block)")
            }
            SelectionFault::Repeated { first_slot } => {
                write!(f, "a block not already selected at slot {first_slot}")
            }
        }
    }
}

/// Why a schedule, or an input it is built from, was rejected.
///
/// Every variant names the offending field (with its index), the value found and what was
/// expected; [`ScheduleError::field`] returns the field name alone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// A field does not satisfy the contract.
    #[error("schedule field `{field}`: found {found}, expected {expected}")]
    Invalid {
        /// The field (with an index where it helps, e.g. `cu_seqlens[3]`).
        field: String,
        /// The value found.
        found: String,
        /// What the contract requires.
        expected: String,
    },
    /// An entry `q2k[head, row, slot]` of a block selection breaks the selection contract.
    #[error(
        "schedule field `q2k[{head},{row},{slot}]` (index head {head}, compact query row {row}): \
         found block {block}, expected {fault}"
    )]
    Selection {
        /// Index head of the entry.
        head: usize,
        /// Compact query row `t` of the entry.
        row: usize,
        /// Position in the query's 16-entry list.
        slot: usize,
        /// The block id found.
        block: i32,
        /// What is wrong with it; its `Display` is the expectation.
        fault: SelectionFault,
    },
    /// The schedule is valid but larger than the backward supports; see [`check_capacity`].
    #[error(
        "schedule too large: {quantity} = {found}, the backward supports at most {limit} ({why})"
    )]
    Capacity {
        /// The bounded quantity, as a formula of the schedule's shape.
        quantity: &'static str,
        /// Its value, with the shape it was computed from.
        found: String,
        /// The largest value supported.
        limit: u64,
        /// Where the limit comes from.
        why: &'static str,
    },
    /// A host allocation of the requested size failed (the process would otherwise abort).
    #[error("cannot allocate {bytes} bytes of host memory for `{what}`")]
    OutOfMemory {
        /// What the memory was for.
        what: &'static str,
        /// Bytes asked for.
        bytes: usize,
    },
}

impl ScheduleError {
    pub(crate) fn invalid(
        field: impl Into<String>,
        found: impl ToString,
        expected: impl Into<String>,
    ) -> Self {
        ScheduleError::Invalid {
            field: field.into(),
            found: found.to_string(),
            expected: expected.into(),
        }
    }

    /// The offending field, e.g. `row_ptr[2,5]` or `q2k[1,300,4]`.
    pub fn field(&self) -> String {
        match self {
            ScheduleError::Invalid { field, .. } => field.clone(),
            ScheduleError::Selection {
                head, row, slot, ..
            } => format!("q2k[{head},{row},{slot}]"),
            ScheduleError::Capacity { quantity, .. } => (*quantity).to_string(),
            ScheduleError::OutOfMemory { what, .. } => (*what).to_string(),
        }
    }
}

/// The capacity limits of the backward for a schedule of `num_tokens` tokens `T`,
/// `workspace_rows` rows `W`, `edge_capacity` CSR slots per head and `work_capacity` metadata
/// rows. [`Schedule::new`] (hence [`build_schedule`]) applies them, so a schedule that exists
/// can also be run; call this (or [`check_capacity`]) to learn the answer before building
/// or allocating anything.
///
/// The limits, each a [`ScheduleError::Capacity`] that names the quantity and its value:
/// - `T <= MAX_TOKENS = 2^20`: the main kernels index the dQ pool `[T, 32, 128]` in 32-bit
///   words. It does not depend on how the tokens are split into documents.
/// - `4·edge_capacity <= 2^32 − 1` (the task build indexes the CSR payload in 32 bits).
/// - task capacity `4·edge_capacity/8 + work_capacity`: four times it `<= 2^32 − 1` (the task
///   build addresses 4 words per task in 32 bits).
///
/// With `T <= 2^20` the task build's locality bins (linear in `T`, see
/// [`crate::contract::Locality`]) stay far below their own 2^31 bound, and `W <= i32::MAX`
/// is already part of the schedule's validation.
pub fn check_shape_capacity(
    num_tokens: usize,
    workspace_rows: usize,
    edge_capacity: usize,
    work_capacity: usize,
) -> Result<(), ScheduleError> {
    if num_tokens > MAX_TOKENS {
        return Err(ScheduleError::Capacity {
            quantity: "tokens T",
            found: format!("{num_tokens} (W = {workspace_rows})"),
            limit: MAX_TOKENS as u64,
            why: "MAX_TOKENS, the main kernels' 32-bit word index into the dQ pool; split the call",
        });
    }
    let u32_max = u64::from(u32::MAX);
    let edges = (NUM_INDEX_HEADS as u64).saturating_mul(edge_capacity as u64);
    if edges > u32_max {
        return Err(ScheduleError::Capacity {
            quantity: "4·edge_capacity",
            found: format!("{edges} (edge_capacity = {edge_capacity})"),
            limit: u32_max,
            why: "the task build indexes the CSR payload with 32-bit offsets",
        });
    }
    let tasks = (edges / QUERY_CHUNK as u64).saturating_add(work_capacity as u64);
    let limit = u32_max / 4;
    if tasks > limit {
        return Err(ScheduleError::Capacity {
            quantity: "task capacity 4·edge_capacity/8 + work_capacity",
            found: format!(
                "{tasks} (edge_capacity = {edge_capacity}, work_capacity = {work_capacity})"
            ),
            limit,
            why: "the task build addresses 4 words per task with 32-bit offsets",
        });
    }
    Ok(())
}

/// [`check_shape_capacity`] for the schedule [`build_schedule`] makes over `cu_seqlens`
/// (`edge_capacity = 16·T`, and the most work items any `queries_per_work` can give,
/// `8·T + 4·rows`), without building anything: call it before allocating the inputs.
///
/// # Errors
/// [`ScheduleError::Invalid`] for a `cu_seqlens` [`workspace_layout`] rejects or without
/// tokens, [`ScheduleError::Capacity`] past a limit.
pub fn check_capacity(cu_seqlens: &[i32]) -> Result<(), ScheduleError> {
    let rows = total_rows(cu_seqlens)?;
    // Validated by total_rows: starts at 0, non-decreasing.
    let t = cu_seqlens[cu_seqlens.len() - 1] as usize;
    let edge_capacity = t.saturating_mul(TOPK_BLOCKS);
    let work = t
        .saturating_mul(NUM_INDEX_HEADS * TOPK_BLOCKS / QUERY_CHUNK)
        .saturating_add(NUM_INDEX_HEADS * rows);
    check_shape_capacity(t, rows * BLOCK_SIZE, edge_capacity, work)
}

/// The aligned workspace layout of packed documents (`docs/design.md` §1.5).
///
/// Returns `document_workspace_starts` (document `d` starts at `Σ_{e<d} ceil(len_e/128)·128`)
/// and the workspace size `W = Σ ceil(len/128)·128`. `cu_seqlens` must start at 0, be
/// non-decreasing and hold at least two entries; `W` must fit in i32 (workspace positions are
/// int32 on the device).
pub fn workspace_layout(cu_seqlens: &[i32]) -> Result<(Vec<i32>, usize), ScheduleError> {
    if cu_seqlens.len() < 2 {
        return Err(ScheduleError::invalid(
            "cu_seqlens.len()",
            cu_seqlens.len(),
            "at least 2 (documents + 1)",
        ));
    }
    if cu_seqlens[0] != 0 {
        return Err(ScheduleError::invalid("cu_seqlens[0]", cu_seqlens[0], "0"));
    }
    let mut starts = Vec::with_capacity(cu_seqlens.len() - 1);
    let mut w: usize = 0;
    for d in 0..cu_seqlens.len() - 1 {
        let len = i64::from(cu_seqlens[d + 1]) - i64::from(cu_seqlens[d]);
        if len < 0 {
            return Err(ScheduleError::invalid(
                format!("cu_seqlens[{}]", d + 1),
                cu_seqlens[d + 1],
                format!(">= cu_seqlens[{d}] = {} (non-decreasing)", cu_seqlens[d]),
            ));
        }
        starts.push(
            i32::try_from(w)
                .map_err(|_| ScheduleError::invalid("workspace rows", w, "at most i32::MAX"))?,
        );
        w += (len as usize).div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
    }
    if i32::try_from(w).is_err() {
        return Err(ScheduleError::invalid(
            "workspace rows",
            w,
            "at most i32::MAX",
        ));
    }
    Ok((starts, w))
}

/// Whether `n` is `k·unit` for some `k >= 1` (`unit >= 1`).
fn positive_multiple(n: usize, unit: usize) -> bool {
    n >= unit && n / unit * unit == n
}

/// Validates `cu_seqlens` and returns the CSR row count `Σ ceil(len_d/128)`, at least 1.
fn total_rows(cu_seqlens: &[i32]) -> Result<usize, ScheduleError> {
    let (_, w) = workspace_layout(cu_seqlens)?;
    if w == 0 {
        let last = cu_seqlens.len() - 1;
        return Err(ScheduleError::invalid(
            format!("cu_seqlens[{last}]"),
            cu_seqlens[last],
            "at least 1 token in total (a schedule has rows >= 1)",
        ));
    }
    Ok(w / BLOCK_SIZE)
}

/// Document geometry and the official CSR row numbering derived from `cu_seqlens`.
struct Documents {
    /// Compact start of each document.
    starts: Vec<usize>,
    /// Tokens of each document.
    lens: Vec<usize>,
    /// Blocks of each document, `ceil(len/128)`.
    blocks: Vec<usize>,
    /// Flat index of each document's block 0 (prefix sum of `blocks`).
    first_block: Vec<usize>,
    /// CSR row of each flat document block.
    row_of_block: Vec<usize>,
    /// `(document, document-local block)` of each CSR row.
    block_of_row: Vec<(usize, usize)>,
    /// Total tokens `T`.
    num_tokens: usize,
}

impl Documents {
    /// Validates `cu_seqlens` (see [`total_rows`]) and numbers the CSR rows.
    ///
    /// Rows are level-major and round-robin across documents: block 0 of every document that
    /// has one, then block 1, and so on (`docs/design.md` §2.1). Callers first check the sizes of
    /// their other inputs against [`total_rows`], so these tables never outgrow the input.
    fn new(cu_seqlens: &[i32]) -> Result<Self, ScheduleError> {
        total_rows(cu_seqlens)?;
        // workspace_layout checked non-negative, non-decreasing offsets.
        let offsets: Vec<usize> = cu_seqlens.iter().map(|&c| c as usize).collect();
        let starts = offsets[..offsets.len() - 1].to_vec();
        let lens: Vec<usize> = offsets.windows(2).map(|w| w[1] - w[0]).collect();
        let blocks: Vec<usize> = lens.iter().map(|l| l.div_ceil(BLOCK_SIZE)).collect();
        let mut first_block = Vec::with_capacity(blocks.len());
        let mut total = 0;
        for &b in &blocks {
            first_block.push(total);
            total += b;
        }
        let mut row_of_block = vec![0; total];
        let mut block_of_row = Vec::with_capacity(total);
        // Each level visits only the documents still long enough: O(rows) overall.
        let mut active: Vec<usize> = (0..blocks.len()).filter(|&d| blocks[d] > 0).collect();
        let mut level = 0;
        while !active.is_empty() {
            for &d in &active {
                row_of_block[first_block[d] + level] = block_of_row.len();
                block_of_row.push((d, level));
            }
            level += 1;
            active.retain(|&d| blocks[d] > level);
        }
        let num_tokens = offsets[offsets.len() - 1];
        Ok(Documents {
            starts,
            lens,
            blocks,
            first_block,
            row_of_block,
            block_of_row,
            num_tokens,
        })
    }

    fn count(&self) -> usize {
        self.lens.len()
    }

    fn rows(&self) -> usize {
        self.block_of_row.len()
    }
}

/// One valid forward work item: `q_count` consecutive edges of one (index head, CSR row),
/// i.e. `q_count` queries that all selected block `document_local_kblock` of document
/// `document_ordinal` (`docs/design.md` §2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WorkItem {
    /// Index head (= kv head), in `[0, 4)`.
    pub index_head: usize,
    /// CSR row, in `[0, rows)`.
    pub row_linear: usize,
    /// First edge, relative to the row's start `row_ptr[index_head, row_linear]`.
    pub q_begin: usize,
    /// Number of edges, at least 1.
    pub q_count: usize,
    /// Document of the key block.
    pub document_ordinal: usize,
    /// Document-local key block.
    pub document_local_kblock: usize,
}

/// Forward-derived int32 metadata the backward task build reads (`MSABackwardSchedule`).
///
/// All arrays are row-major int32:
/// - `row_ptr [4, rows+1]`: CSR offsets of the key-block → query map, one row set per index head;
///   rows are numbered level-major, round-robin across documents, `rows = Σ ceil(len_d/128)`.
/// - `q_indices [4, edge_capacity]`: document-local query positions (the CSR payload).
/// - `scheduler_metadata [work_capacity, 6]`: work items, columns [`METADATA_COLUMNS`]; only the
///   first [`Schedule::num_work`] rows are valid.
/// - `work_count`: number of valid work items as stored; it is *not* rejected outside
///   `[0, work_capacity]` because the device task build clamps it (see [`Schedule::num_work`]).
/// - `cu_seqlens [docs+1]`: compact document offsets.
/// - `document_workspace_starts [docs]`: 128-aligned, non-overlapping workspace row of each
///   document.
///
/// [`Schedule::new`] checks beyond shapes: `row_ptr` is non-negative, non-decreasing and ends
/// within `edge_capacity`; every CSR edge names a query of the row's document at or after the row's
/// block, ascending strictly within the row; every valid work item lies inside its row, names the
/// row's document and block, and covers edges disjoint from every other valid item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    row_ptr: Vec<i32>,
    q_indices: Vec<i32>,
    scheduler_metadata: Vec<i32>,
    work_count: i32,
    cu_seqlens: Vec<i32>,
    document_workspace_starts: Vec<i32>,
    num_tokens: usize,
    workspace_rows: usize,
    /// The compact query rows whose edges the schedule holds, `0..T` unless restricted
    /// ([`Schedule::restrict_queries`]).
    query_rows: Range<usize>,
}

impl Schedule {
    /// Validates the six fields and builds a schedule; shapes are inferred from the lengths.
    ///
    /// Requirements, each failure an error naming the field, value and expectation:
    /// - `cu_seqlens`: at least 2 entries, starts at 0, non-decreasing, at least 1 token in total.
    /// - `document_workspace_starts`: one entry per document, `[0] >= 0`, each a multiple of 128,
    ///   `start[d+1] >= start[d] + ceil(len_d/128)·128` (gaps are allowed, overlaps are not).
    ///   The workspace size is `W = start[last] + ceil(len_last/128)·128 <= i32::MAX`.
    /// - `row_ptr`: length `4·(rows+1)` with `rows = Σ ceil(len_d/128)` (= `W/128` without
    ///   gaps); per head `row_ptr[h,0] >= 0`, non-decreasing, `row_ptr[h,rows] <= edge_capacity`.
    /// - `q_indices`: length `4·edge_capacity`, `edge_capacity >= 1`; the edges of the row of
    ///   document `d`, block `k` lie in `[128·k, len_d)` and ascend strictly.
    /// - `scheduler_metadata`: length `6·work_capacity`, `work_capacity >= 1`. Only the first
    ///   `num_work()` rows are checked: `index_head < 4`, `row_linear < rows`,
    ///   `document_ordinal < docs`, `document_local_kblock < ceil(len_doc/128)`, `row_linear` is the
    ///   CSR row of that document block, `q_begin >= 0`, `q_count >= 1`,
    ///   `q_begin + q_count <= ` the row's edge count, and no two items share an edge.
    /// - `work_count`: any value; it is clamped by [`Schedule::num_work`] as on the device.
    pub fn new(
        row_ptr: Vec<i32>,
        q_indices: Vec<i32>,
        scheduler_metadata: Vec<i32>,
        work_count: i32,
        cu_seqlens: Vec<i32>,
        document_workspace_starts: Vec<i32>,
    ) -> Result<Schedule, ScheduleError> {
        let rows = total_rows(&cu_seqlens)?;
        let heads = NUM_INDEX_HEADS;

        if row_ptr.len() != heads * (rows + 1) {
            return Err(ScheduleError::invalid(
                "row_ptr.len()",
                row_ptr.len(),
                format!(
                    "4·(rows+1) = {} with rows = Σ ceil(len_d/128) = {rows}",
                    heads * (rows + 1)
                ),
            ));
        }
        if !positive_multiple(q_indices.len(), heads) {
            return Err(ScheduleError::invalid(
                "q_indices.len()",
                q_indices.len(),
                "4·edge_capacity with edge_capacity >= 1",
            ));
        }
        let cols = METADATA_COLUMNS.len();
        if !positive_multiple(scheduler_metadata.len(), cols) {
            return Err(ScheduleError::invalid(
                "scheduler_metadata.len()",
                scheduler_metadata.len(),
                "6·work_capacity with work_capacity >= 1",
            ));
        }
        let edge_capacity = q_indices.len() / heads;

        let docs = Documents::new(&cu_seqlens)?;
        let workspace_rows = check_workspace_starts(&docs, &document_workspace_starts)?;
        check_row_ptr(&row_ptr, rows, edge_capacity)?;
        check_edges(&docs, &row_ptr, &q_indices, edge_capacity)?;

        check_shape_capacity(
            docs.num_tokens,
            workspace_rows,
            edge_capacity,
            scheduler_metadata.len() / cols,
        )?;
        let schedule = Schedule {
            row_ptr,
            q_indices,
            scheduler_metadata,
            work_count,
            cu_seqlens,
            document_workspace_starts,
            num_tokens: docs.num_tokens,
            workspace_rows,
            query_rows: 0..docs.num_tokens,
        };
        schedule.check_work_items(&docs)?;
        Ok(schedule)
    }

    /// The same schedule, declared to hold edges of the compact query rows `rows` only: the
    /// backward then takes query-side buffers (q, dO, O, LSE, dQ) of `rows.len()` tokens, whose
    /// token 0 is compact row `rows.start`, against the K/V of every document. This is the
    /// local schedule of a context-parallel rank (`crate::cp`); [`build_schedule_for_rows`]
    /// builds one directly.
    ///
    /// # Errors
    /// [`ScheduleError::Invalid`] when `rows` is not inside `0..T`, or when some edge of a
    /// CSR row names a query outside `rows` (field `q_indices[head, edge]`).
    pub fn restrict_queries(mut self, rows: Range<usize>) -> Result<Schedule, ScheduleError> {
        if rows.start > rows.end || rows.end > self.num_tokens {
            return Err(ScheduleError::invalid(
                "query_rows",
                format!("{rows:?}"),
                format!("a range inside 0..{} (T)", self.num_tokens),
            ));
        }
        for (row, &(doc, _)) in self.block_of_rows().iter().enumerate() {
            let start = self.cu_seqlens[doc] as usize;
            for h in 0..NUM_INDEX_HEADS {
                // Validated by `new`: the row's range lies inside `q_indices`.
                let range = self.row_range(h, row).unwrap_or(0..0);
                for e in range {
                    let q = self.q_indices[h * self.edge_capacity() + e] as usize;
                    if !rows.contains(&(start + q)) {
                        return Err(ScheduleError::invalid(
                            format!("q_indices[{h},{e}]"),
                            format!("document-local query {q} (compact row {})", start + q),
                            format!("a query in the restricted rows {rows:?}"),
                        ));
                    }
                }
            }
        }
        self.query_rows = rows;
        Ok(self)
    }

    /// The compact query rows the schedule's edges lie in: `0..T`, or the range given to
    /// [`Schedule::restrict_queries`]. The backward's query-side buffers hold these rows.
    pub fn query_rows(&self) -> Range<usize> {
        self.query_rows.clone()
    }

    /// `(document, document-local block)` of each CSR row.
    fn block_of_rows(&self) -> Vec<(usize, usize)> {
        // Validated by `new`.
        Documents::new(&self.cu_seqlens)
            .map(|d| d.block_of_row)
            .unwrap_or_default()
    }

    /// `row_ptr [4, rows+1]`, row-major.
    pub fn row_ptr(&self) -> &[i32] {
        &self.row_ptr
    }

    /// CSR rows per index head, `Σ ceil(len_d/128)`.
    pub fn rows(&self) -> usize {
        self.row_ptr.len() / NUM_INDEX_HEADS - 1
    }

    /// `q_indices [4, edge_capacity]`, row-major.
    pub fn q_indices(&self) -> &[i32] {
        &self.q_indices
    }

    /// Edge slots per index head (at least 1).
    pub fn edge_capacity(&self) -> usize {
        self.q_indices.len() / NUM_INDEX_HEADS
    }

    /// `scheduler_metadata [work_capacity, 6]`, row-major; rows past [`Schedule::num_work`] are
    /// unchecked.
    pub fn scheduler_metadata(&self) -> &[i32] {
        &self.scheduler_metadata
    }

    /// Rows of `scheduler_metadata` (at least 1).
    pub fn work_capacity(&self) -> usize {
        self.scheduler_metadata.len() / METADATA_COLUMNS.len()
    }

    /// The work count as stored; it may lie outside `[0, work_capacity]`.
    pub fn work_count(&self) -> i32 {
        self.work_count
    }

    /// Valid work items: `clamp(work_count, 0, work_capacity)`, as the device task build reads it.
    pub fn num_work(&self) -> usize {
        usize::try_from(self.work_count.max(0))
            .unwrap_or(0)
            .min(self.work_capacity())
    }

    /// `cu_seqlens [docs+1]`.
    pub fn cu_seqlens(&self) -> &[i32] {
        &self.cu_seqlens
    }

    /// `document_workspace_starts [docs]`.
    pub fn document_workspace_starts(&self) -> &[i32] {
        &self.document_workspace_starts
    }

    /// Number of documents.
    pub fn num_documents(&self) -> usize {
        self.document_workspace_starts.len()
    }

    /// Total compact tokens `T = cu_seqlens[docs]`.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Workspace rows `W`: the last document's start plus its 128-aligned length
    /// (`Σ ceil(len/128)·128` for the dense [`workspace_layout`]).
    pub fn workspace_rows(&self) -> usize {
        self.workspace_rows
    }

    /// Raw row `i` of `scheduler_metadata`, for any `i < work_capacity`.
    pub fn metadata_row(&self, i: usize) -> Option<[i32; 6]> {
        let cols = METADATA_COLUMNS.len();
        // Checked so that any `i` gives `None`, never an overflow.
        let row = self
            .scheduler_metadata
            .get(i.checked_mul(cols)?..)?
            .get(..cols)?;
        let mut out = [0; 6];
        out.copy_from_slice(row);
        Some(out)
    }

    /// Valid work item `i` (`i < num_work`), with its columns as checked by [`Schedule::new`].
    pub fn work_item(&self, i: usize) -> Option<WorkItem> {
        if i >= self.num_work() {
            return None;
        }
        // Validated non-negative in `new`.
        let m = self.metadata_row(i)?.map(|v| v as usize);
        Some(WorkItem {
            index_head: m[0],
            row_linear: m[1],
            q_begin: m[2],
            q_count: m[3],
            document_ordinal: m[4],
            document_local_kblock: m[5],
        })
    }

    /// The valid work items in stored order.
    pub fn work_items(&self) -> impl Iterator<Item = WorkItem> + '_ {
        (0..self.num_work()).filter_map(move |i| self.work_item(i))
    }

    /// Edge range `[row_ptr[head,row], row_ptr[head,row+1])` of one CSR row, as indices into
    /// the head's `q_indices` row.
    pub fn row_range(&self, head: usize, row: usize) -> Option<Range<usize>> {
        if head >= NUM_INDEX_HEADS || row >= self.rows() {
            return None;
        }
        let base = head * (self.rows() + 1) + row;
        // Validated non-negative and non-decreasing in `new`.
        Some(self.row_ptr[base] as usize..self.row_ptr[base + 1] as usize)
    }

    /// Document-local queries of one CSR row (ascending).
    pub fn row_queries(&self, head: usize, row: usize) -> Option<&[i32]> {
        let range = self.row_range(head, row)?;
        let base = head * self.edge_capacity();
        self.q_indices.get(base + range.start..base + range.end)
    }

    /// Document-local queries covered by valid work item `i`.
    pub fn work_item_queries(&self, i: usize) -> Option<&[i32]> {
        let item = self.work_item(i)?;
        let row = self.row_queries(item.index_head, item.row_linear)?;
        row.get(item.q_begin..item.q_begin + item.q_count)
    }

    /// Checks the first `num_work` metadata rows (the other fields are already valid).
    fn check_work_items(&self, docs: &Documents) -> Result<(), ScheduleError> {
        let rows = self.rows();
        let mut spans = Vec::with_capacity(self.num_work());
        for i in 0..self.num_work() {
            let Some(m) = self.metadata_row(i) else {
                break;
            };
            let field = |c: usize| format!("scheduler_metadata[{i},{c}] ({})", METADATA_COLUMNS[c]);
            let in_range = |c: usize, bound: usize, what: &str| {
                if m[c] >= 0 && (m[c] as usize) < bound {
                    Ok(m[c] as usize)
                } else {
                    Err(ScheduleError::invalid(
                        field(c),
                        m[c],
                        format!("in [0, {bound}) ({what})"),
                    ))
                }
            };
            let head = in_range(0, NUM_INDEX_HEADS, "index heads")?;
            let row = in_range(1, rows, "CSR rows")?;
            let doc = in_range(4, docs.count(), "documents")?;
            let kblock = in_range(5, docs.blocks[doc], "blocks of the document")?;
            let expected_row = docs.row_of_block[docs.first_block[doc] + kblock];
            if row != expected_row {
                return Err(ScheduleError::invalid(
                    field(1),
                    row,
                    format!("{expected_row}, the CSR row of document {doc} block {kblock}"),
                ));
            }
            if m[2] < 0 {
                return Err(ScheduleError::invalid(field(2), m[2], ">= 0"));
            }
            if m[3] < 1 {
                return Err(ScheduleError::invalid(field(3), m[3], ">= 1"));
            }
            let range = self.row_range(head, row).unwrap_or(0..0);
            let (q_begin, q_count) = (m[2] as usize, m[3] as usize);
            if i64::from(m[2]) + i64::from(m[3]) > range.len() as i64 {
                return Err(ScheduleError::invalid(
                    field(3),
                    q_count,
                    format!(
                        "q_begin + q_count <= {} (edges of head {head} row {row}; q_begin = {q_begin})",
                        range.len()
                    ),
                ));
            }
            let begin = range.start + q_begin;
            spans.push((head, begin, begin + q_count, i));
        }
        // A shared edge would add its gradient twice; sorting makes the check O(n log n).
        spans.sort_unstable();
        for pair in spans.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if a.0 == b.0 && b.1 < a.2 {
                let (later, earlier) = if a.3 > b.3 { (a, b) } else { (b, a) };
                return Err(ScheduleError::invalid(
                    format!("scheduler_metadata[{}]", later.3),
                    format!("edges [{}, {}) of head {}", later.1, later.2, later.0),
                    format!(
                        "edges disjoint from work item {} (edges [{}, {}))",
                        earlier.3, earlier.1, earlier.2
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Checks `document_workspace_starts` against the documents; returns the workspace size `W`.
fn check_workspace_starts(docs: &Documents, starts: &[i32]) -> Result<usize, ScheduleError> {
    if starts.len() != docs.count() {
        return Err(ScheduleError::invalid(
            "document_workspace_starts.len()",
            starts.len(),
            format!("{} (one per document)", docs.count()),
        ));
    }
    let aligned = |d: usize| (docs.blocks[d] * BLOCK_SIZE) as i64;
    let mut end: i64 = 0;
    for (d, &start) in starts.iter().enumerate() {
        let field = || format!("document_workspace_starts[{d}]");
        if d == 0 && start < 0 {
            return Err(ScheduleError::invalid(field(), start, ">= 0"));
        }
        if start.rem_euclid(BLOCK_SIZE as i32) != 0 {
            return Err(ScheduleError::invalid(field(), start, "a multiple of 128"));
        }
        if d > 0 && i64::from(start) < end {
            return Err(ScheduleError::invalid(
                field(),
                start,
                format!(
                    ">= {end} (document_workspace_starts[{}] + ceil(len/128)·128: no overlap)",
                    d - 1
                ),
            ));
        }
        end = i64::from(start) + aligned(d);
    }
    if end > i64::from(i32::MAX) {
        let last = starts.len() - 1;
        return Err(ScheduleError::invalid(
            format!("document_workspace_starts[{last}]"),
            starts[last],
            "start + ceil(len/128)·128 <= i32::MAX (workspace rows are int32)",
        ));
    }
    Ok(end as usize)
}

/// Checks the values of `row_ptr [4, rows+1]` (its length is already checked).
fn check_row_ptr(row_ptr: &[i32], rows: usize, edge_capacity: usize) -> Result<(), ScheduleError> {
    for (h, offsets) in row_ptr.chunks_exact(rows + 1).enumerate() {
        if offsets[0] < 0 {
            return Err(ScheduleError::invalid(
                format!("row_ptr[{h},0]"),
                offsets[0],
                ">= 0",
            ));
        }
        for i in 1..=rows {
            if offsets[i] < offsets[i - 1] {
                return Err(ScheduleError::invalid(
                    format!("row_ptr[{h},{i}]"),
                    offsets[i],
                    format!(
                        ">= row_ptr[{h},{}] = {} (non-decreasing)",
                        i - 1,
                        offsets[i - 1]
                    ),
                ));
            }
        }
        if offsets[rows] as usize > edge_capacity {
            return Err(ScheduleError::invalid(
                format!("row_ptr[{h},{rows}]"),
                offsets[rows],
                format!("<= edge_capacity = {edge_capacity}"),
            ));
        }
    }
    Ok(())
}

/// Checks every CSR edge: in its row's document, at or after the row's block, ascending.
fn check_edges(
    docs: &Documents,
    row_ptr: &[i32],
    q_indices: &[i32],
    edge_capacity: usize,
) -> Result<(), ScheduleError> {
    let rows = docs.rows();
    for h in 0..NUM_INDEX_HEADS {
        let offsets = &row_ptr[h * (rows + 1)..(h + 1) * (rows + 1)];
        let edges = &q_indices[h * edge_capacity..(h + 1) * edge_capacity];
        for (row, &(doc, kblock)) in docs.block_of_row.iter().enumerate() {
            let lo = (kblock * BLOCK_SIZE) as i64;
            let hi = docs.lens[doc] as i64;
            let mut prev: Option<i32> = None;
            // check_row_ptr bounded the offsets by edge_capacity.
            let (first, end) = (offsets[row] as usize, offsets[row + 1] as usize);
            for (e, &q) in edges.iter().enumerate().take(end).skip(first) {
                let field = || format!("q_indices[{h},{e}]");
                if i64::from(q) < lo || i64::from(q) >= hi {
                    return Err(ScheduleError::invalid(
                        field(),
                        q,
                        format!(
                            "in [{lo}, {hi}): a query of document {doc} at or after block {kblock} \
                             (CSR row {row})"
                        ),
                    ));
                }
                if let Some(p) = prev {
                    if q <= p {
                        return Err(ScheduleError::invalid(
                            field(),
                            q,
                            format!("> {p} (queries ascend strictly within CSR row {row})"),
                        ));
                    }
                }
                prev = Some(q);
            }
        }
    }
    Ok(())
}

/// Builds a schedule from a block selection on the CPU (the analogue of the official
/// `build_k2q_csr` + prepare-scheduler pair).
///
/// `q2k [4, T, 16]` holds document-local block ids with `-1` padding, in any slot order;
/// `T = cu_seqlens[docs]`. Every id must be `-1` or a block at or before the query's own block
/// (`(t − doc_start)/128`, hence also inside the document), and no id may repeat within one
/// query's list; a violation is a [`ScheduleError::Selection`] naming head, query row, slot and id.
///
/// Output:
/// - CSR rows in the official order (level-major, round-robin across documents), queries
///   ascending within a row; `edge_capacity = max(1, 16·T)`, unused entries `-1`.
/// - Work items: each (head, row) with edges is split into chunks of `queries_per_work` edges
///   (a positive multiple of 8, so every `q_begin` is a multiple of 8 and only a row's last
///   item can have a length that is not); ordered head-major, then by row, then by `q_begin`.
///   The official producer claims slots with atomics, so its order is nondeterministic; the
///   backward must not depend on it.
/// - `work_capacity = max(1, number of items)` and `work_count = number of items`: exact, so a
///   `work_count` past the capacity clamps onto valid items only. Unused metadata rows (only
///   when there are no items) are zero.
/// - `document_workspace_starts` from [`workspace_layout`].
pub fn build_schedule(
    q2k: &[i32],
    cu_seqlens: &[i32],
    queries_per_work: usize,
) -> Result<Schedule, ScheduleError> {
    let t = cu_seqlens.last().map_or(0, |&t| t.max(0) as usize);
    build_schedule_for_rows(q2k, cu_seqlens, 0..t, queries_per_work)
}

/// [`build_schedule`] for the queries of the compact rows `rows` only, against every
/// document's key blocks: the local schedule of a context-parallel rank (`crate::cp`).
///
/// `q2k [4, rows.len(), 16]` holds the selections of those rows (its row `i` is compact row
/// `rows.start + i`); the CSR rows and work items are those of the whole `cu_seqlens`, with
/// edges from `rows` only, and [`Schedule::query_rows`] is `rows`. The result equals
/// `build_schedule` of a `q2k [4, T, 16]` whose other rows are all `-1`, except that the edge
/// capacity is `rows.len()·16`. Errors name the compact row `t` of a faulty entry (index
/// `t − rows.start` of this `q2k`).
pub fn build_schedule_for_rows(
    q2k: &[i32],
    cu_seqlens: &[i32],
    rows: Range<usize>,
    queries_per_work: usize,
) -> Result<Schedule, ScheduleError> {
    if !positive_multiple(queries_per_work, QUERY_CHUNK) {
        return Err(ScheduleError::invalid(
            "queries_per_work",
            queries_per_work,
            "a positive multiple of 8 (QUERY_CHUNK)",
        ));
    }
    let (ws_starts, _) = workspace_layout(cu_seqlens)?;
    // Validated: starts at 0, non-decreasing.
    let t_total = cu_seqlens[cu_seqlens.len() - 1] as usize;
    if rows.start > rows.end || rows.end > t_total {
        return Err(ScheduleError::invalid(
            "query_rows",
            format!("{rows:?}"),
            format!("a range inside 0..{t_total} (T)"),
        ));
    }
    let n_rows = rows.len();
    let per_query = TOPK_BLOCKS;
    let expected_len = n_rows * NUM_INDEX_HEADS * per_query;
    if q2k.len() != expected_len {
        let expected = if n_rows == t_total {
            format!("4·T·16 = {expected_len} (T = {t_total})")
        } else {
            format!("4·rows·16 = {expected_len} ({n_rows} query rows of T = {t_total})")
        };
        return Err(ScheduleError::invalid("q2k.len()", q2k.len(), expected));
    }
    // Sized after the q2k check, so the row tables never outgrow the input.
    let docs = Documents::new(cu_seqlens)?;
    let edge_capacity = (n_rows * per_query).max(1);
    if i32::try_from(edge_capacity).is_err() {
        return Err(ScheduleError::invalid(
            format!("cu_seqlens[{}]", docs.count()),
            t_total,
            "T·16 <= i32::MAX (CSR offsets are int32)",
        ));
    }
    // The limits that depend on the documents alone, before the tables are allocated; the
    // work capacity is known (and checked by Schedule::new) once the items are cut.
    let (_, w) = workspace_layout(cu_seqlens)?;
    check_shape_capacity(t_total, w, edge_capacity, 1)?;
    let list = |h: usize, t: usize| &q2k[(h * n_rows + t - rows.start) * per_query..][..per_query];
    // The document-local queries of document `d` inside `rows`.
    let local = |d: usize| {
        let s = docs.starts[d];
        rows.start.clamp(s, s + docs.lens[d]) - s..rows.end.clamp(s, s + docs.lens[d]) - s
    };
    let query_rows = rows.clone();
    let rows = docs.rows();

    // Pass 1: validate every id and count the edges of each (head, row).
    let mut counts = vec![0usize; NUM_INDEX_HEADS * rows];
    for h in 0..NUM_INDEX_HEADS {
        for d in 0..docs.count() {
            for q in local(d) {
                let t = docs.starts[d] + q;
                let ids = list(h, t);
                for (slot, &id) in ids.iter().enumerate() {
                    let fault = if id == -1 {
                        continue;
                    } else if id < -1 {
                        SelectionFault::BelowPadding
                    } else if id as usize >= docs.blocks[d] {
                        SelectionFault::PastDocumentEnd {
                            num_blocks: docs.blocks[d],
                        }
                    } else if id as usize > q / BLOCK_SIZE {
                        SelectionFault::AfterOwnBlock {
                            own_block: q / BLOCK_SIZE,
                        }
                    } else if let Some(first_slot) = ids[..slot].iter().position(|&x| x == id) {
                        SelectionFault::Repeated { first_slot }
                    } else {
                        let row = docs.row_of_block[docs.first_block[d] + id as usize];
                        counts[h * rows + row] += 1;
                        continue;
                    };
                    return Err(ScheduleError::Selection {
                        head: h,
                        row: t,
                        slot,
                        block: id,
                        fault,
                    });
                }
            }
        }
    }

    // CSR offsets; every total is at most 16·T <= i32::MAX.
    let mut row_ptr = vec![0i32; NUM_INDEX_HEADS * (rows + 1)];
    let mut cursor = vec![0usize; NUM_INDEX_HEADS * rows];
    for h in 0..NUM_INDEX_HEADS {
        let mut acc = 0usize;
        for row in 0..rows {
            cursor[h * rows + row] = acc;
            acc += counts[h * rows + row];
            row_ptr[h * (rows + 1) + row + 1] = acc as i32;
        }
    }

    // Pass 2: fill. Queries are visited in ascending order per document, so each row ascends.
    let mut q_indices = vec![-1i32; NUM_INDEX_HEADS * edge_capacity];
    for h in 0..NUM_INDEX_HEADS {
        for d in 0..docs.count() {
            for q in local(d) {
                for &id in list(h, docs.starts[d] + q) {
                    if id < 0 {
                        continue;
                    }
                    let row = docs.row_of_block[docs.first_block[d] + id as usize];
                    let slot = &mut cursor[h * rows + row];
                    q_indices[h * edge_capacity + *slot] = q as i32;
                    *slot += 1;
                }
            }
        }
    }

    let mut metadata = Vec::new();
    for h in 0..NUM_INDEX_HEADS {
        for (row, &(doc, kblock)) in docs.block_of_row.iter().enumerate() {
            let len = counts[h * rows + row];
            for q_begin in (0..len).step_by(queries_per_work) {
                let q_count = queries_per_work.min(len - q_begin);
                // All values are bounded by 16·T or the row count, both <= i32::MAX.
                metadata.extend([h, row, q_begin, q_count, doc, kblock].map(|v| v as i32));
            }
        }
    }
    let num_items = metadata.len() / METADATA_COLUMNS.len();
    if num_items == 0 {
        metadata.resize(METADATA_COLUMNS.len(), 0);
    }
    let schedule = Schedule::new(
        row_ptr,
        q_indices,
        metadata,
        num_items as i32,
        cu_seqlens.to_vec(),
        ws_starts,
    )?;
    // Only the queries of `query_rows` were visited, so every edge lies in them.
    Ok(Schedule {
        query_rows,
        ..schedule
    })
}

/// The causal support: every query selects every block of its document at or before its own
/// block, nearest first (`own, own−1, …`), truncated to the 16 nearest, `-1` padded.
///
/// Returns `q2k [4, T, 16]` (the same list for all 4 index heads), ready for
/// [`build_schedule`].
///
/// # Errors
/// - [`ScheduleError::Invalid`] when `cu_seqlens` is not valid for [`workspace_layout`], or when
///   `T·16` exceeds `i32::MAX` (the bound [`build_schedule`] puts on its CSR offsets, so
///   such a selection could not be used).
/// - [`ScheduleError::OutOfMemory`] when the `4·T·16` ids cannot be allocated.
pub fn causal_support(cu_seqlens: &[i32]) -> Result<Vec<i32>, ScheduleError> {
    workspace_layout(cu_seqlens)?;
    // Validated: starts at 0, non-decreasing.
    let t_total = cu_seqlens[cu_seqlens.len() - 1] as usize;
    let per_head = t_total
        .checked_mul(TOPK_BLOCKS)
        .filter(|&n| i32::try_from(n).is_ok())
        .ok_or_else(|| {
            ScheduleError::invalid(
                format!("cu_seqlens[{}]", cu_seqlens.len() - 1),
                t_total,
                "T·16 <= i32::MAX (CSR offsets are int32)",
            )
        })?;
    let len = per_head * NUM_INDEX_HEADS;
    let mut q2k: Vec<i32> = Vec::new();
    q2k.try_reserve_exact(len)
        .map_err(|_| ScheduleError::OutOfMemory {
            what: "q2k",
            bytes: len * std::mem::size_of::<i32>(),
        })?;
    q2k.resize(per_head, -1);
    for w in cu_seqlens.windows(2) {
        let (start, end) = (w[0] as usize, w[1] as usize);
        for t in start..end {
            let own = (t - start) / BLOCK_SIZE;
            let ids = &mut q2k[t * TOPK_BLOCKS..(t + 1) * TOPK_BLOCKS];
            for (j, id) in ids.iter_mut().enumerate().take(own + 1) {
                *id = (own - j) as i32;
            }
        }
    }
    // The other three heads repeat head 0 within the reserved capacity.
    for _ in 1..NUM_INDEX_HEADS {
        q2k.extend_from_within(..per_head);
    }
    Ok(q2k)
}
