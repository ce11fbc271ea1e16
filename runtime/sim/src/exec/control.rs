//! Branches, `exit` and `trap`. Reconvergence (min-PC) is in `Cta::step`; a branch only moves
//! or splits the PCs of its lanes.

use super::{lanes, Cta, Flow};
use crate::error::{FaultKind, SimError};
use crate::ir::Op;

impl Cta<'_> {
    /// Executes branches, `exit` and `trap`.
    pub(super) fn step_control(
        &mut self,
        pcu: usize,
        w: usize,
        group: u32,
        exec: u32,
        op: &Op,
    ) -> Result<Flow, SimError> {
        let pc = pcu as u32;
        let base = w * 32;
        match op {
            Op::Bra { target } => {
                let t = *target;
                if self.uniform[w] && (exec == group || exec == 0) {
                    self.wpc[w] = if exec == group { t } else { pc + 1 };
                    return Ok(Flow::Moved);
                }
                self.materialize(w);
                for l in lanes(group) {
                    self.pc[base + l] = if exec >> l & 1 == 1 { t } else { pc + 1 };
                }
                return Ok(Flow::Moved);
            }
            Op::Exit => {
                self.materialize(w);
                self.advance(w, group & !exec);
                self.exited[w] |= exec;
                self.ready[w] &= !exec;
                for id in 0..self.bars.len() {
                    if self.bars[id].active {
                        self.try_complete(id);
                    }
                }
                return Ok(Flow::Moved);
            }
            Op::Trap => {
                if exec != 0 {
                    let l = exec.trailing_zeros() as usize;
                    return Err(self.fault(pcu, w, l, FaultKind::Trap));
                }
            }
            _ => unreachable!("step dispatches only control instructions here"),
        }
        Ok(Flow::Advance)
    }
}
