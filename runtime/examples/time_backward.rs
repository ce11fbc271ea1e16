//! Times the MSA backward on GPU 0.
//!
//! ```sh
//! cargo run -p msa-runtime --release --example time_backward                 # a few documents
//! cargo run -p msa-runtime --release --example time_backward -- --tokens 8192 # one document
//! ```
//!
//! Options: `--tokens N` (one document of N tokens), `--reps R` (timed calls, default 20),
//! `--warmup W` (untimed calls first, default 3). Builds a causal-support schedule, random bf16
//! inputs, and reports the median and best time per `run_backward` call (CUDA events around
//! each call). Without a GPU it says so and exits 0.

use cudarc::driver::{sys, CudaStream};
use half::bf16;
use msa_runtime::contract::{HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS};
use msa_runtime::{
    build_schedule, causal_support, driver_present, reference, run_backward, Device, RuntimeError,
};
use std::process::ExitCode;
use std::sync::Arc;

/// Default documents: uneven lengths, 8192 tokens in all.
const DEFAULT_DOCS: [i32; 5] = [3000, 2048, 1500, 1000, 644];

/// splitmix64: a small deterministic generator for the inputs.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-√3, √3): unit variance, like the randn inputs of the seed's tests.
    fn unit(&mut self) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (u * 2.0 - 1.0) * 3f32.sqrt()
    }

    fn bf16s(&mut self, n: usize) -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(self.unit())).collect()
    }
}

struct Options {
    docs: Vec<i32>,
    reps: usize,
    warmup: usize,
}

fn parse_args() -> Result<Options, String> {
    let mut o = Options {
        docs: DEFAULT_DOCS.to_vec(),
        reps: 20,
        warmup: 3,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> Result<usize, String> {
            args.next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{name} needs a non-negative integer"))
        };
        match a.as_str() {
            "--tokens" => {
                let n = value("--tokens")?;
                let n = i32::try_from(n)
                    .ok()
                    .filter(|&n| n >= 1)
                    .ok_or("--tokens must be in 1..=i32::MAX")?;
                o.docs = vec![n];
            }
            "--reps" => o.reps = value("--reps")?.max(1),
            "--warmup" => o.warmup = value("--warmup")?,
            "-h" | "--help" => {
                return Err("usage: backward [--tokens N] [--reps R] [--warmup W]".into())
            }
            other => return Err(format!("unknown argument `{other}` (try --help)")),
        }
    }
    Ok(o)
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn run(stream: &Arc<CudaStream>, o: &Options) -> Result<(), RuntimeError> {
    let mut cu = vec![0i32];
    for &len in &o.docs {
        cu.push(cu[cu.len() - 1] + len);
    }
    let q2k = causal_support(&cu).unwrap();
    let schedule = build_schedule(&q2k, &cu, 64)?;
    let (t, w) = (schedule.num_tokens(), schedule.workspace_rows());

    let mut rng = Rng(0x5eed_0001);
    let q = rng.bf16s(t * NUM_Q_HEADS * HEAD_DIM);
    let k = rng.bf16s(t * NUM_KV_HEADS * HEAD_DIM);
    let v = rng.bf16s(t * NUM_KV_HEADS * HEAD_DIM);
    let out = rng.bf16s(t * NUM_Q_HEADS * HEAD_DIM);
    let dout = rng.bf16s(t * NUM_Q_HEADS * HEAD_DIM);
    let aligned = |x: &[bf16]| -> Result<Vec<bf16>, RuntimeError> {
        let f: Vec<f32> = x.iter().map(|b| b.to_f32()).collect();
        let a = reference::to_aligned(&f, &cu, NUM_KV_HEADS).map_err(|e| RuntimeError::Input {
            field: "k/v",
            found: e.to_string(),
            expected: "a valid packing".into(),
        })?;
        Ok(a.into_iter().map(bf16::from_f32).collect())
    };
    let (k_al, v_al) = (aligned(&k)?, aligned(&v)?);
    // An LSE near what unit-variance scores give: ln(kept keys) + 1/2, so P stays below 1.
    let kept = reference::keys_attended(&q2k, &cu).map_err(|e| RuntimeError::Input {
        field: "q2k",
        found: e.to_string(),
        expected: "a valid selection".into(),
    })?;
    let lse: Vec<f32> = (0..t * NUM_Q_HEADS)
        .map(|row| {
            let (tok, h) = (row / NUM_Q_HEADS, row % NUM_Q_HEADS);
            let g = h / (NUM_Q_HEADS / NUM_KV_HEADS);
            (kept[g * t + tok].max(1) as f32).ln() + 0.5
        })
        .collect();

    let up = |e| RuntimeError::Driver {
        call: "cuMemcpyHtoD(inputs)",
        source: e,
    };
    let d_q = stream.clone_htod(&q).map_err(up)?;
    let d_k = stream.clone_htod(&k_al).map_err(up)?;
    let d_v = stream.clone_htod(&v_al).map_err(up)?;
    let d_out = stream.clone_htod(&out).map_err(up)?;
    let d_dout = stream.clone_htod(&dout).map_err(up)?;
    let d_lse = stream.clone_htod(&lse).map_err(up)?;

    let call = || {
        run_backward(
            stream,
            &d_q.as_view(),
            &d_k.as_view(),
            &d_v.as_view(),
            &d_dout.as_view(),
            &d_lse.as_view(),
            &d_out.as_view(),
            &schedule,
        )
    };
    let event = |e| RuntimeError::Driver {
        call: "cuEventRecord/cuEventElapsedTime",
        source: e,
    };
    for _ in 0..o.warmup {
        call()?;
    }
    stream.synchronize().map_err(event)?;
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let mut times = Vec::with_capacity(o.reps);
    for _ in 0..o.reps {
        let start = stream.record_event(timing).map_err(event)?;
        let grads = call()?;
        let end = stream.record_event(timing).map_err(event)?;
        times.push(start.elapsed_ms(&end).map_err(event)?);
        drop(grads);
    }

    // Useful work: 5 GEMM terms (S, dP, dV, dK, dQ) of 2·128 flops per kept (query, head, key).
    let pairs: usize = kept.iter().sum::<usize>() * (NUM_Q_HEADS / NUM_KV_HEADS);
    let flops = pairs as f64 * 5.0 * 2.0 * HEAD_DIM as f64;
    let med = median(times.clone());
    let best = times.iter().copied().fold(f32::INFINITY, f32::min);
    println!(
        "T = {t} tokens in {} document(s), W = {w} workspace rows, {} work items",
        o.docs.len(),
        schedule.num_work()
    );
    println!(
        "run_backward: median {med:.3} ms, best {best:.3} ms over {} calls ({} warm-up); {:.1} TFLOP/s useful at the median",
        o.reps,
        o.warmup,
        flops / (f64::from(med) * 1e-3) / 1e12
    );
    Ok(())
}

fn main() -> ExitCode {
    let options = match parse_args() {
        Ok(o) => o,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    if !driver_present() {
        println!("no CUDA driver (libcuda.so) on this machine; nothing to time");
        return ExitCode::SUCCESS;
    }
    let device = match Device::open(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no usable GPU ({e}); nothing to time");
            return ExitCode::SUCCESS;
        }
    };
    let (major, minor) = device.capability();
    println!(
        "device 0: {} (compute capability {major}.{minor}, {} SMs)",
        device.context().name().unwrap_or_else(|_| "?".into()),
        device.sm_count()
    );
    let stream = device.context().default_stream();
    match run(&stream, &options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
