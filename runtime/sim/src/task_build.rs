//! The device task build on the simulator: the host logic of
//! `msa_runtime::tasks::TaskWorkspace::build` (sizing, the one carved workspace, the four
//! launches and their scalar arguments) as pure functions over simulated device pointers.
//!
//! [`task_build_launches`] is the mirror: given the runtime's own [`TaskBuildSizes`] and
//! [`TaskLayout`] it returns the four launches in order, each with the grid, block, dynamic
//! shared memory and arguments `TaskWorkspace::build` passes. [`TaskBuild::run`] uploads a
//! schedule, allocates the zeroed workspace, runs the launches and
//! [`TaskBuild::read_tables`] reads the tables back as `TaskWorkspace::read_tables` does.

use msa_runtime::kernels::{
    task_assign_segments, task_scan_bins, task_scan_work, task_scatter_tables,
};
use msa_runtime::tasks::{HostTaskTables, TaskBuildSizes, TaskLayout};
use msa_runtime::Schedule;

use crate::error::SimError;
use crate::exec::{Arg, Gpu, LaunchConfig, LaunchStats};
use crate::memory::DevPtr;
use crate::module::Module;

/// A GPU architecture the kernels ship PTX for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Hopper, compute capability 9.0 (`sm_90a` PTX).
    Sm90,
    /// Blackwell, compute capability 10.0 (`sm_100a` PTX).
    Sm100,
}

impl Arch {
    /// The compute capability the runtime selects variants by.
    pub fn compute_capability(self) -> (i32, i32) {
        match self {
            Arch::Sm90 => (9, 0),
            Arch::Sm100 => (10, 0),
        }
    }

    /// The PTX the runtime would JIT for this architecture out of `variants` (a kernel's
    /// `VARIANTS` table in `msa_runtime::kernels`).
    pub fn ptx(self, variants: &[((i32, i32), &'static str)]) -> Option<&'static str> {
        let cc = self.compute_capability();
        variants.iter().find(|(v, _)| *v == cc).map(|(_, p)| *p)
    }
}

/// The schedule's arrays in simulated device memory, as `DeviceSchedule::upload` creates them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleBuffers {
    /// `row_ptr`
    pub row_ptr: DevPtr,
    /// `q_indices`
    pub q_indices: DevPtr,
    /// `scheduler_metadata`
    pub metadata: DevPtr,
    /// `work_count` (one `i32`)
    pub work_count: DevPtr,
    /// `cu_seqlens`
    pub cu_seqlens: DevPtr,
    /// `document_workspace_starts`
    pub ws_starts: DevPtr,
    /// CSR rows.
    pub rows: usize,
    /// Edges per head.
    pub edge_capacity: usize,
    /// Metadata rows.
    pub work_capacity: usize,
}

impl ScheduleBuffers {
    /// Copies a schedule into `gpu`'s memory.
    pub fn upload(gpu: &mut Gpu, s: &Schedule) -> Self {
        ScheduleBuffers {
            row_ptr: gpu.upload("row_ptr", s.row_ptr()),
            q_indices: gpu.upload("q_indices", s.q_indices()),
            metadata: gpu.upload("scheduler_metadata", s.scheduler_metadata()),
            work_count: gpu.upload("work_count", &[s.work_count()]),
            cu_seqlens: gpu.upload("cu_seqlens", s.cu_seqlens()),
            ws_starts: gpu.upload("document_workspace_starts", s.document_workspace_starts()),
            rows: s.rows(),
            edge_capacity: s.edge_capacity(),
            work_capacity: s.work_capacity(),
        }
    }
}

/// One kernel launch: the entry, its shape and its arguments in parameter order.
#[derive(Debug, Clone, PartialEq)]
pub struct Launch {
    /// Entry name.
    pub kernel: &'static str,
    /// Grid, block and dynamic shared memory.
    pub config: LaunchConfig,
    /// Arguments in declaration order.
    pub args: Vec<Arg>,
}

fn block(t: (u32, u32, u32)) -> [u32; 3] {
    [t.0, t.1, t.2]
}

/// The four task-build launches `TaskWorkspace::build` enqueues, in order, for a workspace
/// carved by `layout` at `workspace` (word offsets times 4 bytes).
///
/// Fails, like the runtime, when a scalar does not fit in 32 bits or the schedule's work
/// capacity differs from the one the sizes were made for.
pub fn task_build_launches(
    sizes: &TaskBuildSizes,
    layout: &TaskLayout,
    schedule: &ScheduleBuffers,
    workspace: DevPtr,
) -> Result<[Launch; 4], String> {
    let u32_of = |field: &str, v: usize| {
        u32::try_from(v).map_err(|_| format!("`{field}` = {v} does not fit in 32 bits"))
    };
    let cap = u32_of("capacity", sizes.capacity)?;
    let bins = u32_of("bins", sizes.bins)?;
    let rows = u32_of("schedule.rows", schedule.rows)?;
    let edge_cap = u32_of("schedule.edge_capacity", schedule.edge_capacity)?;
    let work_cap = u32_of("schedule.work_capacity", schedule.work_capacity)?;
    let windows = u32_of("num_windows", sizes.num_windows)?;
    let kblocks = u32_of("num_kblocks", sizes.num_kblocks.max(1))?;
    let sms = u32_of("num_sms", sizes.num_sms)?;
    let task_ctas = u32_of(
        "task CTAs",
        sizes
            .capacity
            .div_ceil(task_assign_segments::THREADS.0 as usize),
    )?;
    let region = |words: usize| Arg::Ptr(workspace.offset(4 * words as u64));
    let desc = region(layout.desc);
    let task_ends = region(layout.task_ends);
    let segments = region(layout.segments);
    let count = region(layout.bin_count);
    let first = region(layout.bin_first);
    let last = region(layout.bin_last);
    let offset = region(layout.bin_offset);
    let decode = region(layout.decode);
    let meta = region(layout.meta);
    let qrows = region(layout.qrows);
    let qpos = region(layout.qpos);
    let s = schedule;
    let p = Arg::Ptr;
    let cfg = |grid: u32, threads: (u32, u32, u32), dynamic: u32| LaunchConfig {
        grid: [grid, 1, 1],
        block: block(threads),
        dynamic_shared_bytes: dynamic,
    };
    Ok([
        Launch {
            kernel: task_scan_work::NAME,
            config: cfg(
                1,
                task_scan_work::THREADS,
                task_scan_work::DYNAMIC_SHARED_BYTES,
            ),
            args: vec![
                p(s.metadata),
                p(s.work_count),
                desc.clone(),
                task_ends.clone(),
                count.clone(),
                first.clone(),
                last.clone(),
                Arg::U32(work_cap),
                Arg::U32(bins),
            ],
        },
        Launch {
            kernel: task_assign_segments::NAME,
            config: cfg(
                task_ctas,
                task_assign_segments::THREADS,
                task_assign_segments::DYNAMIC_SHARED_BYTES,
            ),
            args: vec![
                p(s.metadata),
                p(s.row_ptr),
                p(s.q_indices),
                p(s.cu_seqlens),
                p(s.ws_starts),
                desc.clone(),
                task_ends,
                segments.clone(),
                decode.clone(),
                count.clone(),
                first.clone(),
                last.clone(),
                Arg::U32(rows),
                Arg::U32(edge_cap),
                Arg::U32(cap),
                Arg::U32(windows),
                Arg::U32(kblocks),
            ],
        },
        Launch {
            kernel: task_scan_bins::NAME,
            config: cfg(
                1,
                task_scan_bins::THREADS,
                task_scan_bins::DYNAMIC_SHARED_BYTES,
            ),
            args: vec![
                count,
                first.clone(),
                last,
                offset.clone(),
                desc.clone(),
                Arg::U32(bins),
            ],
        },
        Launch {
            kernel: task_scatter_tables::NAME,
            config: cfg(
                task_ctas,
                task_scatter_tables::THREADS,
                task_scatter_tables::DYNAMIC_SHARED_BYTES,
            ),
            args: vec![
                p(s.q_indices),
                p(s.cu_seqlens),
                p(s.ws_starts),
                desc,
                segments,
                decode,
                first,
                offset,
                meta,
                qrows,
                qpos,
                Arg::U32(edge_cap),
                Arg::U32(cap),
                Arg::U32(windows),
                Arg::U32(kblocks),
                Arg::U32(sms),
            ],
        },
    ])
}

/// Parses the four task-build kernels the runtime would load on `arch`.
pub fn task_build_modules(arch: Arch) -> Result<Vec<Module>, SimError> {
    [
        task_scan_work::VARIANTS,
        task_assign_segments::VARIANTS,
        task_scan_bins::VARIANTS,
        task_scatter_tables::VARIANTS,
    ]
    .iter()
    .map(|v| {
        let ptx = arch.ptx(v).ok_or_else(|| SimError::Launch {
            kernel: "task build".to_string(),
            message: format!("no PTX variant for {arch:?}"),
        })?;
        Ok(Module::parse(ptx)?)
    })
    .collect()
}

/// A task build run on the simulator.
#[derive(Debug, Clone)]
pub struct TaskBuild {
    /// The runtime's sizing.
    pub sizes: TaskBuildSizes,
    /// The runtime's carving of the workspace.
    pub layout: TaskLayout,
    /// The workspace allocation (`layout.words` zeroed `i32`s).
    pub workspace: DevPtr,
    /// The uploaded schedule.
    pub schedule: ScheduleBuffers,
    /// What each of the four launches executed.
    pub stats: Vec<LaunchStats>,
}

impl TaskBuild {
    /// Sizes, uploads, allocates and runs the four launches of `schedule` for `num_sms` SMs,
    /// taking the kernels from `modules` by name.
    pub fn run(
        gpu: &mut Gpu,
        modules: &[Module],
        schedule: &Schedule,
        num_sms: usize,
    ) -> Result<TaskBuild, SimError> {
        let err = |message: String| SimError::Launch {
            kernel: "task build".to_string(),
            message,
        };
        let sizes = TaskBuildSizes::new(schedule, num_sms).map_err(|e| err(e.to_string()))?;
        let layout = TaskLayout::new(&sizes, schedule.work_capacity());
        let bufs = ScheduleBuffers::upload(gpu, schedule);
        let workspace = gpu.alloc("task workspace", 4 * layout.words);
        let launches = task_build_launches(&sizes, &layout, &bufs, workspace).map_err(err)?;
        let mut stats = Vec::new();
        for l in &launches {
            let kernel = modules
                .iter()
                .find_map(|m| m.kernel(l.kernel))
                .ok_or_else(|| err(format!("no module holds `{}`", l.kernel)))?;
            stats.push(gpu.launch(kernel, &l.config, &l.args)?);
        }
        Ok(TaskBuild {
            sizes,
            layout,
            workspace,
            schedule: bufs,
            stats,
        })
    }

    /// The region at word offset `words`.
    pub fn region(&self, words: usize) -> DevPtr {
        self.workspace.offset(4 * words as u64)
    }

    /// The descriptor and the first `desc[0]` (clamped to the capacity) table rows, as
    /// `TaskWorkspace::read_tables` copies them back.
    pub fn read_tables(&self, gpu: &Gpu) -> Result<HostTaskTables, SimError> {
        let d = gpu.read::<i32>(self.region(self.layout.desc), 8)?;
        let mut desc = [0i32; 8];
        desc.copy_from_slice(&d);
        let n = (desc[0].max(0) as usize).min(self.sizes.capacity);
        Ok(HostTaskTables {
            desc,
            meta: gpu.read(self.region(self.layout.meta), n * 4)?,
            qrows: gpu.read(self.region(self.layout.qrows), n * 8)?,
            qpos: gpu.read(self.region(self.layout.qpos), n * 8)?,
        })
    }
}
