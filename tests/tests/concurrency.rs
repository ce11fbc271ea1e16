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
//! Inputs and comparison: `msa_tests::streams`.
//!
//! On the code before each stream had its own workspace this test also passed (three H200
//! runs, 2026-12-01): it checks that concurrent use is right, but it is not shown to provoke
//! the old failure (see the README, "Concurrency").
//!
//! GPU tests skip without a GPU and fail with `REQUIRE_GPU=1`. Run with `--release`.

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use msa_runtime::{
    release_workspace, run_backward_raw, BackwardBuffers, CudaBackend, Gradients, MsaBackward,
    ResidentSchedule, Span,
};
use msa_tests::cases::{to_f32, KV_ROW, Q_ROW};
use msa_tests::gpu_stream;
use msa_tests::streams::{check_all, collect_within, download, Case, Report};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Calls per thread in the concurrent phase.
const CALLS: usize = 6;
/// Each concurrent phase must finish within this (it takes a few seconds).
const TIME_BOUND: Duration = Duration::from_secs(60);

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
    let (tx, rx) = mpsc::channel::<Report>();
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
            let results: Vec<(&Case, Gradients)> = order
                .iter()
                .map(|&k| {
                    let g = match &schedules[k] {
                        Some(r) => set[k].run_on_schedule(&stream, r),
                        None => set[k].run(&stream),
                    };
                    (&set[k], g)
                })
                .collect();
            let report = check_all(&stream, &results, &format!("{label}, thread {thread}"));
            drop((results, schedules));
            release_workspace(&stream).unwrap();
            let _ = tx.send((thread, report));
        });
    }
    drop(tx);
    let failures = collect_within(&rx, sets.len(), TIME_BOUND, label);
    assert!(failures.is_empty(), "{label}:\n{}", failures.join("\n"));
}
