//! The tcgen05 / TMEM model on a micro-kernel: SS and TS `tcgen05.mma` (M = 128, N = 16,
//! bf16 → f32) with `enable_input_d`, `tcgen05.commit` → mbarrier, `tcgen05.st`/`ld`
//! `.32x32b` per warp quadrant, alloc / dealloc; results against a host matmul (small
//! integers, so exact). Then planted misuses, each of which must be reported.

use half::bf16;
use msa_sim::{Arg, FaultKind, Gpu, LaunchConfig, Module, SimError};

/// Shared image: A (128 × 16, K-major SW128, 8-row groups 1024 B apart) at 0, B (16 × 16,
/// same layout) at 16384; the mbarrier at 18432, the TMEM address slot at 18440.
const IMG_BYTES: usize = 18432;

const KERNEL: &str = r#"
.version 8.7
.target sm_100a
.address_size 64
.visible .entry umma(
	.param .u64 .ptr .align 16 img,
	.param .u64 .ptr .align 16 a2,
	.param .u64 .ptr .align 16 out
)
.reqntid 128, 1, 1
{
	.reg .pred %p<4>;
	.reg .b32 %r<40>;
	.reg .b64 %rd<12>;
	.reg .f32 %f<32>;
	.shared .align 1024 .b8 smem[18448];
	mov.u32 %r0, %tid.x;
	shr.u32 %r1, %r0, 5;
	mov.u32 %r2, smem;
	ld.param.u64 %rd0, [img];
	cvta.to.global.u64 %rd1, %rd0;
	// copy the shared image, one word per thread per step
	mov.u32 %r3, %r0;
$copy:
	setp.ge.u32 %p0, %r3, 4608;
	@%p0 bra $copied;
	mul.wide.u32 %rd2, %r3, 4;
	add.u64 %rd3, %rd1, %rd2;
	ld.global.u32 %r4, [%rd3];
	shl.b32 %r5, %r3, 2;
	add.u32 %r6, %r2, %r5;
	st.shared.u32 [%r6], %r4;
	add.u32 %r3, %r3, 128;
	bra $copy;
$copied:
	fence.proxy.async.shared::cta;
	setp.eq.u32 %p1, %r0, 0;
	@!%p1 bra $no_init;
	mbarrier.init.shared::cta.b64 [%r2+18432], 1;
	fence.mbarrier_init.release.cluster;
$no_init:
	setp.eq.u32 %p2, %r1, 0;
	@!%p2 bra $no_alloc;
	tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r2+18440], 64; // alloc
	tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;
$no_alloc:
	tcgen05.fence::before_thread_sync;
	bar.sync 0;
	tcgen05.fence::after_thread_sync;
	ld.shared.u32 %r7, [%r2+18440];
	// this warp's quadrant: lanes 32*warp..
	shl.b32 %r8, %r1, 21;
	add.u32 %r9, %r7, %r8; // quadrant
	// TS A operand: row 32*warp+lane, 8 packed words from a2[row*8..]
	ld.param.u64 %rd4, [a2];
	cvta.to.global.u64 %rd5, %rd4;
	mul.wide.u32 %rd6, %r0, 32;
	add.u64 %rd7, %rd5, %rd6;
	ld.global.v4.u32 {%r10, %r11, %r12, %r13}, [%rd7];
	ld.global.v4.u32 {%r14, %r15, %r16, %r17}, [%rd7+16];
	tcgen05.st.sync.aligned.32x32b.x8.b32 [%r9+32], {%r10, %r11, %r12, %r13, %r14, %r15, %r16, %r17};
	tcgen05.wait::st.sync.aligned;
	tcgen05.fence::before_thread_sync;
	bar.sync 0;
	tcgen05.fence::after_thread_sync;
	@!%p2 bra $no_mma;
	elect.sync _|%p3, 0xffffffff;
	// A at 0, B at 16384: (addr >> 4) | LBO 16 B; SBO 1024 B, version bit 46, 128B swizzle
	shr.u32 %r18, %r2, 4;
	or.b32 %r19, %r18, 65536;
	mov.b64 %rd8, {%r19, 1073758272};
	add.u32 %r20, %r2, 16384;
	shr.u32 %r21, %r20, 4;
	or.b32 %r22, %r21, 65536;
	mov.b64 %rd9, {%r22, 1073758272};
	// D = A·B, then D += A·B (M 128, N 16, bf16, f32, K-major)
	@%p3 tcgen05.mma.cta_group::1.kind::f16 [%r7], %rd8, %rd9, 0x8040490, 0;
	@%p3 tcgen05.mma.cta_group::1.kind::f16 [%r7], %rd8, %rd9, 0x8040490, 1;
	// TS: D2 = A2·B with A2 from TMEM columns 32..40
	@%p3 tcgen05.mma.cta_group::1.kind::f16 [%r7+16], [%r7+32], %rd9, 0x8040490, 0;
	@%p3 tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%r2+18432];
$no_mma:
$wait:
	mbarrier.try_wait.parity.shared::cta.b64 %p0, [%r2+18432], 0;
	@!%p0 bra $wait;
	tcgen05.fence::after_thread_sync;
	tcgen05.ld.sync.aligned.32x32b.x32.b32 {%f0, %f1, %f2, %f3, %f4, %f5, %f6, %f7, %f8, %f9, %f10, %f11, %f12, %f13, %f14, %f15, %f16, %f17, %f18, %f19, %f20, %f21, %f22, %f23, %f24, %f25, %f26, %f27, %f28, %f29, %f30, %f31}, [%r9];
	tcgen05.wait::ld.sync.aligned;
	ld.param.u64 %rd4, [out];
	cvta.to.global.u64 %rd5, %rd4;
	mul.wide.u32 %rd6, %r0, 128;
	add.u64 %rd7, %rd5, %rd6;
	st.global.v4.f32 [%rd7], {%f0, %f1, %f2, %f3};
	st.global.v4.f32 [%rd7+16], {%f4, %f5, %f6, %f7};
	st.global.v4.f32 [%rd7+32], {%f8, %f9, %f10, %f11};
	st.global.v4.f32 [%rd7+48], {%f12, %f13, %f14, %f15};
	st.global.v4.f32 [%rd7+64], {%f16, %f17, %f18, %f19};
	st.global.v4.f32 [%rd7+80], {%f20, %f21, %f22, %f23};
	st.global.v4.f32 [%rd7+96], {%f24, %f25, %f26, %f27};
	st.global.v4.f32 [%rd7+112], {%f28, %f29, %f30, %f31};
	tcgen05.fence::before_thread_sync;
	bar.sync 0;
	@!%p2 bra $done;
	tcgen05.fence::after_thread_sync;
	tcgen05.dealloc.cta_group::1.sync.aligned.b32 %r7, 64; // dealloc
$done:
	ret;
}
"#;

/// Byte offset of 16-bit element (row, k) of a K-major SW128 operand at shared `start`.
fn kmajor(start: usize, row: usize, k: usize) -> usize {
    let a = start + (row % 8) * 128 + (row / 8) * 1024 + 2 * k;
    a ^ (((a >> 7) & 7) << 4)
}

struct Inputs {
    a: Vec<f32>,
    b: Vec<f32>,
    a2: Vec<f32>,
    img: Vec<u8>,
    a2_words: Vec<u32>,
}

fn inputs() -> Inputs {
    let val = |i: usize, salt: usize| ((i * 7 + salt * 13) % 9) as f32 - 4.0;
    let a: Vec<f32> = (0..128 * 16).map(|i| val(i, 1)).collect();
    let b: Vec<f32> = (0..16 * 16).map(|i| val(i, 2)).collect();
    let a2: Vec<f32> = (0..128 * 16).map(|i| val(i / 3 + i, 3)).collect();
    let mut img = vec![0u8; IMG_BYTES];
    let put = |img: &mut Vec<u8>, at: usize, x: f32| {
        img[at..at + 2].copy_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes())
    };
    for m in 0..128 {
        for k in 0..16 {
            put(&mut img, kmajor(0, m, k), a[m * 16 + k]);
        }
    }
    for n in 0..16 {
        for k in 0..16 {
            put(&mut img, kmajor(16384, n, k), b[n * 16 + k]);
        }
    }
    // A2[m][k] packed: column k/2, low half = even k.
    let bits = |x: f32| bf16::from_f32(x).to_bits() as u32;
    let a2_words = (0..128 * 8)
        .map(|i| {
            let (m, c) = (i / 8, i % 8);
            bits(a2[m * 16 + 2 * c]) | bits(a2[m * 16 + 2 * c + 1]) << 16
        })
        .collect();
    Inputs {
        a,
        b,
        a2,
        img,
        a2_words,
    }
}

fn run(text: &str) -> Result<(Inputs, Vec<f32>), SimError> {
    let module = Module::parse(text).unwrap_or_else(|e| panic!("{e}"));
    let inp = inputs();
    let mut gpu = Gpu::new();
    let img = gpu.upload("img", &inp.img);
    let a2 = gpu.upload("a2", &inp.a2_words);
    let out = gpu.alloc("out", 128 * 32 * 4);
    gpu.launch(
        module.kernel("umma").unwrap(),
        &LaunchConfig::new((1, 1, 1), (128, 1, 1)),
        &[Arg::Ptr(img), Arg::Ptr(a2), Arg::Ptr(out)],
    )?;
    let got = gpu.read::<f32>(out, 128 * 32)?;
    Ok((inp, got))
}

#[test]
fn ss_and_ts_mma_match_a_host_matmul() {
    let (inp, got) = run(KERNEL).unwrap_or_else(|e| panic!("{e}"));
    for m in 0..128 {
        for n in 0..16 {
            let dot = |a: &[f32]| {
                (0..16)
                    .map(|k| a[m * 16 + k] * inp.b[n * 16 + k])
                    .sum::<f32>()
            };
            // Columns 0..16: D = A·B, then D += A·B.
            assert_eq!(got[m * 32 + n], 2.0 * dot(&inp.a), "SS row {m} col {n}");
            // Columns 16..32: the TS product.
            assert_eq!(got[m * 32 + 16 + n], dot(&inp.a2), "TS row {m} col {n}");
        }
    }
}

fn edited(from: &str, to: &str) -> String {
    assert!(KERNEL.contains(from), "`{from}` not in the kernel");
    KERNEL.replacen(from, to, 1)
}

fn expect(text: &str, needle: &str) {
    match run(text) {
        Ok(_) => panic!("the planted bug went unnoticed"),
        Err(e) => {
            let msg = e.to_string();
            println!("{msg}");
            assert!(
                matches!(
                    &e,
                    SimError::Fault {
                        kind: FaultKind::Tcgen05(_),
                        ..
                    }
                ),
                "{msg}"
            );
            assert!(msg.contains(needle), "`{needle}` missing in: {msg}");
        }
    }
}

#[test]
fn loading_the_accumulator_before_the_commit_wait_is_reported() {
    let text = edited("@!%p0 bra $wait;", "").replace(
        "mbarrier.try_wait.parity.shared::cta.b64 %p0",
        "mbarrier.test_wait.parity.shared::cta.b64 %p0",
    );
    // Whichever warp gets there first reads cells the MMAs have not written (issued or not).
    expect(&text, "tcgen05.ld ");
}

#[test]
fn a_store_over_the_ts_operand_in_flight_is_reported() {
    // Warp 0 re-stores its A2 columns right after issuing the MMAs.
    let text = edited(
        "$no_mma:\n",
        "tcgen05.st.sync.aligned.32x32b.x8.b32 [%r9+32], {%r10, %r11, %r12, %r13, %r14, %r15, %r16, %r17};\n$no_mma:\n",
    );
    expect(&text, "reads while in flight");
}

#[test]
fn a_missing_dealloc_is_reported() {
    expect(
        &edited("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %r7, 64;", ""),
        "still allocated",
    );
}

#[test]
fn use_after_dealloc_is_reported() {
    // Dealloc right after the MMAs completed, before the other warps' loads.
    let text = edited(
        "\ttcgen05.fence::after_thread_sync;\n\ttcgen05.ld",
        "\ttcgen05.fence::after_thread_sync;\n\t@%p2 tcgen05.dealloc.cta_group::1.sync.aligned.b32 %r7, 64;\n\ttcgen05.ld",
    )
    .replace(
        "\ttcgen05.dealloc.cta_group::1.sync.aligned.b32 %r7, 64; // dealloc",
        "",
    );
    expect(&text, "use after tcgen05.dealloc");
}

#[test]
fn dealloc_with_mmas_in_flight_is_reported() {
    let text = edited(
        "$no_mma:\n",
        "tcgen05.dealloc.cta_group::1.sync.aligned.b32 %r7, 64;\n$no_mma:\n",
    );
    expect(&text, "while 3 tcgen05.mma are in flight");
}

#[test]
fn an_allocation_that_cannot_be_satisfied_is_reported() {
    expect(
        &edited(", 64; // alloc", ", 1024; // alloc"),
        "must be a power of two in 32..=512",
    );
    let twice = edited(
        "tcgen05.relinquish_alloc_permit",
        "tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r2+18444], 512;\n\ttcgen05.relinquish_alloc_permit",
    );
    expect(&twice, "would block forever");
}

#[test]
fn an_access_outside_the_warps_lane_quadrant_is_reported() {
    // Every warp loads the first quadrant.
    let text = edited("[%r9];\n\ttcgen05.wait::ld", "[%r7];\n\ttcgen05.wait::ld");
    expect(&text, "warp 1 may access only lanes 32..64");
}

#[test]
fn an_unwritten_accumulator_read_is_reported() {
    // The first MMA accumulates into uninitialised TMEM.
    let text = edited("0x8040490, 0;", "0x8040490, 1;");
    expect(&text, "never written since its allocation");
}

#[test]
fn a_wrong_m_field_is_reported() {
    // M >> 4 written from bit 23 instead of 24 reads as M = 64.
    let text = edited(
        "%rd9, 0x8040490, 0;\n\t@%p3 tcgen05.mma.cta_group::1.kind::f16 [%r7], %rd8",
        "%rd9, 0x4040490, 0;\n\t@%p3 tcgen05.mma.cta_group::1.kind::f16 [%r7], %rd8",
    );
    expect(&text, "instruction descriptor");
}
