//! Bit-level models of the arithmetic the executor performs, per the PTX ISA.

use crate::ir::{AtomOp, Cmp, IntOp, IntTy, RoundInt, ShflMode, Ty};

/// The low `bits` bits of `v`.
#[inline]
pub fn mask(bits: u32, v: u64) -> u64 {
    if bits >= 64 {
        v
    } else {
        v & ((1u64 << bits) - 1)
    }
}

/// `v`'s low `bits` bits, sign-extended.
#[inline]
pub fn sext(v: u64, bits: u32) -> i64 {
    let s = 64 - bits.min(64);
    ((v << s) as i64) >> s
}

/// The f32 in the low 32 bits.
#[inline]
pub fn f32_of(v: u64) -> f32 {
    f32::from_bits(v as u32)
}

/// Flushes a subnormal to a zero of the same sign (`.ftz`).
#[inline]
pub fn flush(x: f32) -> f32 {
    if x.is_subnormal() {
        0.0f32.copysign(x)
    } else {
        x
    }
}

/// f32 result bits; NaN becomes the canonical `0x7fffffff`, as on the GPU.
#[inline]
pub fn canon(x: f32) -> u64 {
    if x.is_nan() {
        0x7fff_ffff
    } else {
        x.to_bits() as u64
    }
}

/// f32 to bf16 bits, round to nearest even; NaN gives the canonical `0x7fff`.
#[inline]
pub fn bf16_rne(x: f32) -> u16 {
    if x.is_nan() {
        0x7fff
    } else {
        half::bf16::from_f32(x).to_bits()
    }
}

/// bf16 bits to f32 (exact).
#[inline]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 to f16 bits, round to nearest even; NaN gives the canonical `0x7fff`.
#[inline]
pub fn f16_rne(x: f32) -> u16 {
    if x.is_nan() {
        0x7fff
    } else {
        half::f16::from_f32(x).to_bits()
    }
}

/// Integer and bit operations; `None` for division by zero.
#[inline]
pub fn int_op(op: IntOp, ty: IntTy, a: u64, b: u64) -> Option<u64> {
    let bits = ty.bits as u32;
    let (ua, ub) = (mask(bits, a), mask(bits, b));
    let (sa, sb) = (sext(a, bits), sext(b, bits));
    let r = match op {
        IntOp::Add => a.wrapping_add(b),
        IntOp::Sub => a.wrapping_sub(b),
        IntOp::MulLo => a.wrapping_mul(b),
        IntOp::MulHi => {
            if ty.signed {
                ((sa as i128 * sb as i128) >> bits) as u64
            } else {
                ((ua as u128 * ub as u128) >> bits) as u64
            }
        }
        IntOp::Div | IntOp::Rem => {
            if ub == 0 {
                return None;
            }
            match (op, ty.signed) {
                (IntOp::Div, true) => sa.wrapping_div(sb) as u64,
                (IntOp::Div, false) => ua / ub,
                (_, true) => sa.wrapping_rem(sb) as u64,
                (_, false) => ua % ub,
            }
        }
        IntOp::Min => {
            if ty.signed {
                sa.min(sb) as u64
            } else {
                ua.min(ub)
            }
        }
        IntOp::Max => {
            if ty.signed {
                sa.max(sb) as u64
            } else {
                ua.max(ub)
            }
        }
        IntOp::And => a & b,
        IntOp::Or => a | b,
        IntOp::Xor => a ^ b,
        IntOp::Shl => {
            let s = b as u32;
            if s >= bits {
                0
            } else {
                ua << s
            }
        }
        IntOp::Shr => {
            let s = (b as u32).min(bits);
            if ty.signed {
                (sa >> s.min(63)) as u64
            } else if s >= bits {
                0
            } else {
                ua >> s
            }
        }
    };
    Some(mask(bits, r))
}

/// `min.f32` / `max.f32`: a NaN operand yields the other one; `-0 < +0`.
#[inline]
pub fn fminmax(a: f32, b: f32, max: bool) -> f32 {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => f32::NAN,
        (true, false) => b,
        (false, true) => a,
        _ => {
            if a == b {
                // Only ±0 compare equal with different bits.
                if a.is_sign_negative() != max {
                    a
                } else {
                    b
                }
            } else if (a < b) != max {
                a
            } else {
                b
            }
        }
    }
}

/// `ex2.approx.f32`, modelled as exp2 in f64 rounded to f32 (the hardware is within 2 ulp).
#[inline]
pub fn ex2(x: f32, ftz: bool) -> f32 {
    let x = if ftz { flush(x) } else { x };
    let r = (x as f64).exp2() as f32;
    if ftz {
        flush(r)
    } else {
        r
    }
}

/// `lg2.approx[.ftz].f32`, modelled as `log2` in f64 rounded to f32 (the hardware's
/// approximation differs in the last bits; `log2(0) = -inf`, negative inputs NaN).
pub fn lg2(x: f32, ftz: bool) -> f32 {
    let x = if ftz { flush(x) } else { x };
    (x as f64).log2() as f32
}

/// `setp.cmp.ty a, b`.
#[inline]
pub fn compare(cmp: Cmp, ty: Ty, a: u64, b: u64) -> bool {
    if ty == Ty::F32 {
        let (x, y) = (f32_of(a), f32_of(b));
        let nan = x.is_nan() || y.is_nan();
        return match cmp {
            Cmp::Eq => x == y,
            Cmp::Ne => !nan && x != y,
            Cmp::Lt => x < y,
            Cmp::Le => x <= y,
            Cmp::Gt => x > y,
            Cmp::Ge => x >= y,
            Cmp::Equ => nan || x == y,
            Cmp::Neu => x != y,
            Cmp::Ltu => nan || x < y,
            Cmp::Leu => nan || x <= y,
            Cmp::Gtu => nan || x > y,
            Cmp::Geu => nan || x >= y,
            Cmp::Num => !nan,
            Cmp::Nan => nan,
        };
    }
    let bits = ty.bits();
    let ord = if ty.is_signed() {
        sext(a, bits).cmp(&sext(b, bits))
    } else {
        mask(bits, a).cmp(&mask(bits, b))
    };
    use std::cmp::Ordering::*;
    match cmp {
        Cmp::Eq => ord == Equal,
        Cmp::Ne => ord != Equal,
        Cmp::Lt => ord == Less,
        Cmp::Le => ord != Greater,
        Cmp::Gt => ord == Greater,
        Cmp::Ge => ord != Less,
        _ => false,
    }
}

/// Rounds `x` to an integral value.
#[inline]
pub fn round_int(x: f32, r: RoundInt) -> f32 {
    match r {
        RoundInt::Nearest => x.round_ties_even(),
        RoundInt::Zero => x.trunc(),
        RoundInt::Down => x.floor(),
        RoundInt::Up => x.ceil(),
    }
}

/// Saturating f32-to-integer conversion after rounding (NaN gives 0), as `cvt.rXi.{s,u}NN.f32`.
#[inline]
pub fn f32_to_int(x: f32, r: RoundInt, to: IntTy) -> u64 {
    let x = round_int(x, r);
    let v = match (to.signed, to.bits) {
        (true, 8) => x as i8 as i64 as u64,
        (true, 16) => x as i16 as i64 as u64,
        (true, 32) => x as i32 as i64 as u64,
        (true, _) => x as i64 as u64,
        (false, 8) => x as u8 as u64,
        (false, 16) => x as u16 as u64,
        (false, 32) => x as u32 as u64,
        (false, _) => x as u64,
    };
    mask(to.bits as u32, v)
}

/// `prmt.b32 d, a, b, c` in the default mode: byte `i` of `d` is byte `c[4i+2:4i]` of
/// `{b, a}`, or that byte's sign replicated when `c[4i+3]` is set.
#[inline]
pub fn prmt(a: u32, b: u32, c: u32) -> u32 {
    let bytes = ((b as u64) << 32 | a as u64).to_le_bytes();
    let mut r = 0u32;
    for i in 0..4 {
        let sel = (c >> (4 * i)) & 0xf;
        let mut byte = bytes[(sel & 7) as usize];
        if sel & 8 != 0 {
            byte = if byte & 0x80 != 0 { 0xff } else { 0 };
        }
        r |= (byte as u32) << (8 * i);
    }
    r
}

/// The source lane of `shfl.sync` and whether it is in range (the PTX ISA's pseudocode):
/// `c[4:0]` is the clamp, `c[12:8]` the segment mask. Out of range, a lane reads itself.
#[inline]
pub fn shfl_source(mode: ShflMode, lane: u32, b: u32, c: u32) -> (u32, bool) {
    let lane = lane as i32;
    let bval = (b & 0x1f) as i32;
    let cval = (c & 0x1f) as i32;
    let segmask = ((c >> 8) & 0x1f) as i32;
    let max_lane = (lane & segmask) | (cval & !segmask);
    let min_lane = lane & segmask;
    let (j, pval) = match mode {
        ShflMode::Up => {
            let j = lane - bval;
            (j, j >= max_lane)
        }
        ShflMode::Down => {
            let j = lane + bval;
            (j, j <= max_lane)
        }
        ShflMode::Bfly => {
            let j = lane ^ bval;
            (j, j <= max_lane)
        }
        ShflMode::Idx => {
            let j = min_lane | (bval & !segmask);
            (j, j <= max_lane)
        }
    };
    if pval {
        (j as u32, true)
    } else {
        (lane as u32, false)
    }
}

fn add_bf16(a: u16, b: u16) -> u16 {
    // Two bf16 (8-bit significands) added in f32 (24 bits >= 2·8+2) and rounded again to
    // bf16 give the correctly rounded sum: double rounding is innocuous here.
    bf16_rne(bf16_to_f32(a) + bf16_to_f32(b))
}

fn add_f16(a: u16, b: u16) -> u16 {
    let f = |x: u16| half::f16::from_bits(x).to_f32();
    f16_rne(f(a) + f(b))
}

/// The new value of an atomic `op` on `old` with operands `b` (and `c` for `.cas`).
#[inline]
pub fn atom_apply(op: AtomOp, ty: Ty, old: u64, b: u64, c: u64) -> u64 {
    let bits = ty.bits();
    match ty {
        Ty::F32 => {
            // atom/red .add.f32 flush subnormal inputs and results (PTX ISA).
            let r = flush(flush(f32_of(old)) + flush(f32_of(b)));
            canon(r)
        }
        Ty::Bf16 => add_bf16(old as u16, b as u16) as u64,
        Ty::F16 => add_f16(old as u16, b as u16) as u64,
        Ty::Bf16x2 => {
            let lo = add_bf16(old as u16, b as u16) as u64;
            let hi = add_bf16((old >> 16) as u16, (b >> 16) as u16) as u64;
            hi << 16 | lo
        }
        Ty::F16x2 => {
            let lo = add_f16(old as u16, b as u16) as u64;
            let hi = add_f16((old >> 16) as u16, (b >> 16) as u16) as u64;
            hi << 16 | lo
        }
        _ => {
            let signed = ty.is_signed();
            let (uo, ub) = (mask(bits, old), mask(bits, b));
            let r = match op {
                AtomOp::Add => uo.wrapping_add(ub),
                AtomOp::Min if signed => sext(old, bits).min(sext(b, bits)) as u64,
                AtomOp::Max if signed => sext(old, bits).max(sext(b, bits)) as u64,
                AtomOp::Min => uo.min(ub),
                AtomOp::Max => uo.max(ub),
                AtomOp::And => uo & ub,
                AtomOp::Or => uo | ub,
                AtomOp::Xor => uo ^ ub,
                AtomOp::Exch => ub,
                AtomOp::Cas => {
                    if uo == ub {
                        c
                    } else {
                        uo
                    }
                }
                AtomOp::Inc => {
                    if uo >= ub {
                        0
                    } else {
                        uo + 1
                    }
                }
                AtomOp::Dec => {
                    if uo == 0 || uo > ub {
                        ub
                    } else {
                        uo - 1
                    }
                }
            };
            mask(bits, r)
        }
    }
}
