//! wgmma numerics probes: many independent m64n64k16 problems, one per CTA, whose inputs are
//! chosen to expose how the tensor core adds products (alignment width, truncation, block
//! size, where the accumulator joins, rounding, signed zeros, specials). `h200_compare.rs`
//! runs them on the GPU and the simulator and compares every accumulator bit for bit.
//!
//! Each CTA copies its 16 KiB shared image (A then B, both K-major, 128B-swizzled, as the
//! host lays them out) into shared memory, loads its accumulators `C` from global memory,
//! issues `steps` chained `wgmma.mma_async` (scale-d of the first step configurable, then 1)
//! and stores `D`.

use super::{acc_pos, ArgSpec, Rng, Scenario, HEADER};

/// The input element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    Bf16,
    F16,
}

impl Elem {
    fn ptx(self) -> &'static str {
        match self {
            Elem::Bf16 => "bf16",
            Elem::F16 => "f16",
        }
    }

    /// Bits of `(-1)^neg · (1 + man/2^mbits) · 2^exp`, with `man` taken from the top of a
    /// 16-bit draw; exponents below the normal range give subnormals (the significand
    /// shifted, low bits dropped) or zero, above it infinity.
    pub fn make(self, neg: bool, exp: i32, man16: u16) -> u16 {
        let (mbits, bias, emax) = match self {
            Elem::Bf16 => (7u32, 127i32, 127i32),
            Elem::F16 => (10, 15, 15),
        };
        let sign = (neg as u16) << 15;
        let man = (man16 >> (16 - mbits)) as u32;
        if exp > emax {
            return sign | (((2 * bias + 1) as u16) << mbits);
        }
        if exp >= 1 - bias {
            return sign | (((exp + bias) as u16) << mbits) | man as u16;
        }
        // Subnormal: the implicit one joins the fraction.
        let shift = (1 - bias - exp) as u32;
        if shift > mbits + 1 {
            return sign;
        }
        sign | (((1 << mbits) | man) >> shift) as u16
    }

    /// The exact value as f64.
    pub fn value(self, bits: u16) -> f64 {
        match self {
            Elem::Bf16 => f32::from_bits((bits as u32) << 16) as f64,
            Elem::F16 => half::f16::from_bits(bits).to_f64(),
        }
    }
}

/// One m64n64 problem: `D = C + Σ_k A[m][k]·B[n][k]` over `16·steps` k.
#[derive(Debug, Clone)]
pub struct Problem {
    /// `[m][k]`, raw 16-bit elements.
    pub a: Vec<u16>,
    /// `[n][k]`, raw 16-bit elements (K-major B).
    pub b: Vec<u16>,
    /// `[m][n]`, raw f32 bits.
    pub c: Vec<u32>,
}

/// A launch of the probe kernel over `problems.len()` CTAs.
#[derive(Debug, Clone)]
pub struct ProbeSet {
    pub name: &'static str,
    pub elem: Elem,
    /// Chained k16 steps (1..=4).
    pub steps: usize,
    /// scale-d of the first step (later steps accumulate).
    pub scale_d0: bool,
    pub neg_a: bool,
    pub neg_b: bool,
    pub problems: Vec<Problem>,
}

pub const N: usize = 64;
const IMAGE: usize = 16384;

/// Offset of 16-bit element `(row, k)` of a K-major 128B-swizzled operand (8 rows of 128 B
/// per 1 KiB atom), from a 1024-aligned base.
fn kmajor_offset(row: usize, k: usize) -> usize {
    let off = (row % 8) * 128 + (row / 8) * 1024 + 2 * k;
    off ^ (((off >> 7) & 7) << 4)
}

impl ProbeSet {
    pub fn k(&self) -> usize {
        16 * self.steps
    }

    fn ptx(&self) -> String {
        let ty = self.elem.ptx();
        let sa = if self.neg_a { -1 } else { 1 };
        let sb = if self.neg_b { -1 } else { 1 };
        let acc: Vec<String> = (0..N / 2).map(|i| format!("%f{i}")).collect();
        let acc = acc.join(", ");
        let mut body = String::new();
        for i in 0..IMAGE / 2048 {
            body.push_str(&format!(
                "\tadd.u32 %r6, %r5, {};\n\tcvt.u64.u32 %rd2, %r6;\n\tadd.u64 %rd3, %rd0, %rd2;\n\
                 \tld.global.v4.b32 {{%r8, %r9, %r10, %r11}}, [%rd3];\n\tadd.u32 %r7, %r1, %r6;\n\
                 \tst.shared.v4.b32 [%r7], {{%r8, %r9, %r10, %r11}};\n",
                2048 * i
            ));
        }
        body.push_str("\tfence.proxy.async.shared::cta;\n\tbar.sync 0;\n");
        for i in 0..N / 8 {
            body.push_str(&format!(
                "\tld.global.v4.f32 {{%f{}, %f{}, %f{}, %f{}}}, [%rd5+{}];\n",
                4 * i,
                4 * i + 1,
                4 * i + 2,
                4 * i + 3,
                16 * i
            ));
        }
        body.push_str("\twgmma.fence.sync.aligned;\n");
        for s in 0..self.steps {
            let sd = if s == 0 && !self.scale_d0 {
                "%p2"
            } else {
                "%p3"
            };
            body.push_str(&format!(
                "\tadd.u32 %r12, %r1, {};\n\tshr.u32 %r12, %r12, 4;\n\tand.b32 %r12, %r12, 16383;\n\
                 \tor.b32 %r12, %r12, 65536;\n\tmov.b64 %bd0, {{%r12, %r22}};\n\
                 \tadd.u32 %r13, %r1, {};\n\tshr.u32 %r13, %r13, 4;\n\tand.b32 %r13, %r13, 16383;\n\
                 \tor.b32 %r13, %r13, 65536;\n\tmov.b64 %bd1, {{%r13, %r22}};\n\
                 \twgmma.mma_async.sync.aligned.m64n64k16.f32.{ty}.{ty} {{{acc}}}, %bd0, %bd1, {sd}, {sa}, {sb}, 0, 0;\n",
                32 * s,
                8192 + 32 * s
            ));
        }
        body.push_str("\twgmma.commit_group.sync.aligned;\n\twgmma.wait_group.sync.aligned 0;\n");
        for i in 0..N / 8 {
            body.push_str(&format!(
                "\tst.global.v4.f32 [%rd6+{}], {{%f{}, %f{}, %f{}, %f{}}};\n",
                16 * i,
                4 * i,
                4 * i + 1,
                4 * i + 2,
                4 * i + 3
            ));
        }
        format!(
            "{HEADER}
.extern .shared .align 1024 .b8 smem[];

.visible .entry wgmma_probe(
	.param .u64 .ptr .align 16 img,
	.param .u64 .ptr .align 16 cin,
	.param .u64 .ptr .align 16 out
)
.maxntid 128, 1, 1
{{
	.reg .pred %p<4>;
	.reg .b32 %r<24>;
	.reg .f32 %f<32>;
	.reg .b64 %bd<2>;
	.reg .b64 %rd<8>;

	mov.u32 %r0, smem;
	add.u32 %r1, %r0, 1023;
	and.b32 %r1, %r1, 4294966272;
	mov.u32 %r3, %tid.x;
	mov.u32 %r4, %ctaid.x;
	mov.u32 %r22, 1073741888;
	mov.u32 %r23, 0;
	setp.ne.u32 %p2, %r23, 0;
	setp.eq.u32 %p3, %r23, 0;
	ld.param.u64 %rd0, [img];
	cvta.to.global.u64 %rd0, %rd0;
	mul.wide.u32 %rd1, %r4, {IMAGE};
	add.u64 %rd0, %rd0, %rd1;
	shl.b32 %r5, %r3, 4;
	mad.lo.u32 %r14, %r4, 128, %r3;
	ld.param.u64 %rd4, [cin];
	cvta.to.global.u64 %rd4, %rd4;
	mul.wide.u32 %rd1, %r14, {};
	add.u64 %rd5, %rd4, %rd1;
	ld.param.u64 %rd4, [out];
	cvta.to.global.u64 %rd4, %rd4;
	add.u64 %rd6, %rd4, %rd1;
{body}	ret;
}}
",
            N * 2
        )
    }

    /// The kernel launch: one CTA per problem.
    pub fn scenario(&self) -> Scenario {
        let k = self.k();
        let p = self.problems.len();
        let mut img = vec![0u8; p * IMAGE];
        let mut cin = vec![0u8; p * 128 * N * 2];
        for (i, pr) in self.problems.iter().enumerate() {
            let base = i * IMAGE;
            for row in 0..64 {
                for kk in 0..k {
                    let at = base + kmajor_offset(row, kk);
                    img[at..at + 2].copy_from_slice(&pr.a[row * k + kk].to_le_bytes());
                    let at = base + 8192 + kmajor_offset(row, kk);
                    img[at..at + 2].copy_from_slice(&pr.b[row * k + kk].to_le_bytes());
                }
            }
            for t in 0..128 {
                for r in 0..N / 2 {
                    let (m, n) = acc_pos(t, r);
                    let at = ((i * 128 + t) * (N / 2) + r) * 4;
                    cin[at..at + 4].copy_from_slice(&pr.c[m * N + n].to_le_bytes());
                }
            }
        }
        Scenario {
            name: self.name,
            ptx: self.ptx(),
            kernel: "wgmma_probe",
            grid: p as u32,
            threads: 128,
            dynamic_smem: 1024 + IMAGE as u32,
            inputs: vec![img, cin],
            outputs: vec![p * 128 * N * 2],
            args: vec![ArgSpec::In(0), ArgSpec::In(1), ArgSpec::Out(0)],
        }
    }

    /// `D[problem][m][n]` (raw f32 bits) from the kernel's per-thread output.
    pub fn unpack(&self, out: &[u8]) -> Vec<u32> {
        let p = self.problems.len();
        let mut d = vec![0u32; p * 64 * N];
        for i in 0..p {
            for t in 0..128 {
                for r in 0..N / 2 {
                    let (m, n) = acc_pos(t, r);
                    let at = ((i * 128 + t) * (N / 2) + r) * 4;
                    d[(i * 64 + m) * N + n] =
                        u32::from_le_bytes(out[at..at + 4].try_into().expect("4 bytes"));
                }
            }
        }
        d
    }
}

// ---------------------------------------------------------------------------------------------
// Inputs

/// A random f32 with random sign and significand and exponent in `lo..=hi` (normal range
/// clamped: below it a subnormal pattern, above it the largest exponent).
fn f32_exp(rng: &mut Rng, lo: i32, hi: i32) -> u32 {
    let r = rng.next();
    let e = lo + (r % (hi - lo + 1) as u64) as i32;
    let sign = ((r >> 20) & 1) as u32;
    let man = ((r >> 32) as u32) & 0x7f_ffff;
    let field = (e + 127).clamp(0, 254) as u32;
    sign << 31 | field << 23 | man
}

fn range(rng: &mut Rng, lo: i32, hi: i32) -> i32 {
    lo + (rng.next() % (hi - lo + 1) as u64) as i32
}

fn elem_exp(rng: &mut Rng, e: Elem, lo: i32, hi: i32) -> u16 {
    let r = rng.next();
    let exp = range(rng, lo, hi);
    e.make(r & 1 == 1, exp, (r >> 16) as u16)
}

fn problem(
    rng: &mut Rng,
    k: usize,
    mut fa: impl FnMut(&mut Rng, usize, usize) -> u16,
    mut fb: impl FnMut(&mut Rng, usize, usize) -> u16,
    mut fc: impl FnMut(&mut Rng, usize, usize) -> u32,
) -> Problem {
    let mut a = vec![0u16; 64 * k];
    let mut b = vec![0u16; N * k];
    let mut c = vec![0u32; 64 * N];
    for m in 0..64 {
        for kk in 0..k {
            a[m * k + kk] = fa(rng, m, kk);
        }
    }
    for n in 0..N {
        for kk in 0..k {
            b[n * k + kk] = fb(rng, n, kk);
        }
    }
    for m in 0..64 {
        for n in 0..N {
            c[m * N + n] = fc(rng, m, n);
        }
    }
    Problem { a, b, c }
}

/// Random inputs with exponents in `±r` and accumulators in `±(2r + 8)` (a quarter zero).
fn random(rng: &mut Rng, e: Elem, k: usize, r: i32) -> Problem {
    let er = r.min(match e {
        Elem::Bf16 => 60,
        Elem::F16 => 14,
    });
    problem(
        rng,
        k,
        |g, _, _| elem_exp(g, e, -er, er),
        |g, _, _| elem_exp(g, e, -er, er),
        |g, _, _| {
            if g.next() % 4 == 0 {
                0
            } else {
                f32_exp(g, -2 * r - 8, 2 * r + 8)
            }
        },
    )
}

/// One product near 1 (k = n mod 16) and fifteen scaled down by `2^-d`, d in 0..=44 per term:
/// where the alignment cuts the small ones off.
fn one_big(rng: &mut Rng, e: Elem) -> Problem {
    let dmax = if e == Elem::F16 { 24 } else { 44 };
    problem(
        rng,
        16,
        |g, _, _| elem_exp(g, e, -1, 0),
        |g, n, kk| {
            let r = g.next();
            if kk == n % 16 {
                e.make(r & 1 == 1, 0, (r >> 16) as u16)
            } else {
                let d = range(g, 0, dmax);
                e.make(r & 1 == 1, -d, (r >> 16) as u16)
            }
        },
        |g, _, _| match g.next() % 3 {
            0 => 0,
            1 => f32_exp(g, -30, 1),
            _ => f32_exp(g, -60, -20),
        },
    )
}

/// Products 0 and 1 cancel exactly (or to a few ulps) and the rest are small: truncation
/// relative to the largest term, not to the result.
fn cancel(rng: &mut Rng, e: Elem) -> Problem {
    let dmax = if e == Elem::F16 { 12 } else { 30 };
    let mut p = problem(
        rng,
        16,
        |g, _, _| elem_exp(g, e, -1, 1),
        |g, _, kk| {
            if kk < 2 {
                elem_exp(g, e, 0, 2)
            } else {
                elem_exp(g, e, -dmax, -1)
            }
        },
        |g, _, _| match g.next() % 3 {
            0 => 0,
            1 => f32_exp(g, -40, 0),
            _ => f32_exp(g, -12, 4),
        },
    );
    for m in 0..64 {
        let a0 = p.a[m * 16];
        // Rows m % 4 == 0 cancel exactly; others are off by m % 4 units in the last place.
        let off = (m % 4) as u16;
        p.a[m * 16 + 1] = (a0 ^ 0x8000).wrapping_add(off);
    }
    for n in 0..N {
        p.b[n * 16 + 1] = p.b[n * 16];
    }
    p
}

/// Accumulators far larger or smaller than the products.
fn c_dominant(rng: &mut Rng, e: Elem) -> Problem {
    problem(
        rng,
        16,
        |g, _, _| elem_exp(g, e, -3, 3),
        |g, _, _| elem_exp(g, e, -3, 3),
        |g, _, _| f32_exp(g, -50, 50),
    )
}

/// All terms of one sign with large significands: carries out of the top bit.
fn carry(rng: &mut Rng, e: Elem, neg: bool) -> Problem {
    let big = |g: &mut Rng, lo: i32, hi: i32| {
        let r = g.next();
        let exp = range(g, lo, hi);
        e.make(neg, exp, 0xc000 | (r as u16))
    };
    problem(
        rng,
        16,
        |g, _, _| big(g, 0, 1),
        |g, _, _| {
            let r = g.next();
            e.make(false, range(g, 0, 1), 0xc000 | r as u16)
        },
        move |g, _, _| {
            let x = f32_exp(g, -4, 8) & 0x7fff_ffff;
            x | (neg as u32) << 31
        },
    )
}

/// Bits of `±j·2^s` (`j` fits the significand).
fn scaled_int(e: Elem, neg: bool, j: u32, s: i32) -> u16 {
    let top = 31 - j.leading_zeros() as i32; // j = 1.f · 2^top
                                             // The fraction bits below the leading one, at the top of 16 bits.
    let man16 = (((j as u64) << (32 - top)) >> 16) as u16;
    e.make(neg, top + s, man16)
}

/// At most two non-zero products per accumulator, each from a fraction to a few thousand
/// units of the accumulator's last place: the rounding of the final sum.
fn ulp_fractions(rng: &mut Rng, e: Elem) -> Problem {
    // a = ±j·2^sa, b = 2^t (t in -8..=2), C = ±1.f·2^ec: the products span 2^-5..2^13 ulps.
    let (jmax, sa, elo, ehi) = match e {
        Elem::Bf16 => (255u64, -26, -6, 2),
        Elem::F16 => (2047, -12, 0, 8),
    };
    problem(
        rng,
        16,
        move |g, _, _| {
            let r = g.next();
            scaled_int(e, r & 1 == 1, 1 + ((r >> 8) % jmax) as u32, sa)
        },
        move |g, n, kk| {
            let two = n >= 32 && kk == (n + 5) % 16;
            if kk == n % 16 || two {
                e.make(false, range(g, -8, 2), 0)
            } else {
                0
            }
        },
        move |g, _, _| f32_exp(g, elo, ehi),
    )
}

/// Products and accumulators near the bottom of the f32 range (subnormal results).
fn tiny(rng: &mut Rng) -> Problem {
    problem(
        rng,
        16,
        |g, _, _| elem_exp(g, Elem::Bf16, -80, -55),
        |g, _, _| {
            if g.next() % 8 == 0 {
                // A subnormal bf16.
                (g.next() as u16) & 0x807f
            } else {
                elem_exp(g, Elem::Bf16, -80, -55)
            }
        },
        |g, _, _| match g.next() % 4 {
            0 => 0,
            1 => (g.next() as u32) & 0x807f_ffff,
            _ => f32_exp(g, -150, -110),
        },
    )
}

/// Products and accumulators near the top of the f32 range (overflow to infinity).
fn huge(rng: &mut Rng) -> Problem {
    problem(
        rng,
        16,
        |g, _, _| elem_exp(g, Elem::Bf16, 58, 66),
        |g, _, _| elem_exp(g, Elem::Bf16, 58, 64),
        |g, _, _| f32_exp(g, 100, 127),
    )
}

/// Products below 2^-149 and accumulators of a few subnormal units: sums that truncate to
/// zero (of which sign?) or to the smallest subnormals.
fn underflow(rng: &mut Rng) -> Problem {
    problem(
        rng,
        16,
        |g, _, _| elem_exp(g, Elem::Bf16, -80, -76),
        |g, _, _| elem_exp(g, Elem::Bf16, -80, -70),
        |g, _, _| {
            let r = g.next();
            match r % 4 {
                0 => 0,
                1 => 0x8000_0000,
                _ => ((r >> 8) as u32 & 0x8000_0000) | ((r >> 16) as u32 % 4),
            }
        },
    )
}

/// Finite products that overflow next to infinite ones of either sign.
fn huge_and_infinite(rng: &mut Rng) -> Problem {
    let pick = |g: &mut Rng| -> u16 {
        let r = g.next();
        match r % 24 {
            0 => 0x7f80,
            1 => 0xff80,
            _ => elem_exp(g, Elem::Bf16, 62, 66),
        }
    };
    problem(
        rng,
        16,
        move |g, _, _| pick(g),
        |g, _, _| elem_exp(g, Elem::Bf16, 60, 64),
        |g, _, _| f32_exp(g, 120, 127),
    )
}

/// Zeros of both signs, infinities, NaNs (various payloads) among ordinary values.
fn special(rng: &mut Rng) -> Problem {
    let pick16 = |g: &mut Rng| -> u16 {
        let r = g.next();
        match r % 16 {
            0 => 0x0000,
            1 => 0x8000,
            2 => 0x7f80,
            3 => 0xff80,
            4 => 0x7fc0 | ((r >> 8) as u16 & 0x3f),
            5 => 0xffa1,
            _ => elem_exp(g, Elem::Bf16, -4, 4),
        }
    };
    problem(
        rng,
        16,
        move |g, _, _| pick16(g),
        move |g, _, _| {
            if g.next() % 2 == 0 {
                pick16(g)
            } else {
                elem_exp(g, Elem::Bf16, -4, 4)
            }
        },
        |g, _, _| {
            let r = g.next();
            match r % 10 {
                0 => 0,
                1 => 0x8000_0000,
                2 => 0x7f80_0000,
                3 => 0xff80_0000,
                4 => 0x7fc0_0000 | (r >> 32) as u32 & 0x3f_ffff,
                5 => 0xffc0_1234,
                _ => f32_exp(g, -8, 8),
            }
        },
    )
}

/// Mostly zeros of either sign with a few small values: the sign of an exact zero result.
fn zeros(rng: &mut Rng, k: usize) -> Problem {
    let z = |g: &mut Rng| -> u16 {
        let r = g.next();
        match r % 8 {
            0..=2 => 0x0000,
            3..=5 => 0x8000,
            _ => elem_exp(g, Elem::Bf16, 0, 0),
        }
    };
    let mut p = problem(
        rng,
        k,
        move |g, _, _| z(g),
        move |g, _, _| z(g),
        |g, _, _| if g.next() % 2 == 0 { 0 } else { 0x8000_0000 },
    );
    // Rows m % 4 == 0: every product a zero (a row of signed zeros).
    for m in (0..64).step_by(4) {
        for kk in 0..k {
            p.a[m * k + kk] &= 0x8000;
        }
    }
    p
}

fn set(
    name: &'static str,
    elem: Elem,
    steps: usize,
    count: usize,
    seed: u64,
    mut f: impl FnMut(&mut Rng, usize) -> Problem,
) -> ProbeSet {
    let mut rng = Rng(seed);
    ProbeSet {
        name,
        elem,
        steps,
        scale_d0: true,
        neg_a: false,
        neg_b: false,
        problems: (0..count).map(|i| f(&mut rng, i)).collect(),
    }
}

/// Every probe set (the recorded-output test runs the first problem of each through
/// [`ProbeSet::truncated`]).
pub fn probe_sets() -> Vec<ProbeSet> {
    use Elem::*;
    let mut v = vec![
        set("bf16 random ±2", Bf16, 1, 24, 1, |g, _| {
            random(g, Bf16, 16, 2)
        }),
        set("bf16 random ±6", Bf16, 1, 24, 2, |g, _| {
            random(g, Bf16, 16, 6)
        }),
        set("bf16 random ±16", Bf16, 1, 24, 3, |g, _| {
            random(g, Bf16, 16, 16)
        }),
        set("bf16 random ±40", Bf16, 1, 24, 4, |g, _| {
            random(g, Bf16, 16, 40)
        }),
        set("bf16 one big, fifteen small", Bf16, 1, 48, 5, |g, _| {
            one_big(g, Bf16)
        }),
        set("bf16 cancellation", Bf16, 1, 48, 6, |g, _| cancel(g, Bf16)),
        set("bf16 accumulator dominant", Bf16, 1, 32, 7, |g, _| {
            c_dominant(g, Bf16)
        }),
        set("bf16 carries", Bf16, 1, 16, 8, |g, i| {
            carry(g, Bf16, i % 2 == 1)
        }),
        set("bf16 ulp fractions", Bf16, 1, 32, 9, |g, _| {
            ulp_fractions(g, Bf16)
        }),
        set("bf16 tiny", Bf16, 1, 16, 10, |g, _| tiny(g)),
        set("bf16 huge", Bf16, 1, 8, 11, |g, _| huge(g)),
        set("bf16 special values", Bf16, 1, 8, 12, |g, _| special(g)),
        set("bf16 signed zeros", Bf16, 1, 4, 13, |g, _| zeros(g, 16)),
        set("bf16 underflow", Bf16, 1, 8, 16, |g, _| underflow(g)),
        set(
            "bf16 overflow next to infinities",
            Bf16,
            1,
            8,
            17,
            |g, _| huge_and_infinite(g),
        ),
        set("bf16 4 chained steps ±8", Bf16, 4, 16, 14, |g, _| {
            random(g, Bf16, 64, 8)
        }),
        set(
            "bf16 4 chained steps, signed zeros",
            Bf16,
            4,
            4,
            15,
            |g, _| zeros(g, 64),
        ),
        set("f16 random ±2", F16, 1, 16, 21, |g, _| {
            random(g, F16, 16, 2)
        }),
        set("f16 random ±8", F16, 1, 16, 22, |g, _| {
            random(g, F16, 16, 8)
        }),
        set("f16 one big, fifteen small", F16, 1, 16, 23, |g, _| {
            one_big(g, F16)
        }),
        set("f16 cancellation", F16, 1, 16, 24, |g, _| cancel(g, F16)),
        set("f16 ulp fractions", F16, 1, 8, 25, |g, _| {
            ulp_fractions(g, F16)
        }),
    ];
    let variants: [(&'static str, bool, bool, bool); 4] = [
        ("bf16 scale-a -1", false, true, false),
        ("bf16 scale-b -1", false, false, true),
        ("bf16 scale-a -1 scale-b -1", false, true, true),
        ("bf16 scale-d 0", true, false, false),
    ];
    for (i, (name, zero_d, neg_a, neg_b)) in variants.into_iter().enumerate() {
        let mut s = set(name, Bf16, 1, 8, 31 + i as u64, |g, j| match j % 4 {
            0 => special(g),
            1 => zeros(g, 16),
            _ => random(g, Bf16, 16, 8),
        });
        s.scale_d0 = !zero_d;
        s.neg_a = neg_a;
        s.neg_b = neg_b;
        v.push(s);
    }
    v
}

impl ProbeSet {
    /// The first `n` problems only.
    pub fn truncated(mut self, n: usize) -> ProbeSet {
        self.problems.truncate(n);
        self
    }
}
