//! The MSA forward on the GPU (`run_forward`, `MsaAttention`) against the f32 CPU reference:
//! `out` within the seed's O tolerance (0.025 max-abs, 0.006 L2-rel), `lse` within 1e-3
//! max-abs, empty rows exactly `out = 0`, `lse = −∞`; then forward → backward chained through
//! `MsaAttention` against the reference gradients (the f32 reference's own out/lse, i.e. the
//! exact gradient of the f32 forward) within the seed's dQ/dK/dV tolerances. Each case runs
//! with both forward algorithms (`ForwardAlgorithm::QParallel` and `KvParallel`). Skips
//! without a GPU; fails without one under `REQUIRE_GPU=1`.

use msa_runtime::reference;
use msa_runtime::{causal_support, ForwardAlgorithm, MsaAttention};
use msa_tests::cases::{check, compare_forward, docs, random_bf16, random_top16, to_f32, Problem};
use msa_tests::{gpu_stream, Rng};

const Q_ROW: usize = 64 * 128;
const KV_ROW: usize = 4 * 128;

/// Forward and chained backward of `p` (built from `cu`, `q2k`, `seed`), with both forward
/// algorithms.
fn run_case(name: &'static str, cu: Vec<i32>, q2k: Vec<i32>, seed: u64) {
    let both = [ForwardAlgorithm::QParallel, ForwardAlgorithm::KvParallel];
    run_case_with(name, cu, q2k, seed, &both);
}

/// [`run_case`] with each of `algorithms`.
fn run_case_with(
    name: &'static str,
    cu: Vec<i32>,
    q2k: Vec<i32>,
    seed: u64,
    algorithms: &[ForwardAlgorithm],
) {
    let Some(stream) = gpu_stream() else { return };
    let t = *cu.last().unwrap() as usize;
    // The same draws as `Problem::new` (q, k, v in that order), for the f32 reference forward.
    let mut rng = Rng::new(seed);
    let (_, q32) = random_bf16(&mut rng, t * Q_ROW);
    let (_, k32) = random_bf16(&mut rng, t * KV_ROW);
    let (_, v32) = random_bf16(&mut rng, t * KV_ROW);
    let want = reference::forward(&q32, &k32, &v32, &q2k, &cu).unwrap();
    let p = Problem::new(name, cu.clone(), q2k.clone(), seed);

    let q = stream.clone_htod(&p.q).unwrap();
    let k = stream.clone_htod(&p.k_aligned).unwrap();
    let v = stream.clone_htod(&p.v_aligned).unwrap();
    let dout = stream.clone_htod(&p.grad_out).unwrap();
    let q2k_d = stream.clone_htod(&q2k).unwrap();
    let cu_d = stream.clone_htod(&cu).unwrap();
    for &algorithm in algorithms {
        let label = format!("{algorithm:?} forward");
        let label = label.as_str();
        let mut attn = MsaAttention::new();
        attn.set_forward_algorithm(algorithm);
        let saved = attn
            .forward(
                &stream,
                &q.as_view(),
                &k.as_view(),
                &v.as_view(),
                &q2k_d.as_view(),
                &cu_d.as_view(),
            )
            .unwrap();
        let grads = attn
            .backward(
                &stream,
                &saved,
                &q.as_view(),
                &k.as_view(),
                &v.as_view(),
                &dout.as_view(),
            )
            .unwrap();
        saved
            .schedule
            .status(&mut msa_runtime::CudaBackend::new(&stream).unwrap())
            .unwrap();

        let out = to_f32(&stream.clone_dtoh(&saved.out).unwrap());
        let lse = stream.clone_dtoh(&saved.lse).unwrap();
        let line = compare_forward(label, &out, &lse, &want.out, &want.lse)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        println!("{name} ({label}): {line}");
        check(
            &stream,
            &p,
            &grads,
            &format!("MsaAttention {label} -> backward"),
        );
    }
}

#[test]
fn forward_packed_tiny_documents() {
    let cu = docs(&[127, 129, 1, 2, 3, 5, 128]);
    let q2k = causal_support(&cu).unwrap();
    run_case("packed tiny documents", cu, q2k, 8001);
}

#[test]
fn forward_odd_lengths_with_empty_selections() {
    // Odd lengths; every 5th query of head 1 and all of head 3 select nothing (empty rows),
    // and some lists have -1 holes.
    let cu = docs(&[301, 1, 130, 77, 1000]);
    let t = *cu.last().unwrap() as usize;
    let mut rng = Rng::new(8002);
    let mut q2k = random_top16(&cu, &mut rng);
    for tok in 0..t {
        for slot in 0..16 {
            if tok % 5 == 0 {
                q2k[(t + tok) * 16 + slot] = -1;
            }
            q2k[(3 * t + tok) * 16 + slot] = -1;
            if (tok + slot) % 7 == 0 {
                q2k[(2 * t + tok) * 16 + slot] = -1;
            }
        }
    }
    run_case("odd lengths, empty selections", cu, q2k, 8002);
}

#[test]
fn forward_one_document_of_2177() {
    if cfg!(debug_assertions) {
        eprintln!("SKIP: needs an optimised build for its CPU reference");
        return;
    }
    let cu = docs(&[2177]);
    let q2k = causal_support(&cu).unwrap();
    run_case("one document of 2177", cu, q2k, 8003);
}

#[test]
fn forward_random_top16_t8192() {
    if cfg!(debug_assertions) {
        eprintln!("SKIP: needs an optimised build for its CPU reference");
        return;
    }
    let cu = docs(&[3000, 2600, 1700, 892]);
    let mut rng = Rng::new(8004);
    let q2k = random_top16(&cu, &mut rng);
    run_case("random top-16, T = 8192", cu, q2k, 8004);
}

#[test]
fn forward_auto_one_document_of_8192() {
    // A mean document above KV_FORWARD_MIN_MEAN_DOC tokens: Auto takes the KV forward on a
    // 9.0 device (the rule's own test is in forward_kv); the Q-parallel one elsewhere.
    if cfg!(debug_assertions) {
        eprintln!("SKIP: needs an optimised build for its CPU reference");
        return;
    }
    const { assert!(8192 >= msa_runtime::KV_FORWARD_MIN_MEAN_DOC) };
    let cu = docs(&[8192]);
    let mut rng = Rng::new(8005);
    let q2k = random_top16(&cu, &mut rng);
    run_case_with(
        "Auto, one document of 8192",
        cu,
        q2k,
        8005,
        &[ForwardAlgorithm::Auto],
    );
}
