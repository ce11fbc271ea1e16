//! Blackwell (`sm_100a`) tensor-core instructions: tensor-memory allocation, `tcgen05.mma`
//! (SS and TS forms), `tcgen05.commit`, `tcgen05.ld`/`st` in the `32x32b` shape, their waits
//! and thread-sync fences, and `elect.sync`.
//!
//! Every method is gated on [`Target::Sm100a`] and records PTX ISA 8.6, the first version
//! that has `tcgen05` (sm100-ptx.md §5.1, §8). Tensor-memory addresses are `.b32` registers:
//! ptxas rejects a `.u32` register as a TMEM operand ("Arguments mismatch"), so they are
//! typed [`B32`] here and carried as a [`TmemAddr`] (a register plus a column offset, which
//! ptxas accepts as `[%b+imm]`).

use super::builder::KernelBuilder;
use super::ir::{AddrBase, Operand};
use super::operand::{Address, SharedAddr, Src};
use super::types::*;
use crate::target::{PtxVersion, Target};

/// The PTX ISA that introduced `tcgen05` and `sm_100a`.
const TCGEN05_VERSION: PtxVersion = PtxVersion(8, 6);

/// A tensor-memory address: a `.b32` register (lane in bits 16–31, column in bits 0–15)
/// plus an immediate offset (columns, or `lanes << 16`).
#[derive(Debug, Clone, Copy)]
pub struct TmemAddr {
    base: Reg<B32>,
    offset: i64,
}

impl TmemAddr {
    /// `[base]`.
    pub fn new(base: Reg<B32>) -> Self {
        TmemAddr { base, offset: 0 }
    }

    /// The same base, `cols` columns further.
    pub fn col(&self, cols: u32) -> Self {
        TmemAddr {
            base: self.base,
            offset: self.offset + cols as i64,
        }
    }

    /// The base register.
    pub fn base(&self) -> Reg<B32> {
        self.base
    }

    fn operand(&self) -> Operand {
        Operand::Addr(AddrBase::Reg(self.base.name()), self.offset)
    }
}

/// Register counts a `32x32b` `tcgen05.ld`/`st` moves per thread: `.x1` .. `.x128`.
fn legal_32x32b(n: usize) -> bool {
    n.is_power_of_two() && n <= 128
}

/// A legal `tcgen05.alloc` column count: a power of two in 32..=512.
pub fn legal_alloc_cols(cols: u32) -> bool {
    cols.is_power_of_two() && (32..=512).contains(&cols)
}

impl KernelBuilder {
    fn tcgen05(&mut self, what: &str, opcode: String, operands: Vec<Operand>) {
        self.require(what, Target::Sm100a);
        self.push(opcode, operands, TCGEN05_VERSION);
    }

    fn check_alloc_cols(&mut self, what: &str, cols: u32) {
        if !legal_alloc_cols(cols) {
            self.error(format!(
                "{what} of {cols} columns: must be a power of two in 32..=512"
            ));
        }
    }

    /// `tcgen05.alloc`: the whole warp allocates `cols` TMEM columns and the base address is
    /// written to the shared word `dst`.
    pub fn tcgen05_alloc(&mut self, dst: &SharedAddr, cols: u32) {
        self.check_alloc_cols("tcgen05.alloc", cols);
        self.tcgen05(
            "tcgen05.alloc",
            "tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32".into(),
            vec![dst.operand(), Operand::Int(cols as i64)],
        );
    }

    /// `tcgen05.dealloc`: the allocating warp frees `cols` columns at `taddr`.
    pub fn tcgen05_dealloc(&mut self, taddr: Reg<B32>, cols: u32) {
        self.check_alloc_cols("tcgen05.dealloc", cols);
        self.tcgen05(
            "tcgen05.dealloc",
            "tcgen05.dealloc.cta_group::1.sync.aligned.b32".into(),
            vec![taddr.operand(), Operand::Int(cols as i64)],
        );
    }

    /// `tcgen05.relinquish_alloc_permit`: this CTA allocates no more TMEM.
    pub fn tcgen05_relinquish_alloc_permit(&mut self) {
        self.tcgen05(
            "tcgen05.relinquish_alloc_permit",
            "tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned".into(),
            vec![],
        );
    }

    /// `D (+)= A·B` with A and B in shared memory (64-bit descriptors), kind::f16, one
    /// thread. `idesc` is the 32-bit instruction descriptor; `accumulate` false overwrites D.
    pub fn tcgen05_mma_ss(
        &mut self,
        d: TmemAddr,
        a_desc: Reg<B64>,
        b_desc: Reg<B64>,
        idesc: u32,
        accumulate: Reg<Pred>,
    ) {
        self.tcgen05(
            "tcgen05.mma",
            "tcgen05.mma.cta_group::1.kind::f16".into(),
            vec![
                d.operand(),
                a_desc.operand(),
                b_desc.operand(),
                Operand::Hex(idesc as u64),
                accumulate.operand(),
            ],
        );
    }

    /// `D (+)= A·B` with A in tensor memory (packed bf16, K-major) and B in shared memory.
    pub fn tcgen05_mma_ts(
        &mut self,
        d: TmemAddr,
        a: TmemAddr,
        b_desc: Reg<B64>,
        idesc: u32,
        accumulate: Reg<Pred>,
    ) {
        self.tcgen05(
            "tcgen05.mma",
            "tcgen05.mma.cta_group::1.kind::f16".into(),
            vec![
                d.operand(),
                a.operand(),
                b_desc.operand(),
                Operand::Hex(idesc as u64),
                accumulate.operand(),
            ],
        );
    }

    /// `tcgen05.commit`: one arrival on `bar` once every prior tcgen05 operation of the
    /// executing thread has completed. Must run on the thread that issued the MMAs.
    pub fn tcgen05_commit(&mut self, bar: &SharedAddr) {
        self.tcgen05(
            "tcgen05.commit",
            "tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64".into(),
            vec![bar.operand()],
        );
    }

    /// `tcgen05.ld.32x32b.xN`: thread t of the warp reads `N` consecutive columns of TMEM lane
    /// `lane(taddr) + t`. Warp-collective; wait with [`Self::tcgen05_wait_ld`] before use.
    pub fn tcgen05_ld_32x32b<T: Word, const N: usize>(&mut self, taddr: TmemAddr) -> [Reg<T>; N] {
        if !legal_32x32b(N) {
            self.error(format!(
                "tcgen05.ld.32x32b.x{N}: the count must be a power of two up to 128"
            ));
        }
        let regs: [Reg<T>; N] = std::array::from_fn(|_| self.fresh::<T>());
        self.tcgen05(
            "tcgen05.ld",
            format!("tcgen05.ld.sync.aligned.32x32b.x{N}.b32"),
            vec![
                Operand::Vector(regs.iter().map(|r| r.name()).collect()),
                taddr.operand(),
            ],
        );
        regs
    }

    /// `tcgen05.st.32x32b.xN`: thread t writes `N` consecutive columns of lane
    /// `lane(taddr) + t`. Warp-collective; [`Self::tcgen05_wait_st`] before signalling.
    pub fn tcgen05_st_32x32b<T: Word, const N: usize>(&mut self, taddr: TmemAddr, v: [Reg<T>; N]) {
        if !legal_32x32b(N) {
            self.error(format!(
                "tcgen05.st.32x32b.x{N}: the count must be a power of two up to 128"
            ));
        }
        self.tcgen05(
            "tcgen05.st",
            format!("tcgen05.st.sync.aligned.32x32b.x{N}.b32"),
            vec![
                taddr.operand(),
                Operand::Vector(v.iter().map(|r| r.name()).collect()),
            ],
        );
    }

    /// `tcgen05.wait::ld`: this thread's earlier `tcgen05.ld` results are available.
    pub fn tcgen05_wait_ld(&mut self) {
        self.tcgen05(
            "tcgen05.wait",
            "tcgen05.wait::ld.sync.aligned".into(),
            vec![],
        );
    }

    /// `tcgen05.wait::st`: this thread's earlier `tcgen05.st` writes are complete.
    pub fn tcgen05_wait_st(&mut self) {
        self.tcgen05(
            "tcgen05.wait",
            "tcgen05.wait::st.sync.aligned".into(),
            vec![],
        );
    }

    /// Orders earlier async tcgen05 operations before a following thread synchronisation.
    pub fn tcgen05_fence_before_thread_sync(&mut self) {
        self.tcgen05(
            "tcgen05.fence",
            "tcgen05.fence::before_thread_sync".into(),
            vec![],
        );
    }

    /// Orders later async tcgen05 operations after a preceding thread synchronisation.
    pub fn tcgen05_fence_after_thread_sync(&mut self) {
        self.tcgen05(
            "tcgen05.fence",
            "tcgen05.fence::after_thread_sync".into(),
            vec![],
        );
    }

    /// `elect.sync _|p, 0xffffffff`: `p` holds in exactly one lane of the (converged) warp.
    pub fn elect_sync(&mut self) -> Reg<Pred> {
        let p = self.fresh::<Pred>();
        self.tcgen05(
            "elect.sync",
            "elect.sync".into(),
            vec![Operand::Symbol(format!("_|{p}")), Operand::Hex(0xffff_ffff)],
        );
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptx::testing::errors;
    use crate::ptx::{print, shared};

    #[test]
    fn prints_every_form_at_ptx_8_6() {
        let mut b = KernelBuilder::new("t", Target::Sm100a, (128, 1, 1));
        let s = b.mov::<U32>(0u32);
        b.tcgen05_alloc(&shared(s, 8), 512);
        b.tcgen05_relinquish_alloc_permit();
        let t = b.mov::<B32>(0u32);
        let t = TmemAddr::new(t);
        let d = b.mov::<B64>(0u64);
        let p = b.elect_sync();
        b.tcgen05_mma_ss(t.col(128), d, d, 0x0820_0490, p);
        b.tcgen05_mma_ts(t.col(256), t.col(8), d, 0x0821_0490, p);
        b.tcgen05_commit(&shared(s, 16));
        let v: [Reg<F32>; 32] = b.tcgen05_ld_32x32b(t.col(32));
        b.tcgen05_wait_ld();
        let w: [Reg<F32>; 16] = std::array::from_fn(|i| v[i]);
        b.tcgen05_st_32x32b(t, w);
        b.tcgen05_wait_st();
        b.tcgen05_fence_before_thread_sync();
        b.tcgen05_fence_after_thread_sync();
        b.tcgen05_dealloc(t.base(), 512);
        let k = b.finish().unwrap();
        assert_eq!(k.version(), PtxVersion(8, 6));
        let text = print::body(&k);
        for want in [
            "tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r0+8], 512;",
            "elect.sync _|%p0, 0xffffffff;",
            "tcgen05.mma.cta_group::1.kind::f16 [%b0+128], %bd0, %bd0, 0x8200490, %p0;",
            "tcgen05.mma.cta_group::1.kind::f16 [%b0+256], [%b0+8], %bd0, 0x8210490, %p0;",
            "tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%r0+16];",
            "tcgen05.ld.sync.aligned.32x32b.x32.b32 {%f0, %f1,",
            "%f31}, [%b0+32];",
            "tcgen05.st.sync.aligned.32x32b.x16.b32 [%b0], {%f0,",
            "tcgen05.dealloc.cta_group::1.sync.aligned.b32 %b0, 512;",
        ] {
            assert!(text.contains(want), "missing {want:?} in\n{text}");
        }
    }

    #[test]
    fn rejects_hopper_and_bad_counts() {
        let mut b = KernelBuilder::new("t", Target::Sm90a, (128, 1, 1));
        b.tcgen05_relinquish_alloc_permit();
        let e = errors(b);
        assert!(e[0].contains("only available on sm_100a"), "{e:?}");

        let mut b = KernelBuilder::new("t", Target::Sm100a, (128, 1, 1));
        let s = b.mov::<U32>(0u32);
        b.tcgen05_alloc(&shared(s, 0), 384);
        let t = TmemAddr::new(b.mov::<B32>(0u32));
        let _: [Reg<F32>; 24] = b.tcgen05_ld_32x32b(t);
        let e = errors(b);
        assert!(e[0].contains("384 columns"), "{e:?}");
        assert!(e[1].contains("x24"), "{e:?}");
    }
}
