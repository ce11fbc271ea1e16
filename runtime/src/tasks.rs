//! The device task build (`docs/design.md` §2.2–§2.4): sizing, the one workspace allocation carved
//! into aligned regions, the four launches, and reading the results back.
//!
//! Everything is issued through a [`Backend`] (a CUDA stream or the simulator); nothing here
//! synchronizes unless a function says so ([`TaskWorkspace::read_tables`],
//! [`FlagsReadback::wait`]).
//!
//! Layer 3 of the crate (the host flow); the pinned-memory flags read is layer 5, in the
//! `stream` child, re-exported here.

use crate::backend::{bytes_of, from_bytes, Backend, Ptr, PtrMut};
use crate::contract::{grid_launch_bound, Locality, NUM_INDEX_HEADS, QUERY_CHUNK};
use crate::error::RuntimeError;
use crate::kernels::{task_assign_segments, task_scan_bins, task_scan_work, task_scatter_tables};
use crate::schedule::Schedule;

mod stream;
pub use stream::FlagsReadback;

/// Descriptor flag: more tasks than capacity; the walk has zero rows.
pub const FLAG_CAPACITY_OVERFLOW: i32 = 1;
/// Descriptor flag: a segment's tasks were not consecutive; tables are in source order.
pub const FLAG_NONCONTIGUOUS_SEGMENTS: i32 = 2;

/// Region starts are rounded to 256 bytes, which also satisfies the 16-byte vector stores.
const REGION_ALIGN_WORDS: usize = 64;

/// CTAs per SM each task scan launches beside its own to zero a buffer
/// ([`TaskWorkspace::build_zeroing`]): two of 1024 threads fill an SM.
pub const SPARE_CTAS_PER_SM: u32 = 2;

/// Bins per CTA of `task_scan_bins` and per word of its chunk totals (`task_build::BIN_CHUNK`
/// in codegen: 1024 threads × 8 bins, one scan tile).
pub const BIN_CHUNK: usize = 8192;

/// Sizes of the task build for one schedule (`docs/design.md` §2.2, with the bins of [`Locality`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskBuildSizes {
    /// Upper bound on tasks: `4·edge_capacity/8 + work_capacity`.
    pub capacity: usize,
    /// Documents of the schedule.
    pub num_docs: usize,
    /// The locality rule the bins follow.
    pub locality: Locality,
    /// Bins of one index head: [`Locality::bins_per_head_bound`] of `T` and the documents.
    pub bins_per_head: usize,
    /// Locality bins: `4·bins_per_head`.
    pub bins: usize,
    /// Scratch words: `8 + work_capacity + capacity + 4·bins + 2·docs + 1 + 4·capacity`.
    pub scratch_words: usize,
    /// Table words: `capacity·(4 + 16)`.
    pub table_words: usize,
    /// CTAs the main kernel is launched with: `grid_launch_bound(capacity, num_sms)`.
    pub grid_launch: usize,
    /// The SM count the walk was sized for.
    pub num_sms: usize,
}

impl TaskBuildSizes {
    /// [`TaskBuildSizes::grid_launch`] as a launch dimension: the grid of the kernels that
    /// walk the task tables.
    ///
    /// # Errors
    /// [`RuntimeError::Input`] past `2^31 − 1` CTAs.
    pub fn main_grid(&self) -> Result<u32, RuntimeError> {
        u32::try_from(self.grid_launch)
            .ok()
            .filter(|&g| g <= i32::MAX as u32)
            .ok_or_else(|| {
                RuntimeError::input(
                    "schedule",
                    format!("{} CTAs for the main kernel", self.grid_launch),
                    "a grid of at most 2^31-1 CTAs",
                )
            })
    }

    /// Sizes the task build with the default [`Locality`].
    pub fn new(schedule: &Schedule, num_sms: usize) -> Result<Self, RuntimeError> {
        Self::with_locality(schedule, num_sms, Locality::default())
    }

    /// Sizes the task build; fails before any launch when the locality rule is out of range
    /// or a count overflows the kernels' 32-bit index arithmetic. Every size comes from the
    /// token, document, edge and work-item counts, never from the selection itself.
    pub fn with_locality(
        schedule: &Schedule,
        num_sms: usize,
        locality: Locality,
    ) -> Result<Self, RuntimeError> {
        Self::for_shape(
            ScheduleShape {
                num_tokens: schedule.num_tokens(),
                num_docs: schedule.num_documents(),
                edge_capacity: schedule.edge_capacity(),
                work_capacity: schedule.work_capacity(),
            },
            num_sms,
            locality,
        )
    }

    /// [`TaskBuildSizes::with_locality`] from the schedule's shape alone (a device-built
    /// schedule has no host copy).
    pub fn for_shape(
        shape: ScheduleShape,
        num_sms: usize,
        locality: Locality,
    ) -> Result<Self, RuntimeError> {
        let ScheduleShape {
            num_tokens,
            num_docs,
            edge_capacity,
            work_capacity,
        } = shape;
        if num_sms == 0 {
            return Err(RuntimeError::input("num_sms", 0, "at least 1"));
        }
        locality
            .validate()
            .map_err(|why| RuntimeError::input("locality", format!("{locality:?}"), why))?;
        let capacity = NUM_INDEX_HEADS * edge_capacity / QUERY_CHUNK + work_capacity;
        let bins_per_head = locality.bins_per_head_bound(num_tokens, num_docs);
        let bins = NUM_INDEX_HEADS.saturating_mul(bins_per_head);
        // The kernels index `head·edge_capacity + edge`, `4·task`, the bins and `2·doc` in u32,
        // and store bin offsets and task indices as int32.
        let limit = u32::MAX as usize;
        if NUM_INDEX_HEADS * edge_capacity > limit {
            return Err(RuntimeError::input(
                "schedule.q_indices",
                format!("edge capacity {}", edge_capacity),
                "4·edge_capacity below 2^32",
            ));
        }
        if 4 * capacity > limit || capacity > i32::MAX as usize {
            return Err(RuntimeError::input(
                "schedule",
                format!("task capacity {capacity}"),
                "4·capacity below 2^32",
            ));
        }
        if bins > i32::MAX as usize || 2 * num_docs + 1 > limit {
            return Err(RuntimeError::input(
                "schedule.cu_seqlens",
                format!("{bins} locality bins for {num_docs} documents"),
                "bins below 2^31",
            ));
        }
        Ok(TaskBuildSizes {
            capacity,
            num_docs,
            locality,
            bins_per_head,
            bins,
            scratch_words: 8
                + work_capacity
                + capacity
                + 4 * bins
                + bins.div_ceil(BIN_CHUNK)
                + 2 * num_docs
                + 1
                + 4 * capacity,
            table_words: capacity * 20,
            grid_launch: grid_launch_bound(capacity, num_sms),
            num_sms,
        })
    }
}

/// The counts a task build is sized from: a schedule's shape, not its contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleShape {
    /// Tokens `T`.
    pub num_tokens: usize,
    /// Documents.
    pub num_docs: usize,
    /// Edge capacity per index head.
    pub edge_capacity: usize,
    /// Work-item capacity.
    pub work_capacity: usize,
}

/// Word offsets of the regions inside the one allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskLayout {
    /// Descriptor `int32[8]` (offset 0, so it is 16-byte aligned).
    pub desc: usize,
    /// `task_ends[work_capacity]`.
    pub task_ends: usize,
    /// `segments[capacity]`.
    pub segments: usize,
    /// Bin counts.
    pub bin_count: usize,
    /// Bin first tasks.
    pub bin_first: usize,
    /// Bin last tasks.
    pub bin_last: usize,
    /// Bin offsets.
    pub bin_offset: usize,
    /// Tasks per chunk of [`BIN_CHUNK`] bins: where each CTA of the bin scan starts.
    pub bin_chunk_totals: usize,
    /// Per document its first bin and window shift, then the bin total: `[2·docs + 1]`.
    pub doc_windows: usize,
    /// Decode words `[capacity, 4]`: valid, edge start, document, `head << 24 | kblock`.
    pub decode: usize,
    /// `task_meta [capacity, 4]`.
    pub meta: usize,
    /// `task_qrows [capacity, 8]`.
    pub qrows: usize,
    /// `task_qpos [capacity, 8]`.
    pub qpos: usize,
    /// Total words.
    pub words: usize,
}

impl TaskLayout {
    /// Carves the regions for `sizes` (and `work_capacity` task ends).
    pub fn new(sizes: &TaskBuildSizes, work_capacity: usize) -> Self {
        let mut at = 0;
        let mut take = |len: usize| {
            let start = at;
            at = (at + len).next_multiple_of(REGION_ALIGN_WORDS);
            start
        };
        let cap = sizes.capacity;
        let bins = sizes.bins;
        TaskLayout {
            desc: take(8),
            task_ends: take(work_capacity),
            segments: take(cap),
            bin_count: take(bins),
            bin_first: take(bins),
            bin_last: take(bins),
            bin_offset: take(bins),
            bin_chunk_totals: take(bins.div_ceil(BIN_CHUNK)),
            doc_windows: take(2 * sizes.num_docs + 1),
            decode: take(4 * cap),
            meta: take(4 * cap),
            qrows: take(8 * cap),
            qpos: take(8 * cap),
            words: at,
        }
    }
}

/// Where a schedule's six arrays live on the device, and the shape the task build reads them
/// with: an uploaded host [`Schedule`] ([`DeviceSchedule::refs`]) or one the device built
/// ([`crate::schedule_build::ResidentSchedule::refs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleRefs {
    /// `row_ptr [4, rows+1]`.
    pub row_ptr: u64,
    /// `q_indices [4, edge_capacity]`.
    pub q_indices: u64,
    /// `scheduler_metadata [work_capacity, 6]`.
    pub metadata: u64,
    /// `work_count [1]`.
    pub work_count: u64,
    /// `cu_seqlens [docs+1]`.
    pub cu_seqlens: u64,
    /// `document_workspace_starts [docs]`.
    pub ws_starts: u64,
    /// CSR rows per head (the `row_ptr` stride is `rows + 1`).
    pub rows: usize,
    /// Edge slots per head.
    pub edge_capacity: usize,
    /// Rows of `scheduler_metadata`.
    pub work_capacity: usize,
    /// Documents (`cu_seqlens` holds `num_docs + 1` entries).
    pub num_docs: usize,
}

/// The schedule's arrays on the device: one allocation carved into 256-byte aligned regions.
pub struct DeviceSchedule<B: Backend> {
    // Never read: it owns the memory the addresses below point into.
    #[allow(dead_code)]
    storage: B::Buffer,
    row_ptr: u64,
    q_indices: u64,
    metadata: u64,
    work_count: u64,
    cu_seqlens: u64,
    ws_starts: u64,
    rows: usize,
    edge_capacity: usize,
    work_capacity: usize,
    num_docs: usize,
    bytes: usize,
}

impl<B: Backend> DeviceSchedule<B> {
    /// The schedule's six arrays in `s`'s order, with their region offsets in bytes.
    fn regions<'a>(s: &'a Schedule, work_count: &'a [i32; 1]) -> ([&'a [i32]; 6], [u64; 6], usize) {
        let arrays: [&[i32]; 6] = [
            s.row_ptr(),
            s.q_indices(),
            s.scheduler_metadata(),
            work_count,
            s.cu_seqlens(),
            s.document_workspace_starts(),
        ];
        let mut offsets = [0u64; 6];
        let mut at = 0usize;
        for (o, a) in offsets.iter_mut().zip(arrays) {
            *o = at as u64;
            at = (at + 4 * a.len()).next_multiple_of(4 * REGION_ALIGN_WORDS);
        }
        (arrays, offsets, at)
    }

    /// Allocates the device copy of `s` without writing it; [`DeviceSchedule::write`] fills
    /// it. (The backward allocates before its first launch and copies after it, so that the
    /// copy overlaps the preprocess.)
    pub fn allocate(backend: &mut B, s: &Schedule) -> Result<Self, RuntimeError> {
        let (_, offsets, bytes) = Self::regions(s, &[s.work_count()]);
        let storage = backend.alloc("schedule", bytes)?;
        let base = backend.address(&storage);
        let at = |i: usize| base + offsets[i];
        Ok(DeviceSchedule {
            row_ptr: at(0),
            q_indices: at(1),
            metadata: at(2),
            work_count: at(3),
            cu_seqlens: at(4),
            ws_starts: at(5),
            storage,
            rows: s.rows(),
            edge_capacity: s.edge_capacity(),
            work_capacity: s.work_capacity(),
            num_docs: s.num_documents(),
            bytes,
        })
    }

    /// Bytes of the one allocation.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Copies `s` (the schedule it was allocated for) to the device, stream-ordered.
    pub fn write(&self, backend: &mut B, s: &Schedule) -> Result<(), RuntimeError> {
        if (s.rows(), s.edge_capacity(), s.work_capacity())
            != (self.rows, self.edge_capacity, self.work_capacity)
        {
            return Err(RuntimeError::input(
                "schedule",
                format!("rows {}, edge capacity {}", s.rows(), s.edge_capacity()),
                format!(
                    "the allocation's rows {}, edge capacity {}",
                    self.rows, self.edge_capacity
                ),
            ));
        }
        let work_count = [s.work_count()];
        let (mut arrays, _, _) = Self::regions(s, &work_count);
        // A schedule restricted to the query rows `r0..` (a context-parallel rank) addresses
        // query-side buffers whose token 0 is row `r0`: the task build computes a task's row as
        // `cu_seqlens[doc] + q` and uses `cu_seqlens` otherwise only in differences (document
        // lengths), so it gets `cu_seqlens − r0`, wrapping as its 32-bit adds do.
        let shifted: Vec<i32>;
        let r0 = s.query_rows().start;
        if r0 != 0 {
            shifted = s
                .cu_seqlens()
                .iter()
                .map(|&c| c.wrapping_sub(r0 as i32))
                .collect();
            arrays[4] = &shifted;
        }
        let dst = [
            self.row_ptr,
            self.q_indices,
            self.metadata,
            self.work_count,
            self.cu_seqlens,
            self.ws_starts,
        ];
        for (a, d) in arrays.iter().zip(dst) {
            if !a.is_empty() {
                backend.upload("schedule", d, bytes_of(a))?;
            }
        }
        Ok(())
    }

    /// The addresses and shape the task build reads.
    pub fn refs(&self) -> ScheduleRefs {
        ScheduleRefs {
            row_ptr: self.row_ptr,
            q_indices: self.q_indices,
            metadata: self.metadata,
            work_count: self.work_count,
            cu_seqlens: self.cu_seqlens,
            ws_starts: self.ws_starts,
            rows: self.rows,
            edge_capacity: self.edge_capacity,
            work_capacity: self.work_capacity,
            num_docs: self.num_docs,
        }
    }

    /// Allocates and copies a validated schedule (stream-ordered).
    pub fn upload(backend: &mut B, s: &Schedule) -> Result<Self, RuntimeError> {
        let d = Self::allocate(backend, s)?;
        d.write(backend, s)?;
        Ok(d)
    }
}

/// The one allocation holding the task build's scratch and tables, carved by a
/// [`TaskLayout`]. Reused across calls whose sizes fit.
pub struct TaskWorkspace<B: Backend> {
    sizes: TaskBuildSizes,
    layout: TaskLayout,
    work_capacity: usize,
    base: u64,
    // Never read: it owns the memory `base` points into.
    #[allow(dead_code)]
    storage: B::Buffer,
}

impl<B: Backend> TaskWorkspace<B> {
    /// Allocates the workspace for `sizes` and zeroes it (stream-ordered).
    pub fn new(
        backend: &mut B,
        sizes: TaskBuildSizes,
        work_capacity: usize,
    ) -> Result<Self, RuntimeError> {
        let layout = TaskLayout::new(&sizes, work_capacity);
        let storage = backend.alloc("task workspace", 4 * layout.words)?;
        let base = backend.address(&storage);
        backend.zero("task workspace", base, 4 * layout.words)?;
        Ok(TaskWorkspace {
            sizes,
            layout,
            work_capacity,
            base,
            storage,
        })
    }

    /// The sizes this workspace was made for.
    pub fn sizes(&self) -> &TaskBuildSizes {
        &self.sizes
    }

    /// The region layout.
    pub fn layout(&self) -> &TaskLayout {
        &self.layout
    }

    /// Whether this workspace can serve a build of `sizes`.
    pub fn fits(&self, sizes: &TaskBuildSizes, work_capacity: usize) -> bool {
        *sizes == self.sizes && work_capacity == self.work_capacity
    }

    /// The region starting at word `words`.
    fn at(&self, words: usize) -> u64 {
        self.base + 4 * words as u64
    }

    /// The descriptor `int32[8]` on the device.
    pub fn desc(&self) -> Ptr<i32> {
        Ptr::new(self.at(self.layout.desc))
    }

    /// `task_meta [capacity, 4]`.
    pub fn task_meta(&self) -> Ptr<i32> {
        Ptr::new(self.at(self.layout.meta))
    }

    /// `task_qrows [capacity, 8]`.
    pub fn task_qrows(&self) -> Ptr<i32> {
        Ptr::new(self.at(self.layout.qrows))
    }

    /// `task_qpos [capacity, 8]`.
    pub fn task_qpos(&self) -> Ptr<i32> {
        Ptr::new(self.at(self.layout.qpos))
    }

    /// The whole allocation's address and bytes.
    pub fn storage(&self) -> (u64, usize) {
        (self.base, 4 * self.layout.words)
    }

    /// Issues the four task-build launches. No host sync.
    pub fn build(
        &mut self,
        backend: &mut B,
        schedule: &DeviceSchedule<B>,
    ) -> Result<(), RuntimeError> {
        self.build_from(backend, &schedule.refs())
    }

    /// [`TaskWorkspace::build`] from any schedule on the device. No host sync.
    pub fn build_from(
        &mut self,
        backend: &mut B,
        schedule: &ScheduleRefs,
    ) -> Result<(), RuntimeError> {
        self.build_zeroing(backend, schedule, None)
    }

    /// [`TaskWorkspace::build_from`] that also zeroes `zero = (addr, bytes)` (16-byte
    /// aligned, a multiple of 16 bytes) on the SMs its two single-CTA scans leave idle: each
    /// scan launches [`SPARE_CTAS_PER_SM`] CTAs per SM beside its own, which zero half of it.
    /// No host sync.
    pub fn build_zeroing(
        &mut self,
        backend: &mut B,
        schedule: &ScheduleRefs,
        zero: Option<(u64, usize)>,
    ) -> Result<(), RuntimeError> {
        if schedule.num_docs != self.sizes.num_docs {
            return Err(RuntimeError::input(
                "schedule.cu_seqlens",
                format!("{} documents", schedule.num_docs),
                format!("the workspace's {}", self.sizes.num_docs),
            ));
        }
        if schedule.work_capacity != self.work_capacity {
            return Err(RuntimeError::input(
                "schedule.scheduler_metadata",
                format!("work capacity {}", schedule.work_capacity),
                format!("the workspace's {}", self.work_capacity),
            ));
        }
        for k in [
            &task_scan_work::KERNEL,
            &task_assign_segments::KERNEL,
            &task_scan_bins::KERNEL,
            &task_scatter_tables::KERNEL,
        ] {
            backend.load(k)?;
        }
        let sz = self.sizes;
        let u32_of = |field: &'static str, v: usize| {
            u32::try_from(v).map_err(|_| RuntimeError::input(field, v, "below 2^32"))
        };
        let cap = u32_of("capacity", sz.capacity)?;
        let bins = u32_of("bins", sz.bins)?;
        let rows = u32_of("schedule.rows", schedule.rows)?;
        let edge_cap = u32_of("schedule.edge_capacity", schedule.edge_capacity)?;
        let work_cap = u32_of("schedule.work_capacity", schedule.work_capacity)?;
        let docs = u32_of("num_docs", sz.num_docs)?;
        let per_head = u32_of("bins_per_head", sz.bins_per_head)?;
        let Locality {
            min_window_log2: min_log2,
            blocks_log2,
            max_window_log2: max_log2,
        } = sz.locality;
        let sms = u32_of("num_sms", sz.num_sms)?;
        let task_ctas = sz
            .capacity
            .div_ceil(task_assign_segments::THREADS.0 as usize) as u32;
        // The two halves of `zero` in 16-byte words, and the scans' spare CTAs.
        let (zero_halves, spare) = match zero {
            Some((addr, bytes)) if bytes > 0 => {
                if addr % 16 != 0 || bytes % 16 != 0 {
                    return Err(RuntimeError::input(
                        "zero",
                        format!("{bytes} bytes at {addr:#x}"),
                        "16-byte aligned, a multiple of 16 bytes",
                    ));
                }
                let words = bytes / 16;
                let first = words / 2;
                let halves = [(addr, first), (addr + 16 * first as u64, words - first)];
                let halves = halves.map(|(a, w)| {
                    u32::try_from(w)
                        .ok()
                        .filter(|&w| w < 1 << 31)
                        .map(|w| (a, w))
                        .ok_or_else(|| {
                            RuntimeError::input("zero", bytes, "halves under 2^31 16-byte words")
                        })
                });
                let [a, b] = halves;
                ([a?, b?], SPARE_CTAS_PER_SM * sms)
            }
            _ => ([(0, 0); 2], 0),
        };
        let bin_ctas = u32_of("bin scan CTAs", sz.bins.div_ceil(BIN_CHUNK))?;
        let bin_grid = bin_ctas
            .checked_add(spare)
            .ok_or_else(|| RuntimeError::input("bins", sz.bins, "a bin scan grid below 2^32"))?;
        let l = self.layout;
        let r = |words: usize| Ptr::<i32>::new(self.at(words));
        let w = |words: usize| PtrMut::<i32>::new(self.at(words));
        let s = schedule;
        let launches = [
            (
                &task_scan_work::KERNEL,
                (1 + spare, 1, 1),
                task_scan_work::args(
                    Ptr::new(s.metadata),
                    Ptr::new(s.work_count),
                    w(l.desc),
                    w(l.task_ends),
                    w(l.bin_count),
                    w(l.bin_first),
                    w(l.bin_last),
                    w(l.bin_chunk_totals),
                    Ptr::new(s.cu_seqlens),
                    w(l.doc_windows),
                    work_cap,
                    bins,
                    docs,
                    min_log2,
                    blocks_log2,
                    max_log2,
                    PtrMut::new(zero_halves[0].0),
                    zero_halves[0].1,
                ),
            ),
            (
                &task_assign_segments::KERNEL,
                (task_ctas, 1, 1),
                task_assign_segments::args(
                    Ptr::new(s.metadata),
                    Ptr::new(s.row_ptr),
                    Ptr::new(s.q_indices),
                    Ptr::new(s.cu_seqlens),
                    Ptr::new(s.ws_starts),
                    r(l.desc),
                    r(l.task_ends),
                    w(l.segments),
                    w(l.decode),
                    w(l.bin_count),
                    w(l.bin_first),
                    w(l.bin_last),
                    w(l.bin_chunk_totals),
                    r(l.doc_windows),
                    rows,
                    edge_cap,
                    cap,
                    per_head,
                ),
            ),
            (
                &task_scan_bins::KERNEL,
                (bin_grid, 1, 1),
                task_scan_bins::args(
                    r(l.bin_count),
                    r(l.bin_first),
                    r(l.bin_last),
                    r(l.bin_chunk_totals),
                    w(l.bin_offset),
                    w(l.desc),
                    bins,
                    PtrMut::new(zero_halves[1].0),
                    zero_halves[1].1,
                ),
            ),
            (
                &task_scatter_tables::KERNEL,
                (task_ctas, 1, 1),
                task_scatter_tables::args(
                    Ptr::new(s.q_indices),
                    Ptr::new(s.cu_seqlens),
                    Ptr::new(s.ws_starts),
                    w(l.desc),
                    r(l.segments),
                    r(l.decode),
                    r(l.bin_first),
                    r(l.bin_offset),
                    w(l.meta),
                    w(l.qrows),
                    w(l.qpos),
                    edge_cap,
                    cap,
                    sms,
                ),
            ),
        ];
        for (kernel, grid, args) in &launches {
            // SAFETY: every region was carved from the same `sizes` the scalars come from,
            // and the schedule's arrays hold the shape `ScheduleRefs` states.
            unsafe { backend.launch(kernel, *grid, args) }?;
        }
        Ok(())
    }

    /// Copies the descriptor and the first `NUM_TASK_ROWS` table rows back. Synchronizes.
    pub fn read_tables(&self, backend: &mut B) -> Result<HostTaskTables, RuntimeError> {
        let d = from_bytes::<i32>(&backend.download("task descriptor", self.desc().addr(), 32)?);
        let mut desc = [0i32; 8];
        desc.copy_from_slice(&d);
        let n = (desc[0].max(0) as usize).min(self.sizes.capacity);
        let mut rows = |p: Ptr<i32>, w: usize| -> Result<Vec<i32>, RuntimeError> {
            Ok(from_bytes(&backend.download(
                "task tables",
                p.addr(),
                4 * n * w,
            )?))
        };
        Ok(HostTaskTables {
            desc,
            meta: rows(self.task_meta(), 4)?,
            qrows: rows(self.task_qrows(), 8)?,
            qpos: rows(self.task_qpos(), 8)?,
        })
    }
}

/// Task tables copied back to the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostTaskTables {
    /// The descriptor.
    pub desc: [i32; 8],
    /// `task_meta [NUM_TASK_ROWS, 4]`.
    pub meta: Vec<i32>,
    /// `task_qrows [NUM_TASK_ROWS, 8]`.
    pub qrows: Vec<i32>,
    /// `task_qpos [NUM_TASK_ROWS, 8]`.
    pub qpos: Vec<i32>,
}
