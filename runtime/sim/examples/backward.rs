//! Runs the whole MSA backward once and checks it against the CPU reference: on GPU 0 when
//! one is usable, otherwise on the `msa_sim` PTX simulator. It builds a causal-support
//! schedule over the given documents (`msa_runtime::build_schedule(&causal_support(&cu), &cu,
//! 64)`), deterministic random bf16 inputs, and the f32 CPU reference forward and backward;
//! then either calls `msa_runtime::run_backward` on the device (compute capability 9.0 or
//! 10.0), or launches the same chain — `bwd_preprocess`, zeroed pools, the four task-build
//! kernels, the main kernel, `bwd_postprocess` — on the simulator for `--arch sm100` (the
//! default: `msa_backward_sm100` has no hardware to run on) or `--arch sm90`. It prints the
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

use half::bf16;
use msa_runtime::backward::TileMapSpec;
use msa_runtime::contract::{HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS};
use msa_runtime::kernels::{
    bwd_postprocess, bwd_preprocess, msa_backward_sm100, msa_backward_sm90,
};
use msa_runtime::reference::{self, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{
    build_schedule, causal_support, driver_present, run_backward, Device, RuntimeError, Schedule,
};
use msa_sim::task_build::{task_build_modules, Arch, TaskBuild};
use msa_sim::{Arg, Gpu, LaunchConfig, Module, SimError, SimTensorMap};

const Q_ROW: usize = NUM_Q_HEADS * HEAD_DIM;
const KV_ROW: usize = NUM_KV_HEADS * HEAD_DIM;

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

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Standard normal (Box–Muller), like the seed's randn inputs.
    fn normal(&mut self) -> f32 {
        let u1 = ((self.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    /// `n` bf16-rounded normals as bf16 and as their exact f32 values.
    fn bf16s(&mut self, n: usize) -> (Vec<bf16>, Vec<f32>) {
        let b: Vec<bf16> = (0..n).map(|_| bf16::from_f32(self.normal())).collect();
        let f = b.iter().map(|x| x.to_f32()).collect();
        (b, f)
    }
}

fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// A causal problem with its inputs and reference gradients.
struct Case {
    schedule: Schedule,
    q: Vec<bf16>,
    k_aligned: Vec<bf16>,
    v_aligned: Vec<bf16>,
    dout: Vec<bf16>,
    lse: Vec<f32>,
    out: Vec<bf16>,
    expected: reference::Gradients,
}

fn case(lengths: &[i32], seed: u64) -> Result<Case, String> {
    let mut cu = vec![0];
    for l in lengths {
        cu.push(cu[cu.len() - 1] + l);
    }
    let t = *cu.last().unwrap() as usize;
    let q2k = causal_support(&cu);
    let schedule = build_schedule(&q2k, &cu, 64).map_err(|e| format!("schedule: {e}"))?;
    let mut rng = Rng(seed);
    let (q, q32) = rng.bf16s(t * Q_ROW);
    let (_, k32) = rng.bf16s(t * KV_ROW);
    let (_, v32) = rng.bf16s(t * KV_ROW);
    let (dout, do32) = rng.bf16s(t * Q_ROW);
    let t0 = Instant::now();
    let fwd = reference::forward(&q32, &k32, &v32, &q2k, &cu)
        .map_err(|e| format!("reference forward: {e}"))?;
    let out = to_bf16(&fwd.out);
    let expected = reference::backward(&q32, &k32, &v32, &q2k, &cu, &to_f32(&out), &fwd.lse, &do32)
        .map_err(|e| format!("reference backward: {e}"))?;
    println!(
        "documents {lengths:?}: T = {t}, W = {}, {} work items; CPU reference {:.2} s",
        schedule.workspace_rows(),
        schedule.num_work(),
        t0.elapsed().as_secs_f64()
    );
    let aligned = |x: &[f32]| {
        reference::to_aligned(x, &cu, NUM_KV_HEADS)
            .map(|a| to_bf16(&a))
            .map_err(|e| format!("to_aligned: {e}"))
    };
    Ok(Case {
        k_aligned: aligned(&k32)?,
        v_aligned: aligned(&v32)?,
        schedule,
        q,
        dout,
        lse: fwd.lse,
        out,
        expected,
    })
}

/// dq `[T,64,128]`, dk and dv `[W,4,128]` as f32.
struct Grads {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
}

/// `run_backward` on a real device.
fn run_gpu(device: &Device, c: &Case) -> Result<Grads, RuntimeError> {
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
    Ok(Grads {
        dq: to_f32(&stream.clone_dtoh(&g.dq).map_err(down)?),
        dk: to_f32(&stream.clone_dtoh(&g.dk_aligned).map_err(down)?),
        dv: to_f32(&stream.clone_dtoh(&g.dv_aligned).map_err(down)?),
    })
}

/// The runtime's launch sequence (`MsaBackward::run`) on the simulator.
fn run_sim(c: &Case, arch: Arch, num_sms: usize) -> Result<Grads, SimError> {
    let t = c.schedule.num_tokens();
    let w = c.schedule.workspace_rows();
    let module = |variants: &[((i32, i32), &'static str)]| -> Result<Module, SimError> {
        Ok(Module::parse(
            arch.ptx(variants).expect("every kernel has both variants"),
        )?)
    };
    let mut gpu = Gpu::new();
    let q = gpu.upload("q", &c.q);
    let k = gpu.upload("k_aligned", &c.k_aligned);
    let v = gpu.upload("v_aligned", &c.v_aligned);
    let dout = gpu.upload("grad_out", &c.dout);
    let lse = gpu.upload("lse", &c.lse);
    let out = gpu.upload("out", &c.out);

    // 1. delta = rowsum(O·dO).
    let delta = gpu.alloc("delta", 4 * t * NUM_Q_HEADS);
    let pre = module(bwd_preprocess::VARIANTS)?;
    gpu.launch(
        pre.kernel(bwd_preprocess::NAME).expect("entry"),
        &LaunchConfig::new(
            (t.div_ceil(128) as u32, NUM_Q_HEADS as u32, 1),
            bwd_preprocess::THREADS,
        ),
        &[
            Arg::Ptr(out),
            Arg::Ptr(dout),
            Arg::Ptr(delta),
            Arg::U32(t as u32),
        ],
    )?;
    // 2. Zeroed pools (fresh allocations are zero).
    let dq_pool = gpu.alloc("dq_pool", 2 * t * Q_ROW);
    let dk_pool = gpu.alloc("dk_pool", 4 * w * KV_ROW);
    let dv_pool = gpu.alloc("dv_pool", 4 * w * KV_ROW);
    // 3. The task build.
    let modules = task_build_modules(arch)?;
    let build = TaskBuild::run(&mut gpu, &modules, &c.schedule, num_sms)?;
    let tasks = gpu.read::<i32>(build.region(build.layout.desc), 1)?[0];

    // 4. The main kernel, with the maps the runtime encodes.
    let (name, variants, threads, smem) = match arch {
        Arch::Sm90 => (
            msa_backward_sm90::NAME,
            msa_backward_sm90::VARIANTS,
            msa_backward_sm90::THREADS,
            msa_backward_sm90::DYNAMIC_SHARED_BYTES,
        ),
        Arch::Sm100 => (
            msa_backward_sm100::NAME,
            msa_backward_sm100::VARIANTS,
            msa_backward_sm100::THREADS,
            msa_backward_sm100::DYNAMIC_SHARED_BYTES,
        ),
    };
    let map = |spec: Result<TileMapSpec, _>, base| {
        let spec = spec.expect("valid map spec");
        SimTensorMap::from_spec(&spec, base)
            .expect("valid map")
            .arg()
    };
    let main = module(variants)?;
    let cfg = LaunchConfig::new((build.sizes.grid_launch as u32, 1, 1), threads)
        .with_dynamic_shared(smem);
    let l = &build.layout;
    let args = [
        map(TileMapSpec::query_rows("q", t), q),
        map(TileMapSpec::query_rows("grad_out", t), dout),
        map(TileMapSpec::key_rows("k_aligned", w), k),
        map(TileMapSpec::key_rows("v_aligned", w), v),
        Arg::Ptr(lse),
        Arg::Ptr(delta),
        Arg::Ptr(build.region(l.meta)),
        Arg::Ptr(build.region(l.qrows)),
        Arg::Ptr(build.region(l.qpos)),
        Arg::Ptr(build.region(l.desc)),
        Arg::Ptr(dq_pool),
        Arg::Ptr(dk_pool),
        Arg::Ptr(dv_pool),
    ];
    let stats = gpu.launch(main.kernel(name).expect("entry"), &cfg, &args)?;
    println!(
        "{name}: {tasks} task rows on {} CTAs ({num_sms} SMs), {} warp instructions",
        cfg.grid[0], stats.warp_instructions
    );

    // 5. Postprocess.
    let dq = gpu.alloc("dq", 2 * t * Q_ROW);
    let dk = gpu.alloc("dk", 2 * w * KV_ROW);
    let dv = gpu.alloc("dv", 2 * w * KV_ROW);
    let post = module(bwd_postprocess::VARIANTS)?;
    gpu.launch(
        post.kernel(bwd_postprocess::NAME).expect("entry"),
        &LaunchConfig::new(((2 * t).max(w / 2) as u32, 2, 1), bwd_postprocess::THREADS),
        &[
            Arg::Ptr(dq_pool),
            Arg::Ptr(dk_pool),
            Arg::Ptr(dv_pool),
            Arg::Ptr(dq),
            Arg::Ptr(dk),
            Arg::Ptr(dv),
            Arg::U32(t as u32),
            Arg::U32(w as u32),
        ],
    )?;
    Ok(Grads {
        dq: to_f32(&gpu.read::<bf16>(dq, t * Q_ROW)?),
        dk: to_f32(&gpu.read::<bf16>(dk, w * KV_ROW)?),
        dv: to_f32(&gpu.read::<bf16>(dv, w * KV_ROW)?),
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
    let c = match case(&o.docs, o.seed) {
        Ok(c) => c,
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
                Arch::Sm90 => ("sm90", 132),
                Arch::Sm100 => ("sm100", 148),
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
