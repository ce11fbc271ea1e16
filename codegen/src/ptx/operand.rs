//! Operands: what an instruction reads ([`Src`]: a register or an immediate), memory
//! addresses in the global and shared spaces ([`Address`]), and references to declared
//! parameters. Fields are visible to the rest of `ptx` so the instruction families can
//! spell them; kernel descriptions only see the constructors.

use super::ir::{AddrBase, Operand};
use super::types::*;

/// A value an instruction can read: a register of type `T` or an immediate of that type.
pub trait Src<T: Ty> {
    /// The operand.
    fn operand(self) -> Operand;
}

impl<T: Ty> Src<T> for Reg<T> {
    fn operand(self) -> Operand {
        Operand::Reg(self.name())
    }
}

macro_rules! imm_src {
    ($($rust:ty => $($T:ident),*);*) => {
        $($(impl Src<$T> for $rust {
            fn operand(self) -> Operand { Operand::Int(self as i64) }
        })*)*
    };
}
imm_src!(u32 => U32, B32; i32 => S32; u64 => U64, B64; i64 => S64);

impl Src<F32> for f32 {
    fn operand(self) -> Operand {
        Operand::F32(self)
    }
}

/// A global-memory address: a 64-bit register plus a byte offset.
#[derive(Debug, Clone, Copy)]
pub struct GlobalAddr {
    pub(super) base: Reg<U64>,
    pub(super) offset: i64,
}

impl GlobalAddr {
    /// The same base, `bytes` further.
    pub fn offset(&self, bytes: i64) -> GlobalAddr {
        GlobalAddr {
            base: self.base,
            offset: self.offset + bytes,
        }
    }
}

/// `[base + offset]` in the global space.
pub fn global(base: Reg<U64>, offset: i64) -> GlobalAddr {
    GlobalAddr { base, offset }
}

/// A shared-memory address: a 32-bit shared-window register or a symbol, plus an offset.
#[derive(Debug, Clone)]
pub struct SharedAddr {
    pub(super) base: AddrBase,
    pub(super) offset: i64,
}

/// A declared shared-memory array.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedVar {
    pub(super) name: String,
    pub(super) bytes: u32,
}

impl SharedVar {
    /// `[var + offset]`.
    pub fn at(&self, offset: i64) -> SharedAddr {
        SharedAddr {
            base: AddrBase::Symbol(self.name.clone()),
            offset,
        }
    }

    /// Declared size in bytes (0 for the dynamic array).
    pub fn bytes(&self) -> u32 {
        self.bytes
    }
}

impl SharedAddr {
    /// The same base, `bytes` further.
    pub fn offset(&self, bytes: i64) -> SharedAddr {
        SharedAddr {
            base: self.base.clone(),
            offset: self.offset + bytes,
        }
    }
}

/// `[base + offset]` in the shared space, base a 32-bit shared-window address.
pub fn shared(base: Reg<U32>, offset: i64) -> SharedAddr {
    SharedAddr {
        base: AddrBase::Reg(base.name()),
        offset,
    }
}

/// A memory operand in some state space.
pub trait Address {
    /// The state space suffix (`global`, `shared`).
    const SPACE: &'static str;
    /// The `[...]` operand.
    fn operand(&self) -> Operand;
}

impl Address for GlobalAddr {
    const SPACE: &'static str = "global";
    fn operand(&self) -> Operand {
        Operand::Addr(AddrBase::Reg(self.base.name()), self.offset)
    }
}

impl Address for SharedAddr {
    const SPACE: &'static str = "shared";
    fn operand(&self) -> Operand {
        Operand::Addr(self.base.clone(), self.offset)
    }
}

/// A declared scalar or pointer parameter whose value has type `T` on the device.
#[derive(Debug, Clone)]
pub struct ParamRef<T: Ty> {
    pub(super) name: String,
    pub(super) _t: std::marker::PhantomData<T>,
}

/// A declared CUtensorMap parameter.
#[derive(Debug, Clone)]
pub struct TensorMapRef {
    pub(super) name: String,
}

impl TensorMapRef {
    /// The parameter's symbol.
    pub fn name(&self) -> &str {
        &self.name
    }
}
