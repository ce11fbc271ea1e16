//! Synchronisation and communication: named barriers (`bar`), mbarriers, memory and
//! proxy fences, warp votes, and warp shuffles. The ISA lists `shfl.sync` under data
//! movement; it lives here with the other warp collectives. `elect.sync` stays in [`crate::ptx::tcgen05`], its
//! only user, under that family's target gate and PTX version.

use crate::ptx::builder::KernelBuilder;
use crate::ptx::ir::Operand;
use crate::ptx::operand::{Address, SharedAddr, Src};
use crate::ptx::types::*;

/// `shfl.sync` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shfl {
    /// Butterfly (xor of the lane id).
    Bfly,
    /// From a lane index.
    Idx,
    /// From a lower lane.
    Up,
    /// From a higher lane.
    Down,
}

impl KernelBuilder {
    /// `redux.sync.min.u32` over the full warp: the least of the lanes' `v`. ptxas keeps the
    /// result in a uniform register, so that values derived from it (a warp-uniform shared
    /// address) stay on the uniform datapath.
    pub fn redux_min(&mut self, v: Reg<U32>) -> Reg<U32> {
        let d = self.fresh::<U32>();
        self.inst(
            "redux.sync.min.u32".into(),
            vec![
                Operand::Reg(d.name()),
                v.operand(),
                Operand::Hex(0xffff_ffff),
            ],
        );
        d
    }

    /// `shfl.sync.<mode>.b32` over the full warp.
    pub fn shfl<T: Word>(
        &mut self,
        mode: Shfl,
        v: Reg<T>,
        lane: impl Src<U32>,
        clamp: u32,
    ) -> Reg<T> {
        let d = self.fresh::<T>();
        let m = match mode {
            Shfl::Bfly => "bfly",
            Shfl::Idx => "idx",
            Shfl::Up => "up",
            Shfl::Down => "down",
        };
        self.inst(
            format!("shfl.sync.{m}.b32"),
            vec![
                Operand::Reg(d.name()),
                v.operand(),
                lane.operand(),
                Operand::Hex(clamp as u64),
                Operand::Hex(0xffff_ffff),
            ],
        );
        d
    }

    /// `vote.sync.ballot.b32` over the full warp: bit `l` is `p` of lane `l`.
    pub fn ballot(&mut self, p: Reg<Pred>) -> Reg<U32> {
        let d = self.fresh::<U32>();
        self.inst(
            "vote.sync.ballot.b32".into(),
            vec![
                Operand::Reg(d.name()),
                p.operand(),
                Operand::Hex(0xffff_ffff),
            ],
        );
        d
    }

    fn check_barrier(&mut self, id: u32, threads: Option<u32>) {
        if id > 15 {
            self.error(format!("named barrier {id} out of range 0..=15"));
        }
        let total = self.threads.0 * self.threads.1 * self.threads.2;
        if let Some(n) = threads {
            if n == 0 || n % 32 != 0 || n > total {
                self.error(format!(
                    "barrier {id}: thread count {n} must be a positive multiple of 32 and at most the CTA's {total}"
                ));
            }
        }
    }

    /// `bar.sync id[, threads]`: waits until `threads` (default: all) have arrived.
    pub fn bar_sync(&mut self, id: u32, threads: Option<u32>) {
        self.check_barrier(id, threads);
        let mut ops = vec![Operand::Int(id as i64)];
        ops.extend(threads.map(|n| Operand::Int(n as i64)));
        self.inst("bar.sync".into(), ops);
    }

    /// `bar.sync id, threads` with the barrier id in a register (a role-dependent barrier).
    pub fn bar_sync_reg(&mut self, id: Reg<U32>, threads: u32) {
        self.check_barrier(0, Some(threads));
        self.inst(
            "bar.sync".into(),
            vec![id.operand(), Operand::Int(threads as i64)],
        );
    }

    /// `bar.arrive id, threads` with the barrier id in a register (a role-dependent barrier).
    pub fn bar_arrive_reg(&mut self, id: Reg<U32>, threads: u32) {
        self.check_barrier(0, Some(threads));
        self.inst(
            "bar.arrive".into(),
            vec![id.operand(), Operand::Int(threads as i64)],
        );
    }

    /// `bar.warp.sync 0xffffffff`: every lane of the warp meets, and their shared-memory
    /// accesses before it are ordered before those after it.
    pub fn bar_warp_sync(&mut self) {
        self.inst("bar.warp.sync".into(), vec![Operand::Hex(0xffff_ffff)]);
    }

    /// `bar.arrive id, threads`: signals without waiting.
    pub fn bar_arrive(&mut self, id: u32, threads: u32) {
        self.check_barrier(id, Some(threads));
        self.inst(
            "bar.arrive".into(),
            vec![Operand::Int(id as i64), Operand::Int(threads as i64)],
        );
    }

    /// `mbarrier.init` with the arrival count of one phase.
    pub fn mbarrier_init(&mut self, bar: &SharedAddr, count: u32) {
        self.inst(
            "mbarrier.init.shared::cta.b64".into(),
            vec![bar.operand(), Operand::Int(count as i64)],
        );
    }

    /// Makes barrier initialisation visible to the async proxy and other threads.
    pub fn fence_mbarrier_init(&mut self) {
        self.inst("fence.mbarrier_init.release.cluster".into(), vec![]);
    }

    /// One arrival on `bar`.
    pub fn mbarrier_arrive(&mut self, bar: &SharedAddr) {
        self.inst(
            "mbarrier.arrive.shared::cta.b64".into(),
            vec![Operand::Symbol("_".into()), bar.operand()],
        );
    }

    /// One arrival on `bar` that also expects `bytes` of transactions in this phase.
    pub fn mbarrier_arrive_expect_tx(&mut self, bar: &SharedAddr, bytes: u32) {
        self.inst(
            "mbarrier.arrive.expect_tx.shared::cta.b64".into(),
            vec![
                Operand::Symbol("_".into()),
                bar.operand(),
                Operand::Int(bytes as i64),
            ],
        );
    }

    /// Waits until the phase of `bar` with parity `parity` has completed.
    pub fn mbarrier_wait(&mut self, bar: &SharedAddr, parity: impl Src<U32>) {
        let top = self.label("mbar_wait");
        self.place(&top);
        let done = self.fresh::<Pred>();
        self.inst(
            "mbarrier.try_wait.parity.shared::cta.b64".into(),
            vec![Operand::Reg(done.name()), bar.operand(), parity.operand()],
        );
        self.bra_unless(done, &top);
    }

    /// `fence.acq_rel.gpu`: orders this thread's memory accesses before and after it at GPU
    /// scope (the release and acquire sides of a handoff between CTAs through an atomic).
    pub fn fence_acq_rel_gpu(&mut self) {
        self.inst("fence.acq_rel.gpu".into(), vec![]);
    }

    /// Orders this thread's generic-proxy shared-memory writes before later async-proxy
    /// (TMA, wgmma, tcgen05) accesses.
    pub fn fence_proxy_async_shared(&mut self) {
        self.inst("fence.proxy.async.shared::cta".into(), vec![]);
    }
}

#[cfg(test)]
mod tests {
    use crate::ptx::testing::{builder, errors};

    #[test]
    fn rejects_bad_barrier_thread_counts_and_ids() {
        let mut b = builder();
        b.bar_sync(1, Some(48));
        b.bar_arrive(2, 256);
        b.bar_sync(16, None);
        let e = errors(b);
        assert_eq!(e.len(), 3, "{e:?}");
        assert!(e[0].contains("thread count 48"), "{e:?}");
        assert!(
            e[1].contains("thread count 256") && e[1].contains("128"),
            "{e:?}"
        );
        assert!(e[2].contains("named barrier 16"), "{e:?}");
    }
}
