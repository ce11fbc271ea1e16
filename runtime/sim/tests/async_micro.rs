//! The sm_90a asynchronous machinery through micro-kernels (shared with `h200_compare.rs`),
//! checked against host models written from the PTX ISA and what an H200 was seen to do: TMA
//! boxes with out-of-range coordinates under every swizzle mode and fill (and the launches
//! the H200 refuses), mbarrier phases and transaction counts, `elect.sync`, and wgmma in the
//! three operand forms of the Hopper kernel.

mod common;

use common::*;

#[test]
fn tma_boxes_match_the_swizzle_and_fill_model() {
    for s in tma_accepted_scenarios() {
        let out = run_sim(&s).unwrap_or_else(|e| panic!("{}: {e}", s.name));
        let ArgSpec::Map(map) = s.args[0] else {
            unreachable!()
        };
        let rows: Vec<i32> = s.inputs[1]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let box_bytes = tma_footprint(map.box_dim, map.swizzle);
        for (i, r) in rows.chunks_exact(4).enumerate() {
            let row = [r[0], r[1], r[2], r[3]];
            let want = tma_expected(&s.inputs[0], &map, row);
            let got = &out[0][i * box_bytes..(i + 1) * box_bytes];
            if let Some(b) = (0..box_bytes).find(|&b| got[b] != want[b]) {
                panic!(
                    "{} box {i} {row:?}: byte {b} is {:#04x}, model {:#04x}",
                    s.name, got[b], want[b]
                );
            }
        }
        assert!(
            u32s(&out[1]).iter().all(|&f| f == 1),
            "{}: every phase completes",
            s.name
        );
    }
}

#[test]
fn tma_refuses_what_the_h200_refuses() {
    use msa_sim::tensor_map::Swizzle;
    let refused = [
        (
            tma_dst_misaligned(Swizzle::None),
            "TMA: destination shared [0x10, +768) must be 128-byte aligned",
        ),
        (
            tma_inner_unaligned(),
            "TMA: the inner coordinate 3 is 6 bytes into the row, not a multiple of 16",
        ),
        (
            tma_inner_unaligned_plain(),
            "TMA: the inner coordinate 3 is 6 bytes into the row",
        ),
        (
            tma_inner_coordinate("in range", 4),
            "TMA: the inner coordinate 4 is 8 bytes into the row",
        ),
        (
            tma_inner_coordinate("cut", -4),
            "TMA: the inner coordinate -4 is -8 bytes into the row",
        ),
    ];
    for (s, want) in refused {
        let err = run_sim(&s).unwrap_err().to_string();
        assert!(err.starts_with(want), "{}: {err}", s.name);
    }
}

#[test]
fn tma_swizzle_moves_chunks_by_the_row_index() {
    // The first box row-pair of an in-range box: row r's 16-byte chunk c lands at chunk c ^ r.
    let s = tma_query_rows();
    let out = run_sim(&s).unwrap();
    let tensor = &s.inputs[0];
    for r in 0..8usize {
        for c in 0..8usize {
            let src = r * 256 + c * 16; // token 0, head r, bytes of d 8c..8c+8
            let dst = r * 128 + ((c ^ r) * 16);
            assert_eq!(
                &out[0][dst..dst + 16],
                &tensor[src..src + 16],
                "row {r} chunk {c}"
            );
        }
    }
}

#[test]
fn mbarrier_phases_follow_the_isa() {
    let s = mbarrier_scenario();
    let out = run_sim(&s).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(u32s(&out[0]), MBARRIER_EXPECTED);
}

#[test]
fn elect_picks_the_lowest_member() {
    let s = elect_scenario();
    let out = u32s(&run_sim(&s).unwrap()[0]);
    for lane in 5..32 {
        assert_eq!(out[lane], 5, "lane {lane}: leader");
        assert_eq!(out[32 + lane], (lane == 5) as u32, "lane {lane}: predicate");
    }
    assert!(out[..5].iter().chain(&out[32..37]).all(|&x| x == 0));
}

#[test]
fn wgmma_forms_compute_the_product() {
    // Layouts: every accumulator within the model's error bound of the exact sum (a wrong
    // layout is off by the size of the terms). A k16 step cuts its 17 terms below
    // 2^(E − 25), E the exponent of its largest term, and truncates the sum to f32: less
    // than 17·2^-25 + 2^-23 of the step's Σ|terms|, so less than 2^-17 of Σ|a·b| over 8.
    for wide in [false, true] {
        for (i, form) in [WgmmaForm::SsKK, WgmmaForm::RsMn, WgmmaForm::SsMnMn]
            .into_iter()
            .enumerate()
        {
            let c = wgmma_case_with(form, 100 + i as u64 + 10 * wide as u64, wide);
            let out = run_sim(&c.scenario).unwrap_or_else(|e| panic!("{}: {e}", c.scenario.name));
            let d = c.unpack(&out[0]);
            let (exact, mag) = c.reference();
            let mut worst = 0f64;
            for e in 0..d.len() {
                let err = (d[e] as f64 - exact[e]).abs() / mag[e].max(f64::MIN_POSITIVE);
                worst = worst.max(err);
            }
            assert!(
                worst < 2f64.powi(-17),
                "{}: error {worst:e} of Σ|ab|",
                c.scenario.name
            );
            println!("{}: worst {worst:.2e} of Σ|ab|", c.scenario.name);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Misuse
// ---------------------------------------------------------------------------------------------

use msa_sim::{FaultKind, Gpu, LaunchConfig, Module, SimError};

fn launch(body: &str, threads: u32) -> Result<(), SimError> {
    let text = format!(
        "{HEADER}
.visible .entry k()
.maxntid {threads}, 1, 1
{{
	.reg .pred %p<4>;
	.reg .b32 %r<8>;
	.reg .f32 %f<8>;
	.reg .b64 %bd<4>;
	.shared .align 1024 .b8 buf[8192];
	.shared .align 8 .b64 mbar0;
	mov.u32 %r0, %tid.x;
	mov.u32 %r1, mbar0;
	mov.u32 %r2, buf;
{body}
	ret;
}}
"
    );
    let m = Module::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let mut gpu = Gpu::new();
    gpu.launch(
        m.kernel("k").unwrap(),
        &LaunchConfig::new((1, 1, 1), (threads, 1, 1)),
        &[],
    )
    .map(|_| ())
}

fn fault_message(r: Result<(), SimError>) -> (FaultKind, String) {
    match r {
        Err(SimError::Fault { kind, at }) => {
            let msg = format!("{kind} at {at}");
            (kind, msg)
        }
        other => panic!("expected a fault, got {other:?}"),
    }
}

#[test]
fn arriving_on_an_uninitialised_mbarrier_is_a_fault() {
    let (kind, msg) = fault_message(launch("\tmbarrier.arrive.shared::cta.b64 _, [%r1];", 32));
    assert!(matches!(kind, FaultKind::Mbarrier(_)), "{msg}");
    assert!(
        msg.contains("no mbarrier is initialised at shared"),
        "{msg}"
    );
}

#[test]
fn a_phase_that_never_completes_deadlocks_naming_mbarrier_and_parity() {
    let body = "\tsetp.eq.u32 %p0, %r0, 0;
	@%p0 mbarrier.init.shared::cta.b64 [%r1], 64;
	bar.sync 0;
	mbarrier.arrive.shared::cta.b64 _, [%r1];
$L_w:
	mbarrier.try_wait.parity.shared::cta.b64 %p1, [%r1], 0;
	@!%p1 bra $L_w;";
    match launch(body, 32) {
        Err(SimError::Deadlock(stall)) => {
            let msg = stall.to_string();
            assert!(
                msg.contains("waiting on mbarrier at shared 0x2000 for parity 0 (phase 0 in progress: 32 of 64 arrivals pending, tx-count 0, 0 TMA copies in flight)"),
                "{msg}"
            );
        }
        other => panic!("expected a deadlock, got {other:?}"),
    }
}

#[test]
fn a_store_over_a_live_mbarrier_is_a_fault() {
    let body = "\tmbarrier.init.shared::cta.b64 [%r1], 1;
	st.shared.u32 [%r1+4], %r0;";
    let (kind, msg) = fault_message(launch(body, 32));
    assert!(matches!(kind, FaultKind::Mbarrier(_)), "{msg}");
    assert!(msg.contains("overwrites the live mbarrier"), "{msg}");
}

#[test]
fn warps_of_a_warpgroup_at_different_collectives_are_a_fault() {
    let body = "\tshr.u32 %r3, %r0, 5;
	setp.eq.u32 %p0, %r3, 2;
	@%p0 bra $L_other;
	setmaxnreg.dec.sync.aligned.u32 120;
	bra $L_end;
$L_other:
	setmaxnreg.dec.sync.aligned.u32 112;
$L_end:";
    let (kind, msg) = fault_message(launch(body, 128));
    assert!(matches!(kind, FaultKind::Sync(_)), "{msg}");
    assert!(
        msg.contains("all four warps must execute the same instruction"),
        "{msg}"
    );
}

#[test]
fn setmaxnreg_in_part_of_a_warp_is_a_fault() {
    let body = "\tsetp.lt.u32 %p0, %r0, 16;
	@%p0 setmaxnreg.dec.sync.aligned.u32 120;";
    let (kind, msg) = fault_message(launch(body, 128));
    assert!(matches!(kind, FaultKind::Sync(_)), "{msg}");
    assert!(msg.contains("lane 16 of warp 0 has a false guard"), "{msg}");
}

#[test]
fn a_wgmma_never_waited_for_is_a_fault_at_exit() {
    // A descriptor over `buf` (K-major SW128, SBO 1024): start 0 >> 4, LBO 1, hi 0x40000040.
    let body = "\tmov.b64 %bd0, 0x4000004000010000;
	setp.ne.u32 %p0, %r0, %r0;
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%f0, %f1, %f2, %f3}, %bd0, %bd0, %p0, 1, 1, 0, 0;
	wgmma.commit_group.sync.aligned;";
    let (kind, msg) = fault_message(launch(body, 128));
    assert!(matches!(kind, FaultKind::Wgmma(_)), "{msg}");
    assert!(
        msg.contains("finished with 1 wgmma.mma_async in flight"),
        "{msg}"
    );
}

#[test]
fn a_wgmma_descriptor_that_differs_across_the_warpgroup_is_a_fault() {
    let body = "\tmov.b64 %bd0, 0x4000004000010000;
	cvt.u64.u32 %bd1, %r0;
	shl.b64 %bd1, %bd1, 4;
	and.b64 %bd1, %bd1, 16;
	or.b64 %bd1, %bd1, %bd0;
	setp.ne.u32 %p0, %r0, %r0;
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%f0, %f1, %f2, %f3}, %bd0, %bd1, %p0, 1, 1, 0, 0;
	wgmma.commit_group.sync.aligned;
	wgmma.wait_group.sync.aligned 0;";
    let (kind, msg) = fault_message(launch(body, 128));
    assert!(matches!(kind, FaultKind::Wgmma(_)), "{msg}");
    assert!(
        msg.contains("the B descriptor differs across the warpgroup"),
        "{msg}"
    );
}

// ---------------------------------------------------------------------------------------------
// Bulk (non-tensor) copies into shared memory
// ---------------------------------------------------------------------------------------------

use msa_sim::Arg;

/// One CTA of 128 threads: thread 0 arms the mbarrier for `expect` bytes and issues `copy`
/// (a `cp.async.bulk` from `src`, `%rd0`, into `buf`, `%r2`), every thread waits for phase 0
/// and writes word `tid` of `buf[256..]` to `out`. Returns `out`, or what went wrong.
fn bulk_copy(copy: &str, expect: u32, src: &[u32]) -> Result<Vec<u32>, SimError> {
    let text = format!(
        "{HEADER}
.visible .entry k(.param .u64 src, .param .u64 out)
.maxntid 128, 1, 1
{{
	.reg .pred %p<4>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<8>;
	.shared .align 1024 .b8 buf[8192];
	.shared .align 8 .b64 mbar0;
	ld.param.u64 %rd0, [src];
	ld.param.u64 %rd1, [out];
	mov.u32 %r0, %tid.x;
	mov.u32 %r1, mbar0;
	mov.u32 %r2, buf;
	setp.eq.u32 %p0, %r0, 0;
	@%p0 mbarrier.init.shared::cta.b64 [%r1], 1;
	bar.sync 0;
	@%p0 mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r1], {expect};
	@%p0 {copy}
$L_w:
	mbarrier.try_wait.parity.shared::cta.b64 %p1, [%r1], 0;
	@!%p1 bra $L_w;
	shl.b32 %r3, %r0, 2;
	add.u32 %r4, %r2, %r3;
	ld.shared.u32 %r5, [%r4+256];
	cvt.u64.u32 %rd2, %r3;
	add.u64 %rd3, %rd1, %rd2;
	st.global.u32 [%rd3], %r5;
	ret;
}}
"
    );
    let m = Module::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let mut gpu = Gpu::new();
    let src = gpu.upload("src", src);
    let out = gpu.upload("out", &[0u32; 128]);
    gpu.launch(
        m.kernel("k").unwrap(),
        &LaunchConfig::new((1, 1, 1), (128, 1, 1)),
        &[Arg::Ptr(src), Arg::Ptr(out)],
    )?;
    gpu.read(out, 128)
}

const BULK: &str = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes";

#[test]
fn a_bulk_copy_lands_its_bytes_before_the_wait_returns() {
    let src: Vec<u32> = (0..256).map(|i| 0x1000 + i).collect();
    // 512 bytes from src + 64 into buf + 256: words 16.. of src.
    let copy = format!("{BULK} [%r2+256], [%rd0+64], 512, [%r1];");
    let out = bulk_copy(&copy, 512, &src).unwrap();
    assert_eq!(out, src[16..144].to_vec());
    // The same with an L2 hint (its policy operand last).
    let hinted = format!(
        "createpolicy.fractional.L2::evict_first.b64 %rd4, 1.0;\n\t@%p0 {BULK}.L2::cache_hint \
         [%r2+256], [%rd0+64], 512, [%r1], %rd4;"
    );
    assert_eq!(
        bulk_copy(&hinted, 512, &src).unwrap(),
        src[16..144].to_vec()
    );
}

#[test]
fn bulk_copies_the_phase_did_not_expect_or_misaligned_are_faults() {
    let src = vec![7u32; 256];
    // Two copies of 512 bytes against an expect_tx of 512: the second lands after its phase
    // completed.
    let two = format!(
        "{BULK} [%r2+256], [%rd0], 512, [%r1];\n\t@%p0 {BULK} [%r2+1024], [%rd0], 512, [%r1];"
    );
    let (kind, msg) = fault_message(bulk_copy(&two, 512, &src).map(|_| ()));
    assert!(matches!(kind, FaultKind::Mbarrier(_)), "{msg}");
    assert!(
        msg.contains("more bytes than the phase's expect_tx"),
        "{msg}"
    );
    // A source off 16 bytes.
    let off = format!("{BULK} [%r2+256], [%rd0+8], 512, [%r1];");
    let (kind, msg) = fault_message(bulk_copy(&off, 512, &src).map(|_| ()));
    assert!(matches!(kind, FaultKind::Tma(_)), "{msg}");
    assert!(msg.contains("must be 16-byte aligned"), "{msg}");
    // A source past its allocation.
    let past = format!("{BULK} [%r2+256], [%rd0+768], 512, [%r1];");
    let (kind, msg) = fault_message(bulk_copy(&past, 512, &src).map(|_| ()));
    assert!(matches!(kind, FaultKind::Tma(_)), "{msg}");
    assert!(msg.contains("the bulk copy reads global"), "{msg}");
}
