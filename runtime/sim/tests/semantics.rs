//! Instruction semantics through tiny PTX kernels, checked against values worked out from the
//! PTX ISA (or CUDA's documented intrinsics) rather than against the simulator's own helpers.

use msa_sim::{Arg, Gpu, LaunchConfig, Module};

/// Runs `body` in a kernel where `%o0` points at this thread's `words` output words and `%o1`
/// at the input buffer; returns all output words (thread-linear order, CTAs in x-then-y order).
fn run_grid(
    body: &str,
    grid: (u32, u32),
    block: (u32, u32),
    words: usize,
    input: &[u32],
) -> Vec<u32> {
    let text = format!(
        r#".version 8.0
.target sm_90a
.address_size 64
.visible .entry t(
	.param .u64 .ptr .align 16 out,
	.param .u64 .ptr .align 16 in
)
{{
	.reg .pred %p<16>;
	.reg .b16 %h<16>;
	.reg .u32 %r<64>;
	.reg .s32 %s<16>;
	.reg .f32 %f<32>;
	.reg .u64 %rd<32>;
	.reg .b64 %bd<8>;
	.reg .u64 %o<4>;
	.reg .u32 %t<8>;
	.shared .align 16 .b8 sbuf[1024];
	ld.param.u64 %o2, [out];
	cvta.to.global.u64 %o2, %o2;
	ld.param.u64 %o1, [in];
	cvta.to.global.u64 %o1, %o1;
	mov.u32 %t0, %tid.x;
	mov.u32 %t1, %tid.y;
	mov.u32 %t2, %ntid.x;
	mad.lo.u32 %t3, %t1, %t2, %t0;
	mov.u32 %t4, %ctaid.y;
	mov.u32 %t5, %nctaid.x;
	mov.u32 %t6, %ctaid.x;
	mad.lo.u32 %t4, %t4, %t5, %t6;
	mov.u32 %t5, %ntid.y;
	mul.lo.u32 %t5, %t5, %t2;
	mad.lo.u32 %t3, %t4, %t5, %t3;
	mul.lo.u32 %t3, %t3, {bytes};
	cvt.u64.u32 %o3, %t3;
	add.u64 %o0, %o2, %o3;
{body}
	ret;
}}
"#,
        bytes = words * 4
    );
    let m = Module::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let threads = (grid.0 * grid.1 * block.0 * block.1) as usize;
    let mut gpu = Gpu::new();
    let out = gpu.upload("out", &vec![0xdead_beefu32; threads * words]);
    let inp = gpu.upload(
        "in",
        &if input.is_empty() {
            vec![0u32]
        } else {
            input.to_vec()
        },
    );
    let cfg = LaunchConfig::new((grid.0, grid.1, 1), (block.0, block.1, 1));
    gpu.launch(
        m.kernel("t").unwrap(),
        &cfg,
        &[Arg::Ptr(out), Arg::Ptr(inp)],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    gpu.read(out, threads * words).unwrap()
}

fn run(body: &str, threads: u32, words: usize) -> Vec<u32> {
    run_grid(body, (1, 1), (threads, 1), words, &[])
}

fn f(x: f32) -> u32 {
    x.to_bits()
}

// ---------------------------------------------------------------------------------------------
// shfl.sync
// ---------------------------------------------------------------------------------------------

/// One shuffle per mode/operands; writes the value and the predicate.
fn shfl(mode: &str, b: u32, c: u32) -> Vec<(u32, bool)> {
    let body = format!(
        "\tmov.u32 %r0, %laneid;\n\tmul.lo.u32 %r1, %r0, 100;\n\tshfl.sync.{mode}.b32 %r2|%p0, %r1, {b}, {c:#x}, 0xffffffff;\n\tselp.u32 %r3, 1, 0, %p0;\n\tst.global.v2.u32 [%o0], {{%r2, %r3}};"
    );
    run(&body, 32, 2)
        .chunks(2)
        .map(|v| (v[0], v[1] == 1))
        .collect()
}

/// CUDA's `__shfl_*_sync(v, x, width)` source lanes (CUDA Programming Guide), for
/// `c = ((32 - width) << 8) | clamp` with clamp 31 (0 for up).
fn cuda_src(mode: &str, lane: u32, x: u32, width: u32) -> (u32, bool) {
    let base = lane / width * width;
    match mode {
        "up" => {
            if lane - base >= x {
                (lane - x, true)
            } else {
                (lane, false)
            }
        }
        "down" => {
            if lane - base + x < width {
                (lane + x, true)
            } else {
                (lane, false)
            }
        }
        "bfly" => {
            let j = lane ^ x;
            if j < base + width {
                (j, true)
            } else {
                (lane, false)
            }
        }
        _ => (base + x % width, true),
    }
}

#[test]
fn shfl_matches_cuda_width_semantics() {
    for mode in ["up", "down", "bfly", "idx"] {
        for width in [32u32, 16, 8, 4, 2] {
            for x in [0u32, 1, 2, 3, 5, 7, 16] {
                let clamp = if mode == "up" { 0 } else { 31 };
                let c = ((32 - width) << 8) | clamp;
                let got = shfl(mode, x, c);
                for (lane, &(v, p)) in got.iter().enumerate() {
                    let lane = lane as u32;
                    let (src, ok) = cuda_src(mode, lane, x, width);
                    assert_eq!(
                        (v, p),
                        (src * 100, ok),
                        "shfl.{mode} x={x} width={width} lane {lane}"
                    );
                }
            }
        }
    }
}

#[test]
fn shfl_idx_clamp_without_segments() {
    // c = 3: lanes above 3 are out of range and read themselves.
    let got = shfl("idx", 5, 3);
    assert!(got
        .iter()
        .enumerate()
        .all(|(l, &(v, p))| v == l as u32 * 100 && !p));
    let got = shfl("idx", 2, 3);
    assert!(got.iter().all(|&(v, p)| v == 200 && p));
    // b[4:0] only: 37 is lane 5.
    let got = shfl("idx", 37, 0x1f);
    assert!(got.iter().all(|&(v, _)| v == 500));
}

#[test]
fn divergent_loops_reconverge_before_a_shuffle() {
    // Lane l runs l iterations of an inner loop and takes one of two branches; afterwards the
    // warp reconverges and shuffles.
    let body = r#"
	mov.u32 %r0, %laneid;
	mov.u32 %r1, 0;
	mov.u32 %r2, 0;
$L_0_loop:
	setp.ge.u32 %p0, %r1, %r0;
	@%p0 bra $L_1_done;
	add.u32 %r2, %r2, %r1;
	add.u32 %r1, %r1, 1;
	bra $L_0_loop;
$L_1_done:
	and.b32 %r3, %r0, 1;
	setp.eq.u32 %p1, %r3, 0;
	@%p1 bra $L_2_even;
	add.u32 %r2, %r2, 1000;
	bra $L_3_join;
$L_2_even:
	add.u32 %r2, %r2, 2000;
$L_3_join:
	shfl.sync.idx.b32 %r4, %r2, 31, 0x1f, 0xffffffff;
	st.global.v2.u32 [%o0], {%r2, %r4};
"#;
    let got = run(body, 64, 2);
    for t in 0..64u32 {
        let l = t % 32;
        let own = l * l.saturating_sub(1) / 2 + if l % 2 == 1 { 1000 } else { 2000 };
        assert_eq!(got[2 * t as usize], own, "thread {t}");
        assert_eq!(got[2 * t as usize + 1], 31 * 30 / 2 + 1000, "thread {t}");
    }
}

// ---------------------------------------------------------------------------------------------
// Bit manipulation and conversions
// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// stmatrix, bar.warp.sync
// ---------------------------------------------------------------------------------------------

/// `stmatrix.m8n8.x4`: lane `l` holds register `i` = `(i << 16) | l` and gives the row address
/// `16·((5l) mod 32)`; each lane then reads back the 16 bytes at `16·lane`. The PTX ISA's
/// layout: row `r` of matrix `i` goes to the address of lane `8i + r`, and word `k` of it is
/// register `i` of lane `4r + k`.
#[test]
fn stmatrix_x4_stores_rows_from_the_fragment_layout() {
    let body = "\tmov.u32 %r0, %laneid;\n\tor.b32 %r1, %r0, 0x0;\n\tor.b32 %r2, %r0, 0x10000;\n\
                \tor.b32 %r3, %r0, 0x20000;\n\tor.b32 %r4, %r0, 0x30000;\n\
                \tmul.lo.u32 %r5, %r0, 5;\n\tand.b32 %r5, %r5, 31;\n\tshl.b32 %r5, %r5, 4;\n\
                \tmov.u32 %r6, sbuf;\n\tadd.u32 %r6, %r6, %r5;\n\
                \tstmatrix.sync.aligned.m8n8.x4.shared.b16 [%r6], {%r1, %r2, %r3, %r4};\n\
                \tbar.warp.sync 0xffffffff;\n\
                \tshl.b32 %r7, %r0, 4;\n\tmov.u32 %r8, sbuf;\n\tadd.u32 %r8, %r8, %r7;\n\
                \tld.shared.v4.u32 {%r9, %r10, %r11, %r12}, [%r8];\n\
                \tst.global.v4.u32 [%o0], {%r9, %r10, %r11, %r12};";
    let out = run(body, 32, 4);
    for q in 0..32u32 {
        // The lane whose row address is slot q: 5l = q (mod 32), 5·13 = 1 (mod 32).
        let l = 13 * q % 32;
        let (i, r) = (l / 8, l % 8);
        for k in 0..4u32 {
            let want = (i << 16) | (4 * r + k);
            assert_eq!(out[(4 * q + k) as usize], want, "slot {q}, word {k}");
        }
    }
}

/// The error of kernel `t` of `text` launched as one warp, which must fail (`why` says why).
/// A one-warp kernel whose lanes from `first_skipping` on branch past `body`; `%r0` holds the
/// lane, `%f0` 0.0, and `sbuf` is 512 bytes of shared memory.
fn partial_warp_kernel(first_skipping: u32, body: &str) -> String {
    format!(
        r#".version 8.0
.target sm_90a
.address_size 64
.visible .entry t()
{{
	.reg .pred %p<2>;
	.reg .u32 %r<8>;
	.reg .f32 %f<8>;
	.shared .align 16 .b8 sbuf[512];
	mov.u32 %r0, %laneid;
	mov.f32 %f0, 0f00000000;
	setp.ge.u32 %p0, %r0, {first_skipping};
	@%p0 bra $L_end;
{body}
$L_end:
	ret;
}}
"#
    )
}

fn one_warp_error(text: &str, why: &str) -> String {
    let m = Module::parse(text).unwrap_or_else(|e| panic!("{e}"));
    let mut gpu = Gpu::new();
    let cfg = LaunchConfig::new((1, 1, 1), (32, 1, 1));
    gpu.launch(m.kernel("t").unwrap(), &cfg, &[])
        .expect_err(why)
        .to_string()
}

/// `redux.sync.min.u32`: every lane of the warp gets the least of the lanes' values (per the
/// PTX ISA), here `(37 − lane) mod 32 + 3` per lane, whose least is 3; each warp of two reduces
/// on its own (warp 1's values are 100 larger).
#[test]
fn redux_min_gives_each_lane_the_warps_least_value() {
    let body = r#"	mov.u32 %r0, %laneid;
	mov.u32 %r5, %tid.x;
	shr.u32 %r5, %r5, 5;
	mul.lo.u32 %r5, %r5, 100;
	sub.u32 %r1, 37, %r0;
	rem.u32 %r1, %r1, 32;
	add.u32 %r1, %r1, 3;
	add.u32 %r1, %r1, %r5;
	redux.sync.min.u32 %r2, %r1, 0xffffffff;
	st.global.u32 [%o0], %r2;"#;
    let out = run(body, 64, 1);
    assert_eq!(&out[..32], &[3; 32]);
    assert_eq!(&out[32..], &[103; 32]);
}

/// A `redux.sync` that part of the warp skips is reported, not reduced over the lanes that came.
#[test]
fn redux_in_a_partial_warp_is_reported() {
    let text = partial_warp_kernel(16, "\tredux.sync.min.u32 %r1, %r0, 0xffffffff;");
    let e = one_warp_error(&text, "half a warp executed redux.sync");
    assert!(e.contains("redux.sync"), "{e}");
}

/// A `stmatrix` that part of the warp skips is an error, not a partial store.
#[test]
fn stmatrix_in_a_partial_warp_is_reported() {
    let text = partial_warp_kernel(
        16,
        r#"	shl.b32 %r1, %r0, 4;
	mov.u32 %r2, sbuf;
	add.u32 %r2, %r2, %r1;
	stmatrix.sync.aligned.m8n8.x4.shared.b16 [%r2], {%r0, %r0, %r0, %r0};"#,
    );
    let e = one_warp_error(&text, "half a warp executed stmatrix");
    assert!(e.contains("stmatrix") && e.contains("lane 16"), "{e}");
}

/// `mma.m16n8k16.row.col.f32.bf16.bf16.f32`: each lane loads its fragment words, laid out
/// here from the PTX ISA's tables (9.7.14.5.8) rather than from the simulator, and stores its
/// four results; the product is checked against a plain matrix product. The entries are small
/// integers, so every sum is exact.
#[test]
fn mma_m16n8k16_follows_the_isa_fragment_layout() {
    let a = |row: u32, k: u32| row as f32 - k as f32 + 0.5 * (k % 3) as f32;
    let b = |k: u32, col: u32| k as f32 + 2.0 * col as f32 - 8.0;
    let c = |row: u32, col: u32| (row * 8 + col) as f32;
    let pair = |lo: f32, hi: f32| {
        let h = |x: f32| half::bf16::from_f32(x).to_bits() as u32;
        h(lo) | h(hi) << 16
    };
    // Per lane: a0..a3; b0, b1 and two words of padding; c0..c3 (48 bytes).
    let mut input = Vec::new();
    for lane in 0..32u32 {
        let (g, t) = (lane / 4, lane % 4);
        for (row, k) in [
            (g, 2 * t),
            (g + 8, 2 * t),
            (g, 2 * t + 8),
            (g + 8, 2 * t + 8),
        ] {
            input.push(pair(a(row, k), a(row, k + 1)));
        }
        for k in [2 * t, 2 * t + 8] {
            input.push(pair(b(k, g), b(k + 1, g)));
        }
        input.extend([0, 0]);
        for (row, col) in [
            (g, 2 * t),
            (g, 2 * t + 1),
            (g + 8, 2 * t),
            (g + 8, 2 * t + 1),
        ] {
            input.push(c(row, col).to_bits());
        }
    }
    let body = r#"
	mov.u32 %r0, %laneid;
	mul.lo.u32 %r0, %r0, 48;
	cvt.u64.u32 %rd0, %r0;
	add.u64 %rd0, %o1, %rd0;
	ld.global.v4.u32 {%r1, %r2, %r3, %r4}, [%rd0];
	ld.global.v2.u32 {%r5, %r6}, [%rd0+16];
	ld.global.v4.f32 {%f0, %f1, %f2, %f3}, [%rd0+32];
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f4, %f5, %f6, %f7}, {%r1, %r2, %r3, %r4}, {%r5, %r6}, {%f0, %f1, %f2, %f3};
	st.global.v4.f32 [%o0], {%f4, %f5, %f6, %f7};
"#;
    let out = run_grid(body, (1, 1), (32, 1), 4, &input);
    for lane in 0..32u32 {
        let (g, t) = (lane / 4, lane % 4);
        for (i, (row, col)) in [
            (g, 2 * t),
            (g, 2 * t + 1),
            (g + 8, 2 * t),
            (g + 8, 2 * t + 1),
        ]
        .into_iter()
        .enumerate()
        {
            let want: f32 = (0..16).map(|k| a(row, k) * b(k, col)).sum::<f32>() + c(row, col);
            let got = f32::from_bits(out[(4 * lane) as usize + i]);
            assert_eq!(got, want, "lane {lane} D[{row}][{col}]");
        }
    }
}

/// An `mma.sync` that part of the warp skips is an error, not a partial product.
#[test]
fn mma_in_a_partial_warp_is_reported() {
    let text = partial_warp_kernel(
        8,
        "\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1, %f2, %f3, %f4}, {%r0, %r0, %r0, %r0}, {%r0, %r0}, {%f0, %f0, %f0, %f0};",
    );
    let e = one_warp_error(&text, "a quarter of a warp executed mma.sync");
    assert!(e.contains("mma.sync") && e.contains("lane 8"), "{e}");
}

#[test]
fn prmt_default_mode() {
    let body = r#"
	mov.u32 %r0, 0x44332211;
	mov.u32 %r1, 0x88776655;
	prmt.b32 %r2, %r0, %r1, 0x5410;
	prmt.b32 %r3, %r0, %r1, 0x7632;
	prmt.b32 %r4, %r0, %r1, 0xF8F8;
	prmt.b32 %r5, %r0, %r1, 0x0123;
	st.global.v4.u32 [%o0], {%r2, %r3, %r4, %r5};
"#;
    assert_eq!(
        run(body, 1, 4),
        [0x6655_2211, 0x8877_4433, 0xff00_ff00, 0x1122_3344]
    );
}

#[test]
fn bf16_packing_rounds_to_nearest_even_with_the_first_operand_high() {
    let body = r#"
	mov.f32 %f0, 0f3F808000;
	mov.f32 %f1, 0f3F818000;
	mov.f32 %f2, 0f3F808001;
	mov.f32 %f3, 0f7F7F8000;
	mov.f32 %f4, 0f00408000;
	mov.f32 %f5, 0f7FC12345;
	cvt.rn.bf16x2.f32 %r0, %f0, %f1;
	cvt.rn.bf16x2.f32 %r1, %f2, %f3;
	cvt.rn.bf16x2.f32 %r2, %f4, %f5;
	cvt.rn.bf16.f32 %h0, %f1;
	cvt.u32.u16 %r3, %h0;
	st.global.v4.u32 [%o0], {%r0, %r1, %r2, %r3};
"#;
    // 1+2^-8 ties to 1.0 (even); 1+3·2^-8 ties up to 1+2^-6; above-tie rounds up; the top tie
    // overflows to +inf; a subnormal tie rounds to even; NaN becomes the canonical 0x7fff.
    assert_eq!(
        run(body, 1, 4),
        [0x3f80_3f82, 0x3f81_7f80, 0x0040_7fff, 0x3f82]
    );
}

#[test]
fn cvt_between_integers_and_floats() {
    let body = r#"
	mov.f32 %f0, 0fC02CCCCD;
	cvt.rzi.s32.f32 %s0, %f0;
	mov.f32 %f1, 0f40200000;
	cvt.rni.s32.f32 %s1, %f1;
	mov.f32 %f2, 0fC0200000;
	cvt.rmi.s32.f32 %s2, %f2;
	mov.f32 %f3, 0fBF800000;
	cvt.rzi.u32.f32 %r0, %f3;
	mov.f32 %f4, 0f7FC00000;
	cvt.rzi.s32.f32 %s3, %f4;
	mov.f32 %f5, 0f5F000000;
	cvt.rzi.s32.f32 %s4, %f5;
	st.global.v4.u32 [%o0], {%s0, %s1, %s2, %r0};
	st.global.v2.u32 [%o0+16], {%s3, %s4};
	mov.u32 %r1, 4294967295;
	cvt.rn.f32.u32 %f6, %r1;
	mov.s32 %s5, -3;
	cvt.rn.f32.s32 %f7, %s5;
	mov.u32 %r2, 16777217;
	cvt.rn.f32.u32 %f8, %r2;
	mov.b32 %r3, 0x3fc0;
	cvt.u16.u32 %h1, %r3;
	cvt.f32.bf16 %f9, %h1;
	st.global.v4.f32 [%o0+32], {%f6, %f7, %f8, %f9};
	cvt.s64.s32 %rd0, %s5;
	cvt.u64.u32 %rd1, %r1;
	st.global.v2.u64 [%o0+48], {%rd0, %rd1};
	cvt.u32.u64 %r4, %rd0;
	mov.u32 %r5, 0x1ff;
	cvt.u8.u32 %h2, %r5;
	cvt.u32.u8 %r6, %h2;
	cvt.s32.s8 %s6, %r5;
	st.global.v4.u32 [%o0+64], {%r4, %r6, %s6, %r5};
"#;
    let got = run(body, 1, 20);
    assert_eq!(
        got[..6],
        [(-2i32) as u32, 2, (-3i32) as u32, 0, 0, i32::MAX as u32]
    );
    assert_eq!(
        got[8..12],
        [f(4294967296.0), f(-3.0), f(16777216.0), f(1.5)]
    );
    assert_eq!(got[12..16], [0xffff_fffd, u32::MAX, u32::MAX, 0]);
    assert_eq!(got[16..20], [0xffff_fffd, 0xff, u32::MAX, 0x1ff]);
}

#[test]
fn integer_arithmetic_edge_cases() {
    let body = r#"
	mov.s32 %s0, -7;
	div.s32 %s1, %s0, 2;
	rem.s32 %s2, %s0, 2;
	shr.s32 %s3, %s0, 1;
	shr.s32 %s4, %s0, 40;
	st.global.v4.u32 [%o0], {%s1, %s2, %s3, %s4};
	mov.u32 %r0, 0x80000001;
	shr.u32 %r1, %r0, 31;
	shl.b32 %r2, %r0, 40;
	mul.hi.u32 %r3, %r0, 4;
	mul.hi.s32 %s5, %s0, 0x40000000;
	st.global.v4.u32 [%o0+16], {%r1, %r2, %r3, %s5};
	mul.wide.s32 %rd0, %s0, 3;
	mul.wide.u32 %rd1, %r0, 4;
	mad.wide.u32 %rd2, %r0, 2, %rd1;
	mad.lo.u32 %r4, %r0, 3, 5;
	st.global.v2.u64 [%o0+32], {%rd0, %rd1};
	st.global.u64 [%o0+48], %rd2;
	min.s32 %s6, %s0, 1;
	min.u32 %r5, %s0, 1;
	max.s32 %s7, %s0, 1;
	max.u32 %r6, %s0, 1;
	st.global.v4.u32 [%o0+64], {%s6, %r5, %s7, %r6};
	setp.lt.s32 %p0, %s0, 1;
	setp.lt.u32 %p1, %s0, 1;
	setp.hi.u32 %p2, %s0, 1;
	setp.ge.s32 %p3, %s0, -7;
	selp.u32 %r7, 1, 0, %p0;
	selp.u32 %r8, 1, 0, %p1;
	selp.u32 %r9, 1, 0, %p2;
	selp.u32 %r10, 1, 0, %p3;
	st.global.v4.u32 [%o0+80], {%r7, %r8, %r9, %r10};
	and.pred %p4, %p0, %p1;
	or.pred %p5, %p0, %p1;
	xor.pred %p6, %p0, %p3;
	not.pred %p7, %p1;
	selp.u32 %r11, 1, 0, %p4;
	selp.u32 %r12, 1, 0, %p5;
	selp.u32 %r13, 1, 0, %p6;
	selp.u32 %r14, 1, 0, %p7;
	st.global.v4.u32 [%o0+96], {%r11, %r12, %r13, %r14};
	st.global.u32 [%o0+112], %r4;
"#;
    let got = run(body, 1, 32);
    let i = |v: i32| v as u32;
    assert_eq!(got[..4], [i(-3), i(-1), i(-4), i(-1)]);
    assert_eq!(got[4..8], [1, 0, 2, i(-2)]);
    let u64s = |k: usize| (got[k] as u64) | (got[k + 1] as u64) << 32;
    assert_eq!(u64s(8), (-21i64) as u64);
    assert_eq!(u64s(10), 0x8000_0001u64 * 4);
    assert_eq!(u64s(12), 0x8000_0001u64 * 6);
    assert_eq!(got[16..20], [i(-7), 1, 1, i(-7)]);
    assert_eq!(got[20..24], [1, 0, 1, 1]);
    assert_eq!(got[24..28], [0, 1, 0, 1]);
    assert_eq!(got[28], 0x8000_0001u32.wrapping_mul(3) + 5);
}

// ---------------------------------------------------------------------------------------------
// f32
// ---------------------------------------------------------------------------------------------

#[test]
fn float_compare_min_max_and_ftz() {
    let body = r#"
	mov.f32 %f0, 0f7FC00000;
	mov.f32 %f1, 0f3F800000;
	setp.eq.f32 %p0, %f0, %f0;
	setp.ne.f32 %p1, %f0, %f1;
	setp.neu.f32 %p2, %f0, %f1;
	setp.nan.f32 %p3, %f0, %f1;
	selp.u32 %r0, 1, 0, %p0;
	selp.u32 %r1, 1, 0, %p1;
	selp.u32 %r2, 1, 0, %p2;
	selp.u32 %r3, 1, 0, %p3;
	st.global.v4.u32 [%o0], {%r0, %r1, %r2, %r3};
	min.f32 %f2, %f0, %f1;
	mov.f32 %f3, 0f80000000;
	mov.f32 %f4, 0f00000000;
	min.f32 %f5, %f4, %f3;
	max.f32 %f6, %f3, %f4;
	mov.f32 %f7, 0f00000001;
	add.f32 %f8, %f7, %f7;
	add.ftz.f32 %f9, %f7, %f7;
	sub.f32 %f10, %f1, %f1;
	st.global.v4.f32 [%o0+16], {%f2, %f5, %f6, %f8};
	st.global.v2.f32 [%o0+32], {%f9, %f10};
	mov.f32 %f11, 0f7F800000;
	sub.f32 %f12, %f11, %f11;
	mov.b32 %r4, %f12;
	st.global.u32 [%o0+40], %r4;
"#;
    let got = run(body, 1, 11);
    assert_eq!(got[..4], [0, 0, 1, 1]);
    assert_eq!(got[4..8], [f(1.0), 0x8000_0000, 0, 2]);
    assert_eq!(got[8..10], [0, 0]);
    assert_eq!(got[10], 0x7fff_ffff, "inf - inf is the canonical NaN");
}

#[test]
fn fma_rounds_once_and_ex2_is_close() {
    // a = 1 + 2^-12: a·a = 1 + 2^-11 + 2^-24 exactly; rounding the product first (a tie,
    // to even) loses the 2^-24 that the fused operation keeps.
    let body = r#"
	mov.f32 %f0, 0f3F800800;
	mov.f32 %f1, 0fBF801000;
	fma.rn.f32 %f2, %f0, %f0, %f1;
	mul.rn.f32 %f3, %f0, %f0;
	add.f32 %f4, %f3, %f1;
	mov.f32 %f5, 0f3F800000;
	ex2.approx.ftz.f32 %f6, %f5;
	mov.f32 %f7, 0fC2FD0000;
	ex2.approx.ftz.f32 %f8, %f7;
	ex2.approx.f32 %f9, %f7;
	mov.f32 %f10, 0f3F000000;
	ex2.approx.ftz.f32 %f11, %f10;
	st.global.v4.f32 [%o0], {%f2, %f4, %f6, %f8};
	st.global.v2.f32 [%o0+16], {%f9, %f11};
"#;
    let got = run(body, 1, 6);
    assert_eq!(got[0], f(2f32.powi(-24)));
    assert_eq!(got[1], 0, "unfused: the product rounds to 1 + 2^-11");
    assert_eq!(got[2], f(2.0));
    assert_eq!(got[3], 0, "2^-126.5 is subnormal: flushed");
    assert_eq!(got[4], f(2f32.powf(-126.5)));
    assert!((f32::from_bits(got[5]) - std::f32::consts::SQRT_2).abs() <= 2.0 * f32::EPSILON);
}

// ---------------------------------------------------------------------------------------------
// Atomics and reductions
// ---------------------------------------------------------------------------------------------

#[test]
fn atomics_return_old_values_in_lane_order() {
    let body = r#"
	mov.u32 %r0, %laneid;
	atom.global.add.u32 %r1, [%o1], 3;
	mov.u32 %r2, sbuf;
	atom.shared.exch.b32 %r3, [%r2], %r0;
	atom.shared.cas.b32 %r4, [%r2+4], 0, 7;
	atom.global.max.s32 %s0, [%o1+4], %r0;
	red.global.min.s32 [%o1+8], %r0;
	bar.sync 0;
	ld.shared.u32 %r5, [%r2];
	ld.global.u32 %r6, [%o1];
	ld.global.u32 %r7, [%o1+8];
	st.global.v4.u32 [%o0], {%r1, %r3, %r4, %r5};
	st.global.v2.u32 [%o0+16], {%s0, %r6};
	st.global.u32 [%o0+24], %r7;
"#;
    let got = run_grid(body, (1, 1), (32, 1), 8, &[10, (-5i32) as u32, 100]);
    for l in 0..32u32 {
        let r = &got[8 * l as usize..][..6];
        assert_eq!(r[0], 10 + 3 * l, "add returns the running value");
        assert_eq!(r[1], if l == 0 { 0 } else { l - 1 }, "exch");
        assert_eq!(r[2], if l == 0 { 0 } else { 7 }, "cas");
        assert_eq!(r[3], 31, "last exchange");
        assert_eq!(r[4], if l == 0 { (-5i32) as u32 } else { l - 1 }, "max");
        assert_eq!(r[5], 10 + 3 * 32, "final sum");
        assert_eq!(got[8 * l as usize + 6], 0, "min of 0..32 and 100");
    }
}

#[test]
fn float_reductions() {
    // Subnormals flush in red.add.f32; bf16x2 lanes round to nearest even separately; the
    // L2 cache-policy operand is accepted and ignored.
    let body = r#"
	mov.f32 %f0, 0f00000001;
	red.global.add.f32 [%o1], %f0;
	mov.f32 %f1, 0f3F800000;
	mov.f32 %f2, 0f40000000;
	createpolicy.fractional.L2::evict_last.L2::evict_unchanged.b64 %bd0, 0f3F800000;
	red.global.add.L2::cache_hint.v4.f32 [%o1+16], {%f1, %f2, %f1, %f2}, %bd0;
	mov.b32 %r1, 0x3bc03b80;
	red.global.add.noftz.L2::cache_hint.bf16x2 [%o1+32], %r1, %bd0;
	red.global.add.noftz.bf16x2 [%o1+36], %r1;
	ld.global.v4.u32 {%r2, %r3, %r4, %r5}, [%o1+16];
	ld.global.v2.u32 {%r6, %r7}, [%o1+32];
	ld.global.u32 %r8, [%o1];
	st.global.v4.u32 [%o0], {%r2, %r3, %r4, %r5};
	st.global.v2.u32 [%o0+16], {%r6, %r7};
	st.global.u32 [%o0+24], %r8;
"#;
    let input = [
        f(1e-39),
        0,
        0,
        0,
        f(1.0),
        f(2.0),
        f(3.0),
        f(4.0),
        0x3f80_3f80, // (1.0, 1.0)
        0xc000_4000, // (-2.0, 2.0)
    ];
    let got = run_grid(body, (1, 1), (1, 1), 7, &input);
    assert_eq!(got[..4], [f(2.0), f(4.0), f(4.0), f(6.0)]);
    // low: 1.0 + 2^-8 ties to 1.0; high: 1.0 + 1.5·2^-8 rounds up to 1 + 2^-7.
    assert_eq!(got[4], 0x3f81_3f80);
    // high: -2 + 1.5·2^-8 = -1.994140625 rounds to -1.9921875 (0xbfff); low: 2 + 2^-8 is
    // below half an ulp (2^-7) above 2: stays 2.0.
    assert_eq!(got[5], 0xbfff_4000);
    assert_eq!(got[6], 0, "1e-39 + 1e-45: both subnormal, flushed");
}

#[test]
fn vector_bf16x2_reductions() {
    // sm_90's red.global.add.noftz.v2/.v4.bf16x2: each packed word adds into its own word,
    // lane-wise (the backward's dQ reductions).
    let body = r#"
	mov.b32 %r1, 0x3f803f80;
	mov.b32 %r2, 0x40004000;
	createpolicy.fractional.L2::evict_last.L2::evict_unchanged.b64 %bd0, 0f3F800000;
	red.global.add.noftz.L2::cache_hint.v2.bf16x2 [%o1], {%r1, %r2}, %bd0;
	red.global.add.noftz.v4.bf16x2 [%o1+16], {%r2, %r1, %r2, %r1};
	ld.global.v2.u32 {%r3, %r4}, [%o1];
	ld.global.v4.u32 {%r5, %r6, %r7, %r8}, [%o1+16];
	st.global.v2.u32 [%o0], {%r3, %r4};
	st.global.v4.u32 [%o0+16], {%r5, %r6, %r7, %r8};
"#;
    let input = [
        0x3f80_3f80, // (1, 1)
        0xc000_4000, // (-2, 2)
        0,
        0,
        0x3f80_3f80,
        0x3f80_3f80,
        0xc000_4000,
        0,
    ];
    let got = run_grid(body, (1, 1), (1, 1), 8, &input);
    // (1,1)+(1,1) = (2,2); (-2,2)+(2,2) = (0,4).
    assert_eq!(got[..2], [0x4000_4000, 0x0000_4080]);
    // (1,1)+(2,2) = (3,3); (1,1)+(1,1); (-2,2)+(2,2); (0,0)+(1,1).
    assert_eq!(
        got[4..8],
        [0x4040_4040, 0x4000_4000, 0x0000_4080, 0x3f80_3f80]
    );
}

// ---------------------------------------------------------------------------------------------
// Barriers, memory forms, special registers
// ---------------------------------------------------------------------------------------------

#[test]
fn named_barriers_order_producer_and_consumer() {
    // Warp 0 waits on barrier 1 first; warp 1 then fills shared memory and arrives. The
    // barrier id comes from a register, as in the main kernel.
    let body = r#"
	mov.u32 %r0, %tid.x;
	mov.u32 %r1, sbuf;
	shl.b32 %r2, %r0, 2;
	add.u32 %r3, %r1, %r2;
	mov.u32 %r4, 1;
	setp.lt.u32 %p0, %r0, 32;
	@%p0 bra $L_0_consumer;
	st.shared.u32 [%r3+-128], %r0;
	bar.arrive %r4, 64;
	bra $L_1_end;
$L_0_consumer:
	bar.sync %r4, 64;
	ld.shared.u32 %r5, [%r3];
	st.global.u32 [%o0], %r5;
$L_1_end:
	bar.sync 0;
"#;
    let got = run(body, 64, 1);
    assert_eq!(got[..32], (32..64).collect::<Vec<u32>>()[..]);
    assert!(got[32..].iter().all(|&v| v == 0xdead_beef));
}

#[test]
fn barrier_zero_counts_exited_warps_as_arrived() {
    let body = r#"
	mov.u32 %r0, %tid.x;
	setp.ge.u32 %p0, %r0, 32;
	@%p0 ret;
	bar.sync 0;
	st.global.u32 [%o0], %r0;
"#;
    let got = run(body, 96, 1);
    assert_eq!(got[..32], (0..32).collect::<Vec<u32>>()[..]);
}

#[test]
fn vector_and_subword_memory_forms() {
    let body = r#"
	ld.global.v2.u64 {%rd0, %rd1}, [%o1];
	ld.global.s8 %s0, [%o1+3];
	ld.global.u8 %r0, [%o1+3];
	ld.global.u16 %h0, [%o1+2];
	cvt.u32.u16 %r1, %h0;
	ld.global.s16 %s1, [%o1+2];
	st.global.v2.u64 [%o0], {%rd1, %rd0};
	st.global.v4.u32 [%o0+16], {%s0, %r0, %r1, %s1};
	mov.b64 {%r2, %r3}, %rd0;
	mov.b64 %rd2, {%r3, %r2};
	mov.b32 {%h1, %h2}, %r2;
	mov.b32 %r4, {%h2, %h1};
	st.global.u64 [%o0+32], %rd2;
	st.global.u32 [%o0+40], %r4;
	mov.u32 %r5, sbuf;
	cvta.shared.u64 %rd3, %rd1;
	cvt.u64.u32 %rd4, %r5;
	cvta.shared.u64 %rd5, %rd4;
	st.u32 [%rd5+8], %r4;
	ld.shared.u32 %r6, [%r5+8];
	cvta.to.shared.u64 %rd6, %rd5;
	st.global.u32 [%o0+44], %r6;
	st.u64 [%o0+48], %rd6;
"#;
    let input = [0x8877_6655, 0x1122_3344, 0xaabb_ccdd, 0x0102_0304];
    let got = run_grid(body, (1, 1), (1, 1), 14, &input);
    assert_eq!(
        got[..4],
        [0xaabb_ccdd, 0x0102_0304, 0x8877_6655, 0x1122_3344]
    );
    assert_eq!(got[4..8], [0xffff_ff88, 0x88, 0x8877, 0xffff_8877]);
    assert_eq!(got[8..10], [0x1122_3344, 0x8877_6655]);
    assert_eq!(got[10], 0x6655_8877);
    assert_eq!(got[11], 0x6655_8877);
    assert_eq!(
        got[12..14],
        [0, 0],
        "cvta.to.shared gives back the shared offset 0"
    );
}

#[test]
fn special_registers_in_a_2d_launch() {
    let body = r#"
	mov.u32 %r0, %tid.x;
	mov.u32 %r1, %tid.y;
	mov.u32 %r2, %ctaid.x;
	mov.u32 %r3, %ctaid.y;
	mov.u32 %r4, %nctaid.x;
	mov.u32 %r5, %nctaid.y;
	mov.u32 %r6, %laneid;
	mov.u32 %r7, %warpid;
	st.global.v4.u32 [%o0], {%r0, %r1, %r2, %r3};
	st.global.v4.u32 [%o0+16], {%r4, %r5, %r6, %r7};
"#;
    let got = run_grid(body, (2, 3), (24, 2), 8, &[]);
    let mut i = 0;
    for cy in 0..3u32 {
        for cx in 0..2u32 {
            for ty in 0..2u32 {
                for tx in 0..24u32 {
                    let lin = ty * 24 + tx;
                    assert_eq!(
                        got[i..i + 8],
                        [tx, ty, cx, cy, 2, 3, lin % 32, lin / 32],
                        "cta ({cx},{cy}) thread ({tx},{ty})"
                    );
                    i += 8;
                }
            }
        }
    }
}

#[test]
fn byte_array_params_and_param_addresses() {
    let text = r#".version 8.0
.target sm_90a
.address_size 64
.visible .entry p(
	.param .u32 n,
	.param .align 64 .b8 blob[128],
	.param .u64 .ptr .align 16 out,
	.param .s32 neg
)
{
	.reg .u32 %r<4>;
	.reg .s32 %s<1>;
	.reg .u64 %rd<4>;
	ld.param.u32 %r0, [n];
	ld.param.u32 %r1, [blob+124];
	mov.u64 %rd0, blob;
	ld.param.u32 %r2, [%rd0+4];
	ld.param.s32 %s0, [neg];
	ld.param.u64 %rd1, [out];
	st.global.v4.u32 [%rd1], {%r0, %r1, %r2, %s0};
	ret;
}
"#;
    let m = Module::parse(text).unwrap();
    let k = m.kernel("p").unwrap();
    let offsets: Vec<(u32, u32)> = k.params().iter().map(|p| (p.offset, p.size)).collect();
    assert_eq!(offsets, [(0, 4), (64, 128), (192, 8), (200, 4)]);
    let mut gpu = Gpu::new();
    let out = gpu.alloc("out", 16);
    let blob: Vec<u8> = (0..128u8).collect();
    gpu.launch(
        k,
        &LaunchConfig::new((1, 1, 1), (1, 1, 1)),
        &[Arg::U32(7), Arg::Bytes(blob), Arg::Ptr(out), Arg::I32(-9)],
    )
    .unwrap();
    assert_eq!(
        gpu.read::<u32>(out, 4).unwrap(),
        [7, 0x7f7e_7d7c, 0x0706_0504, (-9i32) as u32]
    );
}
