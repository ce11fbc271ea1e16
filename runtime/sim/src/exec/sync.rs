//! `bar` (CTA barriers, arrive and sync) and `fence`.

use super::{lanes, Cta, Flow, NOT_BLOCKED};
use crate::error::{FaultKind, SimError};
use crate::ir::{BarKind, FenceKind, Op, Src};

impl Cta<'_> {
    /// Executes `bar` and `fence`.
    pub(super) fn step_sync(
        &mut self,
        pcu: usize,
        w: usize,
        group: u32,
        exec: u32,
        op: &Op,
    ) -> Result<Flow, SimError> {
        let k = self.k;
        match op {
            Op::Bar { kind, id, count } => {
                self.bar(pcu, w, group, exec, *kind, *id, *count)?;
                return Ok(Flow::Moved);
            }
            Op::Fence(kind) => {
                if *kind == FenceKind::ProxyAsync && k.uses_async_proxy {
                    for l in lanes(exec) {
                        self.proxy_fence(w * 32 + l);
                    }
                }
            }
            _ => unreachable!("step dispatches only sync instructions here"),
        }
        Ok(Flow::Advance)
    }

    #[allow(clippy::too_many_arguments)]
    fn bar(
        &mut self,
        pc: usize,
        w: usize,
        group: u32,
        exec: u32,
        kind: BarKind,
        id: Src,
        count: Option<Src>,
    ) -> Result<(), SimError> {
        self.materialize(w);
        self.advance(w, group);
        if exec == 0 {
            return Ok(());
        }
        let ids = self.gather(w, id);
        let counts = count.map(|c| self.gather(w, c));
        let first = exec.trailing_zeros() as usize;
        let bid = ids[first] as u32;
        let cnt = counts.map(|c| c[first] as u32);
        let sync = |msg: String| FaultKind::Sync(msg);
        for l in lanes(exec) {
            if ids[l] as u32 != bid || counts.map(|c| c[l] as u32) != cnt {
                return Err(self.fault(
                    pc,
                    w,
                    l,
                    sync("bar: barrier id or thread count differs across the warp".to_string()),
                ));
            }
        }
        if bid >= 16 {
            return Err(self.fault(
                pc,
                w,
                first,
                sync(format!("barrier id {bid} is not in 0..16")),
            ));
        }
        if let Some(n) = cnt {
            if n == 0 || n % 32 != 0 {
                return Err(self.fault(
                    pc,
                    w,
                    first,
                    sync(format!(
                        "barrier thread count {n} is not a positive multiple of 32"
                    )),
                ));
            }
        }
        let id = bid as usize;
        let b = &mut self.bars[id];
        if b.active {
            if b.count != cnt {
                let msg = format!(
                    "barrier {id}: thread count {cnt:?} differs from {:?} of the threads already waiting",
                    b.count
                );
                return Err(self.fault(pc, w, first, sync(msg)));
            }
            if b.arrived[w] != 0 && b.pc[w] != pc as u32 {
                let msg = format!(
                    "barrier {id}: warp {w} arrives from pc {pc} and from pc {} (bar.sync is .aligned)",
                    b.pc[w]
                );
                return Err(self.fault(pc, w, first, sync(msg)));
            }
        } else {
            b.active = true;
            b.count = cnt;
        }
        b.arrived[w] |= exec;
        b.pc[w] = pc as u32;
        if kind == BarKind::Sync {
            self.ready[w] &= !exec;
            for l in lanes(exec) {
                self.blocked_on[w * 32 + l] = id as u8;
            }
        }
        self.try_complete(id);
        Ok(())
    }

    pub(super) fn try_complete(&mut self, id: usize) {
        let b = &self.bars[id];
        let full =
            |w: usize| b.arrived[w] != 0 && (b.arrived[w] | self.exited[w]) == self.present[w];
        let done = match b.count {
            None => (0..self.nwarps).all(|w| self.exited[w] == self.present[w] || full(w)),
            Some(n) => {
                (0..self.nwarps)
                    .filter(|&w| full(w))
                    .map(|w| self.present[w].count_ones())
                    .sum::<u32>()
                    >= n
            }
        };
        if !done {
            return;
        }
        let release: Vec<usize> = (0..self.nwarps).filter(|&w| full(w)).collect();
        for w in release {
            self.materialize(w);
            let arrived = self.bars[id].arrived[w];
            let mut released = 0u32;
            for l in lanes(arrived) {
                if self.blocked_on[w * 32 + l] == id as u8 {
                    self.blocked_on[w * 32 + l] = NOT_BLOCKED;
                    self.ready[w] |= 1 << l;
                    released |= 1 << l;
                }
            }
            let at = self.bars[id].pc[w] as usize;
            self.note_synced(at, w, released);
            self.bars[id].arrived[w] = 0;
        }
        let b = &mut self.bars[id];
        if b.arrived.iter().all(|&m| m == 0) {
            b.active = false;
            b.count = None;
        }
    }
}
