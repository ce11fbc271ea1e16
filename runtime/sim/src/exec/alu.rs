//! Lane-wise register operations: moves, packing, integer and float arithmetic, comparisons,
//! predicate logic and conversions.

use super::{lanes, Cta, Flow};
use crate::error::{FaultKind, SimError};
use crate::ir::{
    Conversion, Dst, FloatOp, FloatUnOp, IntOp, IntTy, IntUnOp, MadMode, Op, PredOp, Space,
    SHARED_WINDOW,
};
use crate::numeric::{
    bf16_rne, bf16_to_f32, canon, compare, ex2, f16_rne, f32_of, f32_to_int, flush, fminmax,
    int_op, lg2, mask, prmt, round_int, sext,
};

impl Cta<'_> {
    /// Executes moves, packing, integer and float arithmetic, comparisons, predicate logic and
    /// conversions: lane-wise register operations.
    pub(super) fn step_alu(
        &mut self,
        pcu: usize,
        w: usize,
        exec: u32,
        op: &Op,
    ) -> Result<Flow, SimError> {
        match op {
            Op::Mov { bits, d, a } => {
                let bits = *bits as u32;
                self.map1(w, exec, *d, *a, bits, |x| x);
            }
            Op::Pack {
                elem_bits,
                d,
                parts,
            } => {
                let eb = *elem_bits as u32;
                let mut out = [0u64; 32];
                for (i, p) in parts.iter().enumerate() {
                    let v = self.gather(w, *p);
                    for l in lanes(exec) {
                        out[l] |= mask(eb, v[l]) << (i as u32 * eb);
                    }
                }
                self.put(w, *d, exec, &out, eb * parts.len() as u32);
            }
            Op::Unpack { elem_bits, dst, a } => {
                let eb = *elem_bits as u32;
                let v = self.gather(w, *a);
                for (i, d) in dst.iter().enumerate() {
                    if let Dst::Reg(r) = d {
                        let mut out = [0u64; 32];
                        for l in lanes(exec) {
                            out[l] = v[l] >> (i as u32 * eb);
                        }
                        self.put(w, *r, exec, &out, eb);
                    }
                }
            }
            Op::Cvta {
                to,
                space,
                bits,
                d,
                a,
            } => {
                let (to, space) = (*to, *space);
                self.map1(w, exec, *d, *a, *bits as u32, |x| match (space, to) {
                    (Space::Shared, true) => x.wrapping_sub(SHARED_WINDOW),
                    (Space::Shared, false) => x.wrapping_add(SHARED_WINDOW),
                    _ => x,
                });
            }
            Op::Int { op, ty, d, a, b } => {
                let (op, ty) = (*op, *ty);
                let av = self.gather(w, *a);
                let bv = self.gather(w, *b);
                if matches!(op, IntOp::Div | IntOp::Rem) {
                    for l in lanes(exec) {
                        if mask(ty.bits as u32, bv[l]) == 0 {
                            return Err(self.fault(pcu, w, l, FaultKind::DivisionByZero));
                        }
                    }
                }
                let out = int_lanes(op, ty, &av, &bv);
                self.put(w, *d, exec, &out, ty.bits as u32);
            }
            Op::IntUn { op, ty, d, a } => {
                let (op, ty) = (*op, *ty);
                let bits = ty.bits as u32;
                self.map1(w, exec, *d, *a, bits, |x| match op {
                    IntUnOp::Not => !x,
                    IntUnOp::Neg => x.wrapping_neg(),
                    IntUnOp::Abs => sext(x, bits).wrapping_abs() as u64,
                    IntUnOp::Popc => u64::from(mask(bits, x).count_ones()),
                });
            }
            Op::MulWide { ty, d, a, b } => {
                let ty = *ty;
                let bits = ty.bits as u32;
                self.map2(w, exec, *d, *a, *b, bits * 2, |x, y| {
                    if ty.signed {
                        sext(x, bits).wrapping_mul(sext(y, bits)) as u64
                    } else {
                        mask(bits, x).wrapping_mul(mask(bits, y))
                    }
                });
            }
            Op::Mad {
                mode,
                ty,
                d,
                a,
                b,
                c,
            } => {
                let (mode, ty) = (*mode, *ty);
                let bits = ty.bits as u32;
                let out_bits = if mode == MadMode::Wide {
                    bits * 2
                } else {
                    bits
                };
                self.map3(w, exec, *d, *a, *b, *c, out_bits, |x, y, z| {
                    let prod = match mode {
                        MadMode::Lo => x.wrapping_mul(y),
                        MadMode::Hi => int_op(IntOp::MulHi, ty, x, y).unwrap_or(0),
                        MadMode::Wide => {
                            if ty.signed {
                                sext(x, bits).wrapping_mul(sext(y, bits)) as u64
                            } else {
                                mask(bits, x).wrapping_mul(mask(bits, y))
                            }
                        }
                    };
                    prod.wrapping_add(z)
                });
            }
            Op::Float { op, ftz, d, a, b } => {
                let (op, ftz) = (*op, *ftz);
                self.map2(w, exec, *d, *a, *b, 32, |x, y| {
                    let (mut x, mut y) = (f32_of(x), f32_of(y));
                    if ftz {
                        x = flush(x);
                        y = flush(y);
                    }
                    let r = match op {
                        FloatOp::Add => x + y,
                        FloatOp::Sub => x - y,
                        FloatOp::Mul => x * y,
                        FloatOp::Min => fminmax(x, y, false),
                        FloatOp::Max => fminmax(x, y, true),
                    };
                    canon(if ftz { flush(r) } else { r })
                });
            }
            Op::Fma { ftz, d, a, b, c } => {
                let ftz = *ftz;
                self.map3(w, exec, *d, *a, *b, *c, 32, |x, y, z| {
                    let (mut x, mut y, mut z) = (f32_of(x), f32_of(y), f32_of(z));
                    if ftz {
                        x = flush(x);
                        y = flush(y);
                        z = flush(z);
                    }
                    let r = x.mul_add(y, z);
                    canon(if ftz { flush(r) } else { r })
                });
            }
            Op::FloatUn { op, ftz, d, a } => {
                let (op, ftz) = (*op, *ftz);
                self.map1(w, exec, *d, *a, 32, |x| {
                    let x = if ftz { flush(f32_of(x)) } else { f32_of(x) };
                    match op {
                        FloatUnOp::Ex2 => canon(ex2(x, ftz)),
                        FloatUnOp::Lg2 => canon(lg2(x, ftz)),
                        FloatUnOp::Rcp => canon(if ftz { flush(1.0 / x) } else { 1.0 / x }),
                        FloatUnOp::Neg => (-x).to_bits() as u64,
                        FloatUnOp::Abs => x.abs().to_bits() as u64,
                    }
                });
            }
            Op::Setp { cmp, ty, d, a, b } => {
                let (cmp, ty) = (*cmp, *ty);
                self.map2(w, exec, *d, *a, *b, 1, |x, y| compare(cmp, ty, x, y) as u64);
            }
            Op::Selp { bits, d, a, b, p } => {
                let pm = self.pred_mask(w, *p);
                let av = self.gather(w, *a);
                let bv = self.gather(w, *b);
                let mut out = [0u64; 32];
                for l in 0..32 {
                    out[l] = if pm >> l & 1 == 1 { av[l] } else { bv[l] };
                }
                self.put(w, *d, exec, &out, *bits as u32);
            }
            Op::Pred { op, d, a, b } => {
                let (ma, mb) = (self.pred_mask(w, *a), self.pred_mask(w, *b));
                let m = match op {
                    PredOp::And => ma & mb,
                    PredOp::Or => ma | mb,
                    PredOp::Xor => ma ^ mb,
                };
                self.put_mask(w, *d, exec, m);
            }
            Op::PredNot { d, a } => {
                let m = !self.pred_mask(w, *a);
                self.put_mask(w, *d, exec, m);
            }
            Op::Cvt { conv, d, a } => {
                let conv = *conv;
                let bits = match conv {
                    Conversion::Int { to, .. } | Conversion::F32ToInt { to, .. } => to.bits as u32,
                    Conversion::F32ToBf16 | Conversion::F32ToF16 => 16,
                    _ => 32,
                };
                self.map1(w, exec, *d, *a, bits, |x| match conv {
                    Conversion::Int { from, .. } => {
                        if from.signed {
                            sext(x, from.bits as u32) as u64
                        } else {
                            mask(from.bits as u32, x)
                        }
                    }
                    Conversion::IntToF32 { from } => {
                        let f = if from.signed {
                            sext(x, from.bits as u32) as f32
                        } else {
                            mask(from.bits as u32, x) as f32
                        };
                        f.to_bits() as u64
                    }
                    Conversion::F32ToInt { to, round } => f32_to_int(f32_of(x), round, to),
                    Conversion::F32Round(r) => canon(round_int(f32_of(x), r)),
                    Conversion::Bf16ToF32 => bf16_to_f32(x as u16).to_bits() as u64,
                    Conversion::F32ToBf16 => bf16_rne(f32_of(x)) as u64,
                    Conversion::F16ToF32 => {
                        half::f16::from_bits(x as u16).to_f32().to_bits() as u64
                    }
                    Conversion::F32ToF16 => f16_rne(f32_of(x)) as u64,
                });
            }
            Op::CvtBf16x2 { d, hi, lo, f16 } => {
                let pack = if *f16 { f16_rne } else { bf16_rne };
                self.map2(w, exec, *d, *hi, *lo, 32, |h, l| {
                    (pack(f32_of(h)) as u64) << 16 | pack(f32_of(l)) as u64
                });
            }
            Op::Prmt { d, a, b, c } => {
                self.map3(w, exec, *d, *a, *b, *c, 32, |x, y, z| {
                    prmt(x as u32, y as u32, z as u32) as u64
                });
            }
            _ => unreachable!("step dispatches only alu instructions here"),
        }
        Ok(Flow::Advance)
    }
}

/// A binary integer operation on all 32 lanes, with the common operations as tight loops.
#[inline(always)]
fn int_lanes(op: IntOp, ty: IntTy, a: &[u64; 32], b: &[u64; 32]) -> [u64; 32] {
    let mut o = [0u64; 32];
    macro_rules! lanewise {
        (|$x:ident, $y:ident| $e:expr) => {
            for l in 0..32 {
                let ($x, $y) = (a[l], b[l]);
                o[l] = $e;
            }
        };
    }
    let bits = ty.bits as u32;
    match op {
        IntOp::Add => lanewise!(|x, y| x.wrapping_add(y)),
        IntOp::Sub => lanewise!(|x, y| x.wrapping_sub(y)),
        IntOp::MulLo => lanewise!(|x, y| x.wrapping_mul(y)),
        IntOp::And => lanewise!(|x, y| x & y),
        IntOp::Or => lanewise!(|x, y| x | y),
        IntOp::Xor => lanewise!(|x, y| x ^ y),
        IntOp::Shl => lanewise!(|x, y| if (y as u32) < bits {
            x << (y as u32)
        } else {
            0
        }),
        IntOp::Shr if !ty.signed => lanewise!(|x, y| if (y as u32) < bits {
            mask(bits, x) >> (y as u32)
        } else {
            0
        }),
        IntOp::Min if !ty.signed => lanewise!(|x, y| mask(bits, x).min(mask(bits, y))),
        IntOp::Max if !ty.signed => lanewise!(|x, y| mask(bits, x).max(mask(bits, y))),
        // Division by zero was checked on the active lanes; inactive lanes give 0.
        _ => lanewise!(|x, y| int_op(op, ty, x, y).unwrap_or(0)),
    }
    o
}
