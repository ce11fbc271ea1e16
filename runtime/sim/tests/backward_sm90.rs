//! The whole Hopper backward on the simulator, no GPU: `bwd_preprocess` → zeroed pools → the
//! four task-build kernels → `msa_backward_sm90` (TMA, mbarrier pipelines, wgmma,
//! setmaxnreg) → `bwd_postprocess`, launched as `msa_runtime::backward::MsaBackward::run`
//! launches them, and compared with the f32 CPU reference at the seed's tolerances. Then
//! planted pipeline bugs in the same kernel text, each of which must be reported.

use msa_runtime::reference::{DK_TOLERANCE, DQ_TOLERANCE};
use msa_sim::backward::{Case, Grads, MainKernel, H200_SMS};
use msa_sim::{FaultKind, Limits, SimError, TmaCompletion};

mod chain;
mod ptx_edit;
use chain::{case, check};
use ptx_edit::without_wait_at;

/// The runtime's launch sequence on the simulator, with `main_ptx` as the main kernel.
fn run(c: &Case, main_ptx: &str, limits: Limits, num_sms: usize) -> Result<Grads, SimError> {
    chain::run(c, &MainKernel::sm90().with_ptx(main_ptx), limits, num_sms)
}

fn main_ptx() -> &'static str {
    MainKernel::sm90().ptx
}

#[test]
fn backward_sm90_small_documents_matches_the_reference() {
    // The documents of tests/backward.rs case (a) — several documents, partial key blocks,
    // one-token documents, a full 128-token one — plus a trailing one-token document (an even
    // T; `backward_sm90_case_a_exactly` covers the odd T = 395 that once exposed a divergent
    // full-mask `shfl.sync` in `bwd_preprocess`).
    let c = case(&[127, 129, 1, 2, 3, 5, 128, 1], 7001);
    // `MSA_SIM_SMS=n` sizes the walk for another SM count (the grid, tasks per CTA).
    let sms = std::env::var("MSA_SIM_SMS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(H200_SMS);
    let g = run(&c, main_ptx(), Limits::default(), sms).unwrap_or_else(|e| panic!("{e}"));
    assert!(g.tasks > 0);
    check(&c, &g, "deferred TMA");
}

#[test]
fn backward_sm90_case_a_exactly() {
    let c = case(&[127, 129, 1, 2, 3, 5, 128], 7001);
    let g = run(&c, main_ptx(), Limits::default(), H200_SMS).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "case (a)");
}

#[test]
fn backward_sm90_with_tma_completing_at_issue_matches_the_reference() {
    // Copies land as soon as they are issued: a producer that refilled a stage before both
    // consumers released it would corrupt what they read. Fewer SMs: several tasks and
    // segments per CTA, so both Q/dO stages and the K/V stage are reused.
    let c = case(&[127, 129, 4], 7002);
    let limits = Limits {
        tma_completion: TmaCompletion::Immediate,
        ..Limits::default()
    };
    let g = run(&c, main_ptx(), limits, 2).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "immediate TMA, 2 SMs");
}

// ---------------------------------------------------------------------------------------------
// Planted bugs in the shipped kernel text
// ---------------------------------------------------------------------------------------------

/// The main kernel with the `nth` (0-based) line containing `needle` replaced by `with(line)`
/// (several lines joined by `\n`, or none); the instruction forms are matched rather than
/// register names, so the edits survive a regeneration of the kernel.
fn planted(needle: &str, nth: usize, with: impl Fn(&str) -> String) -> String {
    let mut seen = 0;
    let mut out = Vec::new();
    let mut edited = false;
    for line in main_ptx().lines() {
        if line.contains(needle) {
            if seen == nth {
                let new = with(line);
                assert_ne!(new, line, "the edit of `{line}` must change it");
                if !new.is_empty() {
                    out.push(new);
                }
                edited = true;
                seen += 1;
                continue;
            }
            seen += 1;
        }
        out.push(line.to_string());
    }
    assert!(
        edited,
        "line {nth} with `{needle}` not found ({seen} found)"
    );
    out.join("\n") + "\n"
}

/// The main kernel without its `nth` `mbarrier.try_wait` loop (the wait and the retry
/// branch after it).
fn without_wait(nth: usize) -> String {
    let lines: Vec<&str> = main_ptx().lines().collect();
    let at = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.contains("mbarrier.try_wait"))
        .nth(nth)
        .map(|(i, _)| i)
        .expect("the wait exists");
    without_wait_at(&lines, at)
}

/// Two documents and one SM: a few tasks and both Q/dO stages reused in each CTA.
fn tiny() -> Case {
    case(&[100, 60], 7010)
}

fn expect_error(text: &str, limits: Limits, want: impl Fn(&SimError) -> bool, needle: &str) {
    let c = tiny();
    let err = match run(&c, text, limits, 1) {
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

#[test]
fn the_tiny_case_passes_unmodified() {
    let c = tiny();
    let g = run(&c, main_ptx(), Limits::default(), 1).unwrap_or_else(|e| panic!("{e}"));
    assert!(g.tasks >= 3, "{} tasks", g.tasks);
    check(&c, &g, "tiny");
}

#[test]
fn missing_proxy_fence_before_the_dq_wgmma_is_reported() {
    let text = planted("fence.proxy.async.shared::cta;", 0, |_| String::new());
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Proxy(_))),
        "with no fence.proxy.async by that thread since",
    );
}

#[test]
fn missing_proxy_fence_before_the_dq_reduction_is_reported() {
    // The second fence: each lane's staged dQ rows before lane 0's TMA reduce-add reads them.
    let text = planted("fence.proxy.async.shared::cta;", 1, |_| String::new());
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Proxy(_))),
        "without a fence.proxy.async before it",
    );
}

#[test]
fn overwriting_the_dq_staging_before_its_reduction_read_it_is_reported() {
    let text = planted("cp.async.bulk.wait_group.read", 0, |_| String::new());
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Proxy(_))),
        "not yet retired by cp.async.bulk.wait_group.read",
    );
}

#[test]
fn expect_tx_short_of_the_copies_is_reported() {
    // The Q/dO stage expects one 2 KiB box less than its 32 copies carry.
    let text = planted("mbarrier.arrive.expect_tx", 1, |l| {
        l.replace(", 65536;", ", 63488;")
    });
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Mbarrier(_))),
        "the copies carry more bytes than the phase's expect_tx",
    );
}

#[test]
fn expect_tx_beyond_the_copies_deadlocks_naming_the_mbarrier() {
    let text = planted("mbarrier.arrive.expect_tx", 1, |l| {
        l.replace(", 65536;", ", 67584;")
    });
    expect_error(
        &text,
        Limits::default(),
        |e| matches!(e, SimError::Deadlock(_)),
        "tx-count 2048, 0 TMA copies in flight",
    );
}

#[test]
fn consumer_skipping_the_q_full_wait_is_reported() {
    // try_waits in text order: producer K/V and Q/dO empty, gather rows empty, consumer K/V,
    // Q/dO and rows full. The consumers' Q/dO wait is the fifth.
    let text = without_wait(4);
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Mbarrier(_) | FaultKind::Tma(_))),
        "",
    );
}

#[test]
fn reading_an_accumulator_before_wgmma_wait_group_is_reported() {
    let text = planted("wgmma.wait_group.sync.aligned", 0, |_| String::new());
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Wgmma(_))),
        "still in flight",
    );
}

#[test]
fn missing_wgmma_fence_before_the_register_a_mma_is_reported() {
    // The second fence orders the P^T/dS^T fragments (written by cvt) before the RS MMAs.
    let text = planted("wgmma.fence.sync.aligned", 1, |_| String::new());
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Wgmma(_))),
        "was accessed after the warp's last wgmma.fence",
    );
}

#[test]
fn register_pool_overflow_deadlocks_at_setmaxnreg() {
    // 40 producer registers + 2 × 240 consumer registers, × 128 threads > 65536.
    let text = planted("setmaxnreg.dec", 0, |l| l.replace(" 24;", " 40;"));
    expect_error(
        &text,
        Limits::default(),
        |e| matches!(e, SimError::Deadlock(_)),
        "setmaxnreg.inc to 240 waits for registers",
    );
}

#[test]
fn producer_skipping_the_q_empty_wait_corrupts_results_with_immediate_tma() {
    // The producer's Q/dO empty wait is the second try_wait: without it, copies landing at
    // issue overwrite a stage before the consumers have read it.
    let text = without_wait(1);
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

/// Runs `text` on the tiny case; panics unless the simulator reports an error or the gradients
/// miss the reference.
fn does_not_pass_silently(text: &str, what: &str) {
    let c = tiny();
    match run(&c, text, Limits::default(), 1) {
        Err(e) => println!("{what}: reported: {e}"),
        Ok(g) => match msa_sim::backward::check(&c, &g) {
            Err(m) => println!("{what}: wrong gradients: {m}"),
            Ok(_) => panic!("{what} went unnoticed"),
        },
    }
}

/// Warp 1 (the gather warp) runs only when no other warp can.
fn gather_last() -> Limits {
    Limits {
        starved_warps: 1 << 1,
        ..Limits::default()
    }
}

#[test]
fn the_tiny_case_passes_with_the_gather_warp_starved() {
    let c = tiny();
    let g = run(&c, main_ptx(), gather_last(), 1).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "tiny, gather warp last");
}

#[test]
fn consumer_skipping_the_row_scalars_wait_is_caught_with_the_gather_warp_starved() {
    // The consumers' rows full wait is the sixth try_wait: without it, and the gather warp
    // running last, the softmax reads the scalars before they are written.
    let c = tiny();
    match run(&c, &without_wait(5), gather_last(), 1) {
        Err(e) => println!("reported: {e}"),
        Ok(g) => {
            let m = msa_sim::backward::check(&c, &g).expect_err("the missing wait went unnoticed");
            println!("wrong gradients: {m}");
        }
    }
}

#[test]
fn gather_skipping_the_row_scalars_empty_wait_does_not_pass_silently() {
    // The gather warp's empty wait is the third: without it, it overwrites the scalars of a
    // task the consumers are still using.
    does_not_pass_silently(&without_wait(2), "no rows empty wait");
}

/// The consumer warps (4-11) run only when no other warp can: the gather warp then refills
/// the row scalars as soon as their stage is released.
fn consumers_last() -> Limits {
    Limits {
        starved_warps: 0xff0,
        ..Limits::default()
    }
}

#[test]
fn the_tiny_case_passes_with_the_consumers_starved() {
    let c = tiny();
    let g = run(&c, main_ptx(), consumers_last(), 1).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "tiny, consumers last");
}

/// The main kernel with each consumer thread's release of the row scalars moved from after
/// its last read to right after its rows full wait (the sixth `try_wait` loop).
fn rows_released_before_the_reads() -> String {
    let lines: Vec<&str> = main_ptx().lines().collect();
    let note = lines
        .iter()
        .position(|l| l.contains("last read of the row scalars is done"))
        .expect("the release exists");
    let release = lines[note + 1];
    assert!(release.contains("mbarrier.arrive") && !release.contains('@'));
    let wait = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.contains("mbarrier.try_wait"))
        .nth(5)
        .map(|(i, _)| i)
        .expect("the rows full wait exists");
    assert!(wait < note && lines[wait + 1].contains("bra"));
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if i != note + 1 {
            out.push(*l);
        }
        if i == wait + 1 {
            out.push(release);
        }
    }
    out.join("\n") + "\n"
}

#[test]
fn releasing_the_row_scalars_before_the_last_read_is_caught_with_the_consumers_starved() {
    // The write-after-read order that compute-sanitizer's racecheck checks (issue 18): a
    // consumer that hands the stage back before it has read it lets the gather warp
    // overwrite the scalars of the task being computed.
    let c = tiny();
    match run(&c, &rows_released_before_the_reads(), consumers_last(), 1) {
        Err(e) => println!("reported: {e}"),
        Ok(g) => {
            let m = msa_sim::backward::check(&c, &g).expect_err("the early release went unnoticed");
            println!("wrong gradients: {m}");
        }
    }
}

/// Consumer 1 (warps 8-11) runs only when no other warp can: consumer 0 then runs ahead to the
/// next task's dS^T stores while consumer 1's dQ^T of the task before has still to read them.
fn consumer1_last() -> Limits {
    Limits {
        starved_warps: 0xf00,
        ..Limits::default()
    }
}

#[test]
fn the_tiny_case_passes_with_one_consumer_starved() {
    let c = tiny();
    let g = run(&c, main_ptx(), consumer1_last(), 1).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "tiny, consumer 1 last");
}

/// The main kernel without the consumers' `ds_free` wait: the first `bar.sync` after the
/// comment that introduces it.
fn without_ds_free_wait() -> String {
    let lines: Vec<&str> = main_ptx().lines().collect();
    let note = lines
        .iter()
        .position(|l| l.contains("has read these dS^T rows"))
        .expect("the ds_free wait exists");
    let at = (note..lines.len())
        .find(|&i| lines[i].contains("bar.sync"))
        .expect("its bar.sync follows");
    assert!(
        at < note + 4,
        "the bar.sync is not the wait's: {}",
        lines[at]
    );
    let kept: Vec<&str> = lines[..at]
        .iter()
        .chain(&lines[at + 1..])
        .copied()
        .collect();
    kept.join("\n") + "\n"
}

#[test]
fn overwriting_ds_before_the_other_consumer_read_it_is_caught_with_one_consumer_starved() {
    // The write-after-read order on the shared dS^T: without the ds_free wait, consumer 0
    // stores the next task's dS^T rows before the starved consumer 1's dQ^T has read them.
    let c = tiny();
    match run(&c, &without_ds_free_wait(), consumer1_last(), 1) {
        Err(e) => println!("reported: {e}"),
        Ok(g) => {
            let m =
                msa_sim::backward::check(&c, &g).expect_err("the early overwrite went unnoticed");
            println!("wrong gradients: {m}");
        }
    }
}

#[test]
fn leaving_the_cta_before_its_last_dq_reduction_read_the_staging_is_reported() {
    // The second wait: after the walk, before the CTA's shared memory goes.
    let text = planted("cp.async.bulk.wait_group.read", 1, |_| String::new());
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Proxy(_))),
        "TMA reductions may still read shared memory; this one",
    );
}
