//! Warp shuffles and global reductions/atomics as micro-kernels: every `shfl.sync`, `red` and
//! `atom` form of `generated/*.ptx` plus the other modes, clamps, segment widths and partial
//! member masks, and float inputs that exercise rounding, subnormals, infinities and NaNs.
//! Results are deterministic: float reductions add once per address, integer ones are
//! order-independent, and each `atom` that returns the old value owns its address.

use super::{bytes_of_u32, ArgSpec, Rng, Scenario, HEADER};

// ---------------------------------------------------------------------------------------------
// shfl.sync

/// An operand of a shuffle case: an immediate, or per-lane values loaded from `bc`.
#[derive(Debug, Clone, Copy)]
pub enum Opnd {
    Imm(u32),
    /// Per-lane values drawn by the generator (`bits` low bits random).
    Lane(u32),
}

/// One `shfl.sync` instruction executed by the lanes of `active` (the others branch around
/// it) with membermask `mask`.
#[derive(Debug, Clone, Copy)]
pub struct ShflCase {
    pub mode: &'static str,
    pub b: Opnd,
    pub c: Opnd,
    pub mask: u32,
    pub active: u32,
    /// With the `|p` predicate destination.
    pub pred: bool,
}

const FULL: u32 = u32::MAX;

fn case(mode: &'static str, b: Opnd, c: Opnd, mask: u32, pred: bool) -> ShflCase {
    ShflCase {
        mode,
        b,
        c,
        mask,
        active: mask,
        pred,
    }
}

/// The shuffle cases: the generated kernels' forms (`bfly` with clamp 0x1f and `up` with 0,
/// full mask, immediates), every mode with clamps and segment widths 32/16/8/4/2, per-lane
/// lane operands, and partial member masks whose sources stay inside the mask.
pub fn shfl_cases() -> Vec<ShflCase> {
    use Opnd::*;
    let mut v = Vec::new();
    for b in [1, 2, 4, 8, 16] {
        v.push(case("bfly", Imm(b), Imm(0x1f), FULL, false));
        v.push(case("up", Imm(b), Imm(0), FULL, false));
    }
    // Segment widths w: c = ((32 - w) << 8) | clamp, clamp w-1 (0 for up).
    for w in [32u32, 16, 8, 4, 2] {
        let seg = (32 - w) << 8;
        for (mode, clamp) in [("idx", 0x1f), ("down", 0x1f), ("bfly", 0x1f), ("up", 0)] {
            for b in [0, 1, 3, 5, 17, 31] {
                v.push(case(mode, Imm(b), Imm(seg | clamp), FULL, true));
            }
        }
    }
    // Clamps inside a full segment.
    for clamp in [0u32, 3, 7, 15, 22] {
        for mode in ["idx", "down", "bfly"] {
            v.push(case(mode, Imm(3), Imm(clamp), FULL, true));
            v.push(case(mode, Lane(5), Imm(clamp), FULL, true));
        }
        v.push(case("up", Imm(3), Imm(clamp), FULL, true));
    }
    // Per-lane b and c (c's documented 13 bits).
    for mode in ["idx", "up", "down", "bfly"] {
        v.push(case(mode, Lane(32), Lane(13), FULL, true));
        v.push(case(mode, Lane(5), Imm(0x1f), FULL, true));
    }
    // Partial member masks: lanes 0-15, then even lanes; sources stay in the mask.
    let low = 0x0000_ffff;
    for b in [1, 2, 4, 8] {
        v.push(case("bfly", Imm(b), Imm(0x1f), low, true));
        v.push(case("up", Imm(b), Imm(0), low, true));
        v.push(case("down", Imm(b), Imm(0xf), low, true));
    }
    v.push(case("idx", Imm(9), Imm(0x1f), low, true));
    v.push(case("idx", Lane(4), Imm(0x1f), low, true));
    // Segments of 16 inside lanes 0-15: idx over each lane's own segment.
    v.push(case("idx", Imm(6), Imm((16 << 8) | 0x1f), low, true));
    let even = 0x5555_5555;
    for b in [2, 4, 8, 16] {
        v.push(case("bfly", Imm(b), Imm(0x1f), even, true));
    }
    v.push(case("up", Imm(2), Imm(0), even, true));
    v.push(case("idx", Imm(12), Imm(0x1f), even, true));
    v
}

/// `shfl_cases`: lane `l` holds `vals[l]`; case `i` writes its result to `out[i][l]` and
/// its predicate (1/0) to `out[cases + i][l]`.
pub fn shfl_scenario() -> Scenario {
    let cases = shfl_cases();
    let mut rng = Rng(0x5f1f);
    let vals: Vec<u32> = (0..32).map(|_| rng.next() as u32).collect();
    let mut bc = vec![0u32; cases.len() * 64];
    let draw = |rng: &mut Rng, o: Opnd| match o {
        Opnd::Imm(x) => x,
        Opnd::Lane(bits) => (rng.next() as u32) & ((1u64 << bits) - 1) as u32,
    };
    for (i, c) in cases.iter().enumerate() {
        for l in 0..32 {
            let mut b = draw(&mut rng, c.b);
            if c.mask != FULL && matches!(c.b, Opnd::Lane(_)) {
                // idx with a per-lane source: a lane inside the mask.
                let members: Vec<u32> = (0..32).filter(|j| c.mask >> j & 1 == 1).collect();
                b = members[b as usize % members.len()];
            }
            bc[(i * 32 + l) * 2] = b;
            bc[(i * 32 + l) * 2 + 1] = draw(&mut rng, c.c);
        }
    }
    let n = cases.len();
    let mut body = String::new();
    for (i, c) in cases.iter().enumerate() {
        let opnd = |o: Opnd, reg: &str| match o {
            Opnd::Imm(x) => format!("{x:#x}"),
            Opnd::Lane(_) => reg.to_string(),
        };
        let dst = if c.pred { "%r8|%p2" } else { "%r8" };
        body.push_str(&format!(
            "\tmov.u32 %r5, {:#x};\n\tshr.b32 %r5, %r5, %r0;\n\tand.b32 %r5, %r5, 1;\n\tsetp.eq.u32 %p1, %r5, 0;\n\
             \t@%p1 bra $L_skip{i};\n\
             \tld.global.v2.u32 {{%r6, %r7}}, [%rd2+{}];\n\
             \tshfl.sync.{}.b32 {dst}, %r1, {}, {}, {:#x};\n\
             \tst.global.u32 [%rd3+{}], %r8;\n",
            c.active,
            i * 256,
            c.mode,
            opnd(c.b, "%r6"),
            opnd(c.c, "%r7"),
            c.mask,
            i * 128
        ));
        if c.pred {
            body.push_str(&format!(
                "\tselp.u32 %r9, 1, 0, %p2;\n\tst.global.u32 [%rd3+{}], %r9;\n",
                (n + i) * 128
            ));
        }
        body.push_str(&format!("$L_skip{i}:\n"));
    }
    let ptx = format!(
        "{HEADER}
.visible .entry shfl_cases(
	.param .u64 .ptr .align 16 vals,
	.param .u64 .ptr .align 16 bc,
	.param .u64 .ptr .align 16 out
)
.maxntid 32, 1, 1
{{
	.reg .pred %p<4>;
	.reg .b32 %r<12>;
	.reg .b64 %rd<6>;
	mov.u32 %r0, %laneid;
	ld.param.u64 %rd0, [vals];
	cvta.to.global.u64 %rd0, %rd0;
	mul.wide.u32 %rd1, %r0, 4;
	add.u64 %rd4, %rd0, %rd1;
	ld.global.u32 %r1, [%rd4];
	ld.param.u64 %rd2, [bc];
	cvta.to.global.u64 %rd2, %rd2;
	mul.wide.u32 %rd4, %r0, 8;
	add.u64 %rd2, %rd2, %rd4;
	ld.param.u64 %rd3, [out];
	cvta.to.global.u64 %rd3, %rd3;
	add.u64 %rd3, %rd3, %rd1;
{body}	ret;
}}
"
    );
    Scenario {
        name: "shfl.sync forms",
        ptx,
        kernel: "shfl_cases",
        grid: 1,
        threads: 32,
        dynamic_smem: 0,
        inputs: vec![bytes_of_u32(&vals), bytes_of_u32(&bc)],
        outputs: vec![2 * n * 128],
        args: vec![ArgSpec::In(0), ArgSpec::In(1), ArgSpec::Out(0)],
    }
}

// ---------------------------------------------------------------------------------------------
// red / atom

/// An f32 bit pattern from a mix meant to hit every rounding path of an addition with
/// `other`: random bits (NaNs, infinities, subnormals included), values near `other`
/// (cancellation), half and odd fractions of its ulp (ties), subnormals and zeros.
pub fn f32_operand(rng: &mut Rng, other: u32) -> u32 {
    let r = rng.next();
    let sign = ((r >> 40) as u32 & 1) << 31;
    let e_other = (other >> 23) & 0xff;
    match r % 12 {
        0 | 1 => (r >> 16) as u32,
        // Same binade as `other`, either sign: exact sums, carries and cancellation.
        2 | 3 => sign | e_other << 23 | ((r >> 16) as u32 & 0x7f_ffff),
        // 24..=26 binades below: a half ulp of `other` and neighbours (ties).
        4 | 5 => {
            let e = e_other.saturating_sub(24 + (r >> 8) as u32 % 3);
            sign | e << 23 | (((r >> 16) as u32 & 0x7f_ffff) * ((r >> 12) as u32 & 1))
        }
        // A few binades below: inexact sums.
        6 => {
            sign | e_other.saturating_sub(1 + (r >> 8) as u32 % 20) << 23
                | (r >> 16) as u32 & 0x7f_ffff
        }
        // Subnormal.
        7 | 8 => sign | ((r >> 16) as u32 & 0x7f_ffff),
        // Tiny normal (a sum with a subnormal may cross the boundary).
        9 => sign | (1 + (r >> 8) as u32 % 2) << 23 | (r >> 16) as u32 & 0x7f_ffff,
        10 => [0, 0x8000_0000, 0x7f80_0000, 0xff80_0000][(r >> 8) as usize % 4],
        // The negation of `other`: an exact zero.
        _ => other ^ 0x8000_0000,
    }
}

/// The same for one bf16 half.
pub fn bf16_operand(rng: &mut Rng, other: u16) -> u16 {
    let r = rng.next();
    let sign = ((r >> 40) as u16 & 1) << 15;
    let e_other = (other >> 7) & 0xff;
    match r % 12 {
        0 | 1 => (r >> 16) as u16,
        2 | 3 => sign | e_other << 7 | ((r >> 16) as u16 & 0x7f),
        4 | 5 => {
            let e = e_other.saturating_sub(8 + (r >> 8) as u16 % 3);
            sign | e << 7 | (((r >> 16) as u16 & 0x7f) * ((r >> 12) as u16 & 1))
        }
        6 => sign | e_other.saturating_sub(1 + (r >> 8) as u16 % 8) << 7 | (r >> 16) as u16 & 0x7f,
        7 | 8 => sign | ((r >> 16) as u16 & 0x7f),
        9 => sign | (1 + (r >> 8) as u16 % 2) << 7 | (r >> 16) as u16 & 0x7f,
        10 => [0, 0x8000, 0x7f80, 0xff80][(r >> 8) as usize % 4],
        _ => other ^ 0x8000,
    }
}

/// A starting value: random bits half the time, else an ordinary, subnormal or tiny value.
fn f32_start(rng: &mut Rng) -> u32 {
    let r = rng.next();
    match r % 4 {
        0 | 1 => (r >> 16) as u32,
        2 => {
            ((r >> 8) as u32 & 0x8000_0000)
                | ((100 + (r >> 20) as u32 % 56) << 23)
                | (r >> 32) as u32 & 0x7f_ffff
        }
        _ => {
            ((r >> 8) as u32 & 0x8000_0000)
                | ((r >> 20) as u32 % 3) << 23
                | (r >> 32) as u32 & 0x7f_ffff
        }
    }
}

fn bf16_start(rng: &mut Rng) -> u16 {
    let r = rng.next();
    match r % 4 {
        0 | 1 => (r >> 16) as u16,
        2 => {
            ((r >> 8) as u16 & 0x8000)
                | ((100 + (r >> 20) as u16 % 56) << 7)
                | (r >> 32) as u16 & 0x7f
        }
        _ => ((r >> 8) as u16 & 0x8000) | ((r >> 20) as u16 % 3) << 7 | (r >> 32) as u16 & 0x7f,
    }
}

/// Words of the reduction buffer, region by region (offsets in 32-bit words).
pub mod region {
    /// `red.global.add.v4.f32`: 2 × 128 threads × 4 words.
    pub const V4F32: usize = 0;
    /// `red.global.add.noftz.L2::cache_hint.bf16x2`: 2 × 128 words.
    pub const BF16X2: usize = 1024;
    /// `red.global.add.f32` (scalar): 128 words.
    pub const F32: usize = 1280;
    /// `atom.global.add.f32`: 128 words (old values in `OLD`).
    pub const ATOM_F32: usize = 1408;
    /// Integer reductions from all threads into 8 words each: or (immediate 2, and a
    /// register), min.s32, max.s32, add.u32 (immediate 1, and a register), xor, and.
    pub const INT: usize = 1536;
    /// One-owner integer atomics: 10 ops × 128 words.
    pub const ATOM_INT: usize = 1600;
    /// Old values returned by the atomics: 11 × 128 words.
    pub const OLD: usize = 2880;
    /// Total words.
    pub const WORDS: usize = 4288;
}

/// The integer atomics, one address per thread: (instruction, second operand register).
const ATOMS: [&str; 10] = [
    "atom.global.add.u32",
    "atom.global.exch.b32",
    "atom.global.min.u32",
    "atom.global.max.s32",
    "atom.global.and.b32",
    "atom.global.or.b32",
    "atom.global.xor.b32",
    "atom.global.inc.u32",
    "atom.global.dec.u32",
    "atom.global.cas.b32",
];

/// Every `red`/`atom` form: the buffer starts as `init` (copied in by the kernel), then each
/// thread applies its operands (`ops[t·OPS + j]`); the final buffer is the output.
pub fn red_atom_scenario() -> Scenario {
    use region::*;
    const OPS: usize = 32;
    let mut rng = Rng(0x7ed);
    let mut init = vec![0u32; WORDS];
    let mut ops = vec![0u32; 128 * OPS];
    // Floats: each word gets exactly one addition.
    for t in 0..128 {
        for r in 0..2 {
            for j in 0..4 {
                let w = V4F32 + (r * 128 + t) * 4 + j;
                init[w] = f32_start(&mut rng);
                ops[t * OPS + r * 4 + j] = f32_operand(&mut rng, init[w]);
            }
            let w = BF16X2 + r * 128 + t;
            let (lo, hi) = (bf16_start(&mut rng), bf16_start(&mut rng));
            init[w] = (hi as u32) << 16 | lo as u32;
            let (olo, ohi) = (bf16_operand(&mut rng, lo), bf16_operand(&mut rng, hi));
            ops[t * OPS + 8 + r] = (ohi as u32) << 16 | olo as u32;
        }
        init[F32 + t] = f32_start(&mut rng);
        ops[t * OPS + 10] = f32_operand(&mut rng, init[F32 + t]);
        init[ATOM_F32 + t] = f32_start(&mut rng);
        ops[t * OPS + 11] = f32_operand(&mut rng, init[ATOM_F32 + t]);
        // Integer reductions (any order gives the same result).
        for j in 0..3 {
            ops[t * OPS + 12 + j] = rng.next() as u32;
        }
        // One-owner atomics: operands, and for cas a compare value that matches half the time.
        for (j, _) in ATOMS.iter().enumerate() {
            let w = ATOM_INT + j * 128 + t;
            let r = rng.next();
            init[w] = match j {
                7 | 8 => (r as u32) % 8, // inc/dec: small values near the bound
                _ => r as u32,
            };
            ops[t * OPS + 16 + j] = match j {
                7 | 8 => (r >> 32) as u32 % 8,
                9 => {
                    if r >> 40 & 1 == 1 {
                        init[w]
                    } else {
                        (r >> 32) as u32
                    }
                }
                _ => (r >> 32) as u32,
            };
        }
        ops[t * OPS + 26] = rng.next() as u32; // cas swap value
    }
    for w in &mut init[INT..INT + 64] {
        *w = rng.next() as u32;
    }
    let mut body = String::new();
    // Word address of thread t in a region: %rd2 = out + 4·t.
    for r in 0..2 {
        body.push_str(&format!(
            "\tld.global.v4.f32 {{%f0, %f1, %f2, %f3}}, [%rd1+{}];\n\
             \tred.global.add.v4.f32 [%rd4+{}], {{%f0, %f1, %f2, %f3}};\n",
            16 * r,
            4 * (V4F32 + r * 512)
        ));
        body.push_str(&format!(
            "\tld.global.b32 %r10, [%rd1+{}];\n\
             \tred.global.add.noftz.L2::cache_hint.bf16x2 [%rd2+{}], %r10, %rd9;\n",
            4 * (8 + r),
            4 * (BF16X2 + r * 128)
        ));
    }
    body.push_str(&format!(
        "\tld.global.f32 %f4, [%rd1+40];\n\tred.global.add.f32 [%rd2+{}], %f4;\n\
         \tld.global.f32 %f5, [%rd1+44];\n\tatom.global.add.f32 %f6, [%rd2+{}], %f5;\n\
         \tst.global.f32 [%rd2+{}], %f6;\n",
        4 * F32,
        4 * ATOM_F32,
        4 * OLD
    ));
    // Integer reductions from every thread into 8 words per op (word t % 8).
    body.push_str(&format!(
        "\tand.b32 %r11, %r0, 7;\n\tmul.wide.u32 %rd5, %r11, 4;\n\tadd.u64 %rd5, %rd3, %rd5;\n\
         \tld.global.v2.u32 {{%r12, %r13}}, [%rd1+48];\n\tld.global.u32 %r14, [%rd1+56];\n\
         \tred.global.or.b32 [%rd5+{}], 2;\n\
         \tred.global.or.b32 [%rd5+{}], %r12;\n\
         \tred.global.min.s32 [%rd5+{}], %r12;\n\
         \tred.global.max.s32 [%rd5+{}], %r13;\n\
         \tred.global.add.u32 [%rd5+{}], 1;\n\
         \tred.global.add.u32 [%rd5+{}], %r14;\n\
         \tred.global.xor.b32 [%rd5+{}], %r14;\n\
         \tred.global.and.b32 [%rd5+{}], %r13;\n",
        4 * INT,
        4 * (INT + 8),
        4 * (INT + 16),
        4 * (INT + 24),
        4 * (INT + 32),
        4 * (INT + 40),
        4 * (INT + 48),
        4 * (INT + 56)
    ));
    for (j, op) in ATOMS.iter().enumerate() {
        let w = ATOM_INT + j * 128;
        let operands = if j == 9 { "%r15, %r16" } else { "%r15" };
        body.push_str(&format!(
            "\tld.global.u32 %r15, [%rd1+{}];\n\tld.global.u32 %r16, [%rd1+104];\n\
             \t{op} %r17, [%rd2+{}], {operands};\n\tst.global.u32 [%rd2+{}], %r17;\n",
            4 * (16 + j),
            4 * w,
            4 * (OLD + (j + 1) * 128)
        ));
    }
    let ptx = format!(
        "{HEADER}
.visible .entry red_atom(
	.param .u64 .ptr .align 16 init,
	.param .u64 .ptr .align 16 ops,
	.param .u64 .ptr .align 16 out
)
.maxntid 128, 1, 1
{{
	.reg .pred %p<4>;
	.reg .b32 %r<20>;
	.reg .f32 %f<8>;
	.reg .b64 %rd<12>;
	mov.u32 %r0, %tid.x;
	ld.param.u64 %rd0, [init];
	cvta.to.global.u64 %rd0, %rd0;
	ld.param.u64 %rd3, [out];
	cvta.to.global.u64 %rd3, %rd3;
	mov.u32 %r1, %r0;
$L_copy:
	mul.wide.u32 %rd6, %r1, 4;
	add.u64 %rd7, %rd0, %rd6;
	ld.global.u32 %r2, [%rd7];
	add.u64 %rd7, %rd3, %rd6;
	st.global.u32 [%rd7], %r2;
	add.u32 %r1, %r1, 128;
	setp.lt.u32 %p0, %r1, {WORDS};
	@%p0 bra $L_copy;
	bar.sync 0;
	ld.param.u64 %rd1, [ops];
	cvta.to.global.u64 %rd1, %rd1;
	mul.wide.u32 %rd6, %r0, {};
	add.u64 %rd1, %rd1, %rd6;
	mul.wide.u32 %rd6, %r0, 4;
	add.u64 %rd2, %rd3, %rd6;
	mul.wide.u32 %rd6, %r0, 16;
	add.u64 %rd4, %rd3, %rd6;
	createpolicy.fractional.L2::evict_last.L2::evict_unchanged.b64 %rd9, 0f3F800000;
{body}	ret;
}}
",
        OPS * 4
    );
    Scenario {
        name: "red/atom forms",
        ptx,
        kernel: "red_atom",
        grid: 1,
        threads: 128,
        dynamic_smem: 0,
        inputs: vec![bytes_of_u32(&init), bytes_of_u32(&ops)],
        outputs: vec![4 * WORDS],
        args: vec![ArgSpec::In(0), ArgSpec::In(1), ArgSpec::Out(0)],
    }
}
