//! Both forward kernels on the simulator through the runtime's own host flow
//! (`ResidentSchedule::build`, then `MsaForward::run_on` on a `SimDevice`, which picks
//! `msa_forward_sm90` on an `Arch::Sm90` device and `msa_forward_sm100` on an `Arch::Sm100`
//! one), against the f32 CPU reference forward: `out` within the seed's O tolerance (0.025
//! max-abs, 0.006 L2-rel), `lse` within 1e-3 max-abs, and empty rows exactly `out = 0`,
//! `lse = −∞`. No GPU. Then planted bugs in the SM100 kernel's text, each of which must be
//! reported.

use half::bf16;
use msa_runtime::{
    causal_support, ForwardBuffers, MsaForward, ResidentSchedule, RuntimeError, ScheduleBuildSizes,
    Span,
};
use msa_sim::backward::{cu_of, random_q2k, to_f32, Rng};
use msa_sim::device::{sim_error, Arch, SimDevice};
use msa_sim::{Limits, TmaCompletion, UmmaOrder};

mod forward_common;
mod ptx_edit;
use forward_common::{compare, device_schedule, inputs, Inputs, KV_ROW, Q_ROW};
use ptx_edit::{without_first_after, without_wait_before};

/// The forward kernel the runtime must pick on `arch`.
fn forward_name(arch: Arch) -> &'static str {
    match arch {
        Arch::Sm90 => "msa_forward_sm90",
        Arch::Sm100 => "msa_forward_sm100",
    }
}

/// Runs the forward on a simulated `arch` device (with `ptx` in place of the shipped kernel
/// when given) and returns `out` (as f32) and `lse`.
fn run(
    arch: Arch,
    cu: &[i32],
    q2k: &[i32],
    inp: &Inputs,
    sms: usize,
    limits: Limits,
    ptx: Option<String>,
) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
    let t = inp.t;
    let w = inp.ka.len() / KV_ROW;
    let mut dev = SimDevice::with_limits(arch, sms, limits);
    if let Some(text) = ptx {
        dev.override_ptx(forward_name(arch), text);
    }
    let (s, q2k_s) = device_schedule(&mut dev, cu, q2k, w);
    let q_d = dev.upload_new("q", &inp.q);
    let k_d = dev.upload_new("k", &inp.ka);
    let v_d = dev.upload_new("v", &inp.va);
    // Garbage in the outputs: the forward must write every element.
    let out_d = dev.upload_new("out", &vec![bf16::from_f32(f32::NAN); t * Q_ROW]);
    let lse_d = dev.upload_new("lse", &vec![f32::NAN; t * 64]);
    let io = ForwardBuffers {
        q: Span::new(q_d.ptr.addr(), inp.q.len()),
        k_aligned: Span::new(k_d.ptr.addr(), inp.ka.len()),
        v_aligned: Span::new(v_d.ptr.addr(), inp.va.len()),
        q2k: q2k_s,
        out: Span::new(out_d.ptr.addr(), t * Q_ROW),
        lse: Span::new(lse_d.ptr.addr(), t * 64),
    };
    MsaForward.run_on(&mut dev, &io, &s)?;
    let main = dev.launches().last().expect("the forward launched").kernel;
    assert_eq!(main, forward_name(arch), "the kernel the runtime picked");
    let out: Vec<bf16> = dev.read(io.out.addr, t * Q_ROW).unwrap();
    let lse: Vec<f32> = dev.read(io.lse.addr, t * 64).unwrap();
    Ok((to_f32(&out), lse))
}

/// Runs the forward on a simulated `arch` device and checks it against the CPU reference.
fn check(arch: Arch, what: &str, cu: &[i32], q2k: &[i32], seed: u64, sms: usize, limits: Limits) {
    let inp = inputs(cu, q2k, seed);
    let (out, lse) =
        run(arch, cu, q2k, &inp, sms, limits, None).unwrap_or_else(|e| panic!("{what}: {e}"));
    let stats = compare(&inp, &out, &lse).unwrap_or_else(|e| panic!("{what}: {e}"));
    eprintln!("{what}: {stats}");
}

#[test]
fn forward_sm90_packed_tiny_documents_match_the_reference() {
    let cu = cu_of(&[127, 129, 1, 2, 3, 5, 128]);
    let q2k = causal_support(&cu).unwrap();
    check(
        Arch::Sm90,
        "causal support, packed",
        &cu,
        &q2k,
        11,
        132,
        Limits::default(),
    );
}

#[test]
fn forward_sm90_random_selections_with_holes_and_a_silent_head() {
    // Odd lengths, blocks skipped, −1 holes, rows that select nothing (head 2 is silent, and
    // some queries of the others skip their own block).
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(5);
    let q2k = random_q2k(&cu, &mut rng, &[2]);
    check(
        Arch::Sm90,
        "random top-16",
        &cu,
        &q2k,
        12,
        132,
        Limits::default(),
    );
}

#[test]
fn forward_sm90_with_few_ctas_and_immediate_tma() {
    // Two CTAs walk many items: every stage of the three rings is reused, and copies that land
    // at issue would expose a producer that refills a stage before its consumers released it.
    let cu = cu_of(&[260, 3]);
    let mut rng = Rng(9);
    let q2k = random_q2k(&cu, &mut rng, &[]);
    let limits = Limits {
        tma_completion: TmaCompletion::Immediate,
        ..Limits::default()
    };
    check(Arch::Sm90, "immediate TMA, 2 SMs", &cu, &q2k, 13, 2, limits);
}

/// An id after the query's own block: the build flags it, and the forward writes
/// out = 0, lse = −inf everywhere rather than anything computed from the bad selection.
fn flagged_schedule_writes_empty_rows(arch: Arch) {
    let cu = cu_of(&[200]);
    let t = 200;
    let mut q2k = causal_support(&cu).unwrap();
    q2k[5 * 16 + 3] = 1; // query 5 (block 0) selects block 1
    let mut rng = Rng(3);
    let (q, _) = rng.bf16s(t * Q_ROW);
    let (k, _) = rng.bf16s(256 * KV_ROW);
    let mut dev = SimDevice::new(arch, 8);
    let sizes = ScheduleBuildSizes::new(t, 1, 256, 64).unwrap();
    let mut s = ResidentSchedule::new(&mut dev, sizes).unwrap();
    let q2k_d = dev.upload_new("q2k", &q2k);
    let cu_d = dev.upload_new("cu", &cu);
    let q2k_s = Span::new(q2k_d.ptr.addr(), q2k.len());
    s.build(&mut dev, q2k_s, Span::new(cu_d.ptr.addr(), 2))
        .unwrap();
    assert!(
        s.status(&mut dev).is_err(),
        "the build must flag the selection"
    );
    let q_d = dev.upload_new("q", &q);
    let k_d = dev.upload_new("k", &k);
    let out_d = dev.upload_new("out", &vec![bf16::from_f32(1.0); t * Q_ROW]);
    let lse_d = dev.upload_new("lse", &vec![1.0f32; t * 64]);
    let io = ForwardBuffers {
        q: Span::new(q_d.ptr.addr(), q.len()),
        k_aligned: Span::new(k_d.ptr.addr(), k.len()),
        v_aligned: Span::new(k_d.ptr.addr(), k.len()),
        q2k: q2k_s,
        out: Span::new(out_d.ptr.addr(), t * Q_ROW),
        lse: Span::new(lse_d.ptr.addr(), t * 64),
    };
    MsaForward.run_on(&mut dev, &io, &s).unwrap();
    let main = dev.launches().last().expect("the forward launched").kernel;
    assert_eq!(main, forward_name(arch));
    let out: Vec<bf16> = dev.read(io.out.addr, t * Q_ROW).unwrap();
    let lse: Vec<f32> = dev.read(io.lse.addr, t * 64).unwrap();
    assert!(out.iter().all(|x| x.to_f32() == 0.0));
    assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
}

#[test]
fn forward_sm90_on_a_flagged_schedule_writes_empty_rows() {
    flagged_schedule_writes_empty_rows(Arch::Sm90);
}

#[test]
fn forward_checks_lengths_before_any_launch() {
    let mut dev = SimDevice::new(Arch::Sm90, 8);
    let sizes = ScheduleBuildSizes::new(10, 1, 128, 64).unwrap();
    let s = ResidentSchedule::new(&mut dev, sizes).unwrap();
    let b = dev.upload_new("buf", &vec![0u8; 1 << 20]);
    let a = b.ptr.addr();
    let io = ForwardBuffers {
        q: Span::new(a, 10 * Q_ROW),
        k_aligned: Span::new(a, 128 * KV_ROW),
        v_aligned: Span::new(a, 128 * KV_ROW),
        q2k: Span::new(a, 4 * 10 * 16 + 1),
        out: Span::new(a + (1 << 19), 10 * Q_ROW),
        lse: Span::new(a + (1 << 19) + 2 * 10 * Q_ROW as u64, 10 * 64),
    };
    let e = MsaForward
        .run_on(&mut dev, &io, &s)
        .unwrap_err()
        .to_string();
    assert!(e.contains("q2k") && e.contains("641"), "{e}");
    assert!(dev.launches().is_empty(), "nothing may launch");
}

// ---- msa_forward_sm100 (never run on a B200; this is its only execution) -------------------

#[test]
fn forward_sm100_packed_tiny_documents_match_the_reference() {
    let cu = cu_of(&[127, 129, 1, 2, 3, 5, 128]);
    let q2k = causal_support(&cu).unwrap();
    check(
        Arch::Sm100,
        "sm100, causal support, packed",
        &cu,
        &q2k,
        21,
        148,
        Limits::default(),
    );
}

#[test]
fn forward_sm100_random_selections_with_holes_and_a_silent_head() {
    // Odd lengths, −1 holes, blocks skipped, rows with no key (head 2 silent).
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(5);
    let q2k = random_q2k(&cu, &mut rng, &[2]);
    check(
        Arch::Sm100,
        "sm100, random top-16",
        &cu,
        &q2k,
        22,
        148,
        Limits::default(),
    );
}

#[test]
fn forward_sm100_with_few_ctas_immediate_tma_and_other_mma_orders() {
    // Two CTAs walk many items, so every stage and the TMEM regions are reused; copies that
    // land at issue and MMAs completing in other orders the ISA allows would expose a stage
    // refilled or a TMEM column overwritten before its reader was done.
    let cu = cu_of(&[260, 3]);
    let mut rng = Rng(9);
    let q2k = random_q2k(&cu, &mut rng, &[]);
    for (what, limits) in [
        (
            "sm100, immediate TMA, 2 SMs",
            Limits {
                tma_completion: TmaCompletion::Immediate,
                ..Limits::default()
            },
        ),
        (
            "sm100, MMAs latest-first, 2 SMs",
            Limits {
                umma_order: UmmaOrder::Reversed,
                ..Limits::default()
            },
        ),
    ] {
        check(Arch::Sm100, what, &cu, &q2k, 23, 2, limits);
    }
}

#[test]
fn forward_sm100_on_a_flagged_schedule_writes_empty_rows() {
    flagged_schedule_writes_empty_rows(Arch::Sm100);
}

// ---- planted bugs in the shipped msa_forward_sm100 text -----------------------------------

fn sm100_ptx() -> &'static str {
    msa_runtime::kernels::msa_forward_sm100::PTX_SM_100A
}

/// The kernel with the `nth` line of role `role` that contains `needle` replaced by `with`.
fn planted_in_role(role: &str, needle: &str, nth: usize, with: impl Fn(&str) -> String) -> String {
    let mut inside = false;
    let mut seen = 0;
    let mut out = String::new();
    for l in sm100_ptx().lines() {
        if l.trim() == format!("// role {role}: begin") {
            inside = true;
        } else if l.trim() == format!("// role {role}: end") {
            inside = false;
        }
        if inside && l.contains(needle) {
            if seen == nth {
                let new = with(l);
                assert_ne!(new, l, "the edit of `{l}` must change it");
                out.push_str(&new);
                out.push('\n');
                seen += 1;
                continue;
            }
            seen += 1;
        }
        out.push_str(l);
        out.push('\n');
    }
    assert!(seen > nth, "line {nth} with `{needle}` not found in {role}");
    out
}

/// Two documents, one of two blocks: items of one and of two blocks (the rescale path), on 2
/// SMs so each CTA walks many items and every stage is reused.
fn planted_case() -> (Vec<i32>, Vec<i32>, Inputs) {
    let cu = cu_of(&[150, 20]);
    let q2k = causal_support(&cu).unwrap();
    let inp = inputs(&cu, &q2k, 31);
    (cu, q2k, inp)
}

/// Runs `text` in place of the kernel; it must fail with a simulator error, or give results
/// the comparison rejects. Returns what was reported.
fn must_not_pass(text: String) -> String {
    let (cu, q2k, inp) = planted_case();
    match run(
        Arch::Sm100,
        &cu,
        &q2k,
        &inp,
        2,
        Limits::default(),
        Some(text),
    ) {
        Err(e) => {
            assert!(sim_error(&e).is_some(), "not a simulator error: {e}");
            e.to_string()
        }
        Ok((out, lse)) => match compare(&inp, &out, &lse) {
            Ok(stats) => panic!("the planted bug went unnoticed: {stats}"),
            Err(e) => e,
        },
    }
}

/// As [`must_not_pass`], and the report must contain `needle`.
fn reported(text: String, needle: &str) {
    let msg = must_not_pass(text);
    println!("{msg}");
    assert!(msg.contains(needle), "`{needle}` missing in: {msg}");
}

#[test]
fn forward_sm100_planted_case_passes_unmodified() {
    let (cu, q2k, inp) = planted_case();
    let text = sm100_ptx().to_string();
    let (out, lse) = run(
        Arch::Sm100,
        &cu,
        &q2k,
        &inp,
        2,
        Limits::default(),
        Some(text),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    compare(&inp, &out, &lse).unwrap();
}

#[test]
fn forward_sm100_reading_tcgen05_ld_registers_before_wait_ld_is_reported() {
    reported(
        without_first_after(sm100_ptx(), "", "tcgen05.wait::ld.sync.aligned"),
        "not yet waited for",
    );
}

#[test]
fn forward_sm100_publishing_p_without_wait_st_is_reported() {
    reported(
        without_first_after(sm100_ptx(), "", "tcgen05.wait::st.sync.aligned"),
        "tcgen05.wait::st first",
    );
}

#[test]
fn forward_sm100_loading_s_before_its_commit_is_reported() {
    // The compute warps' wait on the S commit is the last wait before the first tcgen05.ld.
    reported(
        without_wait_before(sm100_ptx(), "tcgen05.ld.sync.aligned"),
        "tcgen05.ld",
    );
}

#[test]
fn forward_sm100_an_epilogue_not_waiting_for_o_is_reported() {
    reported(
        without_wait_before(sm100_ptx(), "out = O/l as bf16"),
        "reads TMEM lane 0, column 256, never written",
    );
}

#[test]
fn forward_sm100_pv_reading_p_of_the_wrong_stage_is_reported() {
    // The MMA warp's third stage address (P·V's A: s_first's S, s_next's S, then P·V) with
    // the stage stride 0: every P·V reads stage 0's P, which the next S overwrites.
    let text = planted_in_role("mma", ", 128, %r", 2, |l| l.replace(", 128, ", ", 0, "));
    reported(text, "MMAs on different accumulators are not ordered");
}
