//! Backward calls on several streams, for the concurrency tests: one input on the device
//! with its single-stream result, the GPU-against-GPU comparison, and the bounded wait that
//! turns a hang into a failure.
//!
//! The comparison is GPU against GPU, so the inputs need no CPU forward: random bf16 q, k, v,
//! dO and O uniform in [-2, 2), and an LSE near `ln(2048)`, the size of a real softmax over
//! 16 blocks of 128 keys. The dQ atomics make two runs of one input differ in the last bits
//! (L2-relative about 1e-3, `README.md`), so the figures are judged with the seed
//! tolerances; a shared or regrown workspace gives errors of the order of the gradients
//! themselves.
//!
//! Only API that the runtime had before each stream got its own workspace (commit 5252e57)
//! is used here, so that `tests/tests/overlap.rs` builds against that code unchanged.

use crate::cases::{docs, random_top16, to_f32, KV_ROW, Q_ROW};
use crate::Rng;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use half::bf16;
use msa_runtime::reference::{Tolerance, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{
    build_schedule, run_backward, to_aligned, BackwardSchedule, CudaBackend, Gradients,
    MsaBackward, ResidentSchedule, Schedule, ScheduleBuildSizes, Span,
};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One input on the device, with its single-stream result on the host.
pub struct Case {
    /// Label in the report lines.
    pub name: String,
    /// The host schedule.
    pub schedule: Schedule,
    /// `q2k [4, T, 16]` on the device, for device-built schedules.
    pub q2k: CudaSlice<i32>,
    /// `cu_seqlens` on the device.
    pub cu_seqlens: CudaSlice<i32>,
    /// `q [T, 64, 128]`.
    pub q: CudaSlice<bf16>,
    /// `k_aligned [W, 4, 128]`.
    pub k_aligned: CudaSlice<bf16>,
    /// `v_aligned [W, 4, 128]`.
    pub v_aligned: CudaSlice<bf16>,
    /// `grad_out [T, 64, 128]`.
    pub grad_out: CudaSlice<bf16>,
    /// `lse [T, 64]`.
    pub lse: CudaSlice<f32>,
    /// `out [T, 64, 128]`.
    pub out: CudaSlice<bf16>,
    /// dQ, dK, dV (aligned) of a single-stream run, as f32.
    pub expected: [Vec<f32>; 3],
}

impl Case {
    /// Random inputs for documents of `lengths` tokens and a random top-16 selection from
    /// `seed`, uploaded on `stream`, with the result of one call on `stream` (host schedule).
    pub fn new(stream: &Arc<CudaStream>, name: String, lengths: &[i32], seed: u64) -> Case {
        let cu = docs(lengths);
        let t = *cu.last().unwrap() as usize;
        let mut rng = Rng::new(seed);
        let q2k = random_top16(&cu, &mut rng);
        let schedule = build_schedule(&q2k, &cu, 64).unwrap();
        let mut random = |n: usize| -> Vec<bf16> {
            (0..n)
                .map(|_| bf16::from_f32(2.0 * rng.uniform()))
                .collect()
        };
        let (q, k, v) = (random(t * Q_ROW), random(t * KV_ROW), random(t * KV_ROW));
        let (grad_out, out) = (random(t * Q_ROW), random(t * Q_ROW));
        let lse: Vec<f32> = (0..t * 64)
            .map(|_| (2048f32).ln() + 0.5 * rng.uniform())
            .collect();
        let (k, v) = (
            stream.clone_htod(&k).unwrap(),
            stream.clone_htod(&v).unwrap(),
        );
        let (k_aligned, v_aligned) =
            to_aligned(stream, &schedule, &k.as_view(), &v.as_view()).unwrap();
        let mut case = Case {
            name,
            schedule,
            q2k: stream.clone_htod(&q2k).unwrap(),
            cu_seqlens: stream.clone_htod(&cu).unwrap(),
            q: stream.clone_htod(&q).unwrap(),
            k_aligned,
            v_aligned,
            grad_out: stream.clone_htod(&grad_out).unwrap(),
            lse: stream.clone_htod(&lse).unwrap(),
            out: stream.clone_htod(&out).unwrap(),
            expected: Default::default(),
        };
        let g = case.run(stream);
        case.expected = download(stream, &g);
        case
    }

    /// [`run_backward`] on the host schedule.
    pub fn run(&self, stream: &Arc<CudaStream>) -> Gradients {
        self.run_on_schedule(stream, &self.schedule)
    }

    /// [`run_backward`] on `schedule`.
    pub fn run_on_schedule<'s>(
        &self,
        stream: &Arc<CudaStream>,
        schedule: impl Into<BackwardSchedule<'s, CudaBackend>>,
    ) -> Gradients {
        run_backward(
            stream,
            &self.q.as_view(),
            &self.k_aligned.as_view(),
            &self.v_aligned.as_view(),
            &self.grad_out.as_view(),
            &self.lse.as_view(),
            &self.out.as_view(),
            schedule,
        )
        .unwrap()
    }

    /// The case's schedule built on `stream`'s device from its device `q2k`, checked
    /// unflagged before it is returned.
    pub fn resident(&self, stream: &Arc<CudaStream>) -> ResidentSchedule<CudaBackend> {
        let mut backend = CudaBackend::new(stream).unwrap();
        let s = &self.schedule;
        let sizes =
            ScheduleBuildSizes::new(s.num_tokens(), s.num_documents(), s.workspace_rows(), 64)
                .unwrap();
        let mut r = ResidentSchedule::new(&mut backend, sizes).unwrap();
        {
            let (q2k, _a) = self.q2k.device_ptr(stream);
            let (cu, _b) = self.cu_seqlens.device_ptr(stream);
            let q2k = Span::new(q2k, self.q2k.len());
            let cu = Span::new(cu, self.cu_seqlens.len());
            r.build(&mut backend, q2k, cu).unwrap();
        }
        r.read_status(&backend).unwrap().wait().unwrap();
        r
    }

    /// [`MsaBackward::run`] on the host schedule.
    pub fn run_with(&self, stream: &Arc<CudaStream>, backward: &mut MsaBackward) -> Gradients {
        backward
            .run(
                stream,
                &self.q.as_view(),
                &self.k_aligned.as_view(),
                &self.v_aligned.as_view(),
                &self.grad_out.as_view(),
                &self.lse.as_view(),
                &self.out.as_view(),
                &self.schedule,
            )
            .unwrap()
    }

    /// Compares `got` with the single-stream result; the figures, or every failure.
    ///
    /// Two runs of one input differ by the order of the bf16 dQ reductions, a few ulps of
    /// each element, so an element may differ by the seed's max-abs bound plus 1/32 of its
    /// magnitude (4 bf16 ulps); the L2-relative error is held to the seed's bound. A shared
    /// or regrown workspace loses or mixes whole contributions, far outside both.
    pub fn compare(&self, got: &[Vec<f32>; 3], label: &str) -> Result<String, String> {
        let tolerances: [(Tolerance, &str); 3] = [
            (DQ_TOLERANCE, "dq"),
            (DK_TOLERANCE, "dk"),
            (DV_TOLERANCE, "dv"),
        ];
        let (mut figures, mut failures) = (vec![], vec![]);
        for ((tol, name), (g, e)) in tolerances.iter().zip(got.iter().zip(&self.expected)) {
            let (mut worst, mut at, mut bad) = (0f64, 0usize, 0usize);
            let (mut diff2, mut norm2) = (0f64, 0f64);
            for (i, (&a, &b)) in g.iter().zip(e).enumerate() {
                let d = (a as f64 - b as f64).abs();
                if d.is_nan() || d > tol.max_abs as f64 + b.abs() as f64 / 32.0 {
                    bad += 1;
                }
                if d.is_nan() || d > worst {
                    (worst, at) = (d, i);
                }
                diff2 += d * d;
                norm2 += b as f64 * b as f64;
            }
            let l2 = if norm2 > 0.0 {
                (diff2 / norm2).sqrt()
            } else {
                diff2.sqrt()
            };
            let line = format!(
                "{name} max-abs {worst:.4} (at {at}: {} vs {}) L2-rel {l2:.1e}",
                g[at], e[at]
            );
            if g.len() != e.len() || bad > 0 || l2.is_nan() || l2 > tol.l2_rel as f64 {
                failures.push(format!("{line}; {bad} elements out of bounds"));
            } else {
                figures.push(line);
            }
        }
        if failures.is_empty() {
            Ok(format!("{} ({label}): {}", self.name, figures.join(", ")))
        } else {
            Err(format!("{} ({label}):\n{}", self.name, failures.join("\n")))
        }
    }
}

/// The gradients of `g` on the host, as f32.
pub fn download(stream: &Arc<CudaStream>, g: &Gradients) -> [Vec<f32>; 3] {
    [&g.dq, &g.dk_aligned, &g.dv_aligned].map(|s| to_f32(&stream.clone_dtoh(s).unwrap()))
}

/// What one thread reports: its index, and every result line or every failure.
pub type Report = (usize, Result<Vec<String>, String>);

/// Compares each result `(case, gradients)` with its case's single-stream run, downloading
/// on `stream`; every line, or every failure.
pub fn check_all(
    stream: &Arc<CudaStream>,
    results: &[(&Case, Gradients)],
    label: &str,
) -> Result<Vec<String>, String> {
    let mut report = Ok(vec![]);
    for (i, (case, g)) in results.iter().enumerate() {
        let got = download(stream, g);
        match (
            case.compare(&got, &format!("{label}, call {i}")),
            &mut report,
        ) {
            (Ok(line), Ok(lines)) => lines.push(line),
            (Err(e), Ok(_)) => report = Err(e),
            (Err(e), Err(all)) => *all = format!("{all}\n{e}"),
            (Ok(_), Err(_)) => {}
        }
    }
    report
}

/// Waits for `threads` reports within `bound`, prints their lines and returns the failures
/// (a thread that panicked is one).
/// When the bound passes first, reports the hang and ends the process: a kernel that never
/// finishes cannot be stopped from here, and unwinding would block in the driver's teardown.
pub fn collect_within(
    rx: &Receiver<Report>,
    threads: usize,
    bound: Duration,
    label: &str,
) -> Vec<String> {
    let deadline = Instant::now() + bound;
    let mut failures = vec![];
    for _ in 0..threads {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((_, Ok(lines))) => lines.iter().for_each(|l| println!("{l}")),
            Ok((thread, Err(e))) => failures.push(format!("thread {thread}: {e}")),
            Err(RecvTimeoutError::Disconnected) => {
                failures.push("a thread ended without a report (its panic is above)".into());
                break;
            }
            Err(RecvTimeoutError::Timeout) => {
                eprintln!(
                    "HANG ({label}): the concurrent calls did not finish within {} s (or a thread \
                     stopped on a panic reported above)",
                    bound.as_secs()
                );
                std::process::exit(1);
            }
        }
    }
    failures
}
