//! The KV-parallel forward pass (`msa_forward_kv_sm90`, experimental) on the simulator through
//! the runtime's host flow (`ResidentSchedule::build`, then `MsaForwardKv::run_to_pools`),
//! combined row by row with `forward_kv::combine_row` and compared with the f32 CPU reference
//! forward: `out` within the seed's O tolerance (0.025 max-abs, 0.006 L2-rel), `lse` within
//! 1e-3 max-abs, empty rows `out = 0`, `lse = −∞`. No GPU.

use half::bf16;
use msa_runtime::contract::Locality;
use msa_runtime::forward_kv::{
    combine_row, ForwardKvBuffers, L2Hints, MsaForwardKv, OPool, OPoolSpan, Reference,
    FORWARD_KV_WALK_SPLIT,
};
use msa_runtime::reference;
use msa_runtime::{causal_support, Span};
use msa_sim::backward::{cu_of, random_q2k, Rng};
use msa_sim::device::{Arch, SimDevice};
use msa_sim::{L2Sides, L2Traffic, Limits, TmaCompletion};

mod forward_common;
mod ptx_edit;
use forward_common::{compare, device_schedule, inputs, Inputs, KV_ROW, Q_ROW};
use ptx_edit::{without_first_after, without_wait_at, without_wait_before};

/// `scale·‖q‖·max‖k‖` per row (the largest key norm of the row's KV head), slightly raised:
/// an upper bound of the row's logits, computed here from the bf16 inputs.
fn bound(inp: &Inputs) -> Vec<f32> {
    let norm = |x: &[bf16]| x.iter().map(|v| v.to_f32().powi(2)).sum::<f32>().sqrt();
    let mut kmax = [0f32; 4];
    for (i, row) in inp.ka.chunks(128).enumerate() {
        kmax[i % 4] = kmax[i % 4].max(norm(row));
    }
    let scale = (128f32).powf(-0.5);
    inp.q
        .chunks(128)
        .enumerate()
        .map(|(i, qh)| scale * norm(qh) * kmax[(i % 64) / 16] * 1.001 + 1e-3)
        .collect()
}

/// The pass on a simulated H200 with `reference` per row, then the host combine: `out`, `lse`.
fn run(
    cu: &[i32],
    q2k: &[i32],
    inp: &Inputs,
    reference_rows: &[f32],
    sms: usize,
    limits: Limits,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let split = FORWARD_KV_WALK_SPLIT;
    run_ptx(cu, q2k, inp, reference_rows, (sms, limits), split, None)
}

/// [`run`] with each walk split between `split` CTAs, and `ptx` in place of the shipped
/// `msa_forward_kv_sm90` when given.
fn run_ptx(
    cu: &[i32],
    q2k: &[i32],
    inp: &Inputs,
    reference_rows: &[f32],
    (sms, limits): (usize, Limits),
    split: u32,
    ptx: Option<String>,
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let t = inp.t;
    let w = inp.ka.len() / KV_ROW;
    let mut dev = SimDevice::with_limits(Arch::Sm90, sms, limits);
    if let Some(text) = ptx {
        dev.override_ptx("msa_forward_kv_sm90", text);
    }
    let (s, _) = device_schedule(&mut dev, cu, q2k, w);
    let q_d = dev.upload_new("q", &inp.q);
    let k_d = dev.upload_new("k", &inp.ka);
    let v_d = dev.upload_new("v", &inp.va);
    let r_d = dev.upload_new("reference", reference_rows);
    // Garbage in the pools: the flow zeroes them.
    let o_d = dev.upload_new("o_pool", &vec![f32::NAN; t * Q_ROW]);
    let l_d = dev.upload_new("l_pool", &vec![f32::NAN; t * 64]);
    let m_d = dev.upload_new("m_pool", &vec![u32::MAX; t * 64]);
    let io = ForwardKvBuffers {
        q: Span::new(q_d.ptr.addr(), inp.q.len()),
        k_aligned: Span::new(k_d.ptr.addr(), inp.ka.len()),
        v_aligned: Span::new(v_d.ptr.addr(), inp.va.len()),
        reference: Span::new(r_d.ptr.addr(), t * 64),
        o_pool: OPoolSpan::F32(Span::new(o_d.ptr.addr(), t * Q_ROW)),
        l_pool: Span::new(l_d.ptr.addr(), t * 64),
        m_pool: Span::new(m_d.ptr.addr(), t * 64),
    };
    MsaForwardKv::new()
        .with_walk_split(split)
        .map_err(|e| e.to_string())?
        .run_to_pools(&mut dev, &io, &s)
        .map_err(|e| e.to_string())?;
    let main = dev.launches().last().expect("launched").kernel;
    assert_eq!(main, "msa_forward_kv_sm90");
    let o: Vec<f32> = dev.read(o_d.ptr.addr(), t * Q_ROW).unwrap();
    let l: Vec<f32> = dev.read(io.l_pool.addr, t * 64).unwrap();
    let m: Vec<u32> = dev.read(io.m_pool.addr, t * 64).unwrap();
    let mut out = vec![0f32; t * Q_ROW];
    let mut lse = vec![f32::NEG_INFINITY; t * 64];
    for row in 0..t * 64 {
        let o_row = &o[row * 128..row * 128 + 128];
        match combine_row(o_row, l[row], m[row], reference_rows[row]) {
            Ok(Some((x, y))) => {
                out[row * 128..row * 128 + 128].copy_from_slice(&x);
                lse[row] = y;
            }
            Ok(None) => {}
            Err(gap) => return Err(format!("row {row}: reference {gap} above its maximum")),
        }
    }
    Ok((out, lse))
}

fn check(what: &str, cu: &[i32], q2k: &[i32], seed: u64, sms: usize, limits: Limits) -> Inputs {
    let inp = inputs(cu, q2k, seed);
    let (out, lse) =
        run(cu, q2k, &inp, &bound(&inp), sms, limits).unwrap_or_else(|e| panic!("{what}: {e}"));
    let stats = compare(&inp, &out, &lse).unwrap_or_else(|e| panic!("{what}: {e}"));
    eprintln!("{what}: {stats}");
    inp
}

#[test]
fn forward_kv_packed_tiny_documents_match_the_reference() {
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
fn forward_kv_random_selections_with_holes_and_a_silent_head() {
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(5);
    let q2k = random_q2k(&cu, &mut rng, &[2]);
    check("random top-16", &cu, &q2k, 12, 132, Limits::default());
}

#[test]
fn forward_kv_with_few_ctas_and_immediate_tma_and_any_reference() {
    // Two CTAs walk many tasks and segments: both Q stages and the K/V stage are reused, and
    // copies that land at issue expose a refill before the consumers' release.
    let cu = cu_of(&[260, 3]);
    let mut rng = Rng(9);
    let q2k = random_q2k(&cu, &mut rng, &[]);
    let limits = Limits {
        tma_completion: TmaCompletion::Immediate,
        ..Limits::default()
    };
    let inp = check("immediate TMA, 2 SMs", &cu, &q2k, 13, 2, limits);
    // The result does not depend on the reference while the row's terms keep their range:
    // 20 above the bound gives the same answer, 100 above it is reported, not wrong.
    let high: Vec<f32> = bound(&inp).iter().map(|r| r + 20.0).collect();
    let (out, lse) = run(&cu, &q2k, &inp, &high, 2, limits).expect("R + 20");
    compare(&inp, &out, &lse).expect("R + 20");
    let far: Vec<f32> = bound(&inp).iter().map(|r| r + 100.0).collect();
    let e = run(&cu, &q2k, &inp, &far, 2, limits).unwrap_err();
    assert!(e.contains("above its maximum"), "{e}");
}

#[test]
fn forward_kv_walks_split_in_any_part_count_match_the_reference() {
    // On two SMs each walk holds many rows: one part takes it whole, 4 and 16 parts cut it
    // into runs of a few rows, some of them empty. A row walked twice or never would show in
    // the comparison.
    let (cu, q2k, inp) = planted_case();
    for split in [1, 4, 16] {
        let limits = (2, Limits::default());
        let (out, lse) = run_ptx(&cu, &q2k, &inp, &bound(&inp), limits, split, None)
            .unwrap_or_else(|e| panic!("split {split}: {e}"));
        let stats = compare(&inp, &out, &lse).unwrap_or_else(|e| panic!("split {split}: {e}"));
        eprintln!("split {split}: {stats}");
    }
}

#[test]
fn a_walk_split_that_is_no_power_of_two_up_to_16_is_refused() {
    for parts in [0, 3, 12, 32] {
        let e = MsaForwardKv::<SimDevice>::new()
            .with_walk_split(parts)
            .err()
            .unwrap_or_else(|| panic!("{parts} accepted"))
            .to_string();
        assert!(
            e.contains("walk_split") && e.contains(&parts.to_string()),
            "{e}"
        );
        assert!(e.contains("a power of two from 1 to 16"), "{e}");
    }
}

/// The whole device flow (`MsaForwardKv::run_on`: bound, pass, combine) on a simulated H200:
/// `out` (bf16) and `lse`, and the verdict.
fn run_device(
    cu: &[i32],
    q2k: &[i32],
    q: &[bf16],
    ka: &[bf16],
    va: &[bf16],
) -> (Vec<f32>, Vec<f32>, Result<u32, msa_runtime::RuntimeError>) {
    run_device_with(cu, q2k, (q, ka, va), OPool::F32)
}

/// [`run_device`] with `o_pool` in `pool` (the bound as reference).
fn run_device_with(
    cu: &[i32],
    q2k: &[i32],
    inputs: (&[bf16], &[bf16], &[bf16]),
    pool: OPool,
) -> (Vec<f32>, Vec<f32>, Result<u32, msa_runtime::RuntimeError>) {
    run_device_full(cu, q2k, inputs, (pool, Reference::Bound))
}

/// [`run_device`] with `o_pool` in `pool` and the references from `reference`; checks that
/// the passes that `reference` implies ran, and only those.
fn run_device_full(
    cu: &[i32],
    q2k: &[i32],
    inputs: (&[bf16], &[bf16], &[bf16]),
    how: (OPool, Reference),
) -> (Vec<f32>, Vec<f32>, Result<u32, msa_runtime::RuntimeError>) {
    let mut dev = SimDevice::new(Arch::Sm90, 132);
    run_device_on(&mut dev, &mut flow(how), cu, q2k, inputs, how).expect("forward")
}

/// [`run_device_on`] with `inp`, every error a panic naming `what`, and `out` and `lse`
/// compared with `inp`'s reference: the rows recomputed, and the comparison's line.
fn run_checked(
    dev: &mut SimDevice,
    fwd: &mut MsaForwardKv<SimDevice>,
    (cu, q2k): (&[i32], &[i32]),
    inp: &Inputs,
    how: (OPool, Reference),
    what: &str,
) -> (u32, String) {
    let inputs = (&inp.q[..], &inp.ka[..], &inp.va[..]);
    let (out, lse, verdict) =
        run_device_on(dev, fwd, cu, q2k, inputs, how).unwrap_or_else(|e| panic!("{what}: {e}"));
    let recomputed = verdict.unwrap_or_else(|e| panic!("{what}: {e}"));
    let stats = compare(inp, &out, &lse).unwrap_or_else(|e| panic!("{what}: {e}"));
    (recomputed, stats)
}

/// A flow with `o_pool` in `pool` and the references from `reference`.
fn flow((pool, reference): (OPool, Reference)) -> MsaForwardKv<SimDevice> {
    MsaForwardKv::new()
        .with_o_pool(pool)
        .with_reference(reference)
}

/// What [`run_device_on`] returns: `out`, `lse` and the verdict.
type DeviceRun = (Vec<f32>, Vec<f32>, Result<u32, msa_runtime::RuntimeError>);

/// [`run_device_full`] on `dev` with the caller's flow `fwd` (whose settings `how` states); an
/// error of the flow (a simulator fault) as text.
fn run_device_on(
    dev: &mut SimDevice,
    fwd: &mut MsaForwardKv<SimDevice>,
    cu: &[i32],
    q2k: &[i32],
    (q, ka, va): (&[bf16], &[bf16], &[bf16]),
    (pool, reference): (OPool, Reference),
) -> Result<DeviceRun, String> {
    let t = *cu.last().unwrap() as usize;
    let w = ka.len() / KV_ROW;
    let (s, q2k_s) = device_schedule(dev, cu, q2k, w);
    let q_d = dev.upload_new("q", q);
    let k_d = dev.upload_new("k", ka);
    let v_d = dev.upload_new("v", va);
    let out_d = dev.upload_new("out", &vec![bf16::from_f32(f32::NAN); t * Q_ROW]);
    let lse_d = dev.upload_new("lse", &vec![f32::NAN; t * 64]);
    let io = msa_runtime::ForwardBuffers {
        q: Span::new(q_d.ptr.addr(), q.len()),
        k_aligned: Span::new(k_d.ptr.addr(), ka.len()),
        v_aligned: Span::new(v_d.ptr.addr(), va.len()),
        q2k: q2k_s,
        out: Span::new(out_d.ptr.addr(), t * Q_ROW),
        lse: Span::new(lse_d.ptr.addr(), t * 64),
    };
    fwd.run_on(dev, &io, &s).map_err(|e| e.to_string())?;
    let ran = |name: &str| dev.launches().iter().any(|l| l.kernel == name);
    let exact = reference == Reference::ExactMax;
    assert_eq!(ran("msa_forward_kv_max_sm90"), exact, "the max pass");
    assert_eq!(
        ran("fwd_kv_reference"),
        exact,
        "the reference from the maxima"
    );
    assert_eq!(
        ran("fwd_kv_bound"),
        reference == Reference::Bound,
        "the bound"
    );
    assert_eq!(
        ran("fwd_kv_probe"),
        reference == Reference::Probe,
        "the probe"
    );
    // The f16 pass is the paired pool's under `with_paired_pool(true)`.
    let passes: &[&str] = match pool {
        OPool::F32 => &["msa_forward_kv_sm90"],
        OPool::F16 => &["msa_forward_kv_f16_sm90", "msa_forward_kv_f16p_sm90"],
    };
    assert!(
        dev.launches().iter().any(|l| passes.contains(&l.kernel)),
        "the {pool:?} pass ran"
    );
    let verdict = fwd.status(dev);
    let out: Vec<bf16> = dev.read(io.out.addr, t * Q_ROW).unwrap();
    let lse: Vec<f32> = dev.read(io.lse.addr, t * 64).unwrap();
    Ok((out.iter().map(|x| x.to_f32()).collect(), lse, verdict))
}

#[test]
fn forward_kv_device_flow_matches_the_reference() {
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(21);
    let q2k = random_q2k(&cu, &mut rng, &[1]);
    let inp = inputs(&cu, &q2k, 22);
    let (out, lse, verdict) = run_device(&cu, &q2k, &inp.q, &inp.ka, &inp.va);
    assert_eq!(
        verdict.expect("every row normalised"),
        0,
        "no row recomputed"
    );
    let stats = compare(&inp, &out, &lse).unwrap_or_else(|e| panic!("device flow: {e}"));
    eprintln!("device flow: {stats}");
}

/// The reference forward of `inp` with its (edited) bf16 inputs.
fn reference_of(cu: &[i32], q2k: &[i32], inp: &Inputs) -> reference::Forward {
    let f = |x: &[bf16]| x.iter().map(|v| v.to_f32()).collect::<Vec<f32>>();
    let ks = reference::from_aligned(&f(&inp.ka), cu, 4).unwrap();
    let vs = reference::from_aligned(&f(&inp.va), cu, 4).unwrap();
    reference::forward(&f(&inp.q), &ks, &vs, q2k, cu).unwrap()
}

/// The device flow of `how` on `inp` with V scaled by `factor` (a power of 2), against the
/// reference of the scaled inputs: no row recomputed, and `out` within the tolerances relative
/// to its scale (they are for unit-sized values).
fn check_v_scaled(
    what: &str,
    cu: &[i32],
    q2k: &[i32],
    mut inp: Inputs,
    factor: f32,
    how: (OPool, Reference),
) {
    for v in inp.va.iter_mut() {
        *v = bf16::from_f32(v.to_f32() * factor);
    }
    let want = reference_of(cu, q2k, &inp);
    let (out, lse, verdict) = run_device_full(cu, q2k, (&inp.q, &inp.ka, &inp.va), how);
    assert_eq!(
        verdict.unwrap_or_else(|e| panic!("{what}: {e}")),
        0,
        "{what}"
    );
    let norm = |x: &[f32]| x.iter().map(|v| v / factor).collect::<Vec<f32>>();
    inp.want_out = norm(&want.out);
    inp.want_lse = want.lse;
    let stats = compare(&inp, &norm(&out), &lse).unwrap_or_else(|e| panic!("{what}: {e}"));
    eprintln!("{how:?}, {what}: {stats}");
}

/// One document of 200 tokens, every causal block selected, and one key of KV head 0 with a
/// norm of 256 (key 190: one document, so the workspace row is the token; along d = 0), with
/// its reference.
fn outlier_case() -> (Vec<i32>, Vec<i32>, Inputs) {
    let cu = cu_of(&[200]);
    let q2k = causal_support(&cu).unwrap();
    let mut inp = inputs(&cu, &q2k, 23);
    for d in 0..128 {
        inp.ka[190 * KV_ROW + d] = bf16::from_f32(if d == 0 { 256.0 } else { 0.0 });
    }
    let want = reference_of(&cu, &q2k, &inp);
    inp.want_out = want.out;
    inp.want_lse = want.lse;
    (cu, q2k, inp)
}

#[test]
fn an_outlier_key_sends_the_rows_of_its_block_to_the_recompute_pass_exactly() {
    // One key of KV head 0 with a norm of 256 lifts the bound of every row of heads 0-15 that
    // selected its block (block 1: queries 128..200 under the causal support) far above their
    // logits: summed against it, their terms would leave f32's range. The first combine hands
    // exactly those 72·16 rows to the recompute pass with their exact maxima; every row then
    // matches the reference.
    let (cu, q2k, inp) = outlier_case();
    let (out, lse, verdict) = run_device(&cu, &q2k, &inp.q, &inp.ka, &inp.va);
    let recomputed = verdict.expect("every row normalised");
    assert_eq!(
        recomputed,
        72 * 16,
        "the rows of heads 0-15 that selected block 1"
    );
    let stats = compare(&inp, &out, &lse).unwrap_or_else(|e| panic!("outlier: {e}"));
    eprintln!("outlier key, {recomputed} rows recomputed: {stats}");
}

/// A NaN query row with the pool and reference of `how`: its `lse` NaN and `out` 0, the
/// verdict `ForwardReferenceRange` for that one row, every other row exact.
fn nan_row_case(how: (OPool, Reference)) {
    let cu = cu_of(&[200]);
    let q2k = causal_support(&cu).unwrap();
    let mut inp = inputs(&cu, &q2k, 24);
    let bad_row = 50 * 64 + 3;
    for d in 0..128 {
        inp.q[bad_row * 128 + d] = bf16::from_f32(f32::NAN);
    }
    let (out, lse, verdict) = run_device_full(&cu, &q2k, (&inp.q, &inp.ka, &inp.va), how);
    assert!(
        lse[bad_row].is_nan(),
        "lse of the NaN row: {}",
        lse[bad_row]
    );
    assert!(out[bad_row * 128..bad_row * 128 + 128]
        .iter()
        .all(|&x| x == 0.0));
    match verdict {
        Err(msa_runtime::RuntimeError::ForwardReferenceRange { rows }) => assert_eq!(rows, 1),
        other => panic!("verdict {other:?}"),
    }
    // Every other row is exact.
    let mut want_lse = inp.want_lse.clone();
    let mut got_lse = lse.clone();
    let (mut want_out, mut got_out) = (inp.want_out.clone(), out.clone());
    want_lse[bad_row] = 0.0;
    got_lse[bad_row] = 0.0;
    want_out[bad_row * 128..bad_row * 128 + 128].fill(0.0);
    got_out[bad_row * 128..bad_row * 128 + 128].fill(0.0);
    inp.want_lse = want_lse;
    inp.want_out = want_out;
    compare(&inp, &got_out, &got_lse).unwrap_or_else(|e| panic!("other rows: {e}"));
}

#[test]
fn a_nan_query_row_comes_out_nan_and_is_reported() {
    nan_row_case((OPool::F32, Reference::Bound));
}

// ---- the f16 o_pool (OPool::F16) ------------------------------------------------------------

/// The device flow with the f16 pool on `inp`, compared with its reference; the verdict.
fn check_f16(what: &str, cu: &[i32], q2k: &[i32], inp: &Inputs) -> u32 {
    let (out, lse, verdict) = run_device_with(cu, q2k, (&inp.q, &inp.ka, &inp.va), OPool::F16);
    let recomputed = verdict.unwrap_or_else(|e| panic!("{what}: {e}"));
    let stats = compare(inp, &out, &lse).unwrap_or_else(|e| panic!("{what}: {e}"));
    eprintln!("f16 pool, {what}, {recomputed} rows recomputed: {stats}");
    recomputed
}

/// `inp` with Q and K halved, and its reference: the Cauchy-Schwarz bound then lies within
/// about 3 of each row's maximum (a quarter of the unit-normal inputs' gap of about 10), as
/// on the benchmark's uniform inputs.
fn tight(cu: &[i32], q2k: &[i32], mut inp: Inputs) -> Inputs {
    for x in inp.q.iter_mut().chain(inp.ka.iter_mut()) {
        *x = bf16::from_f32(x.to_f32() * 0.5);
    }
    let want = reference_of(cu, q2k, &inp);
    inp.want_out = want.out;
    inp.want_lse = want.lse;
    inp
}

#[test]
fn f16_pool_device_flow_matches_the_reference() {
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(21);
    let q2k = random_q2k(&cu, &mut rng, &[1]);
    // Bounds within the f16 window: one pass, no row recomputed.
    let inp = tight(&cu, &q2k, inputs(&cu, &q2k, 22));
    assert_eq!(check_f16("random selections", &cu, &q2k, &inp), 0);
    let q2k = causal_support(&cu).unwrap();
    let inp = tight(&cu, &q2k, inputs(&cu, &q2k, 25));
    assert_eq!(check_f16("causal support", &cu, &q2k, &inp), 0);
}

#[test]
fn l2_hints_and_windows_under_one_query_per_block_match_the_reference() {
    // Every L2 hint on (the policies selected at run time) and windows of 8 and 32 queries,
    // fewer than the 300-token document's blocks × 4: many windows, each block in several.
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(23);
    let q2k = random_q2k(&cu, &mut rng, &[1]);
    let inp = tight(&cu, &q2k, inputs(&cu, &q2k, 24));
    let kv = L2Hints {
        kv_evict_first: true,
        ..L2Hints::NONE
    };
    for (max_window_log2, hints) in [(3, L2Hints::ALL), (5, kv)] {
        let how = (OPool::F16, Reference::Probe);
        let rule = Locality::capped(0, 2, max_window_log2);
        let mut fwd = flow(how).with_locality(rule).unwrap().with_l2_hints(hints);
        let mut dev = SimDevice::new(Arch::Sm90, 132);
        let what = format!("{rule:?}, {hints:?}");
        let (recomputed, stats) = run_checked(&mut dev, &mut fwd, (&cu, &q2k), &inp, how, &what);
        assert_eq!(recomputed, 0, "{what}");
        eprintln!("{what}: {stats}");
    }
}

#[test]
fn paired_pool_matches_the_reference_with_and_without_the_recompute() {
    // The paired f16 pool (two copies per row, the combine adds them): the probe on tight
    // inputs (one pass), then the Cauchy-Schwarz bound on unit-normal inputs (about 10 above
    // each row's maximum: every row with a key recomputed, its two copies zeroed by the first
    // combine), each flow called twice on its device (the pool and its homes reused, the rows
    // re-zeroed).
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(31);
    let q2k = random_q2k(&cu, &mut rng, &[1]);
    for (reference, tight_inputs) in [(Reference::Probe, true), (Reference::Bound, false)] {
        let mut dev = SimDevice::new(Arch::Sm90, 132);
        let how = (OPool::F16, reference);
        let mut fwd = flow(how).with_paired_pool(true);
        for seed in [32, 33] {
            let what = format!("{reference:?}, seed {seed}");
            let inp = inputs(&cu, &q2k, seed);
            let inp = if tight_inputs {
                tight(&cu, &q2k, inp)
            } else {
                inp
            };
            let (recomputed, stats) =
                run_checked(&mut dev, &mut fwd, (&cu, &q2k), &inp, how, &what);
            let with_keys = inp.want_lse.iter().filter(|x| x.is_finite()).count() as u32;
            assert_eq!(
                recomputed,
                if tight_inputs { 0 } else { with_keys },
                "{what}"
            );
            eprintln!("paired pool, {what}, {recomputed} rows recomputed: {stats}");
        }
        // The paired kernels ran, and not the unpaired pass or combine.
        let ran = |k: &str| dev.launches().iter().any(|l| l.kernel == k);
        for k in [
            "fwd_kv_homes",
            "msa_forward_kv_f16p_sm90",
            "fwd_kv_combine_f16p",
        ] {
            assert!(ran(k), "{reference:?}: {k} ran");
        }
        for k in ["msa_forward_kv_f16_sm90", "fwd_kv_combine_f16"] {
            assert!(!ran(k), "{reference:?}: {k} did not run");
        }
    }
}

#[test]
fn f16_pool_recomputes_every_row_whose_bound_lies_too_far_above_it() {
    // Unit-normal Q and K put the bound about 10 above each row's maximum, past the f16
    // window of 7 (after the scale's ln 8): every row with a key goes to the recompute pass,
    // and comes out as exact as with the f32 pool. Correct, but two passes.
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(21);
    let q2k = random_q2k(&cu, &mut rng, &[1]);
    let inp = inputs(&cu, &q2k, 22);
    let rows_with_keys = inp.want_lse.iter().filter(|x| x.is_finite()).count() as u32;
    assert_eq!(
        check_f16("unit-normal inputs", &cu, &q2k, &inp),
        rows_with_keys
    );
}

#[test]
fn f16_pool_scales_large_and_small_values_into_range() {
    // V scaled by 2^12 and by 2^-14: the pool's scale c follows max|v| (2^-10 and 2^17
    // here), so no sum overflows f16 (up to 2048·e·4096 unscaled) or sinks into its
    // subnormals.
    let cu = cu_of(&[260, 3]);
    let q2k = causal_support(&cu).unwrap();
    for (what, factor) in [("V × 4096", 4096.0f32), ("V × 2^-14", 1.0 / 16384.0)] {
        let inp = tight(&cu, &q2k, inputs(&cu, &q2k, 26));
        check_v_scaled(what, &cu, &q2k, inp, factor, (OPool::F16, Reference::Bound));
    }
}

#[test]
fn f16_pool_sends_the_outlier_rows_to_the_recompute_pass() {
    // As for the f32 pool: the rows whose bound an outlier key lifts far above their logits
    // are recomputed with their exact maximum (less ln c) as reference, and come out exact.
    let (cu, q2k, inp) = outlier_case();
    let recomputed = check_f16("outlier key", &cu, &q2k, &inp);
    assert!(recomputed >= 72 * 16, "{recomputed} rows recomputed");
}

#[test]
fn f16_pool_reports_a_nan_query_row() {
    nan_row_case((OPool::F16, Reference::Bound));
}

// ---- the exact reference (Reference::ExactMax) --------------------------------------------

#[test]
fn exact_max_references_keep_every_unit_normal_row_in_the_f16_window() {
    // The inputs on which the bound sends every f16 row to the recompute pass: with the max
    // pass's exact maxima as references no row is recomputed, and both pools match the
    // reference.
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(21);
    let q2k = random_q2k(&cu, &mut rng, &[1]);
    let inp = inputs(&cu, &q2k, 22);
    for pool in [OPool::F16, OPool::F32] {
        let how = (pool, Reference::ExactMax);
        let (out, lse, verdict) = run_device_full(&cu, &q2k, (&inp.q, &inp.ka, &inp.va), how);
        let recomputed = verdict.unwrap_or_else(|e| panic!("{pool:?}: {e}"));
        assert_eq!(recomputed, 0, "{pool:?}: no row recomputed");
        let stats = compare(&inp, &out, &lse).unwrap_or_else(|e| panic!("{pool:?}: {e}"));
        eprintln!("exact references, {pool:?} pool: {stats}");
    }
}

#[test]
fn exact_max_references_need_no_recompute_for_an_outlier_key_or_scaled_values() {
    // The outlier key lifts only the bound, not the rows' maxima: no recompute pass.
    let (cu, q2k, inp) = outlier_case();
    let how = (OPool::F16, Reference::ExactMax);
    let (out, lse, verdict) = run_device_full(&cu, &q2k, (&inp.q, &inp.ka, &inp.va), how);
    assert_eq!(verdict.expect("every row normalised"), 0);
    compare(&inp, &out, &lse).unwrap_or_else(|e| panic!("outlier: {e}"));
    // V × 4096 on unit-normal Q and K: the scale still follows max|v|.
    let cu = cu_of(&[260, 3]);
    let q2k = causal_support(&cu).unwrap();
    check_v_scaled("V × 4096", &cu, &q2k, inputs(&cu, &q2k, 26), 4096.0, how);
}

#[test]
fn exact_max_pass_on_two_sms_with_the_gather_warp_starved() {
    // Two SMs: many tasks per CTA, so every one of the max pass's Q and row-scalar stages is
    // reused; the gather warp runs last, so the consumers wait on the row-scalar ring.
    let (cu, q2k, inp) = planted_case();
    let mut dev = SimDevice::with_limits(Arch::Sm90, 2, gather_starved());
    let how = (OPool::F16, Reference::ExactMax);
    let inputs = (&inp.q[..], &inp.ka[..], &inp.va[..]);
    let (out, lse, verdict) =
        run_device_on(&mut dev, &mut flow(how), &cu, &q2k, inputs, how).expect("forward");
    assert_eq!(verdict.expect("every row normalised"), 0);
    let stats = compare(&inp, &out, &lse).unwrap_or_else(|e| panic!("starved gather: {e}"));
    eprintln!("max pass, 2 SMs, starved gather: {stats}");
    // The same with the max pass's wait for its row scalars removed: reported.
    let text = msa_runtime::kernels::msa_forward_kv_max_sm90::PTX_SM_90A;
    let planted = without_wait_before(text, "this thread's last read of the row scalars");
    let mut dev = SimDevice::with_limits(Arch::Sm90, 2, gather_starved());
    dev.override_ptx("msa_forward_kv_max_sm90", planted);
    let e = match run_device_on(&mut dev, &mut flow(how), &cu, &q2k, inputs, how) {
        Err(e) => e,
        Ok((out, lse, _)) => match compare(&inp, &out, &lse) {
            Ok(stats) => panic!("the planted bug went unnoticed: {stats}"),
            Err(e) => e,
        },
    };
    assert!(e.contains("deadlock"), "{e}");
    eprintln!("max pass without its row-scalar wait: {e}");
}

#[test]
fn one_flow_on_two_devices_allocates_on_each() {
    // The flow keeps its workspaces between calls; a call on another device (another memory
    // space) must not run on the first device's buffers.
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(21);
    let q2k = random_q2k(&cu, &mut rng, &[1]);
    let inp = inputs(&cu, &q2k, 22);
    let how = (OPool::F16, Reference::ExactMax);
    let mut fwd = flow(how);
    for (i, mut dev) in [
        SimDevice::new(Arch::Sm90, 132),
        SimDevice::new(Arch::Sm90, 132),
    ]
    .into_iter()
    .enumerate()
    {
        let what = format!("device {i}");
        let (recomputed, _) = run_checked(&mut dev, &mut fwd, (&cu, &q2k), &inp, how, &what);
        assert_eq!(recomputed, 0, "{what}: every row normalised");
    }
}

#[test]
fn a_second_call_on_the_same_workspace_starts_from_zeroed_pools() {
    // The flow keeps its workspace between calls, so o_pool still holds the first call's
    // sums when the second starts: under the exact reference the max pass zeroes it, under
    // the bound a memset does. A second call on other inputs must match its own reference.
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(21);
    let q2k = random_q2k(&cu, &mut rng, &[1]);
    let (first, second) = (inputs(&cu, &q2k, 22), inputs(&cu, &q2k, 23));
    for how in [
        (OPool::F16, Reference::ExactMax),
        (OPool::F32, Reference::ExactMax),
        (OPool::F32, Reference::Bound),
        (OPool::F16, Reference::Probe),
    ] {
        let mut dev = SimDevice::new(Arch::Sm90, 132);
        let mut fwd = flow(how);
        for (i, inp) in [&first, &second].into_iter().enumerate() {
            let what = format!("{how:?}, call {i}");
            let (recomputed, _) = run_checked(&mut dev, &mut fwd, (&cu, &q2k), inp, how, &what);
            assert_eq!(recomputed, 0, "{what}: every row normalised");
        }
    }
}

#[test]
fn exact_max_references_report_a_nan_query_row() {
    nan_row_case((OPool::F16, Reference::ExactMax));
}

// ---- planted bugs in the shipped msa_forward_kv_sm90 text ---------------------------------

fn kv_ptx() -> &'static str {
    msa_runtime::kernels::msa_forward_kv_sm90::PTX_SM_90A
}

/// The planted tests' case: two documents, random selections.
fn planted_case() -> (Vec<i32>, Vec<i32>, Inputs) {
    let cu = cu_of(&[260, 3]);
    let mut rng = Rng(9);
    let q2k = random_q2k(&cu, &mut rng, &[]);
    let inp = inputs(&cu, &q2k, 13);
    (cu, q2k, inp)
}

/// The gather warp (warp 1) runs only when no other warp can: a consumer that reads the row
/// scalars without waiting for them reads them before they are written.
fn gather_starved() -> Limits {
    Limits {
        starved_warps: 1 << 1,
        ..Limits::default()
    }
}

/// Runs `text` in place of the kernel on two SMs with whole walks (many tasks and segments per
/// CTA, every stage reused); it must fail in the simulator or give results the comparison
/// rejects. Returns what was reported.
fn must_not_pass(text: String, limits: Limits) -> String {
    let (cu, q2k, inp) = planted_case();
    match run_ptx(&cu, &q2k, &inp, &bound(&inp), (2, limits), 1, Some(text)) {
        Err(e) => e,
        Ok((out, lse)) => match compare(&inp, &out, &lse) {
            Ok(stats) => panic!("the planted bug went unnoticed: {stats}"),
            Err(e) => e,
        },
    }
}

fn reported(text: String, limits: Limits, needle: &str) {
    let msg = must_not_pass(text, limits);
    println!("{msg}");
    assert!(msg.contains(needle), "`{needle}` missing in: {msg}");
}

#[test]
fn forward_kv_planted_case_passes_unmodified_with_the_gather_warp_starved() {
    let (cu, q2k, inp) = planted_case();
    let ptx = Some(kv_ptx().to_string());
    let (out, lse) = run_ptx(&cu, &q2k, &inp, &bound(&inp), (2, gather_starved()), 1, ptx)
        .unwrap_or_else(|e| panic!("{e}"));
    compare(&inp, &out, &lse).unwrap();
}

#[test]
fn forward_kv_releasing_q_before_its_tma_landed_is_reported() {
    // Without the consumers' wait on the Q stage, their releases run ahead of the TMA: the
    // producer's next arming of the stage finds arrivals already in the phase.
    reported(
        without_wait_before(kv_ptx(), "S = Q_c*K^T"),
        Limits::default(),
        "arrivals in phase",
    );
}

#[test]
fn forward_kv_reading_the_row_scalars_before_the_gather_is_reported() {
    // With the gather warp starved, consumers that do not wait for the row scalars release
    // the stage before it is filled; the pipeline's phases then part, and the CTA stalls.
    // (Under the default schedule the same kernel happens to pass: the starved schedule is
    // what exposes it.)
    reported(
        without_wait_before(kv_ptx(), "this thread's last read of the row scalars"),
        gather_starved(),
        "deadlock",
    );
}

#[test]
fn forward_kv_reading_s_before_its_wgmma_completed_is_reported() {
    reported(
        without_first_after(
            kv_ptx(),
            "the gather warp's row scalars",
            "wgmma.wait_group",
        ),
        Limits::default(),
        "still in flight",
    );
}

#[test]
fn forward_kv_a_consumer_that_never_releases_k_v_is_reported() {
    reported(
        without_first_after(
            kv_ptx(),
            "segment end: this warp's reads of K/V",
            "mbarrier.arrive",
        ),
        Limits::default(),
        "deadlock",
    );
}

#[test]
fn forward_kv_overwriting_the_o_staging_before_its_reduction_read_it_is_reported() {
    // Without lane 0's wait for its previous reduction's reads, the next task's staging
    // stores land on rows the TMA unit may not have read yet.
    reported(
        without_first_after(
            kv_ptx(),
            "its O rows into the warp's staging",
            "cp.async.bulk.wait_group.read",
        ),
        Limits::default(),
        "not yet retired by cp.async.bulk.wait_group.read",
    );
}

#[test]
fn forward_kv_reducing_o_rows_without_the_proxy_fence_is_reported() {
    reported(
        without_first_after(
            kv_ptx(),
            "its O rows into the warp's staging",
            "fence.proxy.async",
        ),
        Limits::default(),
        "without a fence.proxy.async before it",
    );
}

#[test]
fn forward_kv_exiting_before_the_last_reduction_read_its_rows_is_reported() {
    reported(
        without_first_after(
            kv_ptx(),
            "the staged rows' last reduction has read them",
            "cp.async.bulk.wait_group.read",
        ),
        Limits::default(),
        "the CTA finished while",
    );
}

// ---- the probe's reference (Reference::Probe) -----------------------------------------------

#[test]
fn probe_references_keep_unit_normal_rows_in_either_window() {
    // The inputs on which the bound sends every f16 row to the recompute pass: against the
    // first key of each selected block, every row's sum stays inside the window, so there is
    // one pass and no recompute, with both pools, on random selections with holes and a
    // silent head and on the causal support.
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(21);
    let random = random_q2k(&cu, &mut rng, &[1]);
    let causal = causal_support(&cu).unwrap();
    for (what, q2k, seed) in [("random", &random, 22), ("causal", &causal, 25)] {
        let inp = inputs(&cu, q2k, seed);
        for pool in [OPool::F16, OPool::F32] {
            let how = (pool, Reference::Probe);
            let (out, lse, verdict) = run_device_full(&cu, q2k, (&inp.q, &inp.ka, &inp.va), how);
            let recomputed = verdict.unwrap_or_else(|e| panic!("{what}, {pool:?}: {e}"));
            assert_eq!(recomputed, 0, "{what}, {pool:?}: no row recomputed");
            let stats =
                compare(&inp, &out, &lse).unwrap_or_else(|e| panic!("{what}, {pool:?}: {e}"));
            eprintln!("probe references, {what}, {pool:?} pool: {stats}");
        }
    }
}

#[test]
fn probe_references_send_the_outlier_rows_to_the_recompute_pass() {
    // The outlier key (key 190 of block 1) is not the block's first key: the rows that see
    // it and score it high sum far past the f16 window against their probed keys. They, and
    // only rows of heads 0-15 at or after key 190 (10 queries), are recomputed with their
    // lse as reference. The f32 pool's window (sums up to e^80) holds them all in one pass.
    // Every row matches the reference.
    let (cu, q2k, inp) = outlier_case();
    for (pool, most) in [(OPool::F16, 10 * 16), (OPool::F32, 0)] {
        let how = (pool, Reference::Probe);
        let (out, lse, verdict) = run_device_full(&cu, &q2k, (&inp.q, &inp.ka, &inp.va), how);
        let recomputed = verdict.unwrap_or_else(|e| panic!("{pool:?}: {e}"));
        assert!(
            recomputed <= most && (most == 0 || recomputed > 0),
            "{pool:?}: {recomputed} rows recomputed"
        );
        let stats = compare(&inp, &out, &lse).unwrap_or_else(|e| panic!("{pool:?}: {e}"));
        eprintln!("probe, outlier key, {pool:?} pool, {recomputed} rows recomputed: {stats}");
    }
}

#[test]
fn probe_references_scale_large_and_small_values_into_range() {
    // V scaled by 2^12 and by 2^-14 on unit-normal Q and K: the f16 pool's scale follows
    // max|v| under the probe too.
    let cu = cu_of(&[260, 3]);
    let q2k = causal_support(&cu).unwrap();
    let how = (OPool::F16, Reference::Probe);
    for (what, factor) in [("V × 4096", 4096.0f32), ("V × 2^-14", 1.0 / 16384.0)] {
        check_v_scaled(what, &cu, &q2k, inputs(&cu, &q2k, 26), factor, how);
    }
}

#[test]
fn probe_references_report_a_nan_query_row() {
    nan_row_case((OPool::F16, Reference::Probe));
}

#[test]
fn the_probe_takes_each_rows_logit_against_the_first_key_of_each_block_it_sees() {
    // `fwd_kv_probe` alone, against its definition computed here: R = scale·max over the
    // row's selected blocks whose first key it sees (document-local 128·id ≤ its position) of
    // q·k_first, and 0 with an m_pool key of 0 for a row that sees none; R never above the
    // row's true maximum over its visible keys. Random selections with holes and a silent
    // head, on odd document lengths; the f32 pool (no vmax: no scale). It also zeroes both
    // pools the sum pass adds into (filled with NaN here), every group's rows of each.
    use msa_runtime::kernels::fwd_kv_probe;
    use msa_runtime::{workspace_layout, Backend, Ptr, PtrMut};
    let cu = cu_of(&[300, 1, 130, 77]);
    let mut rng = Rng(31);
    let q2k = random_q2k(&cu, &mut rng, &[1]);
    let inp = inputs(&cu, &q2k, 32);
    let (t, w) = (inp.t, inp.ka.len() / KV_ROW);
    let mut dev = SimDevice::new(Arch::Sm90, 132);
    let (s, q2k_s) = device_schedule(&mut dev, &cu, &q2k, w);
    let q_d = dev.upload_new("q", &inp.q);
    let k_d = dev.upload_new("k", &inp.ka);
    let r_d = dev.upload_new("reference", &vec![f32::NAN; t * 64]);
    let m_d = dev.upload_new("m_pool", &vec![u32::MAX; t * 64]);
    let l_d = dev.upload_new("l_pool", &vec![f32::NAN; t * 64]);
    let args = fwd_kv_probe::args(
        Ptr::new(q_d.ptr.addr()),
        Ptr::new(k_d.ptr.addr()),
        q2k_s.ptr(),
        s.cu_seqlens_ptr(),
        Ptr::new(s.refs().ws_starts),
        Ptr::new(0),
        PtrMut::new(r_d.ptr.addr()),
        PtrMut::new(m_d.ptr.addr()),
        (4 * t) as u32,
        t as u32,
        (cu.len() - 1) as u32,
        (w / 128) as u32,
        PtrMut::new(l_d.ptr.addr()),
    );
    dev.load(&fwd_kv_probe::KERNEL).expect("load");
    // SAFETY: every buffer has the length the kernel's parameters describe (T tokens, W
    // aligned rows, cu.len() − 1 documents).
    unsafe {
        dev.launch(
            &fwd_kv_probe::KERNEL,
            ((4 * t).div_ceil(8) as u32, 1, 1),
            &args,
        )
    }
    .expect("probe");
    let r: Vec<f32> = dev.read(r_d.ptr.addr(), t * 64).unwrap();
    let m: Vec<u32> = dev.read(m_d.ptr.addr(), t * 64).unwrap();
    let l: Vec<u32> = dev.read(l_d.ptr.addr(), t * 64).unwrap();
    let left = l.iter().position(|&x| x != 0);
    assert_eq!(left, None, "l_pool not zeroed from element {left:?} on");
    let (starts, _) = workspace_layout(&cu).unwrap();
    let scale = (128f64).powf(-0.5);
    let dot = |row: usize, key: usize, g: usize| -> f64 {
        let q = &inp.q[row * 128..row * 128 + 128];
        let k = &inp.ka[(key * 4 + g) * 128..(key * 4 + g) * 128 + 128];
        q.iter()
            .zip(k)
            .map(|(a, b)| a.to_f64() * b.to_f64())
            .sum::<f64>()
            * scale
    };
    let (mut seen_rows, mut empty_rows) = (0, 0);
    for d in 0..cu.len() - 1 {
        for tok in cu[d] as usize..cu[d + 1] as usize {
            let pos = tok - cu[d] as usize;
            for g in 0..4 {
                let ids: Vec<usize> = (0..16)
                    .map(|j| q2k[(g * t + tok) * 16 + j])
                    .filter(|&id| id >= 0 && 128 * id as usize <= pos)
                    .map(|id| id as usize)
                    .collect();
                for h in 0..16 {
                    let row = tok * 64 + 16 * g + h;
                    if ids.is_empty() {
                        assert_eq!((r[row], m[row]), (0.0, 0), "row {row} sees no block");
                        empty_rows += 1;
                        continue;
                    }
                    let first_key = |id: usize| starts[d] as usize + 128 * id;
                    let want = ids
                        .iter()
                        .map(|&id| dot(row, first_key(id), g))
                        .fold(f64::NEG_INFINITY, f64::max);
                    let max = ids
                        .iter()
                        .flat_map(|&id| (0..128).map(move |k| (id, k)))
                        .filter(|&(id, k)| 128 * id + k <= pos)
                        .map(|(id, k)| dot(row, first_key(id) + k, g))
                        .fold(f64::NEG_INFINITY, f64::max);
                    let got = f64::from(r[row]);
                    assert!(
                        (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "row {row}: R {got}, want {want}"
                    );
                    assert!(
                        got <= max + 1e-5,
                        "row {row}: R {got} above its maximum {max}"
                    );
                    assert!(m[row] > 0x007f_ffff, "row {row}: m_pool key {:#x}", m[row]);
                    seen_rows += 1;
                }
            }
        }
    }
    assert!(
        seen_rows > 0 && empty_rows > 0,
        "{seen_rows} rows with a block, {empty_rows} without"
    );
    eprintln!("probe: {seen_rows} rows with a block, {empty_rows} without");
}

// ---- the f16 pass, which issues each task's S GEMM during the previous task ----------------

fn f16_ptx() -> &'static str {
    msa_runtime::kernels::msa_forward_kv_f16_sm90::PTX_SM_90A
}

/// The default flow (f16 pool, probe) on the planted case on two SMs (every K/V and Q stage
/// reused, S GEMMs issued across segment ends), with `text` in place of the f16 pass: the
/// comparison's statistics, or what went wrong.
fn run_f16(text: Option<String>, limits: Limits) -> Result<String, String> {
    run_f16_pool((false, false), text, limits)
}

/// [`run_f16`] with the paired pool when `paired` (`text` then replaces the paired pass), and
/// paired K/V too when `kv`.
fn run_f16_pool(
    (paired, kv): (bool, bool),
    text: Option<String>,
    limits: Limits,
) -> Result<String, String> {
    run_f16_pool_on(
        &mut SimDevice::with_limits(Arch::Sm90, 2, limits),
        (paired, kv),
        text,
    )
}

/// [`run_f16_pool`] on `dev`.
fn run_f16_pool_on(
    dev: &mut SimDevice,
    (paired, kv): (bool, bool),
    text: Option<String>,
) -> Result<String, String> {
    let (cu, q2k, inp) = planted_case();
    if let Some(text) = text {
        let kernel = if paired {
            "msa_forward_kv_f16p_sm90"
        } else {
            "msa_forward_kv_f16_sm90"
        };
        dev.override_ptx(kernel, text);
    }
    let how = (OPool::F16, Reference::Probe);
    let inputs = (&inp.q[..], &inp.ka[..], &inp.va[..]);
    let mut fwd = flow(how).with_paired_pool(paired).with_paired_kv(kv);
    let (out, lse, verdict) = run_device_on(dev, &mut fwd, &cu, &q2k, inputs, how)?;
    let ran = |k: &str| dev.launches().iter().any(|l| l.kernel == k);
    if ran("fwd_kv_pair_kv") != (paired && kv) {
        return Err(format!("fwd_kv_pair_kv ran: {}", ran("fwd_kv_pair_kv")));
    }
    verdict.map_err(|e| e.to_string())?;
    compare(&inp, &out, &lse)
}

/// The simulator's default limits, and copies that land at issue.
fn default_and_immediate() -> [(&'static str, Limits); 2] {
    [
        ("default", Limits::default()),
        (
            "immediate TMA",
            Limits {
                tma_completion: TmaCompletion::Immediate,
                ..Limits::default()
            },
        ),
    ]
}

#[test]
fn f16_pass_issuing_s_ahead_passes_on_two_sms() {
    let starved = [("gather warp starved", gather_starved())];
    for (what, limits) in default_and_immediate().into_iter().chain(starved) {
        let stats = run_f16(None, limits).unwrap_or_else(|e| panic!("{what}: {e}"));
        eprintln!("{what}: {stats}");
    }
}

#[test]
fn f16_pass_staging_o_before_p_v_completed_is_reported() {
    // Without the wait for all but the newest group (the next task's S GEMM), the staging
    // reads P·V's accumulators in flight.
    let text = without_first_after(f16_ptx(), "the next task's S GEMM", "wgmma.wait_group");
    let e = run_f16(Some(text), Limits::default()).expect_err("the planted bug went unnoticed");
    println!("{e}");
    assert!(e.contains("in flight"), "{e}");
}

#[test]
fn f16_pass_issuing_s_before_the_next_segments_k_landed_is_reported() {
    // The S GEMM issued ahead across a segment end must wait for the next segment's K/V
    // stage: without that wait it reads K before (or while) the TMA writes it.
    let lines: Vec<&str> = f16_ptx().lines().collect();
    let from = lines
        .iter()
        .position(|l| l.contains("the next task's S GEMM"))
        .expect("the S GEMM issued ahead");
    let at = (from..lines.len())
        .find(|&i| lines[i].contains("mbarrier.try_wait"))
        .expect("the next segment's K/V wait");
    let e = run_f16(Some(without_wait_at(&lines, at)), Limits::default())
        .expect_err("the planted bug went unnoticed");
    println!("{e}");
    assert!(e.contains("TMA"), "{e}");
}

// ---- planted bugs in the shipped paired pass (msa_forward_kv_f16p_sm90) ----------------------

fn f16p_ptx() -> &'static str {
    msa_runtime::kernels::msa_forward_kv_f16p_sm90::PTX_SM_90A
}

#[test]
fn paired_pass_passes_unmodified_on_two_sms() {
    // The control for the planted paired tests below: the same case and limits pass.
    let stats = run_f16_pool(
        (true, false),
        Some(f16p_ptx().to_string()),
        Limits::default(),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{stats}");
}

#[test]
fn paired_kv_passes_on_two_sms() {
    // The paired pass loading K/V from the paired tiles (bulk copies of the images
    // `fwd_kv_pair_kv` wrote), on the planted case: every K/V stage reused.
    for (what, limits) in default_and_immediate() {
        let stats =
            run_f16_pool((true, true), None, limits).unwrap_or_else(|e| panic!("{what}: {e}"));
        eprintln!("{what}: {stats}");
    }
}

#[test]
fn paired_pass_reduces_and_loads_on_its_own_side_under_the_l2_model() {
    // Under the simulator's model of the two L2 partitions (the pairing's premise: a
    // returning atomic's latency tells an address's home from the SM's side), every bulk
    // reduction and bulk K/V copy of the paired pass goes to the copy on its CTA's side, on
    // four SMs of both sides. The control swaps the latencies: every one goes across. With
    // session 29's probes (the atomic's value consumed by arithmetic only, which ptxas
    // scheduled after the second clock read) the model finds about half of each on either
    // side, as the GPU did.
    for (what, near, far) in [("the model", 280, 480), ("latencies swapped", 480, 280)] {
        let l2 = L2Sides {
            near,
            far,
            ..L2Sides::default()
        };
        let limits = Limits {
            l2_sides: Some(l2),
            ..Limits::default()
        };
        let mut dev = SimDevice::with_limits(Arch::Sm90, 4, limits);
        let stats =
            run_f16_pool_on(&mut dev, (true, true), None).unwrap_or_else(|e| panic!("{what}: {e}"));
        let launches: Vec<_> = dev
            .launches()
            .iter()
            .filter(|l| l.kernel == "msa_forward_kv_f16p_sm90")
            .collect();
        let pass = launches.iter().fold(L2Traffic::default(), |mut t, l| {
            t.add(&l.l2);
            t
        });
        eprintln!("{what}: {pass:?}; {stats}");
        // The pass's CTAs run on SMs of both sides.
        let ctas = launches.iter().map(|l| l.grid.0).max().unwrap_or(0);
        let sides: Vec<u8> = (0..ctas).map(|x| l2.side([x, 0, 0])).collect();
        assert!(sides.contains(&0) && sides.contains(&1), "{sides:?}");
        let (chosen, other) = if near < far {
            (
                [pass.reduce_near, pass.load_near],
                [pass.reduce_far, pass.load_far],
            )
        } else {
            (
                [pass.reduce_far, pass.load_far],
                [pass.reduce_near, pass.load_near],
            )
        };
        assert!(chosen.iter().all(|&b| b > 0), "{what}: {pass:?}");
        assert_eq!(other, [0, 0], "{what}: {pass:?}");
    }
}

#[test]
fn paired_kv_loading_a_chunk_from_the_wrong_tile_is_reported() {
    // The planted bug: the V chunks read from K's pairs (the `+ 8` of the V image's first
    // pair dropped), so P·V multiplies by K.
    let lines: Vec<&str> = f16p_ptx().lines().collect();
    let at = lines
        .iter()
        .position(|l| l.contains("cp.async.bulk.shared::cluster.global"))
        .expect("the first bulk load");
    // The ninth bulk load is V's chunk 0; its pair is `pair0 + 8`.
    let v0 = (at..lines.len())
        .filter(|&i| lines[i].contains("cp.async.bulk.shared::cluster.global"))
        .nth(8)
        .expect("V's first bulk load");
    let add = (at..v0)
        .rev()
        .find(|&i| {
            lines[i].trim_start().starts_with("add.u32") && lines[i].trim_end().ends_with(", 8;")
        })
        .expect("V's first pair: pair0 + 8");
    let mut planted: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    planted[add] = planted[add].replace(", 8;", ", 0;");
    paired_reported(true, planted.join("\n"), "out: not close");
}

/// `text` in place of the paired pass (with paired K/V when `kv`) on the planted case must be
/// reported, the report naming `needle`.
fn paired_reported(kv: bool, text: String, needle: &str) {
    let e = run_f16_pool((true, kv), Some(text), Limits::default())
        .expect_err("the planted bug went unnoticed");
    println!("{e}");
    assert!(e.contains(needle), "`{needle}` missing in: {e}");
}

#[test]
fn paired_pass_reducing_without_the_proxy_fence_is_reported() {
    // The bulk reduction reads the staging through the async proxy: without the fence after
    // the warp's generic-proxy stores, it may read stale rows.
    let text = without_first_after(
        f16p_ptx(),
        "its O rows into the warp's staging",
        "fence.proxy.async",
    );
    paired_reported(false, text, "without a fence.proxy.async before it");
}

#[test]
fn paired_pass_overwriting_the_staging_before_its_reduction_read_it_is_reported() {
    // Without lane 0's wait for the previous bulk reduction's reads, the next task's staging
    // stores land on rows the reduction may not have read yet.
    let text = without_first_after(
        f16p_ptx(),
        "its O rows into the warp's staging",
        "cp.async.bulk.wait_group.read",
    );
    paired_reported(
        false,
        text,
        "not yet retired by cp.async.bulk.wait_group.read",
    );
}
