//! Atomics and reductions: `atom` (returns the old value) and `red` (no result), on
//! integers and on packed or vector floats.

use crate::ptx::builder::KernelBuilder;
use crate::ptx::ir::Operand;
use crate::ptx::operand::{Address, GlobalAddr, Src};
use crate::ptx::types::*;
use crate::target::PtxVersion;

/// Integer atomic operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomOp {
    /// Add.
    Add,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Bitwise or.
    Or,
    /// Exchange.
    Exch,
}

impl AtomOp {
    fn name(self) -> &'static str {
        match self {
            AtomOp::Add => "add",
            AtomOp::Min => "min",
            AtomOp::Max => "max",
            AtomOp::Or => "or",
            AtomOp::Exch => "exch",
        }
    }
}

/// Integer types atomics accept, with the untyped name bitwise atomics use.
pub trait AtomBits: Int {
    /// `b32`/`b64`.
    const BITS_NAME_OF: &'static str;
}
impl AtomBits for U32 {
    const BITS_NAME_OF: &'static str = "b32";
}
impl AtomBits for S32 {
    const BITS_NAME_OF: &'static str = "b32";
}
impl AtomBits for U64 {
    const BITS_NAME_OF: &'static str = "b64";
}

impl KernelBuilder {
    fn atom_type<T: AtomBits>(op: AtomOp) -> &'static str {
        match op {
            AtomOp::Or | AtomOp::Exch => T::BITS_NAME_OF,
            _ => T::NAME,
        }
    }

    /// `atom.<space>.<op>`: returns the old value.
    pub fn atom<T: Int + AtomBits, A: Address>(
        &mut self,
        op: AtomOp,
        addr: &A,
        v: impl Src<T>,
    ) -> Reg<T> {
        let d = self.fresh::<T>();
        self.inst(
            format!(
                "atom.{}.{}.{}",
                A::SPACE,
                op.name(),
                Self::atom_type::<T>(op)
            ),
            vec![Operand::Reg(d.name()), addr.operand(), v.operand()],
        );
        d
    }

    /// `red.<space>.<op>` on an integer: no result.
    pub fn red<T: Int + AtomBits, A: Address>(&mut self, op: AtomOp, addr: &A, v: impl Src<T>) {
        self.inst(
            format!(
                "red.{}.{}.{}",
                A::SPACE,
                op.name(),
                Self::atom_type::<T>(op)
            ),
            vec![addr.operand(), v.operand()],
        );
    }

    /// `red.global.add.f32`.
    pub fn red_add_f32(&mut self, addr: &GlobalAddr, v: Reg<F32>) {
        self.inst(
            "red.global.add.f32".into(),
            vec![addr.operand(), v.operand()],
        );
    }

    /// `red.global.add.v4.f32`: four consecutive floats in one 16-byte reduction.
    pub fn red_add_v4_f32(
        &mut self,
        addr: &GlobalAddr,
        v: [Reg<F32>; 4],
        policy: Option<Reg<B64>>,
    ) {
        self.red_add_vector("", addr, &v, policy);
    }

    /// `red.global.add.noftz.v4.bf16x2`: eight packed bf16 additions (16 bytes) in one
    /// reduction (PTX 8.1, sm_90).
    pub fn red_add_v4_bf16x2(
        &mut self,
        addr: &GlobalAddr,
        v: [Reg<Bf16x2>; 4],
        policy: Option<Reg<B64>>,
    ) {
        self.red_add_vector(".noftz", addr, &v, policy);
    }

    /// `red.global.add{noftz}{hint}.v{N}.{T}`, the vector reductions (PTX 8.1).
    fn red_add_vector<T: Ty>(
        &mut self,
        noftz: &str,
        addr: &GlobalAddr,
        v: &[Reg<T>],
        policy: Option<Reg<B64>>,
    ) {
        let (hint, mut extra) = Self::policy(policy);
        let mut ops = vec![
            addr.operand(),
            Operand::Vector(v.iter().map(|r| r.name()).collect()),
        ];
        ops.append(&mut extra);
        self.push(
            format!("red.global.add{noftz}{hint}.v{}.{}", v.len(), T::NAME),
            ops,
            PtxVersion(8, 1),
        );
    }

    /// `red.global.add.noftz.bf16x2`: two packed bf16 additions in one 4-byte reduction.
    pub fn red_add_bf16x2(&mut self, addr: &GlobalAddr, v: Reg<Bf16x2>, policy: Option<Reg<B64>>) {
        let (hint, mut extra) = Self::policy(policy);
        let mut ops = vec![addr.operand(), v.operand()];
        ops.append(&mut extra);
        self.push(
            format!("red.global.add.noftz{hint}.bf16x2"),
            ops,
            PtxVersion(7, 8),
        );
    }
}
