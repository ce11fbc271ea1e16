//! A stress test of two streams whose calls share nothing but the GPU (issue 17): two
//! threads, each on its own stream, enqueue [`CALLS`] backward calls each through
//! `run_backward`, all of one shape, then check every result against a single-stream run;
//! a hang fails after [`TIME_BOUND`]. No call waits for the other stream's GPU work:
//! - every call of a phase has the same shape (the same `T`, documents and `W`, so the same
//!   task sizes), with its own selection and values: the workspaces fit, nothing regrows
//!   (on the code before per-stream workspaces a regrown task workspace reused memory freed
//!   on the other stream, and the stream-ordered allocator then orders the allocating
//!   stream behind that free);
//! - the schedules are built on the device beforehand: nothing is uploaded per call;
//! - every result is kept until all calls are enqueued, and the device is idle when the
//!   threads start, so the outputs' allocations take fresh or long-freed memory.
//!
//! The two streams' spans on the GPU are timed with events and printed. Two phases: T = 8192
//! as four documents (the shape of the report), and T = 2048 as two documents.
//!
//! **It does not catch the old failure**: built against the code before per-stream
//! workspaces (commit 5252e57; this file uses only API that code had) it passed too on the
//! H200. Its spans fit this reading: that code's cache lock, held while a call is enqueued,
//! let one thread enqueue all its calls before the other's first, so the two streams ran in
//! turns. The README ("Concurrency") and `docs/h200-concurrency-2026-12-01.md` have the
//! figures, and what was tried to make both streams' calls run at once.
//!
//! GPU tests skip without a GPU and fail with `REQUIRE_GPU=1`. Run with `--release`.

use cudarc::driver::{sys, CudaContext, CudaEvent};
use msa_runtime::{CudaBackend, Gradients, ResidentSchedule};
use msa_tests::gpu_stream;
use msa_tests::streams::{check_all, collect_within, Case, Report};
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Calls per thread in each phase.
const CALLS: usize = 24;
/// Each phase must finish within this (it takes a few seconds).
const TIME_BOUND: Duration = Duration::from_secs(40);

#[test]
fn same_shape_calls_on_two_streams_match_single_stream_runs() {
    let Some(main) = gpu_stream() else {
        return;
    };
    let ctx = main.context().clone();
    let started = Instant::now();
    for (shape, lengths) in [("4x2048", &[2048; 4][..]), ("2x1024", &[1024; 2][..])] {
        // Two inputs per thread, all of one shape, each with its own selection and values;
        // their single-stream results come from `main`, one call at a time.
        let sets: Vec<Arc<Vec<Case>>> = (0..2u64)
            .map(|t| {
                let case = |i: u64| {
                    let name = format!("{shape} #{t}.{i}");
                    Case::new(
                        &main,
                        name,
                        lengths,
                        100 * t + 10 * i + lengths.len() as u64,
                    )
                };
                Arc::new(vec![case(0), case(1)])
            })
            .collect();
        main.synchronize().unwrap();
        println!(
            "{shape}: inputs and single-stream runs done at {:.1} s",
            started.elapsed().as_secs_f64()
        );
        phase(&ctx, &sets, shape);
        println!(
            "{shape}: concurrent phase done at {:.1} s",
            started.elapsed().as_secs_f64()
        );
    }
}

/// A timing event.
fn timed(ctx: &Arc<CudaContext>) -> CudaEvent {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap()
}

/// Two threads, each on a new stream with the schedules of its cases built there, wait for
/// each other and enqueue [`CALLS`] calls alternating their cases, then check every result.
/// Prints each stream's span on the GPU, from an event recorded when the device was idle.
fn phase(ctx: &Arc<CudaContext>, sets: &[Arc<Vec<Case>>], label: &'static str) {
    // `main` was synchronized after the single-stream runs: the device is idle.
    let origin = timed(ctx);
    origin.record(&ctx.default_stream()).unwrap();
    // Only the workers meet here: a worker that panics before it leaves the other waiting,
    // which the time bound reports.
    let start = Arc::new(Barrier::new(sets.len()));
    let (tx, rx) = mpsc::channel::<Report>();
    let (span_tx, span_rx) = mpsc::channel::<(usize, CudaEvent, CudaEvent)>();
    for (thread, set) in sets.iter().enumerate() {
        let (tx, span_tx, set, ctx, start) = (
            tx.clone(),
            span_tx.clone(),
            set.clone(),
            ctx.clone(),
            start.clone(),
        );
        std::thread::spawn(move || {
            let stream = ctx.new_stream().unwrap();
            let schedules: Vec<ResidentSchedule<CudaBackend>> =
                set.iter().map(|c| c.resident(&stream)).collect();
            stream.synchronize().unwrap();
            let (first, last) = (timed(&ctx), timed(&ctx));
            start.wait();
            first.record(&stream).unwrap();
            let results: Vec<(&Case, Gradients)> = (0..CALLS)
                .map(|i| {
                    let k = i % set.len();
                    (&set[k], set[k].run_on_schedule(&stream, &schedules[k]))
                })
                .collect();
            last.record(&stream).unwrap();
            let _ = span_tx.send((thread, first, last));
            let report = check_all(&stream, &results, &format!("{label}, thread {thread}"));
            // The stream's cached workspace stays until the process ends: `release_workspace`
            // is newer than the code this file also builds against.
            drop((results, schedules));
            let _ = tx.send((thread, report));
        });
    }
    drop((tx, span_tx));
    let failures = collect_within(&rx, sets.len(), TIME_BOUND, label);
    let mut spans: Vec<(usize, f32, f32)> = span_rx
        .iter()
        .map(|(t, a, b)| {
            (
                t,
                origin.elapsed_ms(&a).unwrap(),
                origin.elapsed_ms(&b).unwrap(),
            )
        })
        .collect();
    spans.sort_by_key(|s| s.0);
    for (t, a, b) in &spans {
        println!("{label}: stream of thread {t} busy from {a:.1} to {b:.1} ms");
    }
    assert!(failures.is_empty(), "{label}:\n{}", failures.join("\n"));
}
