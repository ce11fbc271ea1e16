//! GPU test cases shared by the backward tests and the sanitizer harness: random inputs, the
//! CPU reference gradients, the upload, and the comparison with the seed tolerances.

use crate::Rng;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use msa_runtime::contract::{BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS, TOPK_BLOCKS};
use msa_runtime::reference::{self, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE, O_TOLERANCE};
use msa_runtime::{build_schedule, run_backward, Gradients, MsaBackward, RuntimeError, Schedule};
use std::sync::Arc;
use std::time::Instant;

pub const Q_ROW: usize = NUM_Q_HEADS * HEAD_DIM;
pub const KV_ROW: usize = NUM_KV_HEADS * HEAD_DIM;

pub fn docs(lengths: &[i32]) -> Vec<i32> {
    let mut cu = vec![0];
    for l in lengths {
        cu.push(cu.last().unwrap() + l);
    }
    cu
}

/// Standard normal (Box–Muller), like the seed's randn inputs.
pub fn normal(rng: &mut Rng) -> f32 {
    let u1 = ((rng.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64; // (0, 1]
    let u2 = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// `n` bf16-rounded normals, as bf16 and as their exact f32 values.
pub fn random_bf16(rng: &mut Rng, n: usize) -> (Vec<bf16>, Vec<f32>) {
    let b: Vec<bf16> = (0..n).map(|_| bf16::from_f32(normal(rng))).collect();
    let f = b.iter().map(|x| x.to_f32()).collect();
    (b, f)
}

pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// A random top-16 selection `q2k [4, T, 16]`: each (index head, query) selects its own block
/// plus up to 15 distinct random earlier blocks of its document, in random slot order with
/// `-1` padding, independently per head.
pub fn random_top16(cu: &[i32], rng: &mut Rng) -> Vec<i32> {
    let t_total = *cu.last().unwrap() as usize;
    let mut q2k = vec![-1i32; NUM_KV_HEADS * t_total * TOPK_BLOCKS];
    let mut pick = |n: usize| (rng.next_u64() % n as u64) as usize;
    for g in 0..NUM_KV_HEADS {
        for w in cu.windows(2) {
            for t in w[0] as usize..w[1] as usize {
                let own = (t - w[0] as usize) / BLOCK_SIZE;
                // Partial Fisher–Yates over the earlier blocks 0..own.
                let mut earlier: Vec<i32> = (0..own as i32).collect();
                let extra = own.min(TOPK_BLOCKS - 1);
                for i in 0..extra {
                    let j = i + pick(own - i);
                    earlier.swap(i, j);
                }
                let mut slots = [-1i32; TOPK_BLOCKS];
                slots[0] = own as i32;
                slots[1..=extra].copy_from_slice(&earlier[..extra]);
                for i in (1..TOPK_BLOCKS).rev() {
                    slots.swap(i, pick(i + 1));
                }
                let at = (g * t_total + t) * TOPK_BLOCKS;
                q2k[at..at + TOPK_BLOCKS].copy_from_slice(&slots);
            }
        }
    }
    q2k
}

/// Host inputs of one case and the reference gradients.
pub struct Problem {
    pub name: &'static str,
    pub schedule: Schedule,
    pub q: Vec<bf16>,
    pub k_aligned: Vec<bf16>,
    pub v_aligned: Vec<bf16>,
    pub grad_out: Vec<bf16>,
    pub lse: Vec<f32>,
    pub out: Vec<bf16>,
    pub expected: reference::Gradients,
}

impl Problem {
    pub fn new(name: &'static str, cu: Vec<i32>, q2k: Vec<i32>, seed: u64) -> Self {
        let t = *cu.last().unwrap() as usize;
        let mut rng = Rng::new(seed);
        let (q, q32) = random_bf16(&mut rng, t * Q_ROW);
        let (_, k32) = random_bf16(&mut rng, t * KV_ROW);
        let (_, v32) = random_bf16(&mut rng, t * KV_ROW);
        let (grad_out, do32) = random_bf16(&mut rng, t * Q_ROW);
        let started = Instant::now();
        let fwd = reference::forward(&q32, &k32, &v32, &q2k, &cu).unwrap();
        // The kernel sees the bf16 output; the reference backward gets the same values.
        let out = to_bf16(&fwd.out);
        let out32 = to_f32(&out);
        let expected =
            reference::backward(&q32, &k32, &v32, &q2k, &cu, &out32, &fwd.lse, &do32).unwrap();
        println!(
            "{name}: T = {t}, W = {}, CPU reference {:.2} s",
            expected.workspace_rows,
            started.elapsed().as_secs_f64()
        );
        let schedule = build_schedule(&q2k, &cu, 64).unwrap();
        assert_eq!(schedule.workspace_rows(), expected.workspace_rows);
        Problem {
            name,
            k_aligned: to_bf16(&reference::to_aligned(&k32, &cu, NUM_KV_HEADS).unwrap()),
            v_aligned: to_bf16(&reference::to_aligned(&v32, &cu, NUM_KV_HEADS).unwrap()),
            schedule,
            q,
            grad_out,
            lse: fwd.lse,
            out,
            expected,
        }
    }
}

/// A problem's inputs on the device.
pub struct DeviceInputs {
    pub q: CudaSlice<bf16>,
    pub k_aligned: CudaSlice<bf16>,
    pub v_aligned: CudaSlice<bf16>,
    pub grad_out: CudaSlice<bf16>,
    pub lse: CudaSlice<f32>,
    pub out: CudaSlice<bf16>,
}

impl DeviceInputs {
    pub fn upload(stream: &Arc<CudaStream>, p: &Problem) -> Self {
        DeviceInputs {
            q: stream.clone_htod(&p.q).unwrap(),
            k_aligned: stream.clone_htod(&p.k_aligned).unwrap(),
            v_aligned: stream.clone_htod(&p.v_aligned).unwrap(),
            grad_out: stream.clone_htod(&p.grad_out).unwrap(),
            lse: stream.clone_htod(&p.lse).unwrap(),
            out: stream.clone_htod(&p.out).unwrap(),
        }
    }

    pub fn run(
        &self,
        stream: &Arc<CudaStream>,
        schedule: &Schedule,
        backward: Option<&mut MsaBackward>,
    ) -> Result<Gradients, RuntimeError> {
        let args = (
            &self.q.as_view(),
            &self.k_aligned.as_view(),
            &self.v_aligned.as_view(),
            &self.grad_out.as_view(),
            &self.lse.as_view(),
            &self.out.as_view(),
        );
        match backward {
            Some(b) => b.run(
                stream, args.0, args.1, args.2, args.3, args.4, args.5, schedule,
            ),
            None => run_backward(
                stream, args.0, args.1, args.2, args.3, args.4, args.5, schedule,
            ),
        }
    }
}

/// Checks a forward's `out [T, 64, 128]` and `lse [T, 64]` against the reference's: `out`
/// within the seed's O tolerance, `lse` within 1e-3 max-abs (a NaN fails), and each empty
/// reference row (`lse = −∞`) exactly `lse = −∞`, `out = 0`. `Ok` holds one line of figures;
/// `label` names the output in the messages.
pub fn compare_forward(
    label: &str,
    out: &[f32],
    lse: &[f32],
    want_out: &[f32],
    want_lse: &[f32],
) -> Result<String, String> {
    let stats = O_TOLERANCE.check(&format!("out ({label})"), out, want_out)?;
    let (mut worst, mut empty) = (0f32, 0usize);
    for (i, (&g, &e)) in lse.iter().zip(want_lse).enumerate() {
        if e == f32::NEG_INFINITY {
            let row = &out[i * HEAD_DIM..(i + 1) * HEAD_DIM];
            if g != e || row.iter().any(|&x| x != 0.0) {
                return Err(format!(
                    "{label}: empty row {i} has lse {g} or a non-zero out"
                ));
            }
            empty += 1;
        } else {
            let d = (g - e).abs();
            if d.is_nan() || d > 1e-3 {
                return Err(format!("{label}: lse[{i}] = {g}, reference {e}"));
            }
            worst = worst.max(d);
        }
    }
    Ok(format!(
        "out {stats}; lse max-abs {worst:.2e}; {empty} empty rows"
    ))
}

/// Checks dQ (compact) and dK/dV (aligned, padding rows included) against the reference;
/// `Ok` holds one line of figures per tensor, `Err` every failure.
pub fn compare(
    stream: &Arc<CudaStream>,
    p: &Problem,
    grads: &Gradients,
    label: &str,
) -> Result<Vec<String>, String> {
    let dq = to_f32(&stream.clone_dtoh(&grads.dq).map_err(|e| e.to_string())?);
    let dk = to_f32(
        &stream
            .clone_dtoh(&grads.dk_aligned)
            .map_err(|e| e.to_string())?,
    );
    let dv = to_f32(
        &stream
            .clone_dtoh(&grads.dv_aligned)
            .map_err(|e| e.to_string())?,
    );
    let e = &p.expected;
    let (mut lines, mut failures) = (vec![], vec![]);
    for (tol, name, got, want) in [
        (DQ_TOLERANCE, "dq", &dq, &e.dq),
        (DK_TOLERANCE, "dk_aligned", &dk, &e.dk_aligned),
        (DV_TOLERANCE, "dv_aligned", &dv, &e.dv_aligned),
    ] {
        match tol.check(name, got, want) {
            Ok(stats) => lines.push(format!("{} ({label}) {name}: {stats}", p.name)),
            Err(msg) => failures.push(msg),
        }
    }
    if failures.is_empty() {
        Ok(lines)
    } else {
        Err(format!("{} ({label}):\n{}", p.name, failures.join("\n")))
    }
}

/// [`compare`], printing the figures and panicking on a failure.
pub fn check(stream: &Arc<CudaStream>, p: &Problem, grads: &Gradients, label: &str) {
    match compare(stream, p, grads, label) {
        Ok(lines) => lines.iter().for_each(|l| println!("{l}")),
        Err(msg) => panic!("{msg}"),
    }
}
