//! Warp-level matrix multiply-accumulate (`mma.sync`, PTX ISA 9.7.14): one shape, the one the
//! forward's reference probe needs. The warpgroup and Blackwell tensor-core families are
//! [`crate::ptx::wgmma`] and [`crate::ptx::tcgen05`].

use crate::ptx::builder::KernelBuilder;
use crate::ptx::ir::Operand;
use crate::ptx::types::*;
use crate::target::PtxVersion;

impl KernelBuilder {
    /// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 d, a, b, c` (sm_80+, PTX 7.0):
    /// `D[16×8] = A[16×16]·B[16×8] + C` over the warp. With `g = lane / 4`, `t = lane % 4`:
    /// `a[0..4]` hold A's (row, k) pairs `(g, 2t..2t+2)`, `(g+8, 2t..)`, `(g, 2t+8..)`,
    /// `(g+8, 2t+8..)`; `b[0..2]` B's (k, col) pairs `(2t..2t+2, g)`, `(2t+8.., g)`; the
    /// result (and `c`) `D[g][2t]`, `D[g][2t+1]`, `D[g+8][2t]`, `D[g+8][2t+1]`. Every lane of
    /// the warp must execute it.
    pub fn mma_m16n8k16_bf16(
        &mut self,
        a: [Reg<Bf16x2>; 4],
        b: [Reg<Bf16x2>; 2],
        c: [Reg<F32>; 4],
    ) -> [Reg<F32>; 4] {
        let d: [Reg<F32>; 4] = std::array::from_fn(|_| self.fresh::<F32>());
        self.push(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32".into(),
            vec![
                Operand::Vector(d.iter().map(|r| r.name()).collect()),
                Operand::Vector(a.iter().map(|r| r.name()).collect()),
                Operand::Vector(b.iter().map(|r| r.name()).collect()),
                Operand::Vector(c.iter().map(|r| r.name()).collect()),
            ],
            PtxVersion(7, 0),
        );
        d
    }
}
