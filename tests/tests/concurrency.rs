//! Concurrent backward calls on one GPU (issue 17): two threads, each on its own stream, run
//! N calls each on inputs of different shapes and selections, and every result is checked
//! against a single-stream run of the same input. A hang (the failure reported before each
//! stream had its own workspace) fails the test after a time bound instead of blocking.
//! The threads run twice: on host schedules, whose upload from pageable memory makes each
//! enqueue wait for part of its stream's work, and on schedules built on the device
//! beforehand, whose calls enqueue without any host copy, so that the two streams' kernels
//! overlap as much as they can. Then one thread alternates two streams without a sync, through `run_backward` and
//! through one `MsaBackward`, and the raw-handle entry point runs on a stream.
//!
//! The comparison is GPU against GPU, so the inputs need no CPU forward: random bf16 q, k, v,
//! dO and O uniform in [-2, 2), and an LSE near `ln(2048)`, the size of a real softmax over 16 blocks of 128
//! keys. The dQ atomics make two runs of one input differ in the last bits (L2-relative
//! about 1e-3, `README.md`), so the figures are judged with the seed tolerances; a shared or
//! regrown workspace gives errors of the order of the gradients themselves.
//!
//! On the code before each stream had its own workspace this test also passed (three H200
//! runs, 2026-12-01): it checks that concurrent use is right, but it is not shown to provoke
//! the old failure (see the README, "Concurrency").
//!
//! GPU tests skip without a GPU and fail with `REQUIRE_GPU=1`. Run with `--release`.

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use msa_runtime::reference::{Tolerance, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{
    build_schedule, release_workspace, run_backward, run_backward_raw, to_aligned, BackwardBuffers,
    CudaBackend, Gradients, MsaBackward, ResidentSchedule, Schedule, ScheduleBuildSizes, Span,
};
use msa_tests::cases::{docs, random_top16, to_f32, KV_ROW, Q_ROW};
use msa_tests::{gpu_stream, Rng};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Calls per thread in the concurrent phase.
const CALLS: usize = 6;
/// Each concurrent phase must finish within this (it takes a few seconds).
const TIME_BOUND: Duration = Duration::from_secs(60);

/// One input on the device, with its single-stream result on the host.
struct Case {
    name: String,
    schedule: Schedule,
    q2k: CudaSlice<i32>,
    cu_seqlens: CudaSlice<i32>,
    q: CudaSlice<bf16>,
    k_aligned: CudaSlice<bf16>,
    v_aligned: CudaSlice<bf16>,
    grad_out: CudaSlice<bf16>,
    lse: CudaSlice<f32>,
    out: CudaSlice<bf16>,
    expected: [Vec<f32>; 3],
}

impl Case {
    fn new(stream: &Arc<CudaStream>, name: String, lengths: &[i32], seed: u64) -> Case {
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

    fn run(&self, stream: &Arc<CudaStream>) -> Gradients {
        self.run_on_schedule(stream, &self.schedule)
    }

    fn run_on_schedule<'s>(
        &self,
        stream: &Arc<CudaStream>,
        schedule: impl Into<msa_runtime::BackwardSchedule<'s, CudaBackend>>,
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
    fn resident(&self, stream: &Arc<CudaStream>) -> ResidentSchedule<CudaBackend> {
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

    fn run_with(&self, stream: &Arc<CudaStream>, backward: &mut MsaBackward) -> Gradients {
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
    fn compare(&self, got: &[Vec<f32>; 3], label: &str) -> Result<String, String> {
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

fn download(stream: &Arc<CudaStream>, g: &Gradients) -> [Vec<f32>; 3] {
    [&g.dq, &g.dk_aligned, &g.dv_aligned].map(|s| to_f32(&stream.clone_dtoh(s).unwrap()))
}

/// Two shapes per thread, each with the thread's own selection: T = 8192 as four packed
/// documents, and one document of 16,384 tokens (the shapes of the reported hang); the
/// second thread also has T = 4096 as three documents.
fn cases(stream: &Arc<CudaStream>, thread: u64) -> Vec<Case> {
    let mut v = vec![
        Case::new(
            stream,
            format!("packed 4x2048 #{thread}"),
            &[2048; 4],
            10 + thread,
        ),
        Case::new(
            stream,
            format!("doc 16384 #{thread}"),
            &[16384],
            20 + thread,
        ),
    ];
    if thread == 1 {
        v.push(Case::new(
            stream,
            "packed 1000+1996+1100 #1".into(),
            &[1000, 1996, 1100],
            31,
        ));
    }
    v
}

#[test]
fn two_threads_on_two_streams_match_single_stream_runs() {
    let Some(main) = gpu_stream() else {
        return;
    };
    let ctx = main.context().clone();
    let started = Instant::now();
    // Every case's single-stream result comes from `main`, one call at a time: afterwards the
    // process has workspaces of both shapes, as in the reported hang.
    let sets: Vec<Arc<Vec<Case>>> = (0..2).map(|t| Arc::new(cases(&main, t))).collect();
    main.synchronize().unwrap();
    println!(
        "inputs and single-stream runs: {:.1} s",
        started.elapsed().as_secs_f64()
    );

    for resident in [false, true] {
        concurrent_phase(&ctx, &sets, resident);
        println!(
            "concurrent phase done: {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }

    // One thread, two streams alternating without a sync: through the per-stream cache of
    // `run_backward`, then through one `MsaBackward` (which moves its workspace to each
    // call's stream).
    let streams = [ctx.new_stream().unwrap(), ctx.new_stream().unwrap()];
    let set = &sets[1];
    let mut owned = MsaBackward::new();
    for (label, use_owned) in [("run_backward", false), ("one MsaBackward", true)] {
        let grads: Vec<(usize, &Case, Gradients)> = (0..CALLS)
            .map(|i| {
                let (s, c) = (i % 2, &set[i % set.len()]);
                let g = if use_owned {
                    c.run_with(&streams[s], &mut owned)
                } else {
                    c.run(&streams[s])
                };
                (s, c, g)
            })
            .collect();
        for (i, (s, c, g)) in grads.iter().enumerate() {
            let got = download(&streams[*s], g);
            let line = c
                .compare(&got, &format!("{label}, alternating streams, call {i}"))
                .unwrap_or_else(|e| panic!("{e}"));
            println!("{line}");
        }
    }

    // The raw-handle entry point on a stream of the context, outputs allocated by the caller.
    let c = &set[0];
    let s = &streams[0];
    let (t, w) = (c.schedule.num_tokens(), c.schedule.workspace_rows());
    let mut dq = s.alloc_zeros::<bf16>(t * Q_ROW).unwrap();
    let mut dk = s.alloc_zeros::<bf16>(w * KV_ROW).unwrap();
    let mut dv = s.alloc_zeros::<bf16>(w * KV_ROW).unwrap();
    {
        let span = |p: u64, len| Span::new(p, len);
        let (q, _g1) = c.q.device_ptr(s);
        let (k, _g2) = c.k_aligned.device_ptr(s);
        let (v, _g3) = c.v_aligned.device_ptr(s);
        let (d_o, _g4) = c.grad_out.device_ptr(s);
        let (lse, _g5) = c.lse.device_ptr(s);
        let (o, _g6) = c.out.device_ptr(s);
        let (dq_p, _g7) = dq.device_ptr_mut(s);
        let (dk_p, _g8) = dk.device_ptr_mut(s);
        let (dv_p, _g9) = dv.device_ptr_mut(s);
        let io = BackwardBuffers {
            q: span(q, t * Q_ROW),
            k_aligned: span(k, w * KV_ROW),
            v_aligned: span(v, w * KV_ROW),
            grad_out: span(d_o, t * Q_ROW),
            lse: Span::new(lse, t * 64),
            out: span(o, t * Q_ROW),
            dq: span(dq_p, t * Q_ROW),
            dk_aligned: span(dk_p, w * KV_ROW),
            dv_aligned: span(dv_p, w * KV_ROW),
        };
        // SAFETY: the stream is alive for the whole test; every span is a live allocation of
        // its context holding the stated elements.
        unsafe { run_backward_raw(s.cu_stream(), &io, &c.schedule) }.unwrap();
    }
    let got = [&dq, &dk, &dv].map(|x| to_f32(&s.clone_dtoh(x).unwrap()));
    println!(
        "{}",
        c.compare(&got, "run_backward_raw")
            .unwrap_or_else(|e| panic!("{e}"))
    );
    for s in &streams {
        assert!(
            release_workspace(s).unwrap(),
            "a cached workspace for the stream"
        );
    }
    println!("total {:.1} s", started.elapsed().as_secs_f64());
}

/// Two threads, each on a new stream, enqueue [`CALLS`] calls on their cases (on host
/// schedules, or on schedules built on the device beforehand), then check each result; a
/// phase that does not finish within [`TIME_BOUND`] ends the process.
fn concurrent_phase(ctx: &Arc<CudaContext>, sets: &[Arc<Vec<Case>>], resident: bool) {
    let label = if resident {
        "device schedule"
    } else {
        "host schedule"
    };
    let (tx, rx) = mpsc::channel::<(usize, Result<Vec<String>, String>)>();
    for (thread, set) in sets.iter().enumerate() {
        let (tx, set, ctx) = (tx.clone(), set.clone(), ctx.clone());
        std::thread::spawn(move || {
            let stream = ctx.new_stream().unwrap();
            let schedules: Vec<Option<ResidentSchedule<CudaBackend>>> = set
                .iter()
                .map(|c| resident.then(|| c.resident(&stream)))
                .collect();
            // Enqueue every call before reading any result back, in a different shape order
            // on each thread, so that the two streams' kernels overlap.
            let order: Vec<usize> = (0..CALLS).map(|i| (i + thread) % set.len()).collect();
            let grads: Vec<Gradients> = order
                .iter()
                .map(|&k| match &schedules[k] {
                    Some(r) => set[k].run_on_schedule(&stream, r),
                    None => set[k].run(&stream),
                })
                .collect();
            let mut report = Ok(vec![]);
            for (i, (&k, g)) in order.iter().zip(&grads).enumerate() {
                let got = download(&stream, g);
                let what = format!("{label}, thread {thread}, call {i}");
                match (set[k].compare(&got, &what), &mut report) {
                    (Ok(line), Ok(lines)) => lines.push(line),
                    (Err(e), Ok(_)) => report = Err(e),
                    (Err(e), Err(all)) => *all = format!("{all}\n{e}"),
                    (Ok(_), Err(_)) => {}
                }
            }
            drop(schedules);
            release_workspace(&stream).unwrap();
            let _ = tx.send((thread, report));
        });
    }
    drop(tx);
    let deadline = Instant::now() + TIME_BOUND;
    let mut failures = vec![];
    for _ in 0..sets.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((_, Ok(lines))) => lines.iter().for_each(|l| println!("{l}")),
            Ok((thread, Err(e))) => failures.push(format!("thread {thread}: {e}")),
            Err(_) => {
                // A kernel that never finishes cannot be stopped from here, and unwinding
                // would block in the driver's teardown: report and leave.
                eprintln!(
                    "HANG ({label}): the concurrent calls did not finish within {} s",
                    TIME_BOUND.as_secs()
                );
                std::process::exit(1);
            }
        }
    }
    assert!(failures.is_empty(), "{label}:\n{}", failures.join("\n"));
}
