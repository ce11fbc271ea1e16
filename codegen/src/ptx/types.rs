//! Register types of the PTX builder.
//!
//! Every virtual register carries its PTX type in the Rust type system (`Reg<U32>`,
//! `Reg<F32>`, ...). Instruction builders are generic over the traits below, so an operand of
//! the wrong type is a Rust compile error rather than a ptxas error.

use std::fmt;
use std::marker::PhantomData;

/// A PTX register type: its name in instructions, in `.reg` declarations, and the prefix of
/// its virtual registers.
pub trait Ty: Copy + fmt::Debug + 'static {
    /// Type suffix used in instructions (`u32` in `add.u32`).
    const NAME: &'static str;
    /// Type used in the `.reg` declaration.
    const DECL: &'static str;
    /// Register name prefix; one numbering sequence per prefix.
    const PREFIX: &'static str;
    /// Size in bytes (0 for predicates).
    const BYTES: u32;
}

macro_rules! reg_types {
    ($($(#[$doc:meta])* $T:ident => $name:literal, $decl:literal, $prefix:literal, $bytes:literal;)*) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
            pub struct $T;
            impl Ty for $T {
                const NAME: &'static str = $name;
                const DECL: &'static str = $decl;
                const PREFIX: &'static str = $prefix;
                const BYTES: u32 = $bytes;
            }
        )*
        /// Every register type, in declaration order (drives `.reg` printing order).
        pub(crate) const ALL_PREFIXES: &[(&str, &str)] = &[$(($prefix, $decl)),*];
    };
}

reg_types! {
    /// Predicate.
    Pred => "pred", "pred", "%p", 0;
    /// Untyped 16 bits.
    B16 => "b16", "b16", "%h", 2;
    /// One bf16 value (held in a 16-bit register).
    Bf16 => "bf16", "b16", "%hb", 2;
    /// Untyped 32 bits.
    B32 => "b32", "b32", "%b", 4;
    /// Two packed bf16 values (upper half, lower half).
    Bf16x2 => "bf16x2", "b32", "%bx", 4;
    /// Two packed f16 values (upper half, lower half).
    F16x2 => "f16x2", "b32", "%hx", 4;
    /// Unsigned 32-bit integer.
    U32 => "u32", "u32", "%r", 4;
    /// Signed 32-bit integer.
    S32 => "s32", "s32", "%s", 4;
    /// 32-bit IEEE float.
    F32 => "f32", "f32", "%f", 4;
    /// Untyped 64 bits.
    B64 => "b64", "b64", "%bd", 8;
    /// Unsigned 64-bit integer (addresses).
    U64 => "u64", "u64", "%rd", 8;
    /// Signed 64-bit integer.
    S64 => "s64", "s64", "%sd", 8;
}

/// Integer types with the usual arithmetic (`add`, `mul.lo`, `min`, ...).
pub trait Int: Ty {
    /// Whether the type is signed (selects `shr.s*` and signed compares).
    const SIGNED: bool;
}
impl Int for U32 {
    const SIGNED: bool = false;
}
impl Int for S32 {
    const SIGNED: bool = true;
}
impl Int for U64 {
    const SIGNED: bool = false;
}
impl Int for S64 {
    const SIGNED: bool = true;
}

/// Types `add`/`sub`/`min`/`max`/`setp` accept.
pub trait Arith: Ty {}
impl Arith for U32 {}
impl Arith for S32 {}
impl Arith for U64 {}
impl Arith for S64 {}
impl Arith for F32 {}

/// Types whose bits the logic instructions (`and.b32`, `shl.b64`, ...) operate on.
pub trait Bits: Ty {
    /// The untyped name of the same width (`b32`).
    const BITS_NAME: &'static str;
}
macro_rules! bits {
    ($($T:ident => $n:literal),*) => { $(impl Bits for $T { const BITS_NAME: &'static str = $n; })* };
}
bits!(B32 => "b32", U32 => "b32", S32 => "b32", Bf16x2 => "b32", F16x2 => "b32", F32 => "b32",
      B64 => "b64", U64 => "b64", S64 => "b64", B16 => "b16", Bf16 => "b16");

/// 32-bit types that `shfl.sync` moves.
pub trait Word: Bits {}
impl Word for B32 {}
impl Word for U32 {}
impl Word for S32 {}
impl Word for F32 {}
impl Word for Bf16x2 {}
impl Word for F16x2 {}

/// Two packed 16-bit floats, as `stmatrix` stores them.
pub trait Packed16x2: Word {}
impl Packed16x2 for Bf16x2 {}
impl Packed16x2 for F16x2 {}

/// Types that can live in memory and be moved by `ld`/`st`.
pub trait Mem: Ty {}
macro_rules! mem {
    ($($T:ident),*) => { $(impl Mem for $T {})* };
}
mem!(B16, Bf16, B32, Bf16x2, F16x2, U32, S32, F32, B64, U64, S64);

/// A typed virtual register. Copyable handle; the builder owns the numbering.
///
/// Operand types are checked by the compiler: adding an `f32` register to a `u32` one, or
/// storing a predicate, does not build.
///
/// ```compile_fail
/// use codegen::ptx::*;
/// let mut b = KernelBuilder::new("k", codegen::Target::Sm90a, (32, 1, 1));
/// let i = b.mov::<U32>(1u32);
/// let f = b.mov::<F32>(1.0f32);
/// b.add(i, f); // mismatched types
/// ```
///
/// ```compile_fail
/// use codegen::ptx::*;
/// let mut b = KernelBuilder::new("k", codegen::Target::Sm90a, (32, 1, 1));
/// let f = b.mov::<F32>(1.0f32);
/// b.mul_lo(f, f); // `mul.lo` is integer-only
/// ```
///
/// ```compile_fail
/// use codegen::ptx::*;
/// let mut b = KernelBuilder::new("k", codegen::Target::Sm90a, (32, 1, 1));
/// let x = b.mov::<U32>(1u32);
/// let _wide: Reg<U64> = b.bitcast::<U64, U32>(x); // widths differ
/// ```
///
/// ```
/// use codegen::ptx::*;
/// let mut b = KernelBuilder::new("k", codegen::Target::Sm90a, (32, 1, 1));
/// let i = b.mov::<U32>(1u32);
/// let j = b.add(i, 2u32);
/// assert_eq!(j.to_string(), "%r1");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Reg<T: Ty> {
    pub(crate) idx: u32,
    _t: PhantomData<T>,
}

impl<T: Ty> Reg<T> {
    pub(crate) fn new(idx: u32) -> Self {
        Reg {
            idx,
            _t: PhantomData,
        }
    }

    /// The untyped name of this register, as printed.
    pub fn name(self) -> RegName {
        RegName {
            prefix: T::PREFIX,
            idx: self.idx,
        }
    }
}

impl<T: Ty> fmt::Display for Reg<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", T::PREFIX, self.idx)
    }
}

/// A register name with its type erased (what the IR stores).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegName {
    pub(crate) prefix: &'static str,
    pub(crate) idx: u32,
}

impl fmt::Display for RegName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.prefix, self.idx)
    }
}
