//! The stress test that catches two streams sharing a workspace (issue 17): two threads, each
//! on its own stream, enqueue [`CALLS`] backward calls each through `run_backward` behind a
//! closed gate (a `cuStreamWaitValue32` on a device word), the gate opens, and every result is
//! checked against a single-stream run. A hang fails after [`TIME_BOUND`].
//!
//! `tests/tests/concurrency.rs` passed on the code before each stream had its own workspace.
//! There, one call's kernels had usually finished before the other stream's next call was
//! enqueued: that code's cache lock serialized the two threads' enqueues, its shapes changed
//! from call to call, so the shared cache reallocated a task workspace nearly every call (an
//! allocation that reuses memory freed on the other stream makes the allocating stream wait
//! for the other stream's work up to that free), and the host schedules' uploads staged
//! through pageable memory. Here the two streams' calls are made to run at the same time:
//! - the gate holds both streams until both threads have enqueued every call, so each stream
//!   starts with [`CALLS`] calls queued, whatever the host's enqueue speed;
//! - every call of a phase has the same shape (the same `T`, documents and `W`, so the same
//!   task sizes), with its own selection and values: the workspaces fit, nothing regrows;
//! - the schedules are built on the device beforehand: nothing is uploaded per call.
//!
//! The two streams' spans on the GPU are timed with events from the opening of the gate and
//! printed with their intersection. Two phases: T = 8192 as four documents (the shape of the
//! report), and T = 2048 as two documents, whose main kernel has few tasks, so that most of
//! its CTAs leave at once and the other stream's kernels get SMs while its last CTAs run.
//!
//! This file uses only API that the runtime had before the fix (commit 5252e57), so it
//! builds against that code unchanged: the README ("Concurrency") and
//! `docs/h200-concurrency-*.md` have the figures of both.
//!
//! GPU tests skip without a GPU and fail with `REQUIRE_GPU=1`. Run with `--release`.

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use msa_runtime::{CudaBackend, Gradients, ResidentSchedule};
use msa_tests::gpu_stream;
use msa_tests::streams::{check_all, collect_within, Case, Report};
use std::sync::mpsc;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Calls per thread in each phase.
const CALLS: usize = 16;
/// Each phase must finish within this (it takes a few seconds).
const TIME_BOUND: Duration = Duration::from_secs(30);

#[test]
fn same_shape_calls_on_two_streams_overlap_and_match_single_stream_runs() {
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

/// A word of device memory that streams wait on (`cuStreamWaitValue32`) until it is opened,
/// so that work enqueued behind it starts on every stream at once.
struct Gate {
    // Owns the word; `addr` is taken once, so that cudarc's access tracking never orders the
    // opening behind the waits.
    _word: CudaSlice<u32>,
    addr: u64,
    stream: Arc<CudaStream>,
}

impl Gate {
    fn new(ctx: &Arc<CudaContext>) -> Gate {
        let stream = ctx.new_stream().unwrap();
        let word = stream.alloc_zeros::<u32>(1).unwrap();
        let addr = word.device_ptr(&stream).0;
        stream.synchronize().unwrap();
        Gate {
            _word: word,
            addr,
            stream,
        }
    }

    /// Makes `stream` wait until the gate is open.
    fn hold(&self, stream: &CudaStream) {
        let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: `addr` is a live word of this context (owned by the gate, which outlives
        // the phase); the wait only reads it.
        unsafe { sys::cuStreamWaitValue32_v2(stream.cu_stream(), self.addr, 1, geq) }
            .result()
            .unwrap();
    }

    fn open(&self) {
        // SAFETY: as in `hold`; the write is the word's only store.
        unsafe { sys::cuStreamWriteValue32_v2(self.stream.cu_stream(), self.addr, 1, 0) }
            .result()
            .unwrap();
    }
}

/// A timing event.
fn timed(ctx: &Arc<CudaContext>) -> CudaEvent {
    ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .unwrap()
}

/// Two threads, each on a new stream with the schedules of its cases built there, enqueue
/// [`CALLS`] calls alternating their cases behind a closed [`Gate`]; once both have, the gate
/// opens and the threads check every result. Prints each stream's span on the GPU, from the
/// opening of the gate.
fn phase(ctx: &Arc<CudaContext>, sets: &[Arc<Vec<Case>>], label: &'static str) {
    let origin = timed(ctx);
    let gate = Arc::new(Gate::new(ctx));
    let enqueued = Arc::new(Barrier::new(sets.len() + 1));
    let (tx, rx) = mpsc::channel::<Report>();
    let (span_tx, span_rx) = mpsc::channel::<(usize, CudaEvent, CudaEvent)>();
    for (thread, set) in sets.iter().enumerate() {
        let (tx, span_tx, set, ctx, gate, enqueued) = (
            tx.clone(),
            span_tx.clone(),
            set.clone(),
            ctx.clone(),
            gate.clone(),
            enqueued.clone(),
        );
        std::thread::spawn(move || {
            let stream = ctx.new_stream().unwrap();
            let schedules: Vec<ResidentSchedule<CudaBackend>> =
                set.iter().map(|c| c.resident(&stream)).collect();
            stream.synchronize().unwrap();
            let (first, last) = (timed(&ctx), timed(&ctx));
            gate.hold(&stream);
            first.record(&stream).unwrap();
            let results: Vec<(&Case, Gradients)> = (0..CALLS)
                .map(|i| {
                    let k = i % set.len();
                    (&set[k], set[k].run_on_schedule(&stream, &schedules[k]))
                })
                .collect();
            last.record(&stream).unwrap();
            let _ = span_tx.send((thread, first, last));
            enqueued.wait();
            let report = check_all(&stream, &results, &format!("{label}, thread {thread}"));
            drop((results, schedules));
            let _ = tx.send((thread, report));
        });
    }
    drop((tx, span_tx));
    // Once every thread is at the barrier, it has enqueued all its calls behind the gate.
    enqueued.wait();
    origin.record(&gate.stream).unwrap();
    gate.open();
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
    if let [(_, a0, b0), (_, a1, b1)] = spans[..] {
        let both = (b0.min(b1) - a0.max(a1)).max(0.0);
        println!(
            "{label}: both streams busy for {both:.1} ms, {:.0} % of the shorter span",
            100.0 * both / (b0 - a0).min(b1 - a1)
        );
    }
    assert!(failures.is_empty(), "{label}:\n{}", failures.join("\n"));
}
