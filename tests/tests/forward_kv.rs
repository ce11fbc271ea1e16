//! The experimental KV-parallel forward (`forward_kv::MsaForwardKv::run_on`: bound, task
//! build, `msa_forward_kv_sm90`, combine) on the GPU against the f32 CPU reference: `out`
//! within the seed's O tolerance (0.025 max-abs, 0.006 L2-rel), `lse` within 1e-3 max-abs,
//! empty rows exactly `out = 0`, `lse = −∞`, and the verdict `Ok` with no row recomputed; and
//! the same cases with the experimental f16 `o_pool` (`OPool::F16`), whose verdict may count
//! recomputed rows (printed) but must be `Ok`; and both pools with the max pass's exact
//! references (`Reference::ExactMax`), where no row may be recomputed, and with the probe's
//! (`Reference::Probe`, the default; as for the bound, only the f16 pool may recompute); and
//! the defaults with each walk whole and split between 4, 8 and 16 CTAs, and with the L2
//! hints on under windows of 8 queries and of `max(512, B)` queries (the seed's rule). Also
//! whether the paired pool's home labels are a property of the memory (two labellings agree),
//! on the GPU and, with its controls, on the simulator. The GPU tests skip without a GPU and
//! fail without one under `REQUIRE_GPU=1`.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use msa_runtime::contract::Locality;
use msa_runtime::forward_kv::{
    L2Hints, MsaForwardKv, OPool, Reference, FORWARD_KV_LOCALITY, FORWARD_KV_WALK_SPLIT,
};
use msa_runtime::reference;
use msa_runtime::{
    causal_support, workspace_layout, CudaBackend, ForwardBuffers, ResidentSchedule,
    ScheduleBuildSizes, Span,
};
use msa_tests::cases::{compare_forward, docs, random_bf16, random_top16, to_f32, Problem};
use msa_tests::{gpu_stream, homes_twice, label_agreement, Rng};
use std::sync::Arc;

const Q_ROW: usize = 64 * 128;
const KV_ROW: usize = 4 * 128;

fn run_case(name: &'static str, cu: Vec<i32>, q2k: Vec<i32>, seed: u64) {
    let Some(stream) = gpu_stream() else { return };
    let t = *cu.last().unwrap() as usize;
    // The same draws as `Problem::new` (q, k, v in that order), for the f32 reference forward,
    // computed once for both pools.
    let mut rng = Rng::new(seed);
    let (_, q32) = random_bf16(&mut rng, t * Q_ROW);
    let (_, k32) = random_bf16(&mut rng, t * KV_ROW);
    let (_, v32) = random_bf16(&mut rng, t * KV_ROW);
    let want = reference::forward(&q32, &k32, &v32, &q2k, &cu).unwrap();
    let p = Problem::new(name, cu.clone(), q2k.clone(), seed);
    for pool in [OPool::F32, OPool::F16] {
        for reference in [Reference::Bound, Reference::ExactMax, Reference::Probe] {
            let how = (pool, reference, FORWARD_KV_WALK_SPLIT, (false, false));
            run_pool(&stream, (&cu, &q2k), &p, &want, how, ORDER);
        }
    }
    // The defaults (f16 pool, probe) with the walks whole and split in 4, 8 and 16 parts.
    for split in [1, 4, 8, 16] {
        let how = (OPool::F16, Reference::Probe, split, (false, false));
        run_pool(&stream, (&cu, &q2k), &p, &want, how, ORDER);
    }
    // The paired pool (opt-in), under the probe and under the bound (which recomputes rows),
    // without and with paired K/V.
    for reference in [Reference::Probe, Reference::Bound] {
        for kv in [false, true] {
            let how = (OPool::F16, reference, FORWARD_KV_WALK_SPLIT, (true, kv));
            run_pool(&stream, (&cu, &q2k), &p, &want, how, ORDER);
        }
    }
    // The defaults with the L2 hints: all under windows of 8 queries, K/V's alone under
    // windows of `max(512, B)` queries for `B` key blocks.
    let kv = L2Hints {
        kv_evict_first: true,
        ..L2Hints::NONE
    };
    let eight = Locality::capped(0, 2, 3);
    for order in [(eight, L2Hints::ALL), (Locality::uncapped(9, 0), kv)] {
        let how = (
            OPool::F16,
            Reference::Probe,
            FORWARD_KV_WALK_SPLIT,
            (false, false),
        );
        run_pool(&stream, (&cu, &q2k), &p, &want, how, order);
    }
}

#[test]
fn l2_hint_bits_are_the_kernels() {
    // `L2Hints` mirrors `forward_kv_sm90::L2Stream`; the hints change no result, so only this
    // comparison would catch a swapped bit.
    use codegen::kernels::forward_kv_sm90::L2Stream;
    let one = |kv, q, o| L2Hints {
        kv_evict_first: kv,
        q_evict_last: q,
        o_evict_last: o,
    };
    assert_eq!(one(true, false, false).bits(), L2Stream::Kv.bit());
    assert_eq!(one(false, true, false).bits(), L2Stream::Q.bit());
    assert_eq!(one(false, false, true).bits(), L2Stream::O.bit());
}

/// The default task order and no L2 hint.
const ORDER: (Locality, L2Hints) = (FORWARD_KV_LOCALITY, L2Hints::NONE);

/// `MsaForwardKv::run_on` with `pool`, `reference` and `split` CTAs per walk on the problem
/// `p` (documents `cu`, selection `q2k`), against its reference `want`.
fn run_pool(
    stream: &Arc<CudaStream>,
    (cu, q2k): (&[i32], &[i32]),
    p: &Problem,
    want: &reference::Forward,
    (pool, refs, split, (paired, paired_kv)): (OPool, Reference, u32, (bool, bool)),
    (locality, hints): (Locality, L2Hints),
) {
    let name = p.name;
    let t = *cu.last().unwrap() as usize;
    let (_, w) = workspace_layout(cu).unwrap();

    let q = stream.clone_htod(&p.q).unwrap();
    let k = stream.clone_htod(&p.k_aligned).unwrap();
    let v = stream.clone_htod(&p.v_aligned).unwrap();
    let q2k_d = stream.clone_htod(q2k).unwrap();
    let cu_d = stream.clone_htod(cu).unwrap();
    let mut out = stream
        .clone_htod(&vec![bf16::from_f32(f32::NAN); t * Q_ROW])
        .unwrap();
    let mut lse = stream.clone_htod(&vec![f32::NAN; t * 64]).unwrap();
    let mut backend = CudaBackend::new(stream).unwrap();
    let sizes = ScheduleBuildSizes::new(t, cu.len() - 1, w, 64).unwrap();
    let mut schedule = ResidentSchedule::new(&mut backend, sizes).unwrap();
    let q2k_s = Span::new(q2k_d.device_ptr(stream).0, q2k.len());
    schedule
        .build(
            &mut backend,
            q2k_s,
            Span::new(cu_d.device_ptr(stream).0, cu.len()),
        )
        .unwrap();
    let io = ForwardBuffers {
        q: Span::new(q.device_ptr(stream).0, q.len()),
        k_aligned: Span::new(k.device_ptr(stream).0, k.len()),
        v_aligned: Span::new(v.device_ptr(stream).0, v.len()),
        q2k: q2k_s,
        out: Span::new(out.device_ptr_mut(stream).0, t * Q_ROW),
        lse: Span::new(lse.device_ptr_mut(stream).0, t * 64),
    };
    let mut fwd = MsaForwardKv::new()
        .with_o_pool(pool)
        .with_reference(refs)
        .with_walk_split(split)
        .unwrap()
        .with_locality(locality)
        .unwrap()
        .with_l2_hints(hints)
        .with_paired_pool(paired)
        .with_paired_kv(paired_kv);
    let how = format!(
        "{pool:?} pool (paired: {paired}, K/V {paired_kv}), {refs:?}, split {split}, \
         {locality:?}, {hints:?}"
    );
    fwd.run_on(&mut backend, &io, &schedule).unwrap();
    schedule.status(&mut backend).unwrap();
    let recomputed = fwd
        .status(&mut backend)
        .unwrap_or_else(|e| panic!("{name} ({how}): {e}"));
    if pool == OPool::F32 || refs == Reference::ExactMax {
        assert_eq!(
            recomputed, 0,
            "{name} ({pool:?}, {refs:?}): rows recomputed"
        );
    }

    let out = to_f32(&stream.clone_dtoh(&out).unwrap());
    let lse = stream.clone_dtoh(&lse).unwrap();
    let line = compare_forward("KV forward", &out, &lse, &want.out, &want.lse)
        .unwrap_or_else(|e| panic!("{name} ({how}): {e}"));
    println!("{name} (KV forward, {how}, {recomputed} rows recomputed): {line}");
}

#[test]
fn forward_kv_packed_tiny_documents() {
    let cu = docs(&[127, 129, 1, 2, 3, 5, 128]);
    let q2k = causal_support(&cu).unwrap();
    run_case("packed tiny documents", cu, q2k, 8101);
}

#[test]
fn forward_kv_odd_lengths_with_empty_selections() {
    let cu = docs(&[301, 1, 130, 77, 1000]);
    let t = *cu.last().unwrap() as usize;
    let mut rng = Rng::new(8102);
    let mut q2k = random_top16(&cu, &mut rng);
    for tok in 0..t {
        for slot in 0..16 {
            if tok % 5 == 0 {
                q2k[(t + tok) * 16 + slot] = -1;
            }
            q2k[(3 * t + tok) * 16 + slot] = -1;
        }
    }
    run_case("odd lengths, empty selections", cu, q2k, 8102);
}

#[test]
fn forward_kv_random_top16_t8192() {
    if cfg!(debug_assertions) {
        eprintln!("SKIP: needs an optimised build for its CPU reference");
        return;
    }
    let cu = docs(&[3000, 2600, 1700, 892]);
    let mut rng = Rng::new(8104);
    let q2k = random_top16(&cu, &mut rng);
    run_case("random top-16, T = 8192", cu, q2k, 8104);
}

/// On the GPU, `fwd_kv_homes`' labels belong to the memory, not to whoever measured them: two
/// labellings of one buffer by grids of different sizes (so that each pair is timed by another
/// warp, which found its side from another anchor) agree, and the pairs split between the
/// sides. Session 29's probes timed no atomic (ptxas read the clock before it returned), so
/// their labels were coin tosses: two such labellings agree on about half the pairs (as
/// `paired_pool_labels_on_the_simulator` shows with the simulator's hashed clock).
#[test]
fn paired_pool_labels_do_not_depend_on_who_measured_them() {
    let Some(stream) = gpu_stream() else { return };
    let mut backend = CudaBackend::new(&stream).unwrap();
    let sms = u32::try_from(msa_runtime::Backend::sm_count(&backend)).unwrap();
    let pairs = msa_runtime::forward_kv::PAIR_ANCHORS + 32 * 1024;
    let [a, b] = homes_twice(&mut backend, pairs, [4 * sms, 7]).unwrap();
    let (agree, zeros) = label_agreement(&a, &b);
    eprintln!(
        "{pairs} pairs: the two labellings agree on {:.2} %, {:.2} % labelled 0",
        100.0 * agree,
        100.0 * zeros
    );
    assert!(
        agree >= 0.9,
        "labels depend on who measured them: {agree:.4} agree"
    );
    assert!(
        (0.25..=0.75).contains(&zeros),
        "{zeros:.4} of the pairs on side 0"
    );
}

/// The statistic above on the simulator, which runs `fwd_kv_homes` without a GPU: under its
/// L2 model (the pairing's premise) the two labellings agree on every pair and split them
/// between the sides; with its default `%clock` (a hash: latencies that mean nothing, as
/// session 29's were) they agree on about half.
#[test]
fn paired_pool_labels_on_the_simulator() {
    use msa_sim::device::{Arch, SimDevice};
    use msa_sim::{L2Sides, Limits};
    let pairs = msa_runtime::forward_kv::PAIR_ANCHORS + 1024;
    let model = Limits {
        l2_sides: Some(L2Sides::default()),
        ..Limits::default()
    };
    let mut dev = SimDevice::with_limits(Arch::Sm90, 4, model);
    let [a, b] = homes_twice(&mut dev, pairs, [4, 3]).unwrap();
    let (agree, zeros) = label_agreement(&a, &b);
    eprintln!("the L2 model: {agree:.4} agree, {zeros:.4} labelled 0");
    assert_eq!(agree, 1.0, "under the model");
    assert!(
        (0.25..=0.75).contains(&zeros),
        "{zeros:.4} on side 0 under the model"
    );
    let mut dev = SimDevice::new(Arch::Sm90, 4);
    let [a, b] = homes_twice(&mut dev, pairs, [4, 3]).unwrap();
    let (agree, _) = label_agreement(&a, &b);
    eprintln!("hashed clock: {agree:.4} agree");
    assert!(
        (0.4..=0.6).contains(&agree),
        "hashed clock: {agree:.4} agree"
    );
}
