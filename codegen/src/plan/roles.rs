//! Warp roles and their register budgets (`docs/design.md` §3.4).
//!
//! 16 warps, 512 threads, one CTA per SM. Warp `w` runs on SM sub-partition (SMSP) `w % 4`
//! and belongs to warpgroup `w / 4`. `setmaxnreg` must be executed with one value by all
//! warps of a warpgroup, so the budgets are checked per warpgroup; the register file limit
//! binds per SMSP, which holds exactly one warp of each warpgroup.
//!
//! The accounting rule checked: after every warpgroup's `setmaxnreg`, the four warps one SMSP
//! holds (one per warpgroup) need at most `64K / 4 SMSPs / 32 lanes = 512` registers per lane
//! together, i.e. the per-warpgroup values sum to at most 512. The PTX ISA states
//! `setmaxnreg.inc` blocks until enough registers are free in the CTA's pool; the pool a
//! warp can draw from is its SMSP's quarter of the register file (a warp's registers live in
//! its SMSP), so a sum over 512 could never be satisfied and would hang. The simulator models
//! the same pool (`register_pool`, with `setmaxnreg.inc` waiting for it).

use super::PlanError;
use crate::ptx::KernelBuilder;
use std::fmt;

/// Warps per CTA.
pub const WARPS: u32 = 16;
/// Threads per CTA.
pub const THREADS: u32 = WARPS * 32;
/// 32-bit registers per SM.
pub const REGS_PER_SM: u32 = 65_536;
/// Registers per thread at launch (the kernel declares `.maxnreg` with this value so that
/// ptxas honours `setmaxnreg`): 65536 / 512.
pub const LAUNCH_REGS: u32 = REGS_PER_SM / THREADS;
/// Per-thread registers one SMSP can hold over its four warps: 64K / 4 SMSPs / 32 lanes.
pub const SMSP_REG_LIMIT: u32 = REGS_PER_SM / 128;

/// A warp plan's thread count per role, which the pipeline and named-barrier checks read
/// (the SM100 [`WarpPlan`] and the Hopper [`Sm90Warps`](super::sm90::Sm90Warps)).
pub trait RoleThreads {
    /// Threads of `role`.
    fn threads(&self, role: Role) -> u32;
}

impl RoleThreads for WarpPlan {
    fn threads(&self, role: Role) -> u32 {
        WarpPlan::threads(self, role)
    }
}

/// What a warp does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// No work; exists so that warpgroups are whole.
    Idle,
    /// Softmax P and dS (one thread per TMEM lane); warp 4 allocates and frees TMEM.
    Compute,
    /// dQ^T drain with bf16x2 reductions, dK/dV segment flush (one thread per TMEM lane).
    Reduce,
    /// Issues all five tcgen05 GEMMs.
    Mma,
    /// TMA: K/V per segment, Q/dO boxes per task.
    Load,
    /// Gathers LSE, Delta, qrows and qpos into shared memory per task.
    Scalar,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 6] = [
        Role::Idle,
        Role::Compute,
        Role::Reduce,
        Role::Mma,
        Role::Load,
        Role::Scalar,
    ];

    /// Warps the design gives the role, or `None` where any number will do.
    fn design_warps(self) -> Option<u32> {
        match self {
            Role::Idle => None,
            Role::Compute | Role::Reduce => Some(4),
            Role::Mma | Role::Load | Role::Scalar => Some(1),
        }
    }

    /// Whether every thread of the role owns one TMEM lane (so its warps must cover all
    /// four lane quadrants).
    fn owns_tmem_lanes(self) -> bool {
        matches!(self, Role::Compute | Role::Reduce)
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Idle => "idle",
            Role::Compute => "compute",
            Role::Reduce => "reduce",
            Role::Mma => "mma",
            Role::Load => "load",
            Role::Scalar => "scalar",
        })
    }
}

/// Per-thread registers of each role after its `setmaxnreg`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoleRegs {
    /// Idle warps.
    pub idle: u32,
    /// Compute warps.
    pub compute: u32,
    /// Reduce warps.
    pub reduce: u32,
    /// The MMA warp.
    pub mma: u32,
    /// The load warp.
    pub load: u32,
    /// The scalar-gather warp.
    pub scalar: u32,
}

impl RoleRegs {
    /// The count of `role`.
    pub fn get(&self, role: Role) -> u32 {
        match role {
            Role::Idle => self.idle,
            Role::Compute => self.compute,
            Role::Reduce => self.reduce,
            Role::Mma => self.mma,
            Role::Load => self.load,
            Role::Scalar => self.scalar,
        }
    }
}

/// How a role's register count moves from [`LAUNCH_REGS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RegChange {
    /// `setmaxnreg.inc` to the value.
    Inc(u32),
    /// `setmaxnreg.dec` to the value.
    Dec(u32),
    /// Already at the value; no instruction.
    Keep,
}

/// The 16 warps' roles and the registers of each role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarpPlan {
    warps: [Role; WARPS as usize],
    regs: RoleRegs,
}

impl WarpPlan {
    /// Checks and returns a plan.
    ///
    /// Rejects: a register count that is not a multiple of 8 in 24..=256; role warp counts
    /// other than the design's (4 compute, 4 reduce, 1 each of MMA, load, scalar); compute or
    /// reduce warps that miss a TMEM lane quadrant; a warpgroup whose warps would execute
    /// different `setmaxnreg` values; an SMSP whose warps sum to more than 512 registers.
    pub fn new(warps: [Role; WARPS as usize], regs: RoleRegs) -> Result<Self, PlanError> {
        let plan = WarpPlan { warps, regs };
        for role in Role::ALL {
            let count = plan.warps_of(role).len() as u32;
            let value = regs.get(role);
            if count > 0 && (!(24..=256).contains(&value) || !value.is_multiple_of(8)) {
                return Err(PlanError::RegCount { role, regs: value });
            }
            if let Some(expected) = role.design_warps() {
                if count != expected {
                    return Err(PlanError::RoleWarps {
                        role,
                        count,
                        expected,
                    });
                }
            }
            if role.owns_tmem_lanes() {
                for quadrant in 0..4 {
                    if !plan.warps_of(role).iter().any(|w| w % 4 == quadrant) {
                        return Err(PlanError::RoleQuadrant { role, quadrant });
                    }
                }
            }
        }
        for wg in 0..WARPS / 4 {
            let first = 4 * wg;
            let expected = plan.warp_regs(first);
            for warp in first + 1..first + 4 {
                let value = plan.warp_regs(warp);
                if value != expected {
                    return Err(PlanError::WarpgroupRegs {
                        warpgroup: wg,
                        warp,
                        role: plan.role(warp),
                        regs: value,
                        first,
                        expected,
                    });
                }
            }
        }
        for smsp in 0..4 {
            let total: u32 = (smsp..WARPS).step_by(4).map(|w| plan.warp_regs(w)).sum();
            if total > SMSP_REG_LIMIT {
                return Err(PlanError::RegBudget {
                    smsp,
                    total,
                    limit: SMSP_REG_LIMIT,
                });
            }
        }
        Ok(plan)
    }

    /// The seed's roles (warps 0–3 and 15 idle, 4–7 compute, 8–11 reduce, 12 MMA, 13 load,
    /// 14 scalar) with its counts 184/128/48, except that idle warps get 48 like the rest of
    /// warpgroup 3: the seed gives warp 15 24 registers, a second value inside one warpgroup.
    pub fn design() -> Result<Self, PlanError> {
        WarpPlan::new(design_roles(), DESIGN_REGS)
    }

    /// Every warp's role.
    pub fn warps(&self) -> &[Role; WARPS as usize] {
        &self.warps
    }

    /// The role of `warp`.
    pub fn role(&self, warp: u32) -> Role {
        self.warps[warp as usize]
    }

    /// Registers of `role`.
    pub fn regs(&self, role: Role) -> u32 {
        self.regs.get(role)
    }

    /// Registers of `warp` after its `setmaxnreg`.
    pub fn warp_regs(&self, warp: u32) -> u32 {
        self.regs(self.role(warp))
    }

    /// The warps of `role`, ascending.
    pub fn warps_of(&self, role: Role) -> Vec<u32> {
        (0..WARPS).filter(|&w| self.role(w) == role).collect()
    }

    /// Threads of `role`.
    pub fn threads(&self, role: Role) -> u32 {
        32 * self.warps_of(role).len() as u32
    }

    /// Registers of each warpgroup (one value per warpgroup in a valid plan).
    pub fn warpgroup_regs(&self) -> [u32; 4] {
        std::array::from_fn(|wg| self.warp_regs(4 * wg as u32))
    }

    /// The `setmaxnreg` direction of `role` relative to the launch value [`LAUNCH_REGS`].
    pub fn change(&self, role: Role) -> RegChange {
        let regs = self.regs(role);
        match regs.cmp(&LAUNCH_REGS) {
            std::cmp::Ordering::Greater => RegChange::Inc(regs),
            std::cmp::Ordering::Less => RegChange::Dec(regs),
            std::cmp::Ordering::Equal => RegChange::Keep,
        }
    }

    /// Emits `role`'s `setmaxnreg` (nothing when it keeps the launch value). Every warp of a
    /// warpgroup executes the same value, so a warpgroup that keeps it skips it uniformly.
    pub fn emit_setmaxnreg(&self, b: &mut KernelBuilder, role: Role) {
        match self.change(role) {
            RegChange::Inc(n) => b.setmaxnreg(true, n),
            RegChange::Dec(n) => b.setmaxnreg(false, n),
            RegChange::Keep => {}
        }
    }
}

/// The design's registers: compute 184 and reduce 128 (`docs/design.md` §3.4); warpgroup 3 and
/// the idle warpgroup 0 at 48. Sum per SMSP: 48 + 184 + 128 + 48 = 408 ≤ 512.
pub const DESIGN_REGS: RoleRegs = RoleRegs {
    idle: 48,
    compute: 184,
    reduce: 128,
    mma: 48,
    load: 48,
    scalar: 48,
};

/// The design's roles by warp.
pub fn design_roles() -> [Role; WARPS as usize] {
    std::array::from_fn(|w| match w {
        4..=7 => Role::Compute,
        8..=11 => Role::Reduce,
        12 => Role::Mma,
        13 => Role::Load,
        14 => Role::Scalar,
        _ => Role::Idle,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptx::print;
    use crate::target::Target;

    #[test]
    fn design_plan_passes() {
        let p = WarpPlan::design().unwrap();
        assert_eq!(p.warpgroup_regs(), [48, 184, 128, 48]);
        assert_eq!(p.warps_of(Role::Compute), vec![4, 5, 6, 7]);
        assert_eq!(p.warps_of(Role::Idle), vec![0, 1, 2, 3, 15]);
        assert_eq!(p.threads(Role::Reduce), 128);
        assert_eq!(p.threads(Role::Scalar), 32);
        assert_eq!(LAUNCH_REGS, 128);
    }

    #[test]
    fn rejects_two_values_in_one_warpgroup() {
        // The seed: idle 24 while warps 12-14 run at 48.
        let seed = RoleRegs {
            idle: 24,
            ..DESIGN_REGS
        };
        let e = WarpPlan::new(design_roles(), seed).unwrap_err();
        assert_eq!(
            e,
            PlanError::WarpgroupRegs {
                warpgroup: 3,
                warp: 15,
                role: Role::Idle,
                regs: 24,
                first: 12,
                expected: 48
            }
        );
        assert!(e.to_string().contains("the same value"), "{e}");
    }

    #[test]
    fn rejects_illegal_register_counts() {
        for bad in [20, 132, 264] {
            let regs = RoleRegs {
                reduce: bad,
                ..DESIGN_REGS
            };
            let e = WarpPlan::new(design_roles(), regs).unwrap_err();
            assert_eq!(
                e,
                PlanError::RegCount {
                    role: Role::Reduce,
                    regs: bad
                }
            );
            assert!(e.to_string().contains("multiple of 8 in 24..=256"));
        }
    }

    #[test]
    fn rejects_an_smsp_over_budget() {
        let regs = RoleRegs {
            reduce: 240,
            ..DESIGN_REGS
        };
        let e = WarpPlan::new(design_roles(), regs).unwrap_err();
        assert_eq!(
            e,
            PlanError::RegBudget {
                smsp: 0,
                total: 48 + 184 + 240 + 48,
                limit: 512
            }
        );
        // Exactly at the limit is fine.
        let regs = RoleRegs {
            reduce: 232,
            ..DESIGN_REGS
        };
        assert!(WarpPlan::new(design_roles(), regs).is_ok());
    }

    #[test]
    fn rejects_role_counts_other_than_the_design() {
        let mut roles = design_roles();
        roles[14] = Role::Idle; // no scalar warp
        let e = WarpPlan::new(roles, DESIGN_REGS).unwrap_err();
        assert_eq!(
            e,
            PlanError::RoleWarps {
                role: Role::Scalar,
                count: 0,
                expected: 1
            }
        );
    }

    #[test]
    fn rejects_lane_owning_roles_that_miss_a_quadrant() {
        // Warps 4,5,6,8 are four compute warps, but none is on quadrant 3 (lanes 96..128).
        let mut roles = design_roles();
        roles.swap(7, 8);
        let e = WarpPlan::new(roles, DESIGN_REGS).unwrap_err();
        assert_eq!(
            e,
            PlanError::RoleQuadrant {
                role: Role::Compute,
                quadrant: 3
            }
        );
        assert!(e.to_string().contains("lanes 96..128"), "{e}");
    }

    #[test]
    fn setmaxnreg_direction_follows_the_launch_value() {
        let p = WarpPlan::design().unwrap();
        assert_eq!(p.change(Role::Compute), RegChange::Inc(184));
        assert_eq!(p.change(Role::Reduce), RegChange::Keep);
        assert_eq!(p.change(Role::Mma), RegChange::Dec(48));
        assert_eq!(p.change(Role::Idle), RegChange::Dec(48));

        let mut b = KernelBuilder::new("t", Target::Sm100a, (THREADS, 1, 1));
        for role in [Role::Compute, Role::Reduce, Role::Load] {
            p.emit_setmaxnreg(&mut b, role);
        }
        let body = print::body(&b.finish().unwrap());
        assert_eq!(
            body,
            "\tsetmaxnreg.inc.sync.aligned.u32 184;\n\tsetmaxnreg.dec.sync.aligned.u32 48;\n"
        );
    }
}
