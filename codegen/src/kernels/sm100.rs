//! What both SM100 kernels (`msa_bwd_sm100`, `msa_forward_sm100`) share.
//!
//! - [`Sm100Layout`], the warp layout as a value: warpgroup 0 idles; the compute and the
//!   reduce (epilogue) roles are one warpgroup each, a thread per TMEM lane; the MMA, load and
//!   scalar (list) warps sit in warpgroup 3, so that one `setmaxnreg` serves them.
//!   [`Sm100Layout::resolve`] reads it from a plan and checks it at codegen time;
//!   [`Sm100Layout::dispatch`] emits the branch to each role.
//! - [`MmaIssuer`]: the MMA warp's `tcgen05.mma` of a planned GEMM, K step by K step.

use crate::plan::gemm::Gemm;
use crate::plan::roles::{Role, WarpPlan};
use crate::plan::tmem::TmemPlan;
use crate::plan::KernelPlan;
use crate::ptx::tcgen05::TmemAddr;
use crate::ptx::*;
use crate::target::Target;
use std::ops::Range;

/// Where each role of an SM100 kernel runs.
#[derive(Debug, Clone, Copy)]
pub struct Sm100Layout {
    /// The compute warpgroup.
    pub compute_wg: u32,
    /// The reduce (epilogue) warpgroup.
    pub reduce_wg: u32,
    /// The MMA warp (in warpgroup 3).
    pub mma_warp: u32,
    /// The load warp (in warpgroup 3).
    pub load_warp: u32,
    /// The scalar (list) warp (in warpgroup 3).
    pub scalar_warp: u32,
}

/// The code of each role for [`Sm100Layout::dispatch`]; `reduce` and `scalar` carry the names
/// their markers and labels take (the kernels name those roles differently).
pub struct Sm100Roles<C, R, M, L, S> {
    /// The compute warpgroup's code.
    pub compute: C,
    /// The reduce warpgroup's name and code.
    pub reduce: (&'static str, R),
    /// The MMA warp's code.
    pub mma: M,
    /// The load warp's code.
    pub load: L,
    /// The scalar warp's name and code.
    pub scalar: (&'static str, S),
}

impl Sm100Layout {
    /// The layout of a plan's `warps`; an error names the rule broken. The warps of each
    /// role in `tmem_roles` must reach their own 32 lanes of `tmem` (thread = lane).
    pub fn resolve(warps: &WarpPlan, tmem: &TmemPlan, tmem_roles: &[Role]) -> Result<Self, String> {
        let group_of = |role: Role| -> Result<u32, String> {
            let ws = warps.warps_of(role);
            let w0 = ws[0];
            if !w0.is_multiple_of(4) || ws != (w0..w0 + 4).collect::<Vec<_>>() {
                return Err(format!("the {role} warps {ws:?} are not one warpgroup"));
            }
            Ok(w0 / 4)
        };
        let single = |role: Role| -> Result<u32, String> {
            let w = warps.warps_of(role)[0];
            if w / 4 != 3 {
                return Err(format!("the {role} warp {w} is not in warpgroup 3"));
            }
            Ok(w)
        };
        let compute_wg = group_of(Role::Compute)?;
        let reduce_wg = group_of(Role::Reduce)?;
        if compute_wg == 3 || reduce_wg == 3 || warps.role(0) != Role::Idle {
            return Err("warpgroup 0 must idle and warpgroup 3 hold the single-warp roles".into());
        }
        for &role in tmem_roles {
            for w in warps.warps_of(role) {
                tmem.check_access(w, 32 * (w % 4)..32 * (w % 4) + 32)
                    .map_err(|e| e.to_string())?;
            }
        }
        Ok(Sm100Layout {
            compute_wg,
            reduce_wg,
            mma_warp: single(Role::Mma)?,
            load_warp: single(Role::Load)?,
            scalar_warp: single(Role::Scalar)?,
        })
    }

    /// Sends each warp of the CTA (`warp`: its index) to its role, each after the
    /// `setmaxnreg` of `warps`, and returns after it; warpgroup 0 idles.
    pub fn dispatch<C, R, M, L, S>(
        &self,
        b: &mut KernelBuilder,
        warps: &WarpPlan,
        warp: Reg<U32>,
        roles: Sm100Roles<C, R, M, L, S>,
    ) where
        C: FnOnce(&mut KernelBuilder),
        R: FnOnce(&mut KernelBuilder),
        M: FnOnce(&mut KernelBuilder),
        L: FnOnce(&mut KernelBuilder),
        S: FnOnce(&mut KernelBuilder),
    {
        let Sm100Roles {
            compute,
            reduce: (reduce_name, reduce),
            mma,
            load,
            scalar: (scalar_name, scalar),
        } = roles;
        let wg = b.shr(warp, 2u32);
        let l_compute = b.label("compute");
        let l_reduce = b.label(reduce_name);
        let l_wg3 = b.label("warpgroup3");
        for (group, label) in [
            (self.compute_wg, &l_compute),
            (self.reduce_wg, &l_reduce),
            (3, &l_wg3),
        ] {
            let is = b.setp(Cmp::Eq, wg, group);
            b.bra_if(is, label);
        }
        role(b, "idle", |b| warps.emit_setmaxnreg(b, Role::Idle));
        b.ret();

        b.place(&l_compute);
        role(b, "compute", |b| {
            warps.emit_setmaxnreg(b, Role::Compute);
            compute(b);
        });
        b.ret();

        b.place(&l_reduce);
        role(b, reduce_name, |b| {
            warps.emit_setmaxnreg(b, Role::Reduce);
            reduce(b);
        });
        b.ret();

        b.place(&l_wg3);
        // One instruction for all four warps of warpgroup 3 (the plan gives the MMA, load,
        // scalar and idle warps one value, checked by `WarpPlan::new`).
        warps.emit_setmaxnreg(b, Role::Mma);
        let l_mma = b.label("mma");
        let l_load = b.label("load");
        let l_scalar = b.label(scalar_name);
        for (w, label) in [
            (self.mma_warp, &l_mma),
            (self.load_warp, &l_load),
            (self.scalar_warp, &l_scalar),
        ] {
            let is = b.setp(Cmp::Eq, warp, w);
            b.bra_if(is, label);
        }
        b.ret();
        b.place(&l_mma);
        role(b, "mma", mma);
        b.ret();
        b.place(&l_load);
        role(b, "load", load);
        b.ret();
        b.place(&l_scalar);
        role(b, scalar_name, scalar);
        b.ret();
    }
}

/// Where a GEMM's A operand lies.
#[derive(Debug, Clone, Copy)]
pub enum MmaA {
    /// A tile in shared memory at this address (the GEMM's A descriptor).
    Smem(Reg<U32>),
    /// TMEM columns (the GEMM's A region) from this base.
    Tmem(TmemAddr),
}

/// Issues a plan's GEMMs from the lane `elect` picks.
#[derive(Clone, Copy)]
pub struct MmaIssuer<'a> {
    /// The plan that holds the GEMMs and their TMEM regions.
    pub plan: &'a KernelPlan,
    /// The one lane that issues (it also commits).
    pub elect: Reg<Pred>,
    /// Always true: the enable-input-D predicate of every K step but the first.
    always: Reg<Pred>,
    /// Always false: the first K step's predicate of a GEMM that overwrites D.
    pub never: Reg<Pred>,
}

impl<'a> MmaIssuer<'a> {
    /// The MMA warp's issuer for `plan`: the elected lane and the constant predicates.
    pub fn new(b: &mut KernelBuilder, plan: &'a KernelPlan) -> Self {
        b.comment("one lane issues every MMA and every commit");
        let elect = b.elect_sync();
        let zero = b.mov::<U32>(0u32);
        let always = b.setp(Cmp::Eq, zero, 0u32);
        let never = b.setp(Cmp::Ne, zero, 0u32);
        MmaIssuer {
            plan,
            elect,
            always,
            never,
        }
    }

    /// Issues every K step of `g` ([`MmaIssuer::issue_steps`]).
    pub fn issue(
        &self,
        b: &mut KernelBuilder,
        g: &Gemm,
        operands: (MmaA, Reg<U32>),
        d_tm: TmemAddr,
        first: Reg<Pred>,
    ) {
        self.issue_steps(b, g, operands, d_tm, 0..g.k_steps(), first);
    }

    /// Issues K steps `ks` of `g`: A from `a`, B's tile at `b_addr`, D at the column of `g`'s
    /// region from `d_tm`; K step 0 adds into D when `first` holds, every later step always.
    /// A plan whose GEMM disagrees with `a` is a codegen error.
    pub fn issue_steps(
        &self,
        b: &mut KernelBuilder,
        g: &Gemm,
        (a, b_addr): (MmaA, Reg<U32>),
        d_tm: TmemAddr,
        ks: Range<u32>,
        first: Reg<Pred>,
    ) {
        let (plan, elect) = (self.plan, self.elect);
        let idesc = match g.instr_desc() {
            Ok(d) => d.bits(),
            Err(e) => return b.error(e.to_string()),
        };
        let d_col = match plan.tmem().region(g.d) {
            Ok(r) => r.col,
            Err(e) => return b.error(e.to_string()),
        };
        let bd = g.b_desc(Target::Sm100a);
        let b0 = bd.emit(b, b_addr);
        // A's first descriptor (shared A), or its TMEM base.
        let a0 = match (g.a_desc(Target::Sm100a), a) {
            (Some(ad), MmaA::Smem(addr)) => Ok((ad, ad.emit(b, addr))),
            (None, MmaA::Tmem(a_tm)) => Err(a_tm),
            _ => return b.error(format!("GEMM `{}`: A operand mismatch", g.name)),
        };
        for k in ks {
            let bk = bd.emit_step(b, b0, k);
            let p = if k == 0 { first } else { self.always };
            match a0 {
                Ok((ad, a0)) => {
                    let ak = ad.emit_step(b, a0, k);
                    b.predicated(elect, false, |b| {
                        b.tcgen05_mma_ss(d_tm.col(d_col), ak, bk, idesc, p)
                    });
                }
                Err(a_tm) => {
                    let col = match g.a_tmem_col(plan.tmem(), k) {
                        Ok(Some(col)) => col,
                        Ok(None) => return b.error(format!("GEMM `{}` has no TMEM A", g.name)),
                        Err(e) => return b.error(e.to_string()),
                    };
                    b.predicated(elect, false, |b| {
                        b.tcgen05_mma_ts(d_tm.col(d_col), a_tm.col(col), bk, idesc, p)
                    });
                }
            }
        }
    }
}

/// Brackets a role's code with the markers the structure tests split the PTX by.
pub fn role(b: &mut KernelBuilder, name: &str, body: impl FnOnce(&mut KernelBuilder)) {
    b.comment(&format!("role {name}: begin"));
    body(b);
    b.comment(&format!("role {name}: end"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::roles::{design_roles, DESIGN_REGS};

    fn resolve_roles(edit: impl FnOnce(&mut [Role; 16])) -> Result<Sm100Layout, String> {
        let mut roles = design_roles();
        edit(&mut roles);
        let warps = WarpPlan::new(roles, DESIGN_REGS).map_err(|e| e.to_string())?;
        Sm100Layout::resolve(&warps, &TmemPlan::design().unwrap(), &[Role::Compute])
    }

    #[test]
    fn the_design_resolves() {
        let l = resolve_roles(|_| {}).unwrap();
        let at = (
            l.compute_wg,
            l.reduce_wg,
            l.mma_warp,
            l.load_warp,
            l.scalar_warp,
        );
        assert_eq!(at, (1, 2, 12, 13, 14));
    }

    #[test]
    fn a_single_warp_role_outside_warpgroup_3_is_rejected() {
        // Warps 3 and 12 trade roles (both at 48 registers: the warp plan accepts it).
        let e = resolve_roles(|r| r.swap(3, 12)).unwrap_err();
        assert!(e.contains("the mma warp 3 is not in warpgroup 3"), "{e}");
    }

    #[test]
    fn a_role_in_warpgroup_0_is_rejected() {
        // The compute and idle warpgroups trade places.
        let e = resolve_roles(|r| {
            for w in 0..4 {
                r.swap(w, w + 4);
            }
        })
        .unwrap_err();
        assert!(e.contains("warpgroup 0 must idle"), "{e}");
    }
}
