//! Moves and conversions between registers: the PTX ISA's `mov` (special registers,
//! bit casts, packing), `cvt` and `prmt` from its data movement and conversion chapter.

use crate::ptx::builder::KernelBuilder;
use crate::ptx::ir::Operand;
use crate::ptx::operand::Src;
use crate::ptx::types::*;
use crate::target::PtxVersion;

/// Special registers read with `mov.u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SReg {
    /// `%tid.x`
    TidX,
    /// `%tid.y`
    TidY,
    /// `%ntid.x`
    NtidX,
    /// `%ctaid.x`
    CtaidX,
    /// `%ctaid.y`
    CtaidY,
    /// `%nctaid.x`
    NctaidX,
    /// `%laneid`
    LaneId,
    /// `%clock`: the SM's cycle counter (low 32 bits), for the latency probes that tell an L2
    /// partition's own addresses from the other one's.
    Clock,
}

impl SReg {
    fn name(self) -> &'static str {
        match self {
            SReg::TidX => "%tid.x",
            SReg::TidY => "%tid.y",
            SReg::NtidX => "%ntid.x",
            SReg::CtaidX => "%ctaid.x",
            SReg::CtaidY => "%ctaid.y",
            SReg::NctaidX => "%nctaid.x",
            SReg::LaneId => "%laneid",
            SReg::Clock => "%clock",
        }
    }
}

/// Conversions `cvt` performs, with the rounding each pair needs.
pub trait CvtFrom<S: Ty>: Ty {
    /// Modifiers between `cvt` and the types (`.rn`, `.rzi`, or empty).
    const ROUND: &'static str;
    /// PTX ISA the pair needs.
    const MIN_VERSION: PtxVersion = PtxVersion(0, 0);
}

macro_rules! cvt_pairs {
    ($($D:ident <- $S:ident : $round:literal $(, $v:expr)?;)*) => {
        $(impl CvtFrom<$S> for $D {
            const ROUND: &'static str = $round;
            $(const MIN_VERSION: PtxVersion = $v;)?
        })*
    };
}
cvt_pairs! {
    U64 <- U32: "";
    S64 <- S32: "";
    U32 <- U64: "";
    U64 <- S32: "";
    F32 <- U32: ".rn";
    F32 <- S32: ".rn";
    U32 <- F32: ".rzi";
    S32 <- F32: ".rzi";
    S64 <- F32: ".rzi";
    F32 <- S64: ".rn";
    S32 <- S64: "";
    F32 <- Bf16: "", PtxVersion(7, 8);
    Bf16 <- F32: ".rn", PtxVersion(7, 0);
}

impl KernelBuilder {
    /// Reads a special register.
    pub fn sreg(&mut self, s: SReg) -> Reg<U32> {
        let d = self.fresh::<U32>();
        self.inst(
            "mov.u32".into(),
            vec![Operand::Reg(d.name()), Operand::Special(s.name())],
        );
        d
    }

    /// `d = src` into a fresh register.
    pub fn mov<T: Ty>(&mut self, src: impl Src<T>) -> Reg<T> {
        let d = self.fresh::<T>();
        self.set(d, src);
        d
    }

    /// `dst = src` (re-assigns an existing register; loop-carried values).
    pub fn set<T: Ty>(&mut self, dst: Reg<T>, src: impl Src<T>) {
        // bf16 values move as untyped bits (`mov.bf16x2` is not PTX).
        let ty = if T::NAME.starts_with("bf16") {
            T::DECL
        } else {
            T::NAME
        };
        self.inst(
            format!("mov.{ty}"),
            vec![Operand::Reg(dst.name()), src.operand()],
        );
    }

    /// Reinterprets the bits of `src` as another type of the same width.
    pub fn bitcast<D: Bits, S: Bits>(&mut self, src: Reg<S>) -> Reg<D> {
        const {
            assert!(
                D::BYTES == S::BYTES,
                "bitcast between types of different width"
            )
        };
        let d = self.fresh::<D>();
        self.inst(
            format!("mov.{}", D::BITS_NAME),
            vec![Operand::Reg(d.name()), Operand::Reg(src.name())],
        );
        d
    }

    /// `{lo, hi}` as one 64-bit value.
    pub fn pack_b64(&mut self, lo: Reg<U32>, hi: impl Src<U32>) -> Reg<B64> {
        let hi = match hi.operand() {
            Operand::Reg(r) => r,
            imm => {
                let r = self.fresh::<U32>();
                self.inst("mov.u32".into(), vec![Operand::Reg(r.name()), imm]);
                r.name()
            }
        };
        let d = self.fresh::<B64>();
        self.inst(
            "mov.b64".into(),
            vec![Operand::Reg(d.name()), Operand::Vector(vec![lo.name(), hi])],
        );
        d
    }

    /// `cvt` between numeric types, with the rounding the pair requires.
    pub fn cvt<D: CvtFrom<S>, S: Ty>(&mut self, src: Reg<S>) -> Reg<D> {
        let d = self.fresh::<D>();
        self.push(
            format!("cvt{}.{}.{}", D::ROUND, D::NAME, S::NAME),
            vec![Operand::Reg(d.name()), src.operand()],
            D::MIN_VERSION,
        );
        d
    }

    /// Packs two f32 values into bf16x2 with round-to-nearest-even: `hi` lands in the upper
    /// half, `lo` in the lower (the operand order of `cvt.rn.bf16x2.f32`).
    pub fn cvt_bf16x2(&mut self, hi: Reg<F32>, lo: Reg<F32>) -> Reg<Bf16x2> {
        let d = self.fresh::<Bf16x2>();
        self.push(
            "cvt.rn.bf16x2.f32".into(),
            vec![Operand::Reg(d.name()), hi.operand(), lo.operand()],
            PtxVersion(7, 0),
        );
        d
    }

    /// Packs two f32 values into f16x2 with round-to-nearest-even: `hi` in the upper half
    /// (`cvt.rn.f16x2.f32`; a value past f16's range becomes ±∞).
    pub fn cvt_f16x2(&mut self, hi: Reg<F32>, lo: Reg<F32>) -> Reg<F16x2> {
        let d = self.fresh::<F16x2>();
        self.push(
            "cvt.rn.f16x2.f32".into(),
            vec![Operand::Reg(d.name()), hi.operand(), lo.operand()],
            PtxVersion(7, 0),
        );
        d
    }

    /// `floor(a)` as f32 (`cvt.rmi.f32.f32`).
    pub fn floor_f32(&mut self, a: Reg<F32>) -> Reg<F32> {
        let d = self.fresh::<F32>();
        self.push(
            "cvt.rmi.f32.f32".into(),
            vec![Operand::Reg(d.name()), a.operand()],
            PtxVersion(7, 0),
        );
        d
    }

    /// Widens f16x2 to two f32 values (lower, upper), exactly (`cvt.f32.f16` of each half).
    pub fn f16x2_to_f32(&mut self, v: Reg<F16x2>) -> (Reg<F32>, Reg<F32>) {
        let lo = self.fresh::<B16>();
        let hi = self.fresh::<B16>();
        self.inst(
            "mov.b32".into(),
            vec![Operand::Vector(vec![lo.name(), hi.name()]), v.operand()],
        );
        let widen = |b: &mut Self, h: Reg<B16>| {
            let d = b.fresh::<F32>();
            b.push(
                "cvt.f32.f16".into(),
                vec![Operand::Reg(d.name()), h.operand()],
                PtxVersion(7, 0),
            );
            d
        };
        (widen(self, lo), widen(self, hi))
    }

    /// Splits bf16x2 into its (lower, upper) halves.
    pub fn unpack_bf16x2(&mut self, v: Reg<Bf16x2>) -> (Reg<Bf16>, Reg<Bf16>) {
        let lo = self.fresh::<Bf16>();
        let hi = self.fresh::<Bf16>();
        self.inst(
            "mov.b32".into(),
            vec![Operand::Vector(vec![lo.name(), hi.name()]), v.operand()],
        );
        (lo, hi)
    }

    /// Widens bf16x2 to two f32 values (lower, upper): the exact reverse of `cvt_bf16x2`.
    pub fn bf16x2_to_f32(&mut self, v: Reg<Bf16x2>) -> (Reg<F32>, Reg<F32>) {
        let (lo, hi) = self.unpack_bf16x2(v);
        (self.cvt::<F32, Bf16>(lo), self.cvt::<F32, Bf16>(hi))
    }

    /// Byte permute: each selector nibble picks one byte of `{b, a}` (`prmt.b32`).
    pub fn prmt<T: Word>(&mut self, a: Reg<T>, b: Reg<T>, selector: u32) -> Reg<T> {
        let d = self.fresh::<T>();
        self.inst(
            "prmt.b32".into(),
            vec![
                Operand::Reg(d.name()),
                a.operand(),
                b.operand(),
                Operand::Hex(selector as u64),
            ],
        );
        d
    }
}

#[cfg(test)]
mod tests {
    use crate::ptx::testing::builder;
    use crate::ptx::{print, Bf16x2, Reg, F32};

    #[test]
    fn bf16_registers_move_as_bits() {
        let mut b = builder();
        let x = b.mov::<F32>(1.0f32);
        let packed = b.cvt_bf16x2(x, x);
        let carried: Reg<Bf16x2> = b.reg();
        b.set(carried, packed);
        let text = print::body(&b.finish().unwrap());
        assert!(
            text.contains(&format!("mov.b32 {}, {};", carried.name(), packed.name())),
            "{text}"
        );
        assert!(!text.contains("mov.bf16x2"), "{text}");
        assert!(text.contains("mov.f32"), "{text}");
    }
}
