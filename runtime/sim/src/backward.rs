//! The whole MSA backward on the simulator through the runtime's own host flow,
//! `msa_runtime::MsaBackward::run_on` on a [`SimDevice`]: `bwd_preprocess` → zeroed pools →
//! the four task-build kernels → the main kernel (`msa_backward_sm90` or `msa_backward_sm100`,
//! whose PTX text callers may replace to plant bugs) → `bwd_postprocess`; plus deterministic
//! random problems with their f32 CPU reference gradients and the check against the seed's
//! tolerances.
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
use msa_runtime::contract::{HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS};
use msa_runtime::kernels::{
    msa_backward_sm100, msa_backward_sm100_det, msa_backward_sm90, msa_backward_sm90_det,
};
use msa_runtime::reference::{self, Tolerance, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{
    build_schedule, causal_support, BackwardBuffers, MsaBackward, RuntimeError, Schedule, Span,
};

use crate::device::Arch;
use crate::device::{sim_error, SimDevice};
use crate::exec::{mix64, GOLDEN};
use crate::{Limits, SimError};

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
        self.0 = self.0.wrapping_add(GOLDEN);
        mix64(self.0)
    }

    /// Uniform in `0..n` (`n > 0`), by the modulo of the next draw.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
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

/// `cu_seqlens` of documents of `lengths` tokens.
pub fn cu_of(lengths: &[i32]) -> Vec<i32> {
    let mut cu = vec![0];
    for &l in lengths {
        cu.push(cu[cu.len() - 1] + l);
    }
    cu
}

/// A random valid selection `q2k [4, T, 16]` over `cu`: each query picks up to 16 distinct
/// blocks at or before its own block (its own block with probability 3/4), `-1` holes
/// anywhere, slots shuffled; index heads in `silent` select nothing.
pub fn random_q2k(cu: &[i32], rng: &mut Rng, silent: &[usize]) -> Vec<i32> {
    let t = *cu.last().unwrap() as usize;
    let mut q2k = vec![-1i32; 4 * t * 16];
    for h in 0..4 {
        if silent.contains(&h) {
            continue;
        }
        for d in 0..cu.len() - 1 {
            for q in 0..(cu[d + 1] - cu[d]) as usize {
                let own = q / 128;
                let mut pool: Vec<i32> = (0..=own as i32).collect();
                let mut picked = Vec::new();
                if rng.below(4) != 0 {
                    picked.push(own as i32);
                    pool.pop();
                }
                let target = (picked.len() + rng.below(17)).min(16);
                while picked.len() < target && !pool.is_empty() {
                    let i = rng.below(pool.len());
                    picked.push(pool.swap_remove(i));
                }
                let mut list = [-1i32; 16];
                for (slot, &id) in list.iter_mut().zip(&picked) {
                    *slot = id;
                }
                for i in (1..16).rev() {
                    list.swap(i, rng.below(i + 1));
                }
                let at = (h * t + cu[d] as usize + q) * 16;
                q2k[at..at + 16].copy_from_slice(&list);
            }
        }
    }
    q2k
}

/// A causal problem over documents, with its inputs and reference gradients.
#[derive(Debug, Clone)]
pub struct Case {
    /// The causal-support schedule (`build_schedule(&causal_support(&cu)?, &cu, 64)`).
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
    let mut cu = vec![0i32];
    for &l in lengths {
        let end = cu[cu.len() - 1]
            .checked_add(l)
            .ok_or_else(|| "the token count overflows i32".to_string())?;
        cu.push(end);
    }
    let t = usize::try_from(cu[cu.len() - 1]).map_err(|_| "negative token count".to_string())?;
    // Refuse a shape the backward cannot run before allocating its T·8192-element inputs.
    msa_runtime::check_capacity(&cu).map_err(|e| format!("capacity: {e}"))?;
    let q2k = causal_support(&cu).map_err(|e| format!("support: {e}"))?;
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

/// The main backward kernel to run: the architecture of the whole chain, and the main
/// kernel's PTX text (the shipped variant, or an edited copy with a planted bug).
#[derive(Debug, Clone, Copy)]
pub struct MainKernel<'a> {
    /// The architecture of the whole chain (every kernel's variant).
    pub arch: Arch,
    /// The entry name.
    pub name: &'static str,
    /// The PTX text (the shipped one, or an edited copy).
    pub ptx: &'a str,
    /// Whether this is the deterministic mode's kernel (the chain then runs with
    /// `MsaBackward::set_deterministic(true)`).
    pub deterministic: bool,
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
        Self::shipped_mode(arch, false)
    }

    /// The shipped deterministic main kernel of `arch` (`msa_backward_sm90_det`,
    /// `msa_backward_sm100_det`).
    pub fn deterministic(arch: Arch) -> Self {
        Self::shipped_mode(arch, true)
    }

    fn shipped_mode(arch: Arch, deterministic: bool) -> Self {
        let k = match (arch, deterministic) {
            (Arch::Sm90, false) => &msa_backward_sm90::KERNEL,
            (Arch::Sm100, false) => &msa_backward_sm100::KERNEL,
            (Arch::Sm90, true) => &msa_backward_sm90_det::KERNEL,
            (Arch::Sm100, true) => &msa_backward_sm100_det::KERNEL,
        };
        MainKernel {
            arch,
            name: k.name,
            ptx: arch.ptx(k.variants).unwrap_or(""),
            deterministic,
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
            deterministic: self.deterministic,
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
    /// The bf16 bits of dq, dk and dv as the postprocess wrote them.
    pub bits: [Vec<bf16>; 3],
    /// The main kernel's task rows (the task build's count).
    pub tasks: i32,
    /// The main kernel's grid size (CTAs).
    pub ctas: u32,
    /// Warp instructions the main kernel executed.
    pub warp_instructions: u64,
    /// The kernels launched, in order.
    pub kernels: Vec<&'static str>,
    /// Wall time of the launches before the main kernel.
    pub before_main: Duration,
    /// Wall time of the main kernel.
    pub main_time: Duration,
    /// Wall time of the whole `run_on` call (uploads excluded).
    pub total: Duration,
}

/// The inputs of `c` uploaded to `dev`, with output buffers for the gradients.
pub fn upload(dev: &mut SimDevice, c: &Case) -> BackwardBuffers {
    let t = c.schedule.num_tokens();
    let w = c.schedule.workspace_rows();
    let mut span = |name: &str, data: &[bf16]| {
        let b = dev.upload_new(name, data);
        Span::new(b.ptr.0, data.len())
    };
    let q = span("q", &c.q);
    let k_aligned = span("k_aligned", &c.k_aligned);
    let v_aligned = span("v_aligned", &c.v_aligned);
    let grad_out = span("grad_out", &c.dout);
    let out = span("out", &c.out);
    let dq = span("dq", &vec![bf16::ZERO; t * Q_ROW]);
    let dk_aligned = span("dk_aligned", &vec![bf16::ZERO; w * KV_ROW]);
    let dv_aligned = span("dv_aligned", &vec![bf16::ZERO; w * KV_ROW]);
    let lse = dev.upload_new("lse", &c.lse);
    BackwardBuffers {
        q,
        k_aligned,
        v_aligned,
        grad_out,
        lse: Span::new(lse.ptr.0, c.lse.len()),
        out,
        dq,
        dk_aligned,
        dv_aligned,
    }
}

/// The host tensors of one backward, as a user holds them: compact K and V.
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a> {
    /// `q [T, 64, 128]`.
    pub q: &'a [bf16],
    /// Compact `k [T, 4, 128]`.
    pub k: &'a [bf16],
    /// Compact `v [T, 4, 128]`.
    pub v: &'a [bf16],
    /// `grad_out [T, 64, 128]`.
    pub grad_out: &'a [bf16],
    /// `lse [T, 64]` (natural log, as the forward returns it).
    pub lse: &'a [f32],
    /// `out [T, 64, 128]`.
    pub out: &'a [bf16],
}

/// The gradients of one backward on the host, all compact.
#[derive(Debug, Clone, PartialEq)]
pub struct HostGradients {
    /// `dq [T, 64, 128]`.
    pub dq: Vec<bf16>,
    /// `dk [T, 4, 128]`.
    pub dk: Vec<bf16>,
    /// `dv [T, 4, 128]`.
    pub dv: Vec<bf16>,
}

/// Uploads a user's tensors to `dev` for `MsaBackward::run_on`: K and V are packed into the
/// schedule's zero-padded aligned layout on the device ([`msa_runtime::to_aligned_on`]), and
/// the three output buffers are allocated.
///
/// ```no_run
/// # fn main() -> Result<(), msa_runtime::RuntimeError> {
/// # let (schedule, inputs): (msa_runtime::Schedule, msa_sim::backward::Inputs) = todo!();
/// use msa_runtime::MsaBackward;
/// use msa_sim::backward::{download_gradients, upload_inputs};
/// use msa_sim::device::{Arch, SimDevice};
///
/// let mut dev = SimDevice::new(Arch::Sm90, 132);
/// let io = upload_inputs(&mut dev, &schedule, &inputs)?;
/// MsaBackward::<SimDevice>::new().run_on(&mut dev, &io, &schedule)?;
/// let grads = download_gradients(&mut dev, &schedule, &io)?; // compact dq, dk, dv
/// # Ok(()) }
/// ```
///
/// # Errors
/// Those of [`msa_runtime::to_aligned_on`] (a compact K or V of the wrong length); the other
/// lengths are checked by `run_on`.
pub fn upload_inputs(
    dev: &mut SimDevice,
    schedule: &Schedule,
    x: &Inputs<'_>,
) -> Result<BackwardBuffers, RuntimeError> {
    let t = schedule.num_tokens();
    let w = schedule.workspace_rows();
    let mut span = |name: &str, data: &[bf16]| {
        let b = dev.upload_new(name, data);
        Span::new(b.ptr.0, data.len())
    };
    let k = span("k", x.k);
    let v = span("v", x.v);
    let io = BackwardBuffers {
        q: span("q", x.q),
        k_aligned: span("k_aligned", &vec![bf16::ZERO; w * KV_ROW]),
        v_aligned: span("v_aligned", &vec![bf16::ZERO; w * KV_ROW]),
        grad_out: span("grad_out", x.grad_out),
        out: span("out", x.out),
        dq: span("dq", &vec![bf16::ZERO; t * Q_ROW]),
        dk_aligned: span("dk_aligned", &vec![bf16::ZERO; w * KV_ROW]),
        dv_aligned: span("dv_aligned", &vec![bf16::ZERO; w * KV_ROW]),
        lse: {
            let b = dev.upload_new("lse", x.lse);
            Span::new(b.ptr.0, x.lse.len())
        },
    };
    msa_runtime::to_aligned_on(dev, schedule, k, v, io.k_aligned, io.v_aligned)?;
    Ok(io)
}

/// Reads the gradients `run_on` wrote into `io` back to the host, with dK and dV gathered to
/// compact rows on the device ([`msa_runtime::from_aligned_on`]).
///
/// # Errors
/// Those of [`msa_runtime::from_aligned_on`], and a simulator error for a buffer that is not
/// on `dev`.
pub fn download_gradients(
    dev: &mut SimDevice,
    schedule: &Schedule,
    io: &BackwardBuffers,
) -> Result<HostGradients, RuntimeError> {
    let len = schedule.num_tokens() * KV_ROW;
    let dk = dev.upload_new("dk", &vec![bf16::ZERO; len]);
    let dv = dev.upload_new("dv", &vec![bf16::ZERO; len]);
    let (dk, dv) = (Span::new(dk.ptr.0, len), Span::new(dv.ptr.0, len));
    msa_runtime::from_aligned_on(dev, schedule, io.dk_aligned, io.dv_aligned, dk, dv)?;
    let read = |dev: &SimDevice, s: Span<bf16>| {
        dev.read::<bf16>(s.addr, s.len)
            .map_err(|e| RuntimeError::Simulator {
                call: "download_gradients".into(),
                source: Box::new(e),
            })
    };
    Ok(HostGradients {
        dq: read(dev, io.dq)?,
        dk: read(dev, dk)?,
        dv: read(dev, dv)?,
    })
}

/// The error the simulator reported, or the runtime's as a [`SimError::Launch`].
fn to_sim_error(e: RuntimeError) -> SimError {
    match sim_error(&e) {
        Some(s) => s.clone(),
        None => SimError::Launch {
            kernel: "run_backward".into(),
            message: e.to_string(),
        },
    }
}

/// `MsaBackward::run_on` — the runtime's own host flow — on a fresh simulated device of
/// `main.arch` with `limits` and `num_sms` SMs, with `main.ptx` as the main kernel's text.
pub fn run(
    c: &Case,
    main: &MainKernel<'_>,
    limits: Limits,
    num_sms: usize,
) -> Result<Grads, SimError> {
    let mut dev = SimDevice::with_limits(main.arch, num_sms, limits);
    if main.ptx.is_empty() {
        return Err(SimError::Launch {
            kernel: main.name.into(),
            message: format!("no {:?} variant", main.arch),
        });
    }
    dev.override_ptx(main.name, main.ptx);
    let io = upload(&mut dev, c);
    let mut backward = MsaBackward::<SimDevice>::new();
    backward.set_deterministic(main.deterministic);
    let started = Instant::now();
    backward
        .run_on(&mut dev, &io, &c.schedule)
        .map_err(to_sim_error)?;
    let total = started.elapsed();
    let tasks = match backward.task_workspace() {
        Some(ws) => dev.read::<i32>(ws.desc().addr(), 1)?[0],
        None => 0,
    };
    let records = dev.launches();
    let at = records.iter().position(|r| r.kernel == main.name);
    let (ctas, warp_instructions, main_time) = at.map_or((0, 0, Duration::ZERO), |i| {
        let r = &records[i];
        (r.grid.0, r.warp_instructions, r.elapsed)
    });
    let before_main = records[..at.unwrap_or(records.len())]
        .iter()
        .map(|r| r.elapsed)
        .sum();
    let kernels = records.iter().map(|r| r.kernel).collect();
    let read = |s: Span<bf16>| dev.read::<bf16>(s.addr, s.len);
    let bits = [read(io.dq)?, read(io.dk_aligned)?, read(io.dv_aligned)?];
    Ok(Grads {
        dq: to_f32(&bits[0]),
        dk: to_f32(&bits[1]),
        dv: to_f32(&bits[2]),
        bits,
        tasks,
        ctas,
        warp_instructions,
        kernels,
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
