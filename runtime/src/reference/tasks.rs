//! CPU oracle of the device task build (`docs/design.md` §2.2–§2.4).
//!
//! The device build (four launches, no host sync) turns the forward work items of a
//! [`Schedule`] into 8-query backward tasks, orders them by locality and writes the CTA-walk
//! descriptor the main kernel's prologue reads. [`build_task_tables`] computes the same tables
//! on the CPU, written from the design text alone:
//!
//! 1. **Split.** Valid work item `w` (`w < num_work`, in stored order) becomes
//!    `ceil(q_count/8)` tasks; task `j` covers edges `row_ptr[h, row] + q_begin + 8j ..` of
//!    head `h`, `valid = min(8, q_count − 8j)` of them. This is the *forward* task order.
//! 2. **Capacity.** `total` (unclamped) tasks against [`task_capacity`]: past it, flag
//!    [`FLAG_CAPACITY_OVERFLOW`] and an empty table (the backward then walks nothing).
//! 3. **Segments.** A task's segment is the tuple `(head, document, window, local kblock)`,
//!    where `window = q / 2^s` for the document-local query `q` of slot 0 and the document's
//!    window `2^s` of [`Locality::window_log2`]. If the forward indices of any segment's tasks
//!    are not one contiguous run, flag [`FLAG_NONCONTIGUOUS_SEGMENTS`] and keep forward order.
//! 4. **Order.** Otherwise rows are sorted by `(segment, qmin)` (unique on a valid schedule),
//!    `qmin` the compact row of slot 0. The device's scatter rule
//!    `row = offsets[seg] + (task − first[seg])` gives the same order whenever each segment's
//!    forward order ascends in `qmin`, as with
//!    [`build_schedule`](crate::schedule::build_schedule)'s order; for a contiguous segment
//!    whose forward order does not ascend, the oracle sorts by `qmin`.
//! 5. **Descriptor.** `[n, rows_per_cta(n), chunk_map(n, ..)…, num_work, total, flags]`.

use crate::contract::{
    chunk_map, rows_per_cta, Locality, BLOCK_SIZE, NUM_INDEX_HEADS, QUERY_CHUNK,
};
use crate::schedule::Schedule;

/// Descriptor flag: more tasks than [`task_capacity`]; the table is empty.
pub const FLAG_CAPACITY_OVERFLOW: i32 = 1;

/// Descriptor flag: some segment's tasks are not consecutive in forward order, so the table
/// keeps forward (source) order instead of locality order.
pub const FLAG_NONCONTIGUOUS_SEGMENTS: i32 = 2;

/// Columns of one `meta` row: `(0, index_head, workspace_global_kblock, valid)`.
pub const TASK_META_COLUMNS: usize = 4;

/// The task tables and CTA-walk descriptor of one schedule, as the device build writes them.
///
/// Row-major int32 with `n = desc[0]` rows: only the rows the device writes (its buffers are
/// sized by the capacity and the rest is never read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskTables {
    /// `[n, 4]`: `(0, index_head, workspace_global_kblock, valid)`; column 0 is the batch
    /// coordinate (always 0), `workspace_global_kblock = ws_start[doc]/128 + local_kblock`,
    /// `valid` in `1..=8`.
    pub meta: Vec<i32>,
    /// `[n, 8]`: slot `s < valid` holds the compact query row `cu_seqlens[doc] + q`, where `q`
    /// is the document-local query of the task's `s`-th edge; other slots are `-1`.
    pub qrows: Vec<i32>,
    /// `[n, 8]`: slot `s < valid` holds the workspace position
    /// `document_workspace_starts[doc] + q` (causal predicate only); other slots are `-1`.
    pub qpos: Vec<i32>,
    /// `NUM_TASK_ROWS, ROWS_PER_CTA, NUM_FULL_CTAS, TAIL_ROWS, GRID_CTAS, NUM_WORK, NUM_TASKS,
    /// FLAGS` (`docs/design.md` §2.3, §2.4).
    pub desc: [i32; 8],
}

impl TaskTables {
    /// Number of task rows `n` (`desc[0]`).
    pub fn num_rows(&self) -> usize {
        self.meta.len() / TASK_META_COLUMNS
    }
}

/// Upper bound on the tasks of a schedule: `4·edge_capacity/8 + work_capacity`.
///
/// A valid [`Schedule`] never exceeds it: its valid items cover disjoint edges, at most
/// `4·edge_capacity` in all, so `Σ ceil(q_count/8) <= Σ floor(q_count/8) + num_work
/// <= floor(4·edge_capacity/8) + work_capacity`. [`build_task_tables`] therefore never flags
/// [`FLAG_CAPACITY_OVERFLOW`]; [`build_task_tables_with_capacity`] reaches that path.
pub fn task_capacity(schedule: &Schedule) -> usize {
    (NUM_INDEX_HEADS * schedule.edge_capacity() / QUERY_CHUNK)
        .saturating_add(schedule.work_capacity())
}

/// The task tables of `schedule` for a GPU with `num_sms` SMs (`0` is treated as `1`, as in
/// [`chunk_map`]), with the capacity of [`task_capacity`].
pub fn build_task_tables(schedule: &Schedule, num_sms: usize) -> TaskTables {
    build_task_tables_with_capacity(schedule, num_sms, task_capacity(schedule))
}

/// [`build_task_tables_with_capacity`] with another locality rule.
pub fn build_task_tables_with(
    schedule: &Schedule,
    num_sms: usize,
    capacity: usize,
    locality: Locality,
) -> TaskTables {
    build_tables(schedule, num_sms, capacity, locality)
}

/// [`build_task_tables`] with an explicit table `capacity` (rows the device buffers hold).
///
/// With `total > capacity` the device still assigns segments to its first `capacity` tasks, so
/// [`FLAG_NONCONTIGUOUS_SEGMENTS`] reflects that prefix; the result is
/// `FLAG_CAPACITY_OVERFLOW` plus that bit, no rows and `desc[0] = 0`.
pub fn build_task_tables_with_capacity(
    schedule: &Schedule,
    num_sms: usize,
    capacity: usize,
) -> TaskTables {
    build_tables(schedule, num_sms, capacity, Locality::default())
}

fn build_tables(
    schedule: &Schedule,
    num_sms: usize,
    capacity: usize,
    locality: Locality,
) -> TaskTables {
    let num_work = schedule.num_work();
    let total: usize = schedule
        .work_items()
        .map(|item| item.q_count.div_ceil(QUERY_CHUNK))
        .fold(0, usize::saturating_add);
    let overflow = total > capacity;
    let tasks = forward_tasks(schedule, total.min(capacity));

    // Each document's window, from its length.
    let cu = schedule.cu_seqlens();
    let window_log2: Vec<u32> = cu
        .windows(2)
        .map(|w| locality.window_log2(((w[1] - w[0]) as usize).div_ceil(BLOCK_SIZE)))
        .collect();
    let segment = |t: &Task| {
        let q = t.queries[0] as u64;
        (t.head, t.doc, q >> window_log2[t.doc], t.local_kblock)
    };
    let key = |t: &Task| (segment(t), t.qmin);

    // Forward indices sorted by key; a segment is then one run of equal segment tuples.
    let mut order: Vec<usize> = (0..tasks.len()).collect();
    order.sort_by_key(|&i| key(&tasks[i]));
    let noncontiguous = order
        .chunk_by(|&a, &b| segment(&tasks[a]) == segment(&tasks[b]))
        .any(|run| {
            let first = run.iter().min().copied().unwrap_or(0);
            let last = run.iter().max().copied().unwrap_or(0);
            last - first + 1 != run.len()
        });

    let mut flags = 0;
    if overflow {
        flags |= FLAG_CAPACITY_OVERFLOW;
    }
    if noncontiguous {
        flags |= FLAG_NONCONTIGUOUS_SEGMENTS;
    }

    let rows: Vec<usize> = if overflow {
        Vec::new()
    } else if noncontiguous {
        (0..tasks.len()).collect()
    } else {
        order
    };

    let mut tables = TaskTables {
        meta: Vec::with_capacity(rows.len() * TASK_META_COLUMNS),
        qrows: Vec::with_capacity(rows.len() * QUERY_CHUNK),
        qpos: Vec::with_capacity(rows.len() * QUERY_CHUNK),
        desc: [0; 8],
    };
    for task in rows.iter().map(|&i| &tasks[i]) {
        let valid = task.queries.len();
        tables.meta.extend([
            0,
            word(task.head as usize),
            word(task.kblock as usize),
            word(valid),
        ]);
        for s in 0..QUERY_CHUNK {
            match task.queries.get(s) {
                // Both sums stay below cu_seqlens[doc+1] resp. W, which are <= i32::MAX.
                Some(&q) => {
                    tables.qrows.push(task.row_base + q);
                    tables.qpos.push(task.ws_base + q);
                }
                None => {
                    tables.qrows.push(-1);
                    tables.qpos.push(-1);
                }
            }
        }
    }

    let n = rows.len();
    let r = rows_per_cta(n);
    let (num_full, tail, grid) = chunk_map(n, r, num_sms);
    tables.desc = [
        word(n),
        word(r),
        word(num_full),
        word(tail),
        word(grid),
        word(num_work),
        word(total),
        flags,
    ];
    tables
}

/// One decoded task (`docs/design.md` §2.2).
struct Task<'a> {
    /// Index head.
    head: u64,
    /// Workspace-global key block `ws_start[doc]/128 + local_kblock`.
    kblock: u64,
    /// Document ordinal.
    doc: usize,
    /// Document-local key block.
    local_kblock: usize,
    /// Compact row of slot 0, `cu_seqlens[doc] + queries[0]`.
    qmin: u64,
    /// `cu_seqlens[doc]`.
    row_base: i32,
    /// `document_workspace_starts[doc]`.
    ws_base: i32,
    /// Document-local queries of the `valid` edges (1..=8).
    queries: &'a [i32],
}

/// The first `limit` tasks in forward order.
///
/// `Schedule::new` guarantees every accessor below returns `Some` for a valid item (its edges
/// lie in its row, its document exists, queries are non-negative), so the `else` branches are
/// unreachable; they skip instead of panicking.
fn forward_tasks(schedule: &Schedule, limit: usize) -> Vec<Task<'_>> {
    let cu = schedule.cu_seqlens();
    let ws = schedule.document_workspace_starts();
    let mut tasks = Vec::with_capacity(limit);
    for w in 0..schedule.num_work() {
        let (Some(item), Some(queries)) = (schedule.work_item(w), schedule.work_item_queries(w))
        else {
            continue;
        };
        let doc = item.document_ordinal;
        let (Some(&row_base), Some(&ws_base)) = (cu.get(doc), ws.get(doc)) else {
            continue;
        };
        let kblock = ws_base as usize / BLOCK_SIZE + item.document_local_kblock;
        for chunk in queries.chunks(QUERY_CHUNK) {
            if tasks.len() == limit {
                return tasks;
            }
            let Some(&first) = chunk.first() else {
                continue;
            };
            tasks.push(Task {
                head: item.index_head as u64,
                kblock: kblock as u64,
                doc,
                local_kblock: item.document_local_kblock,
                qmin: (i64::from(row_base) + i64::from(first)) as u64,
                row_base,
                ws_base,
                queries: chunk,
            });
        }
    }
    tasks
}

/// A table word; counts past `i32::MAX` (impossible for a schedule that fits in memory)
/// saturate instead of wrapping.
fn word(v: usize) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}
