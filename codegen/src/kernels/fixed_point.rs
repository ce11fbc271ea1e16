//! The deterministic backward's fixed-point accumulation (`docs/design.md` §3.8): the facts
//! the preprocess, the main kernels and the postprocess share.
//!
//! Floating-point atomics give sums whose rounding depends on the order the atomics land in.
//! Additions of integers do not round, so in the deterministic mode every partial dQ, dK and
//! dV value is converted to an integer multiple of a power-of-two *unit* (a fixed function of
//! the value: rounded to nearest for dQ, truncated toward zero for dK/dV) and added exactly:
//! the sums, and so the gradients, are the same bits whatever the order, the grid or the warp
//! schedule.
//!
//! A unit comes from a bound on the magnitude of every partial sum of the element, computed
//! before the main kernel from the inputs (maxima are order-independent):
//! - dQ of row `(t, h)`, `h` in KV group `g`: `|dQ[t,h,d]| ≤ scale·Σ_j P·|dP − Δ|·|K_j[d]|`
//!   with `|dP| ≤ ‖dO‖₁·max|V_g|` and `Σ_j P ≤ 1`, so
//!   `≤ a[t,g]·c[g]` with `a[t,g] = max_{h∈g} max(‖dO[t,h]‖₁, |Δ[t,h]|)` and
//!   `c[g] = (max|V_g| + 1)·max|K_g|·scale`.
//! - dK of a key of group `g`: at most `16·T ≤ 2^24` rows attend it, each with `P ≤ 1`:
//!   `≤ 2^24·max_t a[t,g]·(max|V_g| + 1)·max|Q_g|·scale`; dV: `≤ 2^24·max|dO_g|`.
//!
//! For a bound `B` with `2^(e-1) ≤ B < 2^e` the unit is `2^(e - span)`, so every partial sum
//! stays below `2^span` units.
//! - dQ ([`DQ_SPAN`] = 22): each contribution becomes an integer-valued `f32` (rounded to
//!   nearest by an `fma` with `1.5·2^23` and a `sub`: two full-rate instructions, where `cvt`
//!   to an integer is quarter rate on the consumers' hot path). Sums of integers below `2^24`
//!   are exact in `f32`, so the pool takes the default mode's vector float reductions,
//!   `red.add.v4.f32`, four heads per instruction (half the default's bf16x2 reduction
//!   count): heads `2p, 2p+1, 2p+8, 2p+9` of a group at one `d` ([`dq_word`]). A row's
//!   partial sums stay below `2^22 + 8` units, a factor 4 below `2^24`. The guarantee needs
//!   the `lse` of the forward (`Σ P ≤ 1`); one far from it (`Σ P` above 4) may leave the
//!   exact range, and the gradients are then as wrong as the `lse`, and may vary in their
//!   last bits.
//! - dK/dV ([`KV_SPAN`] = 56, one conversion per flushed segment, not per task): one signed
//!   64-bit word per element (`cvt`, `red.add.u64`).
//!
//! A bound that is infinite or NaN (a non-finite input) makes the unit NaN,
//! so the gradients it covers come out NaN rather than silently finite. Maxima are taken on
//! the bits of non-negative floats (integer max), under which NaN is above infinity and
//! survives, where `max.f32` would drop it.

use super::common::FixedParams;
use crate::ptx::*;

/// Words of the `bounds` buffer (u32, f32 bits, atomic max; zeroed before the preprocess).
pub const BOUND_WORDS: u32 = 32;
/// `bounds[KMAX + g]`: `max |K_g|`.
pub const KMAX: u32 = 0;
/// `bounds[VMAX + g]`: `max |V_g|`.
pub const VMAX: u32 = 4;
/// `bounds[QMAX + g]`: `max |Q|` over the heads of group `g`.
pub const QMAX: u32 = 8;
/// `bounds[AMAX + g]`: `max_t a[t, g]`.
pub const AMAX: u32 = 12;
/// `bounds[DOMAX + g]`: `max |dO|` over the heads of group `g`.
pub const DOMAX: u32 = 16;
/// dQ partial sums stay below `2^DQ_SPAN` units (of an integer-valued f32).
pub const DQ_SPAN: u32 = 22;
/// `1.5·2^23`: adding it to an `f32` of magnitude at most `2^22` rounds that to an integer
/// (the sum's unit in the last place is 1); subtracting it again is exact.
const MAGIC: f32 = 12_582_912.0;
/// dK/dV sums stay below `2^KV_SPAN` units (of a signed 64-bit word).
pub const KV_SPAN: u32 = 56;
/// Rows that may attend one key, `16 heads · MAX_TOKENS = 2^24`, as an f32 factor.
pub const ATTENDING_ROWS: f32 = 16_777_216.0;

/// `|x|` as the bits of a non-negative float (NaN stays NaN, above infinity).
pub fn abs_bits(b: &mut KernelBuilder, x: Reg<F32>) -> Reg<U32> {
    let bits = b.bitcast::<U32, F32>(x);
    b.and(bits, 0x7fff_ffffu32)
}

/// A unit and its inverse.
pub type Units = (Reg<F32>, Reg<F32>);

/// The unit and its inverse `(2^(e-span), 2^(span-e))` of a non-negative bound (f32 bits
/// `bound`), both NaN when the bound is not finite. Exact powers of two, so scaling by them
/// is exact; the exponent is clamped to the normal range (a zero or tiny bound covers only
/// zeros and tiny values, which the clamped unit still resolves).
pub fn units(b: &mut KernelBuilder, bound: Reg<U32>, span: u32) -> Units {
    // Biased exponent E of the bound: B < 2^(E-126), so the unit's biased exponent is
    // E + 1 - span (an f32 2^(k) has biased exponent k + 127).
    let e = b.shr(bound, 23u32);
    let e = b.bitcast::<S32, U32>(e);
    let u = b.add(e, 1 - span as i32);
    let u = b.max(u, 1i32);
    let u = b.min(u, 253i32);
    let u = b.bitcast::<U32, S32>(u);
    let unit = b.shl(u, 23u32);
    let top = b.mov::<U32>(254u32);
    let inv_e = b.sub(top, u);
    let inv = b.shl(inv_e, 23u32);
    let finite = b.setp(Cmp::Lt, bound, 0x7f80_0000u32);
    let nan = 0x7fc0_0000u32;
    let unit = b.selp(unit, nan, finite);
    let inv = b.selp(inv, nan, finite);
    (b.bitcast::<F32, U32>(unit), b.bitcast::<F32, U32>(inv))
}

/// `c[g] = (max|V_g| + 1)·max|K_g|·scale`, from the `bounds` buffer (the dQ bound per `a`).
pub fn dq_factor(b: &mut KernelBuilder, bounds: Reg<U64>, g: Reg<U32>) -> Reg<F32> {
    let k = bound(b, bounds, KMAX, g);
    let v = bound(b, bounds, VMAX, g);
    let v1 = b.fadd(v, 1.0);
    let kv = b.fmul(v1, k);
    b.fmul(kv, super::common::SCALE)
}

/// The inverse dQ unit of row `(t, g)` from `a[t, g]` (f32 bits) and [`dq_factor`].
pub fn dq_inv_unit(b: &mut KernelBuilder, a: Reg<U32>, factor: Reg<F32>) -> Reg<F32> {
    units_of_product(b, a, factor, DQ_SPAN).1
}

/// [`dq_inv_unit`] of the main kernels' query slot of compact row `row` (an empty slot's
/// row clamped to 0 by the caller: its reductions are skipped), reading `a[row, g]`.
pub fn dq_row_inv_unit(
    b: &mut KernelBuilder,
    f: &FixedParams,
    row: Reg<U32>,
    g: Reg<U32>,
    factor: Reg<F32>,
) -> Reg<F32> {
    let tg = b.mad_lo(row, 4u32, g);
    let rb = b.ld_param_ptr(&f.row_bounds);
    let a = super::common::load_u32(b, rb, tg);
    dq_inv_unit(b, a, factor)
}

/// The main kernels' inverse units `[dV, dK]` of group `g` for a segment flush.
pub fn flush_inv_units(b: &mut KernelBuilder, f: &FixedParams, g: Reg<U32>) -> [Reg<F32>; 2] {
    let bounds = b.ld_param_ptr(&f.bounds);
    let ((_, dk_inv), (_, dv_inv)) = kv_units(b, bounds, g);
    [dv_inv, dk_inv]
}

/// The dQ unit of row `(t, g)` (the postprocess's side of [`dq_inv_unit`]).
pub fn dq_unit(b: &mut KernelBuilder, a: Reg<U32>, factor: Reg<F32>) -> Reg<F32> {
    units_of_product(b, a, factor, DQ_SPAN).0
}

/// `(dK units, dV units)` of group `g`, each `(unit, inverse)`.
pub fn kv_units(b: &mut KernelBuilder, bounds: Reg<U64>, g: Reg<U32>) -> (Units, Units) {
    let a = bound(b, bounds, AMAX, g);
    let v = bound(b, bounds, VMAX, g);
    let q = bound(b, bounds, QMAX, g);
    let v1 = b.fadd(v, 1.0);
    let k = b.fmul(a, v1);
    let k = b.fmul(k, q);
    let k = b.fmul(k, super::common::SCALE * ATTENDING_ROWS);
    let dk = b.bitcast::<U32, F32>(k);
    let o = bound(b, bounds, DOMAX, g);
    let dv = b.fmul(o, ATTENDING_ROWS);
    let dv = b.bitcast::<U32, F32>(dv);
    (units(b, dk, KV_SPAN), units(b, dv, KV_SPAN))
}

/// `x·inv` rounded to the nearest integer, as an exact integer-valued `f32`: one `fma` with
/// `1.5·2^23` (a single rounding of `x·inv + 1.5·2^23`, exact for `|x·inv| ≤ 2^22`, which the
/// bound guarantees) and one `sub`. A NaN stays NaN and reaches the pool (the postprocess
/// writes NaN).
pub fn to_fixed_f32(b: &mut KernelBuilder, x: Reg<F32>, inv: Reg<F32>) -> Reg<F32> {
    const _: () = assert!(
        DQ_SPAN <= 22,
        "the magic-number rounding is exact up to 2^22"
    );
    let v = b.fma(x, inv, MAGIC);
    b.fsub(v, MAGIC)
}

/// The head of group-local quad `p` that element `e` (0..4) of a dQ pool word holds.
pub const fn dq_quad_head(p: u32, e: u32) -> u32 {
    2 * p + (e & 1) + 8 * (e >> 1)
}

/// The first f32 index of dQ pool word `(t, g, p, d)` of the deterministic pool
/// `[T, 4, 4, 128, 4]`: its four elements are heads [`dq_quad_head`]`(p, 0..4)` of group `g`
/// at head dim `d`.
pub fn dq_word(
    b: &mut KernelBuilder,
    t: Reg<U32>,
    g: Reg<U32>,
    p: impl Src<U32>,
    d: Reg<U32>,
) -> Reg<U32> {
    let tg = b.mad_lo(t, 4u32, g);
    let p_reg = b.mov::<U32>(p);
    let tgp = b.mad_lo(tg, 4u32, p_reg);
    let w = b.mad_lo(tgp, 128u32, d);
    b.shl(w, 2u32)
}

/// `x·inv` truncated to a signed 64-bit integer, as the bits a `red.add.u64` adds.
pub fn to_fixed64(b: &mut KernelBuilder, x: Reg<F32>, inv: Reg<F32>) -> Reg<U64> {
    let s = b.fmul(x, inv);
    let v = b.cvt::<S64, F32>(s);
    b.bitcast::<U64, S64>(v)
}

/// A signed 64-bit fixed-point sum times its unit, as f32.
pub fn from_fixed64(b: &mut KernelBuilder, v: Reg<U64>, unit: Reg<F32>) -> Reg<F32> {
    let v = b.bitcast::<S64, U64>(v);
    let f = b.cvt::<F32, S64>(v);
    b.fmul(f, unit)
}

fn bound(b: &mut KernelBuilder, bounds: Reg<U64>, at: u32, g: Reg<U32>) -> Reg<F32> {
    let i = b.add(g, at);
    let v = super::common::load_u32(b, bounds, i);
    b.bitcast::<F32, U32>(v)
}

fn units_of_product(b: &mut KernelBuilder, a: Reg<U32>, factor: Reg<F32>, span: u32) -> Units {
    let af = b.bitcast::<F32, U32>(a);
    let p = b.fmul(af, factor);
    let bits = b.bitcast::<U32, F32>(p);
    units(b, bits, span)
}
