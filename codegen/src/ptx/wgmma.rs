//! Hopper (`sm_90a`) warpgroup MMA: `wgmma.mma_async` (SS and RS forms), its fence,
//! commit and wait. Every method is gated on [`Target::Sm90a`].

use super::builder::KernelBuilder;
use super::ir::Operand;
use super::operand::Src;
use super::types::*;
use crate::target::Target;

impl KernelBuilder {
    /// `wgmma.fence`: orders register accesses of the accumulators and A fragments before
    /// the following wgmma.
    pub fn wgmma_fence(&mut self) {
        self.require("wgmma", Target::Sm90a);
        self.inst("wgmma.fence.sync.aligned".into(), vec![]);
    }

    /// Closes the current group of wgmma operations.
    pub fn wgmma_commit(&mut self) {
        self.require("wgmma", Target::Sm90a);
        self.inst("wgmma.commit_group.sync.aligned".into(), vec![]);
    }

    /// Waits until at most `pending` wgmma groups are in flight.
    pub fn wgmma_wait(&mut self, pending: u32) {
        self.require("wgmma", Target::Sm90a);
        self.inst(
            "wgmma.wait_group.sync.aligned".into(),
            vec![Operand::Int(pending as i64)],
        );
    }

    fn wgmma_shape(&mut self, acc: &[Reg<F32>]) -> u32 {
        let n = acc.len() as u32 * 2;
        if !(8..=256).contains(&n) || !n.is_multiple_of(8) {
            self.error(format!(
                "wgmma m64: {} accumulators per thread is not a legal N",
                acc.len()
            ));
        }
        n
    }

    /// `D (+)= A·B` with A and B in shared memory (descriptors), bf16 inputs, f32
    /// accumulators `acc` (N/2 registers per thread). `accumulate` false overwrites D.
    pub fn wgmma_ss(
        &mut self,
        acc: &[Reg<F32>],
        a_desc: Reg<B64>,
        b_desc: Reg<B64>,
        accumulate: Reg<Pred>,
        transpose_a: bool,
        transpose_b: bool,
    ) {
        self.require("wgmma", Target::Sm90a);
        let n = self.wgmma_shape(acc);
        self.inst(
            format!("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16"),
            vec![
                Operand::Vector(acc.iter().map(|r| r.name()).collect()),
                a_desc.operand(),
                b_desc.operand(),
                accumulate.operand(),
                Operand::Int(1),
                Operand::Int(1),
                Operand::Int(transpose_a as i64),
                Operand::Int(transpose_b as i64),
            ],
        );
    }

    /// `D (+)= A·B` with A from registers (four bf16x2 per thread, the m64k16 fragment) and B
    /// in shared memory.
    pub fn wgmma_rs(
        &mut self,
        acc: &[Reg<F32>],
        a: [Reg<Bf16x2>; 4],
        b_desc: Reg<B64>,
        accumulate: Reg<Pred>,
        transpose_b: bool,
    ) {
        self.require("wgmma", Target::Sm90a);
        let n = self.wgmma_shape(acc);
        self.inst(
            format!("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16"),
            vec![
                Operand::Vector(acc.iter().map(|r| r.name()).collect()),
                Operand::Vector(a.iter().map(|r| r.name()).collect()),
                b_desc.operand(),
                accumulate.operand(),
                Operand::Int(1),
                Operand::Int(1),
                Operand::Int(transpose_b as i64),
            ],
        );
    }
}
