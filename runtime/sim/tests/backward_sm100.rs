//! The whole Blackwell backward on the simulator, no GPU: `bwd_preprocess` → zeroed pools →
//! the four task-build kernels (all `sm_100a` PTX) → `msa_backward_sm100` (TMEM, tcgen05.mma
//! SS and TS, tcgen05.commit → mbarrier, tcgen05.ld/st, TMA, setmaxnreg, 512 threads) →
//! `bwd_postprocess`, launched as `msa_runtime::backward::MsaBackward::run` launches them on a
//! compute-capability-10.0 device, and compared with the f32 CPU reference at the seed's
//! tolerances. Then planted bugs in the same kernel text, each of which must be reported.
//!
//! `msa_backward_sm100` has never run on SM100 hardware; this is the only execution of it.

use msa_runtime::reference::{DK_TOLERANCE, DQ_TOLERANCE};
use msa_sim::backward::{Case, Grads, MainKernel, B200_SMS};
use msa_sim::{FaultKind, Limits, SimError, Tcgen05Numerics, TmaCompletion, UmmaOrder};

mod chain;
mod ptx_edit;
use chain::{case, check};
use ptx_edit::{without_wait_before, without_wait_before_line};

/// The runtime's launch sequence on the simulator, with `main_ptx` as the main kernel.
fn run(c: &Case, main_ptx: &str, limits: Limits, num_sms: usize) -> Result<Grads, SimError> {
    chain::run(c, &MainKernel::sm100().with_ptx(main_ptx), limits, num_sms)
}

fn main_ptx() -> &'static str {
    MainKernel::sm100().ptx
}

#[test]
fn backward_sm100_case_a_matches_the_reference() {
    // The documents of tests/backward.rs case (a): several documents, partial key blocks,
    // one-token documents, a full 128-token one.
    let c = case(&[127, 129, 1, 2, 3, 5, 128], 7001);
    let sms = std::env::var("MSA_SIM_SMS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(B200_SMS);
    let g = run(&c, main_ptx(), Limits::default(), sms).unwrap_or_else(|e| panic!("{e}"));
    assert!(g.tasks > 0);
    check(&c, &g, "case (a), 148 SMs");
}

#[test]
fn backward_sm100_with_tma_completing_at_issue_matches_the_reference() {
    // Copies land as soon as they are issued: a producer that refilled a K/V or Q/dO stage
    // before the MMAs reading it completed would trip the operand check or corrupt results.
    let c = case(&[127, 129, 4], 7002);
    let limits = Limits {
        tma_completion: TmaCompletion::Immediate,
        ..Limits::default()
    };
    let g = run(&c, main_ptx(), limits, 2).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "immediate TMA, 2 SMs");
}

#[test]
fn backward_sm100_top16_window_on_two_sms_matches_the_reference() {
    // One 1153-token document with causal support: queries from block 16 on select a real
    // top-16 (their 16 nearest blocks, not all of them). Every CTA walks several task rows
    // and a key block's bucket holds more rows than one CTA walks, so buckets split across CTAs and the TMEM / shared-memory stages are reused. (2920 task
    // rows: the large regime, 16 rows per CTA.)
    let c = case(&[1153], 7004);
    let g = run(&c, main_ptx(), Limits::default(), 2).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "1153 tokens, 2 SMs");
}

#[test]
fn backward_sm100_under_other_mma_completion_orders_matches_the_reference() {
    // In-flight MMAs complete in a random order the ISA allows (two seeds) and latest-first;
    // 2 SMs, so every CTA walks several tasks and the TMEM regions are reused.
    let c = case(&[127, 129, 4], 7002);
    for order in [
        UmmaOrder::Seeded(1),
        UmmaOrder::Seeded(2),
        UmmaOrder::Reversed,
    ] {
        let limits = Limits {
            umma_order: order,
            ..Limits::default()
        };
        let g = run(&c, main_ptx(), limits, 2).unwrap_or_else(|e| panic!("{order:?}: {e}"));
        check(&c, &g, &format!("{order:?}, 2 SMs"));
    }
}

#[test]
fn backward_sm100_with_truncating_tensor_cores_matches_the_reference() {
    // The H200's wgmma rounding (truncation) instead of round-to-nearest, with a seeded
    // completion order, on 2 SMs (several tasks per CTA).
    let c = case(&[127, 129, 4], 7002);
    let limits = Limits {
        tcgen05_numerics: Tcgen05Numerics::Truncating,
        umma_order: UmmaOrder::Seeded(3),
        ..Limits::default()
    };
    let g = run(&c, main_ptx(), limits, 2).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "2 SMs, truncating, seeded order");
}

#[test]
#[ignore = "about 130 s in release (40 s of it the CPU reference): run with --ignored"]
fn backward_sm100_long_document_on_few_sms_matches_the_reference() {
    // One 2177-token document with causal support (as in the H200 GPU tests), 4 SMs: the
    // large `chunk_map` regime (16 task rows per CTA).
    let c = case(&[2177], 7003);
    let g = run(&c, main_ptx(), Limits::default(), 4).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "2177 tokens, 4 SMs");
}

// ---------------------------------------------------------------------------------------------
// Planted bugs in the shipped kernel text
// ---------------------------------------------------------------------------------------------

/// The main kernel with the `nth` (0-based) line containing `needle` replaced by `with(line)`
/// (nothing when empty); instruction forms are matched rather than register names, so the
/// edits survive a regeneration of the kernel.
fn planted(needle: &str, nth: usize, with: impl Fn(&str) -> String) -> String {
    let mut seen = 0;
    let mut out = Vec::new();
    for line in main_ptx().lines() {
        if line.contains(needle) {
            if seen == nth {
                let new = with(line);
                assert_ne!(new, line, "the edit of `{line}` must change it");
                if !new.is_empty() {
                    out.push(new);
                }
                seen += 1;
                continue;
            }
            seen += 1;
        }
        out.push(line.to_string());
    }
    assert!(
        seen > nth,
        "line {nth} with `{needle}` not found ({seen} found)"
    );
    out.join("\n") + "\n"
}

/// The main kernel without the load warp's Q/dO stage-empty wait: the `mbarrier.try_wait`
/// loop right before the first TMA copy into a Q/dO stage (mbarrier at offset 16 or 24 of the
/// barrier block, i.e. an operand ending in `+16];`).
fn without_q_empty_wait() -> String {
    without_wait_before_line(
        main_ptx(),
        |l| l.contains("cp.async.bulk.tensor") && l.trim_end().ends_with("+16];"),
        "a Q/dO copy",
    )
}

/// Two documents and one SM: a few tasks per CTA.
fn tiny() -> Case {
    case(&[100, 60], 7010)
}

fn expect_error(text: &str, want: impl Fn(&SimError) -> bool, needle: &str) {
    let c = tiny();
    let err = match run(&c, text, Limits::default(), 1) {
        Ok(_) => panic!("the planted bug went unnoticed"),
        Err(e) => e,
    };
    let msg = err.to_string();
    println!("{msg}");
    assert!(want(&err), "unexpected error: {msg}");
    assert!(msg.contains(needle), "`{needle}` missing in: {msg}");
}

fn fault(want: impl Fn(&FaultKind) -> bool) -> impl Fn(&SimError) -> bool {
    move |e| matches!(e, SimError::Fault { kind, .. } if want(kind))
}

fn tcgen05_fault(e: &SimError) -> bool {
    fault(|k| matches!(k, FaultKind::Tcgen05(_)))(e)
}

#[test]
fn the_tiny_case_passes_unmodified() {
    let c = tiny();
    let g = run(&c, main_ptx(), Limits::default(), 1).unwrap_or_else(|e| panic!("{e}"));
    assert!(g.tasks >= 3, "{} tasks", g.tasks);
    check(&c, &g, "tiny");
}

#[test]
fn reading_tcgen05_ld_registers_before_wait_ld_is_reported() {
    let text = planted("tcgen05.wait::ld.sync.aligned", 0, |_| String::new());
    expect_error(&text, tcgen05_fault, "not yet waited for");
}

#[test]
fn publishing_p_without_wait_st_is_reported() {
    let text = planted("tcgen05.wait::st.sync.aligned", 0, |_| String::new());
    expect_error(&text, tcgen05_fault, "tcgen05.wait::st first");
}

#[test]
fn loading_s_without_waiting_for_its_commit_is_reported() {
    // The compute warps' wait on the S^T commit is the wait right before the first
    // tcgen05.ld: without it they read columns the G1 MMAs still write.
    let text = without_wait_before(main_ptx(), "tcgen05.ld.sync.aligned");
    expect_error(&text, tcgen05_fault, "tcgen05.ld");
}

#[test]
fn missing_proxy_fence_before_the_ds_mma_is_reported() {
    // The last of the three fences of a task: the dS^T panels of chunk 3 are read by the dQ
    // MMAs (the first two fences are redundant, the later ones cover the same threads'
    // earlier stores).
    let text = planted("fence.proxy.async.shared::cta;", 2, |_| String::new());
    expect_error(
        &text,
        fault(|k| matches!(k, FaultKind::Proxy(_))),
        "with no fence.proxy.async by that thread since",
    );
}

#[test]
fn a_hopper_style_descriptor_is_reported() {
    // 0x40004040 → 0x40000040: the SM100 version bit 46 cleared.
    let text = planted("1073758272", 0, |l| l.replace("1073758272", "1073741888"));
    expect_error(&text, tcgen05_fault, "version bits 46-48");
}

#[test]
fn a_tmem_store_outside_the_warps_lane_quadrant_is_reported() {
    // The first P store of each compute warp moved one quadrant (32 lanes) up.
    let text = planted("tcgen05.st.sync.aligned", 0, |l| {
        l.replace("[%b0]", "[%b0+2097152]")
    });
    expect_error(&text, tcgen05_fault, "may access only lanes");
}

#[test]
fn producer_skipping_the_q_stage_empty_wait_does_not_pass_silently() {
    // The Q/dO stage-empty wait (released by a tcgen05.commit after the MMAs that read the
    // stage): without it, copies landing at issue overwrite shared memory under MMAs still in
    // flight, or the stage's full-barrier phases run ahead of the consumers (today: a
    // deadlock report naming every warp's wait).
    let text = without_q_empty_wait();
    assert!(main_ptx().contains("tcgen05.commit"));
    let c = tiny();
    let limits = Limits {
        tma_completion: TmaCompletion::Immediate,
        ..Limits::default()
    };
    match run(&c, &text, limits, 1) {
        Err(e) => println!("reported: {e}"),
        Ok(g) => {
            let e = &c.expected;
            let dq = DQ_TOLERANCE.check("dq", &g.dq, &e.dq);
            let dk = DK_TOLERANCE.check("dk", &g.dk, &e.dk_aligned);
            assert!(
                dq.is_err() || dk.is_err(),
                "the overwritten stages went unnoticed"
            );
        }
    }
}

#[test]
fn removing_any_tcgen05_fence_is_reported() {
    // Each `tcgen05.fence::{before,after}_thread_sync` of the kernel, removed in turn, must be
    // reported by the simulator's fence rules on the tiny case (two threads run the cases).
    let lines: Vec<&str> = main_ptx().lines().collect();
    let fences: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].contains("tcgen05.fence::"))
        .collect();
    assert!(fences.len() >= 20, "{} fences", fences.len());
    let c = tiny();
    let check = |at: usize| -> Result<String, String> {
        let text: String = lines
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != at)
            .map(|(_, l)| format!("{l}\n"))
            .collect();
        match run(&c, &text, Limits::default(), 1) {
            Err(e) if e.to_string().contains("tcgen05.fence::") => Ok(e.to_string()),
            Err(e) => Err(format!("reported, but not as a fence rule: {e}")),
            Ok(_) => Err("not reported".to_string()),
        }
    };
    let half = fences.len() / 2;
    let (a, b) = fences.split_at(half);
    let results: Vec<(usize, Result<String, String>)> = std::thread::scope(|s| {
        let jobs: Vec<_> = [a, b]
            .into_iter()
            .map(|part| s.spawn(|| part.iter().map(|&i| (i, check(i))).collect::<Vec<_>>()))
            .collect();
        jobs.into_iter()
            .flat_map(|j| j.join().expect("thread"))
            .collect()
    });
    // A fence whose removal changes nothing is one another fence of its kind already covers
    // on every path (a fence orders against all earlier synchronizations, resp. all earlier
    // TMEM accesses, of its thread). The kernel keeps these as cheap insurance; they are
    // exactly: the `after` fence of each role right after the TMEM-address hand-off
    // (`bar.sync 1`), covered by the role's first wait-and-fence; the `before` fence of
    // compute and reduce right before the final `bar.sync 6`, covered by the fence after
    // their last TMEM access; a second `before` fence with no TMEM access since the previous
    // one; and the `after` fence of the dK/dV acquire, covered by the chunk-stage fence
    // before the first G3.
    let covered = |i: usize| -> Option<&'static str> {
        let line = lines[i];
        let prev_fence = (0..i).rev().find(|&j| lines[j].contains("tcgen05.fence::"));
        if line.contains("after_thread_sync") && lines[i - 1].contains("bar.sync 1, 288") {
            Some("hand-off")
        } else if line.contains("before_thread_sync") && lines[i + 1].contains("bar.sync 6, 256") {
            Some("final barrier")
        } else if line.contains("before_thread_sync")
            && prev_fence.is_some_and(|j| {
                lines[j].contains("before_thread_sync")
                    && !lines[j..i].iter().any(|l| {
                        l.contains("tcgen05.ld")
                            || l.contains("tcgen05.st")
                            || l.contains("tcgen05.alloc")
                    })
            })
        {
            Some("second before fence")
        } else if line.contains("after_thread_sync") && lines[i + 1].contains("dkv_acquire") {
            Some("dK/dV acquire")
        } else {
            None
        }
    };
    let (mut missed, mut redundant) = (Vec::new(), Vec::new());
    for (i, r) in results {
        match (r, covered(i)) {
            (Ok(msg), _) => println!("line {}: {msg}", i + 1),
            (Err(_), Some(why)) => redundant.push(why),
            (Err(why), None) => missed.push(format!("line {} `{}`: {why}", i + 1, lines[i].trim())),
        }
    }
    assert!(
        missed.is_empty(),
        "fences whose removal went unnoticed:\n{}",
        missed.join("\n")
    );
    redundant.sort_unstable();
    assert_eq!(
        redundant,
        [
            "dK/dV acquire",
            "final barrier",
            "final barrier",
            "hand-off",
            "hand-off",
            "hand-off",
            "second before fence"
        ],
        "the covered fences changed"
    );
}

#[test]
fn mmas_on_other_accumulators_without_the_order_wait_are_reported() {
    // The MmaOrder::IssueOrder variant: without the wait for the Q/dO release commit before
    // G5, G5 overwrites the dS^T columns the in-flight G4 MMAs read.
    let lines: Vec<&str> = main_ptx().lines().collect();
    let note = lines
        .iter()
        .position(|l| l.contains("G5 overwrites the dS^T that G4 reads"))
        .expect("the order wait exists");
    assert!(lines[note + 2].contains("mbarrier.try_wait") && lines[note + 3].contains("bra"));
    let text: String = lines
        .iter()
        .enumerate()
        .filter(|&(i, _)| !(note + 1..=note + 3).contains(&i))
        .map(|(_, l)| format!("{l}\n"))
        .collect();
    expect_error(
        &text,
        tcgen05_fault,
        "MMAs on different accumulators are not ordered",
    );
}
