//! The device task build (seed-design §2.2–§2.4): sizing, the one workspace allocation carved
//! into aligned regions, the four launches, and reading the results back.
//!
//! Everything is enqueued on the caller's stream; nothing here synchronizes unless a function
//! says so ([`TaskWorkspace::read_tables`], [`FlagsReadback::wait`]).

use crate::contract::{
    grid_launch_bound, BLOCK_SIZE, LOCALITY_WINDOW, MAX_BINS, NUM_INDEX_HEADS, QUERY_CHUNK,
};
use crate::device::Device;
use crate::error::RuntimeError;
use crate::kernels::{task_assign_segments, task_scan_bins, task_scan_work, task_scatter_tables};
use crate::schedule::Schedule;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};
use std::mem::ManuallyDrop;
use std::sync::Arc;

/// Descriptor flag: more tasks than capacity; the walk has zero rows.
pub const FLAG_CAPACITY_OVERFLOW: i32 = 1;
/// Descriptor flag: a segment's tasks were not consecutive; tables are in source order.
pub const FLAG_NONCONTIGUOUS_SEGMENTS: i32 = 2;

/// Region starts are rounded to 256 bytes, which also satisfies the 16-byte vector stores.
const REGION_ALIGN_WORDS: usize = 64;

/// Sizes of the task build for one schedule (seed-design §2.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskBuildSizes {
    /// Upper bound on tasks: `4·edge_capacity/8 + work_capacity`.
    pub capacity: usize,
    /// Locality windows: `ceil(T/512)`.
    pub num_windows: usize,
    /// Key blocks of the workspace: `W/128`.
    pub num_kblocks: usize,
    /// Locality bins: `4·num_windows·max(num_kblocks, 1)`.
    pub bins: usize,
    /// Scratch words: `8 + work_capacity + capacity + 4·bins + 3·capacity`.
    pub scratch_words: usize,
    /// Table words: `capacity·(4 + 16)`.
    pub table_words: usize,
    /// CTAs the main kernel is launched with: `grid_launch_bound(capacity, num_sms)`.
    pub grid_launch: usize,
    /// The SM count the walk was sized for.
    pub num_sms: usize,
}

impl TaskBuildSizes {
    /// Sizes the task build; fails before any launch when the bins exceed [`MAX_BINS`] or a
    /// count overflows the kernels' 32-bit index arithmetic.
    pub fn new(schedule: &Schedule, num_sms: usize) -> Result<Self, RuntimeError> {
        if num_sms == 0 {
            return Err(RuntimeError::input("num_sms", 0, "at least 1"));
        }
        let capacity =
            NUM_INDEX_HEADS * schedule.edge_capacity() / QUERY_CHUNK + schedule.work_capacity();
        let num_windows = schedule.num_tokens().div_ceil(LOCALITY_WINDOW);
        let num_kblocks = schedule.workspace_rows() / BLOCK_SIZE;
        let bins = NUM_INDEX_HEADS * num_windows * num_kblocks.max(1);
        if bins > MAX_BINS {
            return Err(RuntimeError::TooManyBins {
                bins,
                limit: MAX_BINS,
                num_tokens: schedule.num_tokens(),
                workspace_rows: schedule.workspace_rows(),
            });
        }
        // The kernels index `head·edge_capacity + edge` and `3·task` in u32.
        let limit = u32::MAX as usize;
        if NUM_INDEX_HEADS * schedule.edge_capacity() > limit {
            return Err(RuntimeError::input(
                "schedule.q_indices",
                format!("edge capacity {}", schedule.edge_capacity()),
                "4·edge_capacity below 2^32",
            ));
        }
        if 3 * capacity > limit || capacity > i32::MAX as usize {
            return Err(RuntimeError::input(
                "schedule",
                format!("task capacity {capacity}"),
                "3·capacity below 2^32",
            ));
        }
        Ok(TaskBuildSizes {
            capacity,
            num_windows,
            num_kblocks,
            bins,
            scratch_words: 8 + schedule.work_capacity() + capacity + 4 * bins + 3 * capacity,
            table_words: capacity * 20,
            grid_launch: grid_launch_bound(capacity, num_sms),
            num_sms,
        })
    }
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
    /// Decode words `[capacity, 3]`.
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
            decode: take(3 * cap),
            meta: take(4 * cap),
            qrows: take(8 * cap),
            qpos: take(8 * cap),
            words: at,
        }
    }

    fn regions(&self, sizes: &TaskBuildSizes, work_capacity: usize) -> [(usize, usize); 11] {
        let (cap, bins) = (sizes.capacity, sizes.bins);
        [
            (self.desc, 8),
            (self.task_ends, work_capacity),
            (self.segments, cap),
            (self.bin_count, bins),
            (self.bin_first, bins),
            (self.bin_last, bins),
            (self.bin_offset, bins),
            (self.decode, 3 * cap),
            (self.meta, 4 * cap),
            (self.qrows, 8 * cap),
            (self.qpos, 8 * cap),
        ]
    }
}

/// The schedule's arrays on the device.
pub struct DeviceSchedule {
    row_ptr: CudaSlice<i32>,
    q_indices: CudaSlice<i32>,
    metadata: CudaSlice<i32>,
    work_count: CudaSlice<i32>,
    cu_seqlens: CudaSlice<i32>,
    ws_starts: CudaSlice<i32>,
    rows: usize,
    edge_capacity: usize,
    work_capacity: usize,
}

impl DeviceSchedule {
    /// Copies a validated schedule to the device (asynchronously, on `stream`).
    pub fn upload(stream: &Arc<CudaStream>, s: &Schedule) -> Result<Self, RuntimeError> {
        let up = |v: &[i32]| {
            stream
                .clone_htod(v)
                .map_err(RuntimeError::driver("cuMemcpyHtoD(schedule)"))
        };
        Ok(DeviceSchedule {
            row_ptr: up(s.row_ptr())?,
            q_indices: up(s.q_indices())?,
            metadata: up(s.scheduler_metadata())?,
            work_count: up(&[s.work_count()])?,
            cu_seqlens: up(s.cu_seqlens())?,
            ws_starts: up(s.document_workspace_starts())?,
            rows: s.rows(),
            edge_capacity: s.edge_capacity(),
            work_capacity: s.work_capacity(),
        })
    }
}

/// The one allocation holding the task build's scratch and tables, with a typed window per
/// region. Reused across calls whose sizes fit.
pub struct TaskWorkspace {
    sizes: TaskBuildSizes,
    layout: TaskLayout,
    work_capacity: usize,
    // Windows into `storage`, created over its device pointer; never freed themselves.
    regions: ManuallyDrop<Vec<CudaSlice<i32>>>,
    storage: CudaSlice<i32>,
}

impl Drop for TaskWorkspace {
    fn drop(&mut self) {
        // SAFETY: the windows are not used after this; leaking them releases their events
        // without freeing memory that `storage` owns.
        let regions = unsafe { ManuallyDrop::take(&mut self.regions) };
        for r in regions {
            r.leak();
        }
    }
}

// Indices into `TaskWorkspace::regions`, in `TaskLayout::regions` order.
const DESC: usize = 0;
const META: usize = 8;
const QROWS: usize = 9;
const QPOS: usize = 10;

impl TaskWorkspace {
    /// Allocates the workspace for `sizes` on `stream`.
    pub fn new(
        stream: &Arc<CudaStream>,
        sizes: TaskBuildSizes,
        work_capacity: usize,
    ) -> Result<Self, RuntimeError> {
        let layout = TaskLayout::new(&sizes, work_capacity);
        let storage = stream
            .alloc_zeros::<i32>(layout.words)
            .map_err(RuntimeError::driver("cuMemAlloc(task workspace)"))?;
        let (base, _guard) = storage.device_ptr(stream);
        let regions = layout
            .regions(&sizes, work_capacity)
            .iter()
            // SAFETY: every window lies inside `storage` (the layout's regions are disjoint
            // and end before `layout.words`), and `storage` outlives them (see Drop).
            .map(|&(start, len)| unsafe {
                stream.upgrade_device_ptr::<i32>(base + 4 * start as u64, len)
            })
            .collect();
        drop(_guard);
        Ok(TaskWorkspace {
            sizes,
            layout,
            work_capacity,
            regions: ManuallyDrop::new(regions),
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

    /// The descriptor `int32[8]` on the device.
    pub fn desc(&self) -> &CudaSlice<i32> {
        &self.regions[DESC]
    }

    /// `task_meta [capacity, 4]`.
    pub fn task_meta(&self) -> &CudaSlice<i32> {
        &self.regions[META]
    }

    /// `task_qrows [capacity, 8]`.
    pub fn task_qrows(&self) -> &CudaSlice<i32> {
        &self.regions[QROWS]
    }

    /// `task_qpos [capacity, 8]`.
    pub fn task_qpos(&self) -> &CudaSlice<i32> {
        &self.regions[QPOS]
    }

    /// Enqueues the four task-build launches on `stream`. No host sync.
    pub fn build(
        &mut self,
        stream: &Arc<CudaStream>,
        schedule: &DeviceSchedule,
    ) -> Result<(), RuntimeError> {
        if schedule.work_capacity != self.work_capacity {
            return Err(RuntimeError::input(
                "schedule.scheduler_metadata",
                format!("work capacity {}", schedule.work_capacity),
                format!("the workspace's {}", self.work_capacity),
            ));
        }
        let device = Device::of(stream.context())?;
        let sz = self.sizes;
        let u32_of = |field: &'static str, v: usize| {
            u32::try_from(v).map_err(|_| RuntimeError::input(field, v, "below 2^32"))
        };
        let cap = u32_of("capacity", sz.capacity)?;
        let bins = u32_of("bins", sz.bins)?;
        let rows = u32_of("schedule.rows", schedule.rows)?;
        let edge_cap = u32_of("schedule.edge_capacity", schedule.edge_capacity)?;
        let work_cap = u32_of("schedule.work_capacity", schedule.work_capacity)?;
        let windows = u32_of("num_windows", sz.num_windows)?;
        let kblocks = u32_of("num_kblocks", sz.num_kblocks.max(1))?;
        let sms = u32_of("num_sms", sz.num_sms)?;
        let task_ctas = sz
            .capacity
            .div_ceil(task_assign_segments::THREADS.0 as usize) as u32;
        let launch = RuntimeError::driver("cuLaunchKernel(task build)");

        // Windows are separate handles over one allocation, so each launch can borrow several
        // regions mutably at once; take them out for the duration of the launches.
        let mut r: Vec<CudaSlice<i32>> = std::mem::take(&mut *self.regions);
        let result = (|| -> Result<(), RuntimeError> {
            let [desc, task_ends, segments, count, first, last, offset, decode, meta, qrows, qpos] =
                r.as_mut_slice()
            else {
                unreachable!("the layout has eleven regions")
            };
            let f = device.function(task_scan_work::NAME, task_scan_work::VARIANTS)?;
            // SAFETY: every region was sized from the same `sizes` the scalars come from.
            unsafe {
                task_scan_work::launch(
                    stream,
                    &f,
                    (1, 1, 1),
                    &schedule.metadata.as_view(),
                    &schedule.work_count.as_view(),
                    &mut desc.as_view_mut(),
                    &mut task_ends.as_view_mut(),
                    &mut count.as_view_mut(),
                    &mut first.as_view_mut(),
                    &mut last.as_view_mut(),
                    work_cap,
                    bins,
                )
            }
            .map_err(launch)?;
            let f = device.function(task_assign_segments::NAME, task_assign_segments::VARIANTS)?;
            // SAFETY: as above.
            unsafe {
                task_assign_segments::launch(
                    stream,
                    &f,
                    (task_ctas, 1, 1),
                    &schedule.metadata.as_view(),
                    &schedule.row_ptr.as_view(),
                    &schedule.q_indices.as_view(),
                    &schedule.cu_seqlens.as_view(),
                    &schedule.ws_starts.as_view(),
                    &desc.as_view(),
                    &task_ends.as_view(),
                    &mut segments.as_view_mut(),
                    &mut decode.as_view_mut(),
                    &mut count.as_view_mut(),
                    &mut first.as_view_mut(),
                    &mut last.as_view_mut(),
                    rows,
                    edge_cap,
                    cap,
                    windows,
                    kblocks,
                )
            }
            .map_err(RuntimeError::driver("cuLaunchKernel(task_assign_segments)"))?;
            let f = device.function(task_scan_bins::NAME, task_scan_bins::VARIANTS)?;
            // SAFETY: as above.
            unsafe {
                task_scan_bins::launch(
                    stream,
                    &f,
                    (1, 1, 1),
                    &count.as_view(),
                    &first.as_view(),
                    &last.as_view(),
                    &mut offset.as_view_mut(),
                    &mut desc.as_view_mut(),
                    bins,
                )
            }
            .map_err(RuntimeError::driver("cuLaunchKernel(task_scan_bins)"))?;
            let f = device.function(task_scatter_tables::NAME, task_scatter_tables::VARIANTS)?;
            // SAFETY: as above.
            unsafe {
                task_scatter_tables::launch(
                    stream,
                    &f,
                    (task_ctas, 1, 1),
                    &schedule.q_indices.as_view(),
                    &schedule.cu_seqlens.as_view(),
                    &schedule.ws_starts.as_view(),
                    &mut desc.as_view_mut(),
                    &segments.as_view(),
                    &decode.as_view(),
                    &first.as_view(),
                    &offset.as_view(),
                    &mut meta.as_view_mut(),
                    &mut qrows.as_view_mut(),
                    &mut qpos.as_view_mut(),
                    edge_cap,
                    cap,
                    windows,
                    kblocks,
                    sms,
                )
            }
            .map_err(RuntimeError::driver("cuLaunchKernel(task_scatter_tables)"))?;
            Ok(())
        })();
        *self.regions = std::mem::take(&mut r);
        result
    }

    /// Enqueues a copy of the descriptor's flags word to pinned host memory without blocking.
    pub fn read_flags(&self, stream: &Arc<CudaStream>) -> Result<FlagsReadback, RuntimeError> {
        // SAFETY: pinned memory of one i32, written only by the copy below.
        let mut host = unsafe { stream.context().alloc_pinned::<i32>(1) }
            .map_err(RuntimeError::driver("cuMemHostAlloc"))?;
        let desc = self.desc();
        stream
            .memcpy_dtoh(&desc.slice(7..8), &mut host)
            .map_err(RuntimeError::driver("cuMemcpyDtoHAsync(flags)"))?;
        let done = stream
            .record_event(None)
            .map_err(RuntimeError::driver("cuEventRecord"))?;
        Ok(FlagsReadback { host, done })
    }

    /// Copies the descriptor and the first `NUM_TASK_ROWS` table rows back. Synchronizes.
    pub fn read_tables(&self, stream: &Arc<CudaStream>) -> Result<HostTaskTables, RuntimeError> {
        let dtoh = RuntimeError::driver("cuMemcpyDtoH(task tables)");
        let d = stream.clone_dtoh(self.desc()).map_err(dtoh)?;
        let mut desc = [0i32; 8];
        desc.copy_from_slice(&d);
        let n = (desc[0].max(0) as usize).min(self.sizes.capacity);
        let rows = |s: &CudaSlice<i32>, w: usize| stream.clone_dtoh(&s.slice(0..n * w));
        Ok(HostTaskTables {
            desc,
            meta: rows(self.task_meta(), 4)
                .map_err(RuntimeError::driver("cuMemcpyDtoH(task_meta)"))?,
            qrows: rows(self.task_qrows(), 8)
                .map_err(RuntimeError::driver("cuMemcpyDtoH(task_qrows)"))?,
            qpos: rows(self.task_qpos(), 8)
                .map_err(RuntimeError::driver("cuMemcpyDtoH(task_qpos)"))?,
        })
    }

    /// The whole allocation (for zeroing or inspection).
    pub fn storage(&self) -> &CudaSlice<i32> {
        &self.storage
    }
}

/// The flags word on its way to the host.
pub struct FlagsReadback {
    host: PinnedHostSlice<i32>,
    done: CudaEvent,
}

impl FlagsReadback {
    /// The flags if the copy has finished, without blocking.
    pub fn poll(&self) -> Option<i32> {
        if self.done.is_complete() {
            self.host.as_slice().ok().map(|s| s[0])
        } else {
            None
        }
    }

    /// Blocks until the copy has finished and returns the flags.
    pub fn wait(&self) -> Result<i32, RuntimeError> {
        self.done
            .synchronize()
            .map_err(RuntimeError::driver("cuEventSynchronize"))?;
        let s = self
            .host
            .as_slice()
            .map_err(RuntimeError::driver("cuEventSynchronize"))?;
        Ok(s[0])
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
