//! Runs the whole MSA backward once and checks it against the CPU reference: on GPU 0 when
//! one is usable, otherwise on the `msa_sim` PTX simulator. It builds a causal-support
//! schedule over the given documents (`msa_runtime::build_schedule(&causal_support(&cu)?, &cu,
//! 64)`), deterministic random bf16 inputs, and the f32 CPU reference forward and backward;
//! then either calls `msa_runtime::run_backward` on the device (compute capability 9.0 or
//! 10.0), or runs the same host flow (`MsaBackward::run_on`: `bwd_preprocess`, zeroed pools,
//! the four task-build kernels, the main kernel, `bwd_postprocess`) on a simulated device,
//! `msa_sim::device::SimDevice`, for `--arch sm100` (the default: `msa_backward_sm100` has no
//! hardware to run on) or `--arch sm90`. It prints the
//! max-abs / L2-rel error of dq, dk and dv against the seed tolerances and the wall time, and
//! exits non-zero when a tolerance fails.
//!
//! ```sh
//! cargo run --release -p msa-sim --example backward
//! cargo run --release -p msa-sim --example backward -- --docs 127,129,1,2,3,5,128 --arch sm90
//! ```
//!
//! Options: `--docs L1,L2,...` (document lengths, default `127,129,1,2,3,5,128`), `--arch
//! sm90|sm100` (the simulated kernel, default `sm100`), `--sms N` (the simulated SM count,
//! default 148 for sm100 and 132 for sm90), `--seed S`.

use std::process::ExitCode;
use std::time::Instant;

use msa_runtime::reference::{DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{driver_present, run_backward, Device, RuntimeError};
use msa_sim::backward::{self, to_f32, Case, MainKernel, B200_SMS, H200_SMS};
use msa_sim::device::Arch;
use msa_sim::{Limits, SimError};

struct Options {
    docs: Vec<i32>,
    arch: Arch,
    sms: Option<usize>,
    seed: u64,
}

fn parse_args() -> Result<Options, String> {
    const USAGE: &str =
        "usage: backward [--docs L1,L2,...] [--arch sm90|sm100] [--sms N] [--seed S]";
    let mut o = Options {
        docs: vec![127, 129, 1, 2, 3, 5, 128],
        arch: Arch::Sm100,
        sms: None,
        seed: 7001,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or(format!("{a} needs a value ({USAGE})"));
        match a.as_str() {
            "--docs" => {
                o.docs = value()?
                    .split(',')
                    .map(|s| s.trim().parse::<i32>().ok().filter(|&n| n >= 1))
                    .collect::<Option<_>>()
                    .ok_or("--docs takes positive lengths separated by commas")?;
            }
            "--arch" => {
                o.arch = match value()?.as_str() {
                    "sm90" | "sm_90a" => Arch::Sm90,
                    "sm100" | "sm_100a" => Arch::Sm100,
                    other => return Err(format!("unknown --arch `{other}` (sm90 or sm100)")),
                };
            }
            "--sms" => {
                let n = value()?
                    .parse::<usize>()
                    .ok()
                    .filter(|&n| n >= 1)
                    .ok_or("--sms takes a positive integer")?;
                o.sms = Some(n);
            }
            "--seed" => {
                o.seed = value()?
                    .parse()
                    .map_err(|_| "--seed takes a non-negative integer")?;
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument `{other}` ({USAGE})")),
        }
    }
    let total: i64 = o.docs.iter().map(|&l| i64::from(l)).sum();
    if total > i64::from(i32::MAX) {
        return Err("--docs: too many tokens in all".into());
    }
    Ok(o)
}

/// dq `[T,64,128]`, dk and dv `[W,4,128]` as f32.
struct Computed {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// `run_backward` on a real device.
fn run_gpu(device: &Device, c: &Case) -> Result<Computed, RuntimeError> {
    let stream = device.context().default_stream();
    let driver = |call| move |source| RuntimeError::Driver { call, source };
    let up = driver("cuMemcpyHtoD(inputs)");
    let d_q = stream.clone_htod(&c.q).map_err(up)?;
    let d_k = stream.clone_htod(&c.k_aligned).map_err(up)?;
    let d_v = stream.clone_htod(&c.v_aligned).map_err(up)?;
    let d_dout = stream.clone_htod(&c.dout).map_err(up)?;
    let d_lse = stream.clone_htod(&c.lse).map_err(up)?;
    let d_out = stream.clone_htod(&c.out).map_err(up)?;
    let g = run_backward(
        &stream,
        &d_q.as_view(),
        &d_k.as_view(),
        &d_v.as_view(),
        &d_dout.as_view(),
        &d_lse.as_view(),
        &d_out.as_view(),
        &c.schedule,
    )?;
    let down = driver("cuMemcpyDtoH(gradients)");
    Ok(Computed {
        dq: to_f32(&stream.clone_dtoh(&g.dq).map_err(down)?),
        dk: to_f32(&stream.clone_dtoh(&g.dk_aligned).map_err(down)?),
        dv: to_f32(&stream.clone_dtoh(&g.dv_aligned).map_err(down)?),
    })
}

/// The runtime's host flow (`MsaBackward::run_on`) on a simulated device.
fn run_sim(c: &Case, arch: Arch, num_sms: usize) -> Result<Computed, SimError> {
    let main = MainKernel::shipped(arch);
    let g = backward::run(c, &main, Limits::default(), num_sms)?;
    println!(
        "{}: {} task rows on {} CTAs ({num_sms} SMs), {} warp instructions",
        main.name, g.tasks, g.ctas, g.warp_instructions
    );
    Ok(Computed {
        dq: g.dq,
        dk: g.dk,
        dv: g.dv,
    })
}

/// Device 0 when it is usable for `run_backward`, or why not.
fn usable_gpu() -> Result<std::sync::Arc<Device>, String> {
    if !driver_present() {
        return Err("no CUDA driver (libcuda.so)".into());
    }
    let device = Device::open(0).map_err(|e| e.to_string())?;
    match device.capability() {
        (9, 0) | (10, 0) => Ok(device),
        (major, minor) => Err(format!(
            "device 0 has compute capability {major}.{minor}; the backward has sm_90a and \
             sm_100a variants only"
        )),
    }
}

fn main() -> ExitCode {
    let o = match parse_args() {
        Ok(o) => o,
        Err(msg) => {
            eprintln!("{msg}");
            return ExitCode::from(2);
        }
    };
    let c = match backward::case(&o.docs, o.seed) {
        Ok(c) => {
            println!(
                "documents {:?}: T = {}, W = {}, {} work items; CPU reference {:.2} s",
                o.docs,
                c.schedule.num_tokens(),
                c.schedule.workspace_rows(),
                c.schedule.num_work(),
                c.reference_time.as_secs_f64()
            );
            c
        }
        Err(msg) => {
            eprintln!("error: {msg}");
            return ExitCode::FAILURE;
        }
    };
    let started = Instant::now();
    let result = match usable_gpu() {
        Ok(device) => {
            let (major, minor) = device.capability();
            println!(
                "running on GPU {} (compute capability {major}.{minor}, {} SMs)",
                device.context().name().unwrap_or_else(|_| "?".into()),
                device.sm_count()
            );
            run_gpu(&device, &c).map_err(|e| e.to_string())
        }
        Err(reason) => {
            let (label, default_sms) = match o.arch {
                Arch::Sm90 => ("sm90", H200_SMS),
                Arch::Sm100 => ("sm100", B200_SMS),
            };
            println!("no GPU found ({reason}): running on the msa-sim PTX simulator ({label})");
            run_sim(&c, o.arch, o.sms.unwrap_or(default_sms)).map_err(|e| e.to_string())
        }
    };
    let elapsed = started.elapsed();
    let g = match result {
        Ok(g) => g,
        Err(msg) => {
            eprintln!("error: {msg}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "backward wall time {:.3} s (uploads, first-call module load and downloads included)",
        elapsed.as_secs_f64()
    );
    let e = &c.expected;
    let mut failed = false;
    for (tol, name, got, want) in [
        (DQ_TOLERANCE, "dq", &g.dq, &e.dq),
        (DK_TOLERANCE, "dk_aligned", &g.dk, &e.dk_aligned),
        (DV_TOLERANCE, "dv_aligned", &g.dv, &e.dv_aligned),
    ] {
        let limits = format!("tolerance {} / {}", tol.max_abs, tol.l2_rel);
        match tol.check(name, got, want) {
            Ok(stats) => println!("  {name}: {stats} ({limits}): ok"),
            Err(msg) => {
                println!("  FAILED {msg} ({limits})");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
