//! Typed plans of the SM100 main kernel (`msa_backward_sm100`), checked at codegen time.
//!
//! The kernel is composed from five descriptions, each validated when it is built and each
//! rejection reported as a [`PlanError`] that names what is wrong, the value and the limit:
//!
//! - [`roles`]: the 16 warps' roles and their `setmaxnreg` budgets;
//! - [`tmem`]: the 512-column tensor-memory plan, its aliases and lane quadrants;
//! - [`smem`]: the shared-memory layout and the K-/MN-major views of its tiles;
//! - [`pipeline`]: mbarrier pipelines (with generated phase/parity bookkeeping) and named
//!   barriers;
//! - [`gemm`]: tcgen05 instruction descriptors, shared-memory descriptors and the five GEMMs.
//!
//! [`KernelPlan`] bundles them and adds the checks that span two plans (barrier slots in
//! shared memory, the buffers a TMA stage fills, GEMM operands against both memories).

pub mod gemm;
pub mod pipeline;
pub mod roles;
pub mod sm90;
pub mod smem;
pub mod tmem;

use gemm::Gemm;
use pipeline::{NamedBarrier, PipelinePlan, Side};
use roles::{Role, WarpPlan};
use smem::{Buf, BufKind, SmemPlan};
use tmem::{TmemPlan, TmemRegion};

fn list<T: std::fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A plan that breaks a rule of the hardware or of the kernel design.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    // ---- roles ----------------------------------------------------------------------
    /// A role's register count is not a legal `setmaxnreg` operand.
    #[error("setmaxnreg {regs} for the {role} warps: must be a multiple of 8 in 24..=256")]
    RegCount {
        /// The role.
        role: Role,
        /// Its register count.
        regs: u32,
    },
    /// Two warps of one warpgroup would execute different `setmaxnreg` values.
    #[error(
        "warpgroup {warpgroup}: warp {warp} ({role}) would execute setmaxnreg {regs} but warp \
         {first} executes {expected}; all warps of a warpgroup must execute the same value"
    )]
    WarpgroupRegs {
        /// Warpgroup index (warps 4k..4k+3).
        warpgroup: u32,
        /// The warp that differs.
        warp: u32,
        /// Its role.
        role: Role,
        /// Its value.
        regs: u32,
        /// The warpgroup's first warp.
        first: u32,
        /// The first warp's value.
        expected: u32,
    },
    /// The warps of one SM sub-partition hold more registers per thread than it has.
    #[error(
        "SMSP {smsp}: its warps (one per warpgroup) hold {total} registers per thread in sum, \
         above the limit of {limit} (64K registers per SM / 128 threads per warpgroup)"
    )]
    RegBudget {
        /// Sub-partition (warp % 4).
        smsp: u32,
        /// Sum of the per-thread counts of its warps.
        total: u32,
        /// The limit (512).
        limit: u32,
    },
    /// A role has the wrong number of warps for the design.
    #[error("{count} {role} warps; the design needs exactly {expected}")]
    RoleWarps {
        /// The role.
        role: Role,
        /// Warps that have it.
        count: u32,
        /// Warps the design needs.
        expected: u32,
    },
    /// A role with one thread per TMEM lane leaves a lane quadrant without a warp.
    #[error(
        "no {role} warp covers TMEM lanes {}..{}; a role with one thread per TMEM lane needs a \
         warp w with w % 4 == {quadrant} (warp w may only access lanes 32·(w % 4)..+32)",
        32 * .quadrant, 32 * .quadrant + 32
    )]
    RoleQuadrant {
        /// The role.
        role: Role,
        /// The uncovered quadrant.
        quadrant: u32,
    },

    /// A Hopper budget whose `setmaxnreg` would go the wrong way from the launch value.
    #[error(
        "Hopper registers: producer {producer} must be at most and consumer {consumer} at least \
         the launch value {launch} (setmaxnreg.dec for the producer, .inc for the consumers)"
    )]
    Sm90RegDirection {
        /// The producer warpgroup's count.
        producer: u32,
        /// Each consumer warpgroup's count.
        consumer: u32,
        /// Registers per thread at launch.
        launch: u32,
    },

    // ---- tensor memory --------------------------------------------------------------
    /// The TMEM allocation size is not allocatable.
    #[error("TMEM allocation of {cols} columns: must be a power of two in 32..=512")]
    TmemAllocCols {
        /// Requested columns.
        cols: u32,
    },
    /// A TMEM region lies (partly) outside the allocation, or is empty.
    #[error(
        "TMEM region {region} spans columns {start}..{end}; regions must be non-empty and inside \
         the {alloc}-column allocation"
    )]
    TmemRegionBounds {
        /// The region.
        region: TmemRegion,
        /// First column.
        start: u32,
        /// One past the last column.
        end: u32,
        /// Allocated columns.
        alloc: u32,
    },
    /// A TMEM region is declared twice.
    #[error("TMEM region {region} is declared twice")]
    TmemRegionTwice {
        /// The region.
        region: TmemRegion,
    },
    /// A TMEM region is used but not declared.
    #[error("TMEM region {region} is not in the TMEM plan")]
    TmemRegionMissing {
        /// The region.
        region: TmemRegion,
    },
    /// Two TMEM regions overlap without being declared aliases.
    #[error("TMEM regions {a} and {b} share columns {start}..{end} but are not declared aliases")]
    TmemOverlap {
        /// One region.
        a: TmemRegion,
        /// The other.
        b: TmemRegion,
        /// First shared column.
        start: u32,
        /// One past the last shared column.
        end: u32,
    },
    /// A warp accesses TMEM lanes outside its quadrant.
    #[error(
        "warp {warp} accesses TMEM lanes {start}..{end}; it may only access lanes \
         {allowed_start}..{allowed_end} (32·(warp % 4)..+32)"
    )]
    TmemLanes {
        /// The warp.
        warp: u32,
        /// First lane accessed.
        start: u32,
        /// One past the last lane accessed.
        end: u32,
        /// First lane of its quadrant.
        allowed_start: u32,
        /// One past the last lane of its quadrant.
        allowed_end: u32,
    },

    // ---- shared memory --------------------------------------------------------------
    /// A buffer's declared alignment is not a power of two.
    #[error("shared buffer {buffer}: alignment {align} is not a power of two")]
    SmemAlignValue {
        /// The buffer.
        buffer: Buf,
        /// Declared alignment.
        align: u32,
    },
    /// A buffer's offset, alignment or stage size breaks its alignment rule.
    #[error("shared buffer {buffer}: {what} {value} is not a multiple of {align} B")]
    SmemAlign {
        /// The buffer.
        buffer: Buf,
        /// Which quantity (`offset`, `alignment`, `stage size`).
        what: &'static str,
        /// Its value.
        value: u32,
        /// The required multiple.
        align: u32,
    },
    /// The layout needs more shared memory than a CTA may have.
    #[error("shared memory plan needs {total} B, above the per-CTA limit of {limit} B")]
    SmemTotal {
        /// Bytes needed.
        total: u32,
        /// The limit (232,448).
        limit: u32,
    },
    /// Two shared buffers overlap.
    #[error("shared buffers {a} and {b} overlap in bytes {start}..{end}")]
    SmemOverlap {
        /// One buffer.
        a: Buf,
        /// The other.
        b: Buf,
        /// First shared byte.
        start: u32,
        /// One past the last shared byte.
        end: u32,
    },
    /// A shared buffer is declared twice.
    #[error("shared buffer {buffer} is declared twice")]
    SmemBufferTwice {
        /// The buffer.
        buffer: Buf,
    },
    /// A shared buffer is used but not declared.
    #[error("shared buffer {buffer} is not in the shared-memory plan")]
    SmemBufferMissing {
        /// The buffer.
        buffer: Buf,
    },
    /// A K-/MN-major view asked of a buffer that is not a bf16 tile.
    #[error(
        "shared buffer {buffer} is a {kind} buffer; only 128×128 bf16 tiles have K-/MN-major views"
    )]
    SmemView {
        /// The buffer.
        buffer: Buf,
        /// Its kind.
        kind: BufKind,
    },
    /// The barrier array does not have exactly the slots the pipelines use.
    #[error("the mbarrier array holds {slots} slots but the pipelines use {needed}")]
    SmemBarrierSlots {
        /// Slots in the shared-memory plan.
        slots: u32,
        /// Slots the pipelines need (full + empty per stage).
        needed: u32,
    },

    // ---- pipelines ------------------------------------------------------------------
    /// A pipeline without stages.
    #[error("pipeline `{pipeline}` has {stages} stages; it needs at least 1")]
    Stages {
        /// The pipeline.
        pipeline: &'static str,
        /// Its stage count.
        stages: u32,
    },
    /// A stage index at or past the stage count.
    #[error("pipeline `{pipeline}`: stage {stage} does not exist (it has {stages})")]
    StageIndex {
        /// The pipeline.
        pipeline: &'static str,
        /// The stage asked for.
        stage: u32,
        /// Its stage count.
        stages: u32,
    },
    /// Two pipelines share a name.
    #[error("pipeline `{pipeline}` is declared twice")]
    PipelineTwice {
        /// The name.
        pipeline: &'static str,
    },
    /// A pipeline is used but not declared.
    #[error("pipeline `{pipeline}` is not in the pipeline plan")]
    PipelineMissing {
        /// The name.
        pipeline: String,
    },
    /// A pipeline side names the idle role (or a role no warp has).
    #[error(
        "pipeline `{pipeline}`: the {side} role {role} has no work to signal with; only \
         compute, reduce, mma, load and scalar warps take part in pipelines"
    )]
    PipelineRole {
        /// The pipeline.
        pipeline: &'static str,
        /// Producer or consumer.
        side: Side,
        /// The role.
        role: Role,
    },
    /// A TMA box with too few or too many dimensions.
    #[error("pipeline `{pipeline}`: TMA box {index} has {rank} dimensions; boxes have 1..=5")]
    TmaBoxRank {
        /// The pipeline.
        pipeline: &'static str,
        /// Index of the box.
        index: usize,
        /// Its rank.
        rank: usize,
    },
    /// A TMA box dimension out of range.
    #[error(
        "pipeline `{pipeline}`: TMA box {index} has extent {extent} in dimension {dim}; box \
         extents are 1..=256 elements"
    )]
    TmaBoxExtent {
        /// The pipeline.
        pipeline: &'static str,
        /// Index of the box.
        index: usize,
        /// The dimension (innermost = 0).
        dim: usize,
        /// Its extent.
        extent: u32,
    },
    /// A TMA box's inner extent wider than the 128-B swizzle span.
    #[error(
        "pipeline `{pipeline}`: TMA box {index} has a {bytes}-B inner extent; with 128-B swizzling \
         it may be at most {limit} B"
    )]
    TmaBoxInner {
        /// The pipeline.
        pipeline: &'static str,
        /// Index of the box.
        index: usize,
        /// Inner extent in bytes.
        bytes: u32,
        /// The limit (128).
        limit: u32,
    },
    /// A declared transaction count that differs from the boxes' bytes.
    #[error(
        "pipeline `{pipeline}` declares {declared} tx bytes per stage but its TMA boxes carry \
         {boxes} B"
    )]
    TxMismatch {
        /// The pipeline.
        pipeline: &'static str,
        /// Declared bytes.
        declared: u32,
        /// Sum over the boxes.
        boxes: u32,
    },
    /// A transaction count the mbarrier cannot hold.
    #[error("pipeline `{pipeline}`: {bytes} tx bytes per stage, above the mbarrier's {limit}")]
    TxLimit {
        /// The pipeline.
        pipeline: &'static str,
        /// Bytes per stage.
        bytes: u32,
        /// The tx-count limit (2^20 − 1).
        limit: u32,
    },
    /// An arrival count that does not match how the side signals.
    #[error(
        "pipeline `{pipeline}`: {arrivals} {side} arrivals; {signal} the {side} side arrives \
         {} times",
        list(.allowed).replace(", ", " or ")
    )]
    Arrivals {
        /// The pipeline.
        pipeline: &'static str,
        /// Producer or consumer.
        side: Side,
        /// Declared arrivals.
        arrivals: u32,
        /// How the side signals, as a phrase.
        signal: &'static str,
        /// The counts that would be consistent.
        allowed: Vec<u32>,
    },
    /// Chunk stage starts that do not split the chunks into the pipeline's stages.
    #[error(
        "pipeline `{pipeline}`: chunk stage starts ({}) must be {stages} strictly increasing \
         chunk indices starting at 0 and below {chunks}",
        list(.starts)
    )]
    ChunkGroups {
        /// The pipeline.
        pipeline: &'static str,
        /// The starts.
        starts: Vec<u32>,
        /// Chunks per tile.
        chunks: u32,
        /// Stages of the pipeline.
        stages: u32,
    },
    /// TMA transaction bytes that differ from the buffers the stage fills.
    #[error(
        "pipeline `{pipeline}` expects {tx} tx bytes per stage but the buffers it fills ({}) hold \
         {fills} B per stage",
        list(.buffers)
    )]
    TxFill {
        /// The pipeline.
        pipeline: &'static str,
        /// Its tx bytes.
        tx: u32,
        /// The buffers.
        buffers: Vec<Buf>,
        /// Their bytes per stage.
        fills: u32,
    },
    /// A filled buffer with a different stage count than its pipeline.
    #[error(
        "pipeline `{pipeline}` has {stages} stages but the buffer {buffer} it fills has \
         {buffer_stages}"
    )]
    FillStages {
        /// The pipeline.
        pipeline: &'static str,
        /// The buffer.
        buffer: Buf,
        /// Stages of the buffer.
        buffer_stages: u32,
        /// Stages of the pipeline.
        stages: u32,
    },

    // ---- named barriers -------------------------------------------------------------
    /// A named-barrier id out of range.
    #[error("named barrier `{barrier}` has id {id}; ids are 1..=15 (0 is the CTA-wide barrier)")]
    BarrierId {
        /// The barrier.
        barrier: &'static str,
        /// Its id.
        id: u32,
    },
    /// Two named barriers share an id.
    #[error("named barriers `{first}` and `{second}` both use id {id}")]
    BarrierIdReused {
        /// The id.
        id: u32,
        /// The first barrier.
        first: &'static str,
        /// The second.
        second: &'static str,
    },
    /// A named barrier's thread count differs from its roles' threads.
    #[error(
        "named barrier `{barrier}` counts {threads} threads but its roles ({}) have {roles_threads}",
        list(.roles)
    )]
    BarrierThreads {
        /// The barrier.
        barrier: &'static str,
        /// Declared threads.
        threads: u32,
        /// The roles.
        roles: Vec<Role>,
        /// Their threads in the warp plan.
        roles_threads: u32,
    },

    // ---- GEMMs and descriptors ------------------------------------------------------
    /// An MMA shape tcgen05.mma kind::f16 with cta_group::1 does not have.
    #[error(
        "GEMM `{gemm}` is M{m} N{n} K{k}; tcgen05.mma kind::f16 cta_group::1 needs M 64 (N \
         8..=256 step 8) or M 128 (N 16..=256 step 16), and K a positive multiple of 16"
    )]
    MmaShape {
        /// The GEMM.
        gemm: &'static str,
        /// M.
        m: u32,
        /// N.
        n: u32,
        /// K.
        k: u32,
    },
    /// A shared-memory operand larger than its buffer's stage.
    #[error(
        "GEMM `{gemm}`: operand {operand} needs {bytes} B of bf16 but a stage of {buffer} holds \
         {capacity} B"
    )]
    GemmOperandBytes {
        /// The GEMM.
        gemm: &'static str,
        /// `A` or `B`.
        operand: &'static str,
        /// The buffer.
        buffer: Buf,
        /// Bytes the operand needs.
        bytes: u32,
        /// Bytes in one stage of the buffer.
        capacity: u32,
    },
    /// A TMEM operand wider than its region.
    #[error(
        "GEMM `{gemm}`: operand {operand} needs {needed} TMEM columns but region {region} has {cols}"
    )]
    GemmTmemCols {
        /// The GEMM.
        gemm: &'static str,
        /// `A` or `D`.
        operand: &'static str,
        /// The region.
        region: TmemRegion,
        /// Columns needed.
        needed: u32,
        /// Columns of the region.
        cols: u32,
    },
    /// A TS GEMM whose TMEM A operand shares columns with its accumulator.
    #[error(
        "GEMM `{gemm}` reads A from TMEM region {a}, which shares columns with its D region {d}"
    )]
    GemmAliased {
        /// The GEMM.
        gemm: &'static str,
        /// A's region.
        a: TmemRegion,
        /// D's region.
        d: TmemRegion,
    },
    /// A descriptor byte offset that its 14-bit field (in 16-B units) cannot hold.
    #[error(
        "shared-memory descriptor {field} = {value} B: must be a multiple of 16 below {limit} B"
    )]
    DescField {
        /// `LBO` or `SBO`.
        field: &'static str,
        /// The offset.
        value: u32,
        /// The limit (2^18).
        limit: u32,
    },
}

/// The whole SM100 main-kernel plan: every part validated, plus the checks across parts.
#[derive(Debug, Clone)]
pub struct KernelPlan {
    warps: WarpPlan,
    tmem: TmemPlan,
    smem: SmemPlan,
    pipelines: PipelinePlan,
    barriers: Vec<NamedBarrier>,
    gemms: Vec<Gemm>,
}

impl KernelPlan {
    /// The design's plan (`docs/design.md` §3.3–§3.5, with one `setmaxnreg` value per warpgroup).
    pub fn design() -> Result<Self, PlanError> {
        let warps = WarpPlan::design()?;
        let tmem = TmemPlan::design()?;
        let pipelines = PipelinePlan::new(pipeline::design_pipelines(), &warps)?;
        let smem = SmemPlan::design(pipelines.barrier_slots())?;
        let gemms = gemm::design_gemms(&smem)?;
        KernelPlan::new(
            warps,
            tmem,
            smem,
            pipelines,
            pipeline::design_barriers(),
            gemms,
        )
    }

    /// Bundles validated parts after checking what spans them: the barrier slots, the
    /// buffers each TMA stage fills, the named barriers' roles and every GEMM's operands.
    pub fn new(
        warps: WarpPlan,
        tmem: TmemPlan,
        smem: SmemPlan,
        pipelines: PipelinePlan,
        barriers: Vec<NamedBarrier>,
        gemms: Vec<Gemm>,
    ) -> Result<Self, PlanError> {
        let slots = smem.barrier_slots()?;
        if slots != pipelines.barrier_slots() {
            return Err(PlanError::SmemBarrierSlots {
                slots,
                needed: pipelines.barrier_slots(),
            });
        }
        pipelines.check_fills(&smem)?;
        pipeline::check_named_barriers(&barriers, &warps)?;
        for g in &gemms {
            g.validate(&smem, &tmem)?;
        }
        Ok(KernelPlan {
            warps,
            tmem,
            smem,
            pipelines,
            barriers,
            gemms,
        })
    }

    /// Warp roles and registers.
    pub fn warps(&self) -> &WarpPlan {
        &self.warps
    }

    /// Tensor-memory plan.
    pub fn tmem(&self) -> &TmemPlan {
        &self.tmem
    }

    /// Shared-memory plan.
    pub fn smem(&self) -> &SmemPlan {
        &self.smem
    }

    /// mbarrier pipelines.
    pub fn pipelines(&self) -> &PipelinePlan {
        &self.pipelines
    }

    /// Named barriers.
    pub fn barriers(&self) -> &[NamedBarrier] {
        &self.barriers
    }

    /// The named barrier called `name`.
    pub fn barrier(&self, name: &str) -> Option<&NamedBarrier> {
        self.barriers.iter().find(|b| b.name == name)
    }

    /// The GEMMs, in issue order of the design (S^T, dP^T, dV, dK, dQ^T).
    pub fn gemms(&self) -> &[Gemm] {
        &self.gemms
    }

    /// The GEMM called `name`.
    pub fn gemm(&self, name: &str) -> Option<&Gemm> {
        self.gemms.iter().find(|g| g.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipeline::design_pipelines;

    fn parts() -> (WarpPlan, TmemPlan, SmemPlan, PipelinePlan) {
        let warps = WarpPlan::design().unwrap();
        let pipes = PipelinePlan::new(design_pipelines(), &warps).unwrap();
        let smem = SmemPlan::design(pipes.barrier_slots()).unwrap();
        (warps, TmemPlan::design().unwrap(), smem, pipes)
    }

    #[test]
    fn design_plan_passes_every_check() {
        let plan = KernelPlan::design().unwrap();
        assert_eq!(plan.gemms().len(), 5);
        assert_eq!(plan.barriers().len(), 4);
        assert_eq!(plan.pipelines().barrier_slots(), 24);
        assert!(plan.smem().total() <= smem::SMEM_LIMIT);
        assert_eq!(plan.barrier("tmem_alloc").unwrap().threads, 288);
        assert_eq!(
            plan.gemm("dq_t").unwrap().instr_desc().unwrap().bits(),
            0x0821_8490
        );
    }

    #[test]
    fn rejects_barrier_slots_that_differ_from_the_pipelines() {
        let (warps, tmem, _, pipes) = parts();
        let smem = SmemPlan::design(pipes.barrier_slots() - 2).unwrap();
        let gemms = gemm::design_gemms(&smem).unwrap();
        let e = KernelPlan::new(warps, tmem, smem, pipes, pipeline::design_barriers(), gemms)
            .unwrap_err();
        assert_eq!(
            e,
            PlanError::SmemBarrierSlots {
                slots: 22,
                needed: 24
            }
        );
        assert!(e.to_string().contains("holds 22 slots"), "{e}");
    }

    #[test]
    fn cross_checks_reach_barriers_and_gemms() {
        let (warps, tmem, smem, pipes) = parts();
        let mut barriers = pipeline::design_barriers();
        barriers[0].threads = 256;
        let gemms = gemm::design_gemms(&smem).unwrap();
        let e = KernelPlan::new(
            warps.clone(),
            tmem.clone(),
            smem.clone(),
            pipes.clone(),
            barriers,
            gemms.clone(),
        )
        .unwrap_err();
        assert!(matches!(e, PlanError::BarrierThreads { .. }), "{e}");

        let mut gemms = gemms;
        gemms[2].d = TmemRegion::S;
        let e = KernelPlan::new(warps, tmem, smem, pipes, pipeline::design_barriers(), gemms)
            .unwrap_err();
        assert!(matches!(e, PlanError::GemmAliased { .. }), "{e}");
    }
}
