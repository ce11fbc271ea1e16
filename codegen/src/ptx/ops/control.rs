//! Control flow: labels, branches, predicated regions and counted loops, `ret`, and
//! `setmaxnreg` (from the ISA's miscellaneous instructions: it changes a warp's resources).

use super::arith::Cmp;
use crate::ptx::builder::KernelBuilder;
use crate::ptx::ir::{Label, Operand, Stmt};
use crate::ptx::operand::Src;
use crate::ptx::types::*;

impl KernelBuilder {
    /// A new label (placed later with [`Self::place`]).
    pub fn label(&mut self, hint: &'static str) -> Label {
        let l = Label {
            idx: self.labels,
            hint,
        };
        self.labels += 1;
        self.placed.push(false);
        self.used.push(false);
        l
    }

    /// Places `label` at the current position.
    pub fn place(&mut self, label: &Label) {
        if self.guard.is_some() {
            self.error(format!("label {label} placed inside a predicated region"));
        }
        if std::mem::replace(&mut self.placed[label.idx as usize], true) {
            self.error(format!("label {label} placed twice"));
        }
        self.body.push(Stmt::Label(label.clone()));
    }

    fn branch(&mut self, guard: Option<(RegName, bool)>, label: &Label) {
        self.used[label.idx as usize] = true;
        let saved = self.guard;
        if saved.is_some() && guard.is_some() {
            self.error(format!(
                "conditional branch to {label} inside a predicated region"
            ));
        }
        self.guard = guard.or(saved);
        self.inst("bra".into(), vec![Operand::Label(label.clone())]);
        self.guard = saved;
    }

    /// Unconditional branch.
    pub fn bra(&mut self, label: &Label) {
        self.branch(None, label);
    }

    /// Branch if `p`.
    pub fn bra_if(&mut self, p: Reg<Pred>, label: &Label) {
        self.branch(Some((p.name(), false)), label);
    }

    /// Branch unless `p`.
    pub fn bra_unless(&mut self, p: Reg<Pred>, label: &Label) {
        self.branch(Some((p.name(), true)), label);
    }

    /// Runs `body` only in threads where `p` holds (a branch around it).
    pub fn if_then(&mut self, p: Reg<Pred>, hint: &'static str, body: impl FnOnce(&mut Self)) {
        let skip = self.label(hint);
        self.bra_unless(p, &skip);
        body(self);
        self.place(&skip);
    }

    /// Runs `body` only in threads where `p` does not hold.
    pub fn unless(&mut self, p: Reg<Pred>, hint: &'static str, body: impl FnOnce(&mut Self)) {
        let skip = self.label(hint);
        self.bra_if(p, &skip);
        body(self);
        self.place(&skip);
    }

    /// Predicates every instruction `body` emits with `p` (or `!p` when `negate`).
    pub fn predicated(&mut self, p: Reg<Pred>, negate: bool, body: impl FnOnce(&mut Self)) {
        if self.guard.is_some() {
            self.error("nested predicated regions".into());
        }
        let saved = self.guard.replace((p.name(), negate));
        body(self);
        self.guard = saved;
    }

    /// A counted loop: `for i in (start..end).step_by(step)`, with `i` a `u32` register.
    pub fn for_range(
        &mut self,
        start: impl Src<U32>,
        end: impl Src<U32> + Copy,
        step: impl Src<U32>,
        hint: &'static str,
        body: impl FnOnce(&mut Self, Reg<U32>),
    ) {
        let i = self.mov::<U32>(start);
        let top = self.label(hint);
        let done = self.label(hint);
        self.place(&top);
        let out = self.setp(Cmp::Ge, i, end);
        self.bra_if(out, &done);
        body(self, i);
        let next = self.add(i, step);
        self.set(i, next);
        self.bra(&top);
        self.place(&done);
    }

    /// `ret`.
    pub fn ret(&mut self) {
        self.inst("ret".into(), vec![]);
    }

    /// `trap`: aborts the launch with an error the host sees (for a run-time condition the
    /// kernel cannot continue past, such as too little shared-memory slack).
    pub fn trap(&mut self) {
        self.inst("trap".into(), vec![]);
    }

    /// `setmaxnreg`: every warp of a warpgroup must execute the same value.
    pub fn setmaxnreg(&mut self, increase: bool, regs: u32) {
        if !(24..=256).contains(&regs) || !regs.is_multiple_of(8) {
            self.error(format!(
                "setmaxnreg {regs}: must be a multiple of 8 in 24..=256"
            ));
        }
        let dir = if increase { "inc" } else { "dec" };
        self.inst(
            format!("setmaxnreg.{dir}.sync.aligned.u32"),
            vec![Operand::Int(regs as i64)],
        );
    }
}

#[cfg(test)]
mod tests {
    use crate::ptx::testing::{builder, errors};
    use crate::ptx::{Pred, Reg};

    #[test]
    fn rejects_unplaced_and_doubly_placed_labels() {
        let mut b = builder();
        let l = b.label("x");
        b.bra(&l);
        let e = errors(b);
        assert!(e[0].contains("never placed"), "{e:?}");

        let mut b = builder();
        let l = b.label("x");
        b.place(&l);
        b.place(&l);
        assert!(errors(b)[0].contains("placed twice"));
    }

    #[test]
    fn rejects_nested_guards_and_labels_in_predicated_regions() {
        let mut b = builder();
        let p = b.mov::<Pred>(Reg::<Pred>::new(0));
        b.predicated(p, false, |b| {
            b.predicated(p, true, |_| {});
            let l = b.label("inner");
            b.place(&l);
        });
        let e = errors(b);
        assert!(e.iter().any(|m| m.contains("nested predicated")), "{e:?}");
        assert!(
            e.iter().any(|m| m.contains("inside a predicated region")),
            "{e:?}"
        );
    }
}
