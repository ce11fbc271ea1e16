//! The whole MSA backward chain on the simulator, as `msa_runtime::backward::MsaBackward::run`
//! launches it: `bwd_preprocess` → zeroed pools → the four task-build kernels → the main kernel
//! (`msa_backward_sm90` or `msa_backward_sm100`, given as PTX text so that callers can plant
//! bugs in it) → `bwd_postprocess`, plus deterministic random problems with their f32 CPU
//! reference gradients and the check against the seed's tolerances.
//!
//! ```no_run
//! use msa_sim::backward::{case, check, run, MainKernel};
//! use msa_sim::Limits;
//!
//! let c = case(&[127, 129, 4], 7002).unwrap();
//! let main = MainKernel::sm100();
//! let g = run(&c, &main, Limits::default(), 148).unwrap();
//! check(&c, &g).unwrap();
//! ```

use std::time::{Duration, Instant};

use half::bf16;
use msa_runtime::backward::TileMapSpec;
use msa_runtime::contract::{HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS};
use msa_runtime::kernels::{
    bwd_postprocess, bwd_preprocess, msa_backward_sm100, msa_backward_sm90,
};
use msa_runtime::reference::{self, Tolerance, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{build_schedule, causal_support, Schedule};

use crate::task_build::{task_build_modules, Arch, TaskBuild};
use crate::{Arg, Gpu, Kernel, LaunchConfig, Limits, Module, SimError, SimTensorMap};

/// Elements of one token's Q (or dO, dQ) row: `NUM_Q_HEADS × HEAD_DIM`.
pub const Q_ROW: usize = NUM_Q_HEADS * HEAD_DIM;
/// Elements of one token's K (or V, dK, dV) row: `NUM_KV_HEADS × HEAD_DIM`.
pub const KV_ROW: usize = NUM_KV_HEADS * HEAD_DIM;
/// The H200's SM count: the grid the runtime launches there.
pub const H200_SMS: usize = 132;
/// The B200's SM count: the grid the runtime launches there.
pub const B200_SMS: usize = 148;

/// splitmix64, the inputs' deterministic random source.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Standard normal (Box–Muller), like the seed's randn inputs.
    pub fn normal(&mut self) -> f32 {
        let u1 = ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }

    /// `n` bf16-rounded normals as bf16 and as their exact f32 values.
    pub fn bf16s(&mut self, n: usize) -> (Vec<bf16>, Vec<f32>) {
        let b: Vec<bf16> = (0..n).map(|_| bf16::from_f32(self.normal())).collect();
        let f = to_f32(&b);
        (b, f)
    }
}

/// `v` rounded to bf16.
pub fn to_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// `v` widened to f32 (exact).
pub fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// A causal problem over documents, with its inputs and reference gradients.
#[derive(Debug, Clone)]
pub struct Case {
    /// The causal-support schedule (`build_schedule(&causal_support(&cu), &cu, 64)`).
    pub schedule: Schedule,
    /// Q `[T,64,128]`.
    pub q: Vec<bf16>,
    /// K in the aligned layout `[W,4,128]`.
    pub k_aligned: Vec<bf16>,
    /// V in the aligned layout `[W,4,128]`.
    pub v_aligned: Vec<bf16>,
    /// The output gradient dO `[T,64,128]`.
    pub dout: Vec<bf16>,
    /// The reference forward's log-sum-exp `[T,64]`.
    pub lse: Vec<f32>,
    /// The reference forward's output `[T,64,128]`, rounded to bf16.
    pub out: Vec<bf16>,
    /// The f32 CPU reference gradients.
    pub expected: reference::Gradients,
    /// Wall time of the CPU reference forward and backward.
    pub reference_time: Duration,
}

/// The causal problem over documents of `lengths` tokens with inputs drawn from `seed`, and
/// its CPU reference gradients.
pub fn case(lengths: &[i32], seed: u64) -> Result<Case, String> {
    let mut cu = vec![0];
    for l in lengths {
        cu.push(cu[cu.len() - 1] + l);
    }
    let t = usize::try_from(cu[cu.len() - 1]).map_err(|_| "negative token count".to_string())?;
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
    let reference_time = t0.elapsed();
    if schedule.workspace_rows() != expected.workspace_rows {
        return Err(format!(
            "the schedule has {} workspace rows, the reference {}",
            schedule.workspace_rows(),
            expected.workspace_rows
        ));
    }
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
        reference_time,
    })
}

/// The main backward kernel to launch: its architecture, entry, launch shape and PTX text.
#[derive(Debug, Clone, Copy)]
pub struct MainKernel<'a> {
    /// The architecture of the whole chain (the pre/post-process and task-build variants).
    pub arch: Arch,
    /// The entry name.
    pub name: &'static str,
    /// The PTX text (the shipped one, or an edited copy).
    pub ptx: &'a str,
    /// The block shape.
    pub threads: (u32, u32, u32),
    /// Dynamic shared memory per CTA.
    pub dynamic_shared_bytes: u32,
}

impl MainKernel<'static> {
    /// The shipped `msa_backward_sm90` (`sm_90a`).
    pub fn sm90() -> Self {
        Self::shipped(Arch::Sm90)
    }

    /// The shipped `msa_backward_sm100` (`sm_100a`).
    pub fn sm100() -> Self {
        Self::shipped(Arch::Sm100)
    }

    /// The shipped main kernel of `arch` (empty text, which [`run`] rejects, if the runtime
    /// had no variant for it).
    pub fn shipped(arch: Arch) -> Self {
        let (name, variants, threads, dynamic_shared_bytes) = match arch {
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
        MainKernel {
            arch,
            name,
            ptx: arch.ptx(variants).unwrap_or(""),
            threads,
            dynamic_shared_bytes,
        }
    }
}

impl<'a> MainKernel<'a> {
    /// The same kernel with `ptx` as its text (for planted bugs).
    pub fn with_ptx<'b>(&self, ptx: &'b str) -> MainKernel<'b> {
        MainKernel {
            arch: self.arch,
            name: self.name,
            ptx,
            threads: self.threads,
            dynamic_shared_bytes: self.dynamic_shared_bytes,
        }
    }
}

/// The simulated chain's gradients and what it took.
#[derive(Debug, Clone)]
pub struct Grads {
    /// dq `[T,64,128]`, from bf16.
    pub dq: Vec<f32>,
    /// dk in the aligned layout `[W,4,128]`, from bf16.
    pub dk: Vec<f32>,
    /// dv in the aligned layout `[W,4,128]`, from bf16.
    pub dv: Vec<f32>,
    /// The main kernel's task rows (the task build's count).
    pub tasks: i32,
    /// The main kernel's grid size (CTAs).
    pub ctas: u32,
    /// Warp instructions the main kernel executed.
    pub warp_instructions: u64,
    /// Wall time of preprocess and the task build.
    pub before_main: Duration,
    /// Wall time of the main kernel.
    pub main_time: Duration,
    /// Wall time of the whole chain (uploads excluded).
    pub total: Duration,
}

fn launch_error(kernel: &str, message: impl Into<String>) -> SimError {
    SimError::Launch {
        kernel: kernel.to_string(),
        message: message.into(),
    }
}

fn entry<'m>(m: &'m Module, name: &str) -> Result<&'m Kernel, SimError> {
    m.kernel(name)
        .ok_or_else(|| launch_error(name, "no such entry in the module"))
}

fn variant_module(
    arch: Arch,
    name: &str,
    variants: &[((i32, i32), &'static str)],
) -> Result<Module, SimError> {
    let ptx = arch
        .ptx(variants)
        .ok_or_else(|| launch_error(name, format!("no {arch:?} variant")))?;
    Ok(Module::parse(ptx)?)
}

/// The runtime's launch sequence on a fresh simulated GPU with `limits`, the task build sized
/// for `num_sms` SMs and `main` as the main kernel.
pub fn run(
    c: &Case,
    main: &MainKernel<'_>,
    limits: Limits,
    num_sms: usize,
) -> Result<Grads, SimError> {
    let arch = main.arch;
    let t = c.schedule.num_tokens();
    let w = c.schedule.workspace_rows();
    let mut gpu = Gpu::with_limits(limits);
    let q = gpu.upload("q", &c.q);
    let k = gpu.upload("k_aligned", &c.k_aligned);
    let v = gpu.upload("v_aligned", &c.v_aligned);
    let dout = gpu.upload("grad_out", &c.dout);
    let lse = gpu.upload("lse", &c.lse);
    let out = gpu.upload("out", &c.out);

    // 1. delta = rowsum(O·dO).
    let started = Instant::now();
    let delta = gpu.alloc("delta", 4 * t * NUM_Q_HEADS);
    let pre = variant_module(arch, bwd_preprocess::NAME, bwd_preprocess::VARIANTS)?;
    gpu.launch(
        entry(&pre, bwd_preprocess::NAME)?,
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
    let before_main = started.elapsed();

    // 4. The main kernel, with the maps the runtime encodes.
    let map = |spec: Result<TileMapSpec, _>, base| -> Result<Arg, SimError> {
        let spec = spec.map_err(|e| launch_error(main.name, format!("tensor map spec: {e}")))?;
        SimTensorMap::from_spec(&spec, base)
            .map(|m| m.arg())
            .map_err(|e| launch_error(main.name, format!("tensor map: {e}")))
    };
    let module = Module::parse(main.ptx)?;
    let kernel = entry(&module, main.name)?;
    let cfg = LaunchConfig::new((build.sizes.grid_launch as u32, 1, 1), main.threads)
        .with_dynamic_shared(main.dynamic_shared_bytes);
    let l = &build.layout;
    let args = [
        map(TileMapSpec::query_rows("q", t), q)?,
        map(TileMapSpec::query_rows("grad_out", t), dout)?,
        map(TileMapSpec::key_rows("k_aligned", w), k)?,
        map(TileMapSpec::key_rows("v_aligned", w), v)?,
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
    let t_main = Instant::now();
    let stats = gpu.launch(kernel, &cfg, &args)?;
    let main_time = t_main.elapsed();

    // 5. Postprocess.
    let dq = gpu.alloc("dq", 2 * t * Q_ROW);
    let dk = gpu.alloc("dk", 2 * w * KV_ROW);
    let dv = gpu.alloc("dv", 2 * w * KV_ROW);
    let post = variant_module(arch, bwd_postprocess::NAME, bwd_postprocess::VARIANTS)?;
    gpu.launch(
        entry(&post, bwd_postprocess::NAME)?,
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
    let total = started.elapsed();
    Ok(Grads {
        dq: to_f32(&gpu.read::<bf16>(dq, t * Q_ROW)?),
        dk: to_f32(&gpu.read::<bf16>(dk, w * KV_ROW)?),
        dv: to_f32(&gpu.read::<bf16>(dv, w * KV_ROW)?),
        tasks,
        ctas: cfg.grid[0],
        warp_instructions: stats.warp_instructions,
        before_main,
        main_time,
        total,
    })
}

/// One gradient's comparison: its tolerance, name, computed and reference values.
pub type Comparison<'a> = (Tolerance, &'static str, &'a [f32], &'a [f32]);

/// dq, dk and dv of `g` next to the reference's, with the seed's tolerances.
pub fn comparisons<'a>(c: &'a Case, g: &'a Grads) -> [Comparison<'a>; 3] {
    let e = &c.expected;
    [
        (DQ_TOLERANCE, "dq", &g.dq, &e.dq),
        (DK_TOLERANCE, "dk_aligned", &g.dk, &e.dk_aligned),
        (DV_TOLERANCE, "dv_aligned", &g.dv, &e.dv_aligned),
    ]
}

/// Checks dq, dk and dv against the reference at the seed's tolerances: the statistics line of
/// each (`"name: stats"`), or every failure's message joined by newlines.
pub fn check(c: &Case, g: &Grads) -> Result<Vec<String>, String> {
    let mut lines = Vec::new();
    let mut failures = Vec::new();
    for (tol, name, got, want) in comparisons(c, g) {
        match tol.check(name, got, want) {
            Ok(stats) => lines.push(format!("{name}: {stats}")),
            Err(msg) => failures.push(msg),
        }
    }
    if failures.is_empty() {
        Ok(lines)
    } else {
        Err(failures.join("\n"))
    }
}
