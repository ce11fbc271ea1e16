//! A workspace regrown on one stream while another stream's backward still runs (issue 17's
//! hang, as diagnosed: with one workspace cache per context, the stream whose call outgrew
//! the cache freed the old workspace in its own stream order, while the other stream's
//! kernels were still reading it, and the freed memory went to the next allocation).
//!
//! Each round enqueues a call on stream V that fits the workspace grown so far, then at once
//! a call with twice the tokens on stream G, then, still on G and before V's kernels can have
//! finished, allocations that another library might make, filled with 0xff bytes. Memory
//! that V's in-flight kernels use must never be handed out, so V's and G's gradients must
//! equal their single-stream runs (within the seed tolerances; the dQ atomics differ run to
//! run), and the rounds must finish within a time bound instead of hanging.
//!
//! Inputs and comparison: `msa_tests::streams` (only API of commit 5252e57, before each stream
//! had its own workspace, so that this file builds against that code unchanged).
//!
//! GPU tests skip without a GPU and fail with `REQUIRE_GPU=1`. Run with `--release`.

use cudarc::driver::{result, CudaSlice, DevicePtr};
use msa_tests::gpu_stream;
use msa_tests::streams::{check_all, collect_within, Case, Report};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Tokens of the cases: one document each, doubling (round `r` runs case `r` on V and
/// case `r + 1` on G).
const LENGTHS: [i32; 5] = [4096, 8192, 16384, 32768, 65536];
/// The rounds take well under a second of GPU time; inputs are made before the clock starts.
const TIME_BOUND: Duration = Duration::from_secs(60);

#[test]
fn a_workspace_regrown_on_one_stream_is_never_reused_under_another_streams_kernels() {
    let Some(main) = gpu_stream() else {
        return;
    };
    let ctx = main.context().clone();
    let started = Instant::now();
    let cases: Arc<Vec<Case>> = Arc::new(
        LENGTHS
            .iter()
            .enumerate()
            .map(|(i, &len)| Case::new(&main, format!("doc {len}"), &[len], 70 + i as u64))
            .collect(),
    );
    main.synchronize().unwrap();
    println!(
        "inputs and single-stream runs: {:.1} s",
        started.elapsed().as_secs_f64()
    );

    let (tx, rx) = mpsc::channel::<Report>();
    let worker = {
        let (cases, ctx) = (cases.clone(), ctx.clone());
        std::thread::spawn(move || {
            let (v, g) = (ctx.new_stream().unwrap(), ctx.new_stream().unwrap());
            // G's first call sizes the workspace (and, with one cache per context, owns it).
            drop(cases[0].run(&g));
            let mut lines = vec![];
            let mut failures = vec![];
            for r in 0..LENGTHS.len() - 1 {
                let on_v = cases[r].run(&v);
                let on_g = cases[r + 1].run(&g);
                // Another library's allocations on G, written at once (0xff: NaN in bf16/f32
                // and out-of-range indices in the task tables).
                let garbage: Vec<CudaSlice<u8>> = [1usize << 20; 32]
                    .into_iter()
                    .chain([8 << 20; 8])
                    .chain([32 << 20; 2])
                    .map(|n| {
                        // SAFETY: `n` bytes allocated on `g`, written in `g`'s order.
                        let buf = unsafe { g.alloc::<u8>(n) }.unwrap();
                        {
                            let (p, _sync) = buf.device_ptr(&g);
                            unsafe { result::memset_d8_async(p, 0xff, n, g.cu_stream()) }.unwrap();
                        }
                        buf
                    })
                    .collect();
                let checks = [
                    check_all(&v, &[(&cases[r], on_v)], &format!("round {r}, stream V")),
                    check_all(
                        &g,
                        &[(&cases[r + 1], on_g)],
                        &format!("round {r}, stream G"),
                    ),
                ];
                for c in checks {
                    match c {
                        Ok(l) => lines.extend(l),
                        Err(e) => failures.push(e),
                    }
                }
                drop(garbage);
            }
            let report = if failures.is_empty() {
                Ok(lines)
            } else {
                Err(failures.join("\n"))
            };
            let _ = tx.send((0, report));
        })
    };
    let failures = collect_within(&rx, 1, TIME_BOUND, "regrow");
    worker.join().unwrap();
    assert!(failures.is_empty(), "regrow:\n{}", failures.join("\n"));
    println!("total {:.1} s", started.elapsed().as_secs_f64());
}
