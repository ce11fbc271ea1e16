//! The Hopper (sm_90) tensor core's f16/bf16 → f32 accumulation, bit for bit, as measured on
//! an H200.
//!
//! # The model
//!
//! One `wgmma.mma_async` k16 step computes every output element as a single fused block of the
//! sixteen products and the accumulator `c`:
//!
//! 1. Each product `a·b` is exact. Its *alignment exponent* is `ea + eb`, where an input's
//!    exponent is that of its encoding (`max(field, 1) − bias`): the exponent of a significand
//!    in `[1, 2)` for normal inputs, so a product's significand lies in `[0, 4)` and is not
//!    renormalised. `c`'s alignment exponent is likewise `max(field, 1) − 127`.
//! 2. `E` is the largest alignment exponent among the non-zero terms (products and `c`).
//! 3. Every term is cut to a multiple of `2^max(E − 25, −158)` by truncating its magnitude
//!    (toward zero), `c` included.
//! 4. The cut terms are added exactly; the sum is normalised and rounded **toward zero** into
//!    f32 (gradual underflow at `2^-149`; an exponent past 127 gives ±infinity).
//! 5. A zero result is `+0`, whatever the signs of the zero terms or of `c`, and also when a
//!    negative sum truncates to zero below `2^-149`.
//! 6. Any NaN input (in `a`, `b` or `c`), `∞·0`, or infinities of both signs give the
//!    canonical NaN `0x7fffffff`; otherwise an infinite product or `c` gives that infinity
//!    (also when the finite terms overflow to the other sign).
//!
//! `imm-scale-a/b = −1` negate the products (the inputs' signs); `scale-d = 0` drops `c`
//! (the same as `c = +0`). Chained steps apply the block once per k16 instruction, each
//! result rounded to f32 before it is the next step's `c`. f16 and bf16 inputs follow the
//! same rule.
//!
//! # Evidence
//!
//! `tests/h200_compare.rs` runs the probe kernels of `tests/common/probe.rs` on an H200: 448
//! CTAs of m64n64k16, 1,835,008 accumulators (random inputs with exponent spreads of ±2 to
//! ±40, one large and fifteen small products, exact and near cancellation, accumulators far
//! above and below the products, carries, one or two products a few ulps of `c` apart,
//! subnormal, underflowing and overflowing results, infinities, NaNs, signed zeros, four
//! chained steps, negated A/B, scale-d 0, f16 inputs), plus the Hopper kernel's three operand
//! forms (32,768 accumulators over 4 and 8 chained steps). The parameters were fitted offline
//! against the first run's 1,769,472 accumulators. A grid over block sizes 4/8/16 with `c`
//! inside or outside the block, 22 to 34 kept bits, normalised or encoded product exponents,
//! truncation toward zero or toward −∞ and rounding toward zero or to nearest, scored on a
//! sample of 49,157 finite accumulators, put this combination first (93 %; the next, 26 kept
//! bits with normalised exponents, 87 %); its misses were subnormal accumulators (aligned at
//! exponent −126, not at their leading bit) and overflow (to infinity, not the largest
//! finite value), and with those fixed it matched every accumulator. The second run added
//! the underflow probes, which fixed the floor of the unit at `2^-158` (−159 and
//! −157 miss 32 and 79 of their 32,768 accumulators) and the `+0` of a truncated negative
//! sum. The model now agrees with every accumulator of both runs bit for bit. Published work
//! describes tensor cores in the same terms (exact products, alignment to the largest
//! exponent, truncation, normalisation once per block: Fasi et al. 2021 for V100/T4/A100;
//! Khattak and Mikaitis, "Accurate Models of NVIDIA Tensor Cores", arXiv 2512.07004, 2025,
//! for H100 and B200); the parameters here are our own measurements.
//!
//! Not measured: B200 (the tcgen05 model keeps its sequential f32 sums).

/// The 16-bit input format of the products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmaInput {
    /// bfloat16
    Bf16,
    /// IEEE binary16
    F16,
}

/// Bits kept below the block's alignment exponent.
const KEPT: i32 = 25;
/// The finest unit of the sum: terms are never kept below 2^-158.
const MIN_LSB: i32 = -158;
/// The canonical NaN of f32 results.
const NAN: u32 = 0x7fff_ffff;

/// An input element decoded once for many products.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operand {
    /// Significand with the implicit bit (none for subnormals); 0 for zeros.
    sig: u32,
    /// Encoding exponent, `max(field, 1) − bias`.
    exp: i32,
    neg: bool,
    kind: Kind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Finite,
    Inf,
    Nan,
}

impl MmaInput {
    /// Fraction bits of the format.
    fn frac(self) -> u32 {
        match self {
            MmaInput::Bf16 => 7,
            MmaInput::F16 => 10,
        }
    }

    /// Decodes raw bits, negated when `neg`.
    pub fn decode(self, bits: u16, neg: bool) -> Operand {
        let (frac, ebits) = match self {
            MmaInput::Bf16 => (7, 8),
            MmaInput::F16 => (10, 5),
        };
        let bias = (1 << (ebits - 1)) - 1;
        let field = ((bits & 0x7fff) >> frac) as i32;
        let man = (bits & ((1 << frac) - 1)) as u32;
        let neg = (bits >> 15 == 1) ^ neg;
        let kind = if field == (1 << ebits) - 1 {
            if man == 0 {
                Kind::Inf
            } else {
                Kind::Nan
            }
        } else {
            Kind::Finite
        };
        let sig = if field == 0 { man } else { man | 1 << frac };
        Operand {
            sig,
            exp: field.max(1) - bias,
            neg,
            kind,
        }
    }
}

/// Whether every operand is finite, so that [`sm90_block_finite`] applies.
pub fn all_finite(ops: &[Operand]) -> bool {
    ops.iter().all(|o| o.kind == Kind::Finite)
}

/// Operands prepared for [`sm90_block_prepared`]: each one's exact value as f64 and its
/// alignment exponent (the encoded exponent; far below any real one for a zero).
#[derive(Debug, Clone, Default)]
pub struct Prepared {
    /// Exact values.
    pub value: Vec<f64>,
    /// Alignment exponents.
    pub exp: Vec<i32>,
}

/// The exponent of a zero operand: its products never set the alignment.
const ZERO_EXP: i32 = -1 << 20;

impl Prepared {
    /// Prepares finite operands (see [`all_finite`]).
    pub fn new(input: MmaInput, ops: &[Operand]) -> Prepared {
        let unit = f64::from_bits(((1023 - input.frac() as i32) as u64) << 52);
        let value = ops
            .iter()
            .map(|o| {
                let v = o.sig as f64 * f64::from_bits(((1023 + o.exp) as u64) << 52) * unit;
                if o.neg {
                    -v
                } else {
                    v
                }
            })
            .collect();
        let exp = ops
            .iter()
            .map(|o| if o.sig == 0 { ZERO_EXP } else { o.exp })
            .collect();
        Prepared { value, exp }
    }
}

/// [`sm90_block`] for sixteen finite A and B operands (see [`all_finite`]) given as
/// [`Prepared`] slices of 16: the same arithmetic in f64, exact, without the special-value
/// branches. The wgmma hot path; a unit test checks it equals [`sm90_block`].
pub fn sm90_block_prepared(
    input: MmaInput,
    a_val: &[f64],
    a_exp: &[i32],
    b_val: &[f64],
    b_exp: &[i32],
    c: Option<u32>,
) -> u32 {
    let c = c.unwrap_or(0);
    if (c >> 23) & 0xff == 0xff {
        // An infinite or NaN accumulator: the general path.
        let a: Vec<Operand> = a_val.iter().map(|&v| operand(input, v)).collect();
        let b: Vec<Operand> = b_val.iter().map(|&v| operand(input, v)).collect();
        return sm90_block(input, &a, &b, Some(c));
    }
    let (c_field, c_man) = (((c >> 23) & 0xff) as i32, c & 0x7f_ffff);
    let mut top = if c_field == 0 && c_man == 0 {
        ZERO_EXP
    } else {
        c_field.max(1) - 127
    };
    for k in 0..16 {
        top = top.max(a_exp[k] + b_exp[k]);
    }
    if top < ZERO_EXP / 2 {
        return 0;
    }
    let lsb = (top - KEPT).max(MIN_LSB);
    // Each term in units of 2^lsb, cut toward zero by the integer conversion. Exact: products
    // of 8- or 11-bit significands are exact in f64, scaling by a power of two is exact (or
    // leaves a value below one unit, which the cut makes zero anyway), and every term is below
    // 2^27 units, so neither the conversion nor the 17-term integer sum rounds.
    let scale = f64::from_bits(((1023 - lsb) as u64) << 52);
    let mut sum = (f32::from_bits(c) as f64 * scale) as i64;
    for k in 0..16 {
        sum += (a_val[k] * b_val[k] * scale) as i64;
    }
    round_toward_zero(sum, lsb)
}

/// The operand of an exact finite input value (the inverse of [`Prepared::new`]).
fn operand(input: MmaInput, v: f64) -> Operand {
    let bits = match input {
        MmaInput::Bf16 => (((v as f32).to_bits()) >> 16) as u16,
        MmaInput::F16 => half::f16::from_f64(v).to_bits(),
    };
    input.decode(bits, false)
}

/// [`sm90_block_prepared`] on operands.
pub fn sm90_block_finite(input: MmaInput, a: &[Operand], b: &[Operand], c: Option<u32>) -> u32 {
    let (pa, pb) = (Prepared::new(input, a), Prepared::new(input, b));
    sm90_block_prepared(input, &pa.value, &pa.exp, &pb.value, &pb.exp, c)
}

/// `c + Σ a[k]·b[k]` over one k16 step as the sm_90 tensor core computes it (see the module
/// documentation); `c` is raw f32 bits or `None` for scale-d = 0. Returns raw f32 bits.
pub fn sm90_block(input: MmaInput, a: &[Operand], b: &[Operand], c: Option<u32>) -> u32 {
    let pfrac = 2 * input.frac() as i32;
    let (mut pos_inf, mut neg_inf) = (false, false);
    let mut top = i32::MIN;
    for (x, y) in a.iter().zip(b) {
        match (x.kind, y.kind) {
            (Kind::Nan, _) | (_, Kind::Nan) => return NAN,
            (Kind::Inf, _) | (_, Kind::Inf) => {
                if x.sig == 0 || y.sig == 0 {
                    return NAN; // ∞ · 0
                }
                if x.neg ^ y.neg {
                    neg_inf = true;
                } else {
                    pos_inf = true;
                }
            }
            _ if x.sig != 0 && y.sig != 0 => top = top.max(x.exp + y.exp),
            _ => {}
        }
    }
    let c = c.unwrap_or(0);
    let (c_neg, c_field, c_man) = (c >> 31 == 1, ((c >> 23) & 0xff) as i32, c & 0x7f_ffff);
    if c_field == 0xff {
        if c_man != 0 {
            return NAN;
        }
        if c_neg {
            neg_inf = true;
        } else {
            pos_inf = true;
        }
    }
    match (pos_inf, neg_inf) {
        (true, true) => return NAN,
        (true, false) => return 0x7f80_0000,
        (false, true) => return 0xff80_0000,
        _ => {}
    }
    let c_sig = if c_field == 0 { c_man } else { c_man | 1 << 23 };
    let c_exp = c_field.max(1) - 127;
    if c_sig != 0 {
        top = top.max(c_exp);
    }
    if top == i32::MIN {
        return 0;
    }
    // The unit of the fixed-point sum: 2^lsb. A term m·2^(e − frac) becomes m shifted by
    // e − frac − lsb, truncated toward zero.
    let lsb = (top - KEPT).max(MIN_LSB);
    let cut = |sig: u64, exp: i32, frac: i32| -> i64 {
        let sh = exp - frac - lsb;
        if sh >= 0 {
            (sig << sh) as i64
        } else if sh > -64 {
            (sig >> -sh) as i64
        } else {
            0
        }
    };
    let mut sum = 0i64;
    for (x, y) in a.iter().zip(b) {
        let q = cut(x.sig as u64 * y.sig as u64, x.exp + y.exp, pfrac);
        sum += if x.neg ^ y.neg { -q } else { q };
    }
    let q = cut(c_sig as u64, c_exp, 23);
    sum += if c_neg { -q } else { q };
    round_toward_zero(sum, lsb)
}

/// `sum · 2^lsb` rounded toward zero to f32 bits (+0 for a sum that is or truncates to 0,
/// ±infinity past the range).
fn round_toward_zero(sum: i64, lsb: i32) -> u32 {
    if sum == 0 {
        return 0;
    }
    let sign = ((sum < 0) as u32) << 31;
    let mag = sum.unsigned_abs();
    let lead = lsb + 63 - mag.leading_zeros() as i32; // exponent of the leading bit
    if lead > 127 {
        return sign | 0x7f80_0000;
    }
    let out_lsb = (lead - 23).max(-149);
    let sh = out_lsb - lsb;
    let m = if sh >= 64 {
        0
    } else if sh >= 0 {
        mag >> sh
    } else {
        mag << -sh
    } as u32;
    if m == 0 {
        0
    } else if m < 1 << 23 {
        sign | m // subnormal
    } else {
        sign | ((out_lsb + 150) as u32) << 23 | (m & 0x7f_ffff)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf(x: f32) -> Operand {
        MmaInput::Bf16.decode((x.to_bits() >> 16) as u16, false)
    }

    fn dot(a: &[f32], b: &[f32], c: f32) -> f32 {
        let a: Vec<Operand> = a.iter().map(|&x| bf(x)).collect();
        let b: Vec<Operand> = b.iter().map(|&x| bf(x)).collect();
        f32::from_bits(sm90_block(MmaInput::Bf16, &a, &b, Some(c.to_bits())))
    }

    #[test]
    fn the_finite_fast_path_equals_the_general_block() {
        // splitmix64 over wide exponent ranges, zeros, subnormals and cancellation.
        let mut state = 0x1234_5678u64;
        let mut next = || {
            state = state.wrapping_add(crate::exec::GOLDEN);
            crate::exec::mix64(state)
        };
        for input in [MmaInput::Bf16, MmaInput::F16] {
            let emax: u64 = match input {
                MmaInput::Bf16 => 255,
                MmaInput::F16 => 31,
            };
            let frac = input.frac();
            for case in 0..20_000u32 {
                let op = |r: u64| {
                    let field = match r % 8 {
                        0 => 0,
                        1 => emax / 2,
                        _ => (r >> 8) % emax,
                    };
                    let bits = ((r >> 3) & 1) << 15 | field << frac | (r >> 16) & ((1 << frac) - 1);
                    input.decode(bits as u16, false)
                };
                let a: Vec<Operand> = (0..16).map(|_| op(next())).collect();
                let b: Vec<Operand> = (0..16).map(|_| op(next())).collect();
                if !all_finite(&a) || !all_finite(&b) {
                    continue;
                }
                let r = next();
                let c = match case % 8 {
                    0 => None,
                    3 => Some(0x7f80_0000 | ((r as u32) & 1) << 31), // ±inf: the general path
                    1 => Some((r as u32) & 0x807f_ffff),             // zero or subnormal
                    _ => Some((r as u32) & !(0xff << 23) | (((r >> 32) % 255) as u32) << 23),
                };
                assert_eq!(
                    sm90_block_finite(input, &a, &b, c),
                    sm90_block(input, &a, &b, c),
                    "{input:?} case {case}: c {c:?}"
                );
            }
        }
    }

    #[test]
    fn exact_sums_are_exact() {
        assert_eq!(dot(&[1.0, 2.0, -0.5], &[3.0, 0.25, 4.0], 10.0), 11.5);
        assert_eq!(dot(&[], &[], -0.0).to_bits(), 0, "an exact zero is +0");
    }

    #[test]
    fn terms_below_the_kept_window_are_cut_toward_zero() {
        // c = 1 sets E = 0 and the unit 2^-25: seven products of 2^-26 each vanish, where the
        // exact sum 1 + 0.875 ulp rounded to nearest would be 1 + 2^-23.
        let e = 2f32.powi(-26);
        assert_eq!(dot(&[e; 7], &[1.0; 7], 1.0), 1.0);
        // Three products of 2^-25 are kept (0.75 ulp) and the sum is truncated, not rounded.
        let q = 2f32.powi(-25);
        assert_eq!(dot(&[q; 3], &[1.0; 3], 1.0), 1.0);
        // c = 2 sets the unit 2^-24: products of −2^-25 are cut to zero (toward zero), so the
        // result stays 2 where the exact 2 − 0.75·2^-23 truncated would be 2 − 2^-23.
        assert_eq!(dot(&[q; 3], &[-1.0; 3], 2.0), 2.0);
    }

    #[test]
    fn specials() {
        let nan = |x: f32| x.to_bits() == NAN;
        assert!(nan(dot(&[f32::INFINITY], &[0.0], 1.0)));
        assert!(nan(dot(
            &[f32::INFINITY, 1.0],
            &[1.0, 1.0],
            f32::NEG_INFINITY
        )));
        assert_eq!(dot(&[f32::INFINITY], &[-2.0], 1.0), f32::NEG_INFINITY);
        assert_eq!(
            dot(&[2f32.powi(100)], &[2f32.powi(100)], 0.0),
            f32::INFINITY
        );
    }
}
