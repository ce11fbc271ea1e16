//! The typed plan of the Hopper kernels (`msa_backward_sm90`'s design here; `msa_forward_sm90`
//! builds its own from the same parts), checked at codegen time
//! like the SM100 [`KernelPlan`](super::KernelPlan): the warp roles and `setmaxnreg` budgets,
//! the shared-memory layout, the mbarrier pipelines (barrier slots assigned in order, never
//! numbered by hand) and the named barriers.
//!
//! 12 warps, 384 threads, one CTA per SM. Warpgroup 0 produces: warp 0 issues the TMA loads
//! ([`Role::Load`]), warp 1 gathers the row scalars ([`Role::Scalar`]), warps 2–3 idle.
//! Warpgroups 1 and 2 are the two consumers ([`Role::Compute`]: wgmma and softmax).

use super::pipeline::{NamedBarrier, Pipeline, PipelinePlan, TmaBox, KV_BOX, QDO_BOX};
use super::roles::{Role, RoleThreads, REGS_PER_SM};
use super::smem::{Buf, BufferSpec, SmemPlan, TILE_ROWS};
use super::PlanError;
use crate::ptx::KernelBuilder;

/// Warps per CTA.
pub const WARPS: u32 = 12;
/// Threads per CTA.
pub const THREADS: u32 = WARPS * 32;
/// Consumer warpgroups.
pub const CONSUMERS: u32 = 2;
/// Registers per thread at launch: `.maxntid 384` with one CTA per SM gives 65536 / 384,
/// rounded down to the allocation granule of 8.
pub const LAUNCH_REGS: u32 = REGS_PER_SM / THREADS / 8 * 8;
/// Query slots per task (8 query rows of 16 heads each).
pub const SLOTS: u32 = 8;

/// The Hopper warps: fixed roles, one register budget per warpgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sm90Warps {
    producer_regs: u32,
    consumer_regs: u32,
}

impl Sm90Warps {
    /// Checks and returns the budgets.
    ///
    /// Rejects: a count that is not a multiple of 8 in 24..=256; a producer budget above the
    /// launch value (its `setmaxnreg` must be a `.dec`) or a consumer budget below it (an
    /// `.inc`); budgets whose three warpgroups sum to more than the 512 registers per thread
    /// one SMSP holds (each SMSP holds one warp of each warpgroup).
    pub fn new(producer_regs: u32, consumer_regs: u32) -> Result<Self, PlanError> {
        for (role, regs) in [(Role::Load, producer_regs), (Role::Compute, consumer_regs)] {
            if !(24..=256).contains(&regs) || !regs.is_multiple_of(8) {
                return Err(PlanError::RegCount { role, regs });
            }
        }
        if producer_regs > LAUNCH_REGS || consumer_regs < LAUNCH_REGS {
            return Err(PlanError::Sm90RegDirection {
                producer: producer_regs,
                consumer: consumer_regs,
                launch: LAUNCH_REGS,
            });
        }
        let total = producer_regs + CONSUMERS * consumer_regs;
        let limit = super::roles::SMSP_REG_LIMIT;
        if total > limit {
            return Err(PlanError::RegBudget {
                smsp: 0,
                total,
                limit,
            });
        }
        Ok(Sm90Warps {
            producer_regs,
            consumer_regs,
        })
    }

    /// The role of warp `warp`.
    pub fn role(&self, warp: u32) -> Role {
        match warp {
            0 => Role::Load,
            1 => Role::Scalar,
            2 | 3 => Role::Idle,
            _ => Role::Compute,
        }
    }

    /// Registers of the producer warpgroup after its `setmaxnreg.dec`.
    pub fn producer_regs(&self) -> u32 {
        self.producer_regs
    }

    /// Registers of each consumer warpgroup after its `setmaxnreg.inc`.
    pub fn consumer_regs(&self) -> u32 {
        self.consumer_regs
    }

    /// The producer warpgroup's `setmaxnreg.dec`.
    pub fn emit_producer_setmaxnreg(&self, b: &mut KernelBuilder) {
        b.setmaxnreg(false, self.producer_regs);
    }

    /// A consumer warpgroup's `setmaxnreg.inc`.
    pub fn emit_consumer_setmaxnreg(&self, b: &mut KernelBuilder) {
        b.setmaxnreg(true, self.consumer_regs);
    }
}

impl RoleThreads for Sm90Warps {
    fn threads(&self, role: Role) -> u32 {
        32 * (0..WARPS).filter(|&w| self.role(w) == role).count() as u32
    }
}

/// Named barriers with one instance per consumer warpgroup: ids `first .. first + 2`, each
/// over that warpgroup's 128 threads (the kernel picks `first + c` in a register).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarpgroupBarrier {
    /// Name.
    pub name: &'static str,
    /// The id of consumer 0's instance.
    pub first: u32,
}

impl WarpgroupBarrier {
    /// Threads of one instance.
    pub const THREADS: u32 = 128;

    /// The ids of its instances.
    pub fn ids(&self) -> std::ops::Range<u32> {
        self.first..self.first + CONSUMERS
    }
}

/// The whole Hopper main-kernel plan.
#[derive(Debug, Clone)]
pub struct Sm90Plan {
    warps: Sm90Warps,
    smem: SmemPlan,
    pipelines: PipelinePlan,
    barriers: Vec<NamedBarrier>,
    warpgroup_barriers: Vec<WarpgroupBarrier>,
}

/// The Hopper pipelines, in barrier-slot order: K/V once per segment (released by each
/// consumer warpgroup), Q/dO two stages (32 boxes), the row scalars one stage (filled by the
/// gather warp's 32 lanes, released by all 256 consumer threads after their own last read).
pub fn design_pipelines() -> Vec<Pipeline> {
    use Role::*;
    let boxes = |dims: [u32; 3], n: usize| {
        vec![
            TmaBox {
                dims: dims.to_vec(),
                elem_bytes: 2,
            };
            n
        ]
    };
    vec![
        Pipeline {
            tx: boxes(KV_BOX, 4),
            declared_tx: Some(2 * 128 * 128 * 2),
            fills: vec![Buf::K, Buf::V],
            ..Pipeline::new("kv", 1, Load, &[Compute], 1, CONSUMERS)
        },
        Pipeline {
            tx: boxes(QDO_BOX, 32),
            declared_tx: Some(65_536),
            fills: vec![Buf::Q, Buf::DO],
            ..Pipeline::new("q_do", 2, Load, &[Compute], 1, CONSUMERS)
        },
        Pipeline::new("rows", 1, Scalar, &[Compute], 32, CONSUMERS * 128),
    ]
}

/// The shared layout for `pipelines`: sK, sV, sQ×2, sdO×2, sdS (the dS^T panels dQ^T reads),
/// the barrier array, then one stage of the row scalars (`−lse·log2e` and delta per folded
/// row, the slots' compact query rows and positions and, in the deterministic mode, their
/// inverse dQ units).
pub fn design_smem(pipelines: &PipelinePlan) -> Result<SmemPlan, PlanError> {
    let stages = |name| pipelines.get(name).map(|p| p.pipeline.stages);
    let (q_do, rows) = (stages("q_do")?, stages("rows")?);
    SmemPlan::layout(vec![
        BufferSpec::tile(Buf::K, 1),
        BufferSpec::tile(Buf::V, 1),
        BufferSpec::tile(Buf::Q, q_do),
        BufferSpec::tile(Buf::DO, q_do),
        BufferSpec::tile(Buf::PdS, 1),
        BufferSpec::barriers(pipelines.barrier_slots()),
        BufferSpec::scalar(Buf::Lse, TILE_ROWS, rows),
        BufferSpec::scalar(Buf::Delta, TILE_ROWS, rows),
        BufferSpec::scalar(Buf::QRows, SLOTS, rows),
        BufferSpec::scalar(Buf::QPos, SLOTS, rows),
        BufferSpec::scalar(Buf::DqInv, SLOTS, rows),
    ])
}

/// The named barriers: `consumers` (id 1) joins both consumer warpgroups around the shared
/// dS^T.
pub fn design_barriers() -> Vec<NamedBarrier> {
    vec![NamedBarrier {
        name: "consumers",
        id: 1,
        threads: CONSUMERS * 128,
        roles: vec![Role::Compute],
    }]
}

/// The per-warpgroup barriers: `consumer_wg` (ids 2, 3) orders one warpgroup's wgmma reads
/// before its single elected release of a stage; `ds_free` (ids 4, 5), instance `c`, tells
/// consumer `c` that the other consumer's dQ^T has read `c`'s rows of the shared dS^T (the
/// reader `bar.arrive`s with 256, consumer `c` `bar.sync`s with 256 before its next store).
pub fn design_warpgroup_barriers() -> Vec<WarpgroupBarrier> {
    vec![
        WarpgroupBarrier {
            name: "consumer_wg",
            first: 2,
        },
        WarpgroupBarrier {
            name: "ds_free",
            first: 4,
        },
    ]
}

impl Sm90Plan {
    /// The design's plan: 24 producer and 240 consumer registers.
    pub fn design() -> Result<Self, PlanError> {
        let warps = Sm90Warps::new(24, 240)?;
        let pipelines = PipelinePlan::new(design_pipelines(), &warps)?;
        let smem = design_smem(&pipelines)?;
        Sm90Plan::new(
            warps,
            smem,
            pipelines,
            design_barriers(),
            design_warpgroup_barriers(),
        )
    }

    /// Bundles validated parts after checking what spans them: the barrier slots, the buffers
    /// each TMA stage fills, the named barriers' ids and threads (the per-warpgroup ids count
    /// as named barriers too and must not collide).
    pub fn new(
        warps: Sm90Warps,
        smem: SmemPlan,
        pipelines: PipelinePlan,
        barriers: Vec<NamedBarrier>,
        warpgroup_barriers: Vec<WarpgroupBarrier>,
    ) -> Result<Self, PlanError> {
        let slots = smem.barrier_slots()?;
        if slots != pipelines.barrier_slots() {
            return Err(PlanError::SmemBarrierSlots {
                slots,
                needed: pipelines.barrier_slots(),
            });
        }
        pipelines.check_fills(&smem)?;
        super::pipeline::check_named_barriers(&barriers, &warps)?;
        let mut ids: Vec<(&'static str, u32)> = barriers.iter().map(|b| (b.name, b.id)).collect();
        for wb in &warpgroup_barriers {
            for id in wb.ids() {
                if !(1..=15).contains(&id) {
                    return Err(PlanError::BarrierId {
                        barrier: wb.name,
                        id,
                    });
                }
                if let Some(&(first, _)) = ids.iter().find(|(_, i)| *i == id) {
                    return Err(PlanError::BarrierIdReused {
                        id,
                        first,
                        second: wb.name,
                    });
                }
                ids.push((wb.name, id));
            }
        }
        Ok(Sm90Plan {
            warps,
            smem,
            pipelines,
            barriers,
            warpgroup_barriers,
        })
    }

    /// Warp roles and registers.
    pub fn warps(&self) -> &Sm90Warps {
        &self.warps
    }

    /// Shared-memory plan.
    pub fn smem(&self) -> &SmemPlan {
        &self.smem
    }

    /// mbarrier pipelines.
    pub fn pipelines(&self) -> &PipelinePlan {
        &self.pipelines
    }

    /// The named barrier called `name`.
    pub fn barrier(&self, name: &str) -> Option<&NamedBarrier> {
        self.barriers.iter().find(|b| b.name == name)
    }

    /// The per-warpgroup barrier called `name`.
    pub fn warpgroup_barrier(&self, name: &str) -> Option<&WarpgroupBarrier> {
        self.warpgroup_barriers.iter().find(|b| b.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::smem::TILE_BYTES;

    #[test]
    fn design_plan_passes() {
        let plan = Sm90Plan::design().unwrap();
        assert_eq!(LAUNCH_REGS, 168);
        assert_eq!(plan.pipelines().barrier_slots(), 8);
        let slots: Vec<u32> = ["kv", "q_do", "rows"]
            .map(|n| plan.pipelines().get(n).unwrap().slot)
            .to_vec();
        assert_eq!(slots, [0, 2, 6]);
        let smem = plan.smem();
        assert_eq!(smem.offset(Buf::DO).unwrap(), 4 * TILE_BYTES);
        assert_eq!(smem.offset(Buf::Barriers).unwrap(), 7 * TILE_BYTES);
        // 7 tiles, 8 barriers, 2 × 128 + 3 × 8 row words (lse, delta, rows, positions, dQ
        // units).
        assert_eq!(smem.total(), 7 * TILE_BYTES + 64 + 4 * (2 * 128 + 3 * 8));
        assert_eq!(smem.offset(Buf::DqInv).unwrap(), smem.total() - 4 * 8);
        assert_eq!(plan.warps().threads(Role::Compute), 256);
        assert_eq!(plan.warps().threads(Role::Idle), 64);
        assert_eq!(plan.warpgroup_barrier("consumer_wg").unwrap().ids(), 2..4);
        assert_eq!(plan.warpgroup_barrier("ds_free").unwrap().ids(), 4..6);
    }

    #[test]
    fn rejects_register_budgets() {
        assert_eq!(
            Sm90Warps::new(24, 244),
            Err(PlanError::RegCount {
                role: Role::Compute,
                regs: 244
            })
        );
        let e = Sm90Warps::new(24, 248).unwrap_err();
        assert_eq!(
            e,
            PlanError::RegBudget {
                smsp: 0,
                total: 520,
                limit: 512
            }
        );
        let e = Sm90Warps::new(176, 176).unwrap_err();
        assert!(e.to_string().contains("launch value 168"), "{e}");
    }

    #[test]
    fn rejects_arrivals_the_consumers_cannot_give() {
        let mut ps = design_pipelines();
        ps[1].consumer_arrivals = 3;
        let e = PipelinePlan::new(ps, &Sm90Warps::new(24, 240).unwrap()).unwrap_err();
        assert!(
            matches!(&e, PlanError::Arrivals { allowed, .. } if allowed == &[2, 8, 256]),
            "{e}"
        );
    }

    #[test]
    fn rejects_colliding_barrier_ids() {
        let warps = Sm90Warps::new(24, 240).unwrap();
        let pipelines = PipelinePlan::new(design_pipelines(), &warps).unwrap();
        let smem = design_smem(&pipelines).unwrap();
        let wb = vec![WarpgroupBarrier {
            name: "consumer_wg",
            first: 0,
        }];
        let e = Sm90Plan::new(
            warps.clone(),
            smem.clone(),
            pipelines.clone(),
            design_barriers(),
            wb,
        )
        .unwrap_err();
        assert_eq!(
            e,
            PlanError::BarrierId {
                barrier: "consumer_wg",
                id: 0
            }
        );
        let wb = vec![WarpgroupBarrier {
            name: "consumer_wg",
            first: 1,
        }];
        let e = Sm90Plan::new(warps, smem, pipelines, design_barriers(), wb).unwrap_err();
        assert_eq!(
            e,
            PlanError::BarrierIdReused {
                id: 1,
                first: "consumers",
                second: "consumer_wg"
            }
        );
    }

    #[test]
    fn rejects_a_layout_without_the_pipelines_barriers() {
        let warps = Sm90Warps::new(24, 240).unwrap();
        let pipelines = PipelinePlan::new(design_pipelines(), &warps).unwrap();
        let mut ps = design_pipelines();
        ps.truncate(2);
        let fewer = PipelinePlan::new(ps, &warps).unwrap();
        let e = design_smem(&fewer).unwrap_err();
        assert_eq!(
            e,
            PlanError::PipelineMissing {
                pipeline: "rows".into()
            }
        );
        let mut short = design_pipelines();
        short[2].stages = 2;
        let two = PipelinePlan::new(short, &warps).unwrap();
        let smem = design_smem(&two).unwrap();
        let e = Sm90Plan::new(
            warps,
            smem,
            pipelines,
            design_barriers(),
            design_warpgroup_barriers(),
        )
        .unwrap_err();
        assert_eq!(
            e,
            PlanError::SmemBarrierSlots {
                slots: 10,
                needed: 8
            }
        );
    }
}
