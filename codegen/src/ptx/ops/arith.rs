//! Arithmetic, logic and comparison: the PTX ISA's integer and floating-point arithmetic,
//! logic and shift, and comparison and selection instructions.
//!
//! The uniform two-operand emitters (`op.<type> d, a, b`) come from one table,
//! `binary_ops!`; the rest differ in arity, rounding or operand shape and are written out.

use crate::ptx::builder::KernelBuilder;
use crate::ptx::ir::Operand;
use crate::ptx::operand::Src;
use crate::ptx::types::*;

/// Comparison operators of `setp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
}

impl Cmp {
    fn name(self) -> &'static str {
        match self {
            Cmp::Eq => "eq",
            Cmp::Ne => "ne",
            Cmp::Lt => "lt",
            Cmp::Le => "le",
            Cmp::Gt => "gt",
            Cmp::Ge => "ge",
        }
    }
}

/// Integer types whose `mul.wide` result is `Self::Wide`.
pub trait Widen: Int {
    /// The double-width result type.
    type Wide: Int;
}
impl Widen for U32 {
    type Wide = U64;
}
impl Widen for S32 {
    type Wide = S64;
}

/// One `KernelBuilder` method per row. `name<T: Bound>(a: A, b: B) -> R = "op", suffix;`
/// emits `op.<suffix> d, a, b` into a fresh `d`, the suffix being one of the type's names
/// (`T::NAME`, `T::BITS_NAME`); a row without a suffix has a fixed opcode.
macro_rules! binary_ops {
    ($(
        $(#[$doc:meta])*
        $name:ident $(<$T:ident: $bound:ident>)? ($a:ident: $A:ty, $b:ident: $B:ty) -> $R:ty
            = $op:literal $(, $suffix:expr)?;
    )*) => {
        impl KernelBuilder {
            $(
                $(#[$doc])*
                pub fn $name $(<$T: $bound>)? (&mut self, $a: $A, $b: $B) -> $R {
                    let op = binary_ops!(@opcode $op $(, $suffix)?);
                    self.binary(&op, $a.operand(), $b.operand())
                }
            )*
        }
    };
    (@opcode $op:literal) => { $op };
    (@opcode $op:literal, $suffix:expr) => { format!(concat!($op, ".{}"), $suffix) };
}

binary_ops! {
    /// `a + b`.
    add<T: Arith>(a: Reg<T>, b: impl Src<T>) -> Reg<T> = "add", T::NAME;
    /// `a - b`.
    sub<T: Arith>(a: Reg<T>, b: impl Src<T>) -> Reg<T> = "sub", T::NAME;
    /// `min(a, b)`.
    min<T: Arith>(a: Reg<T>, b: impl Src<T>) -> Reg<T> = "min", T::NAME;
    /// `max(a, b)`.
    max<T: Arith>(a: Reg<T>, b: impl Src<T>) -> Reg<T> = "max", T::NAME;
    /// Low half of `a * b`.
    mul_lo<T: Int>(a: Reg<T>, b: impl Src<T>) -> Reg<T> = "mul.lo", T::NAME;
    /// Full-width product of two 32-bit integers.
    mul_wide<T: Widen>(a: Reg<T>, b: impl Src<T>) -> Reg<T::Wide> = "mul.wide", T::NAME;
    /// `a / b` (integer, truncating).
    div<T: Int>(a: Reg<T>, b: impl Src<T>) -> Reg<T> = "div", T::NAME;
    /// `a % b` (integer).
    rem<T: Int>(a: Reg<T>, b: impl Src<T>) -> Reg<T> = "rem", T::NAME;
    /// `a * b` in f32, round to nearest even.
    fmul(a: Reg<F32>, b: impl Src<F32>) -> Reg<F32> = "mul.rn.f32";
    /// `a + b` in f32, round to nearest even, never contracted into an `fma`.
    fadd(a: Reg<F32>, b: impl Src<F32>) -> Reg<F32> = "add.rn.f32";
    /// `a - b` in f32, round to nearest even, never contracted into an `fma`.
    fsub(a: Reg<F32>, b: impl Src<F32>) -> Reg<F32> = "sub.rn.f32";
    /// `a << n`.
    shl<T: Bits>(a: Reg<T>, n: impl Src<U32>) -> Reg<T> = "shl", T::BITS_NAME;
    /// `a >> n` (arithmetic for signed types).
    shr<T: Int>(a: Reg<T>, n: impl Src<U32>) -> Reg<T> = "shr", T::NAME;
    /// Bitwise and.
    and<T: Bits>(a: Reg<T>, b: impl Src<T>) -> Reg<T> = "and", T::BITS_NAME;
    /// Bitwise or.
    or<T: Bits>(a: Reg<T>, b: impl Src<T>) -> Reg<T> = "or", T::BITS_NAME;
    /// Bitwise xor.
    xor<T: Bits>(a: Reg<T>, b: impl Src<T>) -> Reg<T> = "xor", T::BITS_NAME;
    /// Predicate and.
    and_pred(a: Reg<Pred>, b: Reg<Pred>) -> Reg<Pred> = "and.pred";
    /// Predicate or.
    or_pred(a: Reg<Pred>, b: Reg<Pred>) -> Reg<Pred> = "or.pred";
}

impl KernelBuilder {
    /// `op d, srcs...` into a fresh `d`.
    fn compute<T: Ty>(&mut self, op: &str, srcs: Vec<Operand>) -> Reg<T> {
        let d = self.fresh::<T>();
        let mut operands = vec![Operand::Reg(d.name())];
        operands.extend(srcs);
        self.inst(op.to_string(), operands);
        d
    }

    fn binary<T: Ty>(&mut self, op: &str, a: Operand, b: Operand) -> Reg<T> {
        self.compute(op, vec![a, b])
    }

    /// `popc.b32`: the number of set bits of `a`.
    pub fn popc(&mut self, a: Reg<U32>) -> Reg<U32> {
        self.compute("popc.b32", vec![a.operand()])
    }

    /// `not.pred`: the negation of `a`.
    pub fn not_pred(&mut self, a: Reg<Pred>) -> Reg<Pred> {
        self.compute("not.pred", vec![a.operand()])
    }

    /// `a * b + c` (low half).
    pub fn mad_lo<T: Int>(&mut self, a: Reg<T>, b: impl Src<T>, c: impl Src<T>) -> Reg<T> {
        let op = format!("mad.lo.{}", T::NAME);
        self.compute(&op, vec![a.operand(), b.operand(), c.operand()])
    }

    /// Fused `a * b + c` in f32, one rounding.
    pub fn fma(&mut self, a: Reg<F32>, b: impl Src<F32>, c: impl Src<F32>) -> Reg<F32> {
        self.compute("fma.rn.f32", vec![a.operand(), b.operand(), c.operand()])
    }

    /// `2^a`, approximate (flush-to-zero), as the MUFU unit computes it.
    pub fn ex2_approx(&mut self, a: Reg<F32>) -> Reg<F32> {
        self.compute("ex2.approx.ftz.f32", vec![a.operand()])
    }

    /// `log2(a)`, approximate (flush-to-zero), as the MUFU unit computes it.
    pub fn lg2_approx(&mut self, a: Reg<F32>) -> Reg<F32> {
        self.compute("lg2.approx.ftz.f32", vec![a.operand()])
    }

    /// `1/a`, IEEE round to nearest even.
    pub fn rcp_rn(&mut self, a: Reg<F32>) -> Reg<F32> {
        self.compute("rcp.rn.f32", vec![a.operand()])
    }

    /// `p = a <cmp> b`.
    pub fn setp<T: Arith>(&mut self, cmp: Cmp, a: Reg<T>, b: impl Src<T>) -> Reg<Pred> {
        self.binary(
            &format!("setp.{}.{}", cmp.name(), T::NAME),
            a.operand(),
            b.operand(),
        )
    }

    /// `p ? a : b`.
    pub fn selp<T: Ty>(&mut self, a: impl Src<T>, b: impl Src<T>, p: Reg<Pred>) -> Reg<T> {
        let d = self.fresh::<T>();
        let name = if T::BYTES == 0 { "pred" } else { T::DECL };
        self.inst(
            format!("selp.{name}"),
            vec![
                Operand::Reg(d.name()),
                a.operand(),
                b.operand(),
                p.operand(),
            ],
        );
        d
    }
}
