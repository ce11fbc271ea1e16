//! The Hopper forward (`msa_forward_sm90`) on the simulator through the runtime's own host
//! flow (`ResidentSchedule::build`, then `MsaForward::run_on` on a `SimDevice`), against the
//! f32 CPU reference forward: `out` within the seed's O tolerance (0.025 max-abs, 0.006
//! L2-rel), `lse` within 1e-3 max-abs, and empty rows exactly `out = 0`, `lse = −∞`. No GPU.

use half::bf16;
use msa_runtime::reference::{self, O_TOLERANCE};
use msa_runtime::{
    causal_support, workspace_layout, ForwardBuffers, MsaForward, ResidentSchedule,
    ScheduleBuildSizes, Span,
};
use msa_sim::backward::{cu_of, random_q2k, to_f32, Rng};
use msa_sim::device::{Arch, SimDevice};
use msa_sim::{Limits, TmaCompletion};

const Q_ROW: usize = 64 * 128;
const KV_ROW: usize = 4 * 128;

/// Runs the forward on the simulator and checks it against the CPU reference.
fn check(what: &str, cu: &[i32], q2k: &[i32], seed: u64, sms: usize, limits: Limits) {
    let t = *cu.last().unwrap() as usize;
    let mut rng = Rng(seed);
    let (q, q32) = rng.bf16s(t * Q_ROW);
    let (_, k32) = rng.bf16s(t * KV_ROW);
    let (_, v32) = rng.bf16s(t * KV_ROW);
    let want = reference::forward(&q32, &k32, &v32, q2k, cu).expect("reference");
    let (_, w) = workspace_layout(cu).expect("layout");
    let ka: Vec<bf16> = reference::to_aligned(&k32, cu, 4)
        .unwrap()
        .iter()
        .map(|&x| bf16::from_f32(x))
        .collect();
    let va: Vec<bf16> = reference::to_aligned(&v32, cu, 4)
        .unwrap()
        .iter()
        .map(|&x| bf16::from_f32(x))
        .collect();
    assert_eq!(ka.len(), w * KV_ROW);

    let mut dev = SimDevice::with_limits(Arch::Sm90, sms, limits);
    let sizes = ScheduleBuildSizes::new(t, cu.len() - 1, w, 64).expect("sizes");
    let mut s = ResidentSchedule::new(&mut dev, sizes).expect("schedule");
    let q2k_d = dev.upload_new("q2k", q2k);
    let cu_d = dev.upload_new("cu", cu);
    let q2k_s = Span::new(q2k_d.ptr.addr(), q2k.len());
    s.build(&mut dev, q2k_s, Span::new(cu_d.ptr.addr(), cu.len()))
        .expect("build");
    let q_d = dev.upload_new("q", &q);
    let k_d = dev.upload_new("k", &ka);
    let v_d = dev.upload_new("v", &va);
    // Garbage in the outputs: the forward must write every element.
    let out_d = dev.upload_new("out", &vec![bf16::from_f32(f32::NAN); t * Q_ROW]);
    let lse_d = dev.upload_new("lse", &vec![f32::NAN; t * 64]);
    let io = ForwardBuffers {
        q: Span::new(q_d.ptr.addr(), q.len()),
        k_aligned: Span::new(k_d.ptr.addr(), ka.len()),
        v_aligned: Span::new(v_d.ptr.addr(), va.len()),
        q2k: q2k_s,
        out: Span::new(out_d.ptr.addr(), t * Q_ROW),
        lse: Span::new(lse_d.ptr.addr(), t * 64),
    };
    MsaForward
        .run_on(&mut dev, &io, &s)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let out: Vec<bf16> = dev.read(io.out.addr, t * Q_ROW).unwrap();
    let lse: Vec<f32> = dev.read(io.lse.addr, t * 64).unwrap();
    let out = to_f32(&out);
    let stats = O_TOLERANCE
        .check("out", &out, &want.out)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut lse_err = 0f32;
    for (i, (&g, &e)) in lse.iter().zip(&want.lse).enumerate() {
        if e == f32::NEG_INFINITY {
            assert_eq!(g, e, "{what}: lse[{i}] of an empty row");
            let row = &out[i * 128..i * 128 + 128];
            assert!(
                row.iter().all(|&x| x == 0.0),
                "{what}: out of empty row {i}"
            );
        } else {
            let d = (g - e).abs();
            assert!(d <= 1e-3, "{what}: lse[{i}] = {g}, want {e}");
            lse_err = lse_err.max(d);
        }
    }
    eprintln!("{what}: {stats}; lse max-abs {lse_err:.2e}");
}

#[test]
fn forward_sm90_packed_tiny_documents_match_the_reference() {
    let cu = cu_of(&[127, 129, 1, 2, 3, 5, 128]);
    let q2k = causal_support(&cu).unwrap();
    check(
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
    check("random top-16", &cu, &q2k, 12, 132, Limits::default());
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
    check("immediate TMA, 2 SMs", &cu, &q2k, 13, 2, limits);
}

#[test]
fn forward_sm90_on_a_flagged_schedule_writes_empty_rows() {
    // An id after the query's own block: the build flags it, and the forward writes
    // out = 0, lse = −inf everywhere rather than anything computed from the bad selection.
    let cu = cu_of(&[200]);
    let t = 200;
    let mut q2k = causal_support(&cu).unwrap();
    q2k[5 * 16 + 3] = 1; // query 5 (block 0) selects block 1
    let mut rng = Rng(3);
    let (q, _) = rng.bf16s(t * Q_ROW);
    let (k, _) = rng.bf16s(256 * KV_ROW);
    let mut dev = SimDevice::new(Arch::Sm90, 8);
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
    let out: Vec<bf16> = dev.read(io.out.addr, t * Q_ROW).unwrap();
    let lse: Vec<f32> = dev.read(io.lse.addr, t * 64).unwrap();
    assert!(out.iter().all(|x| x.to_f32() == 0.0));
    assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
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
