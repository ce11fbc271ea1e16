//! The whole Hopper backward on the simulator, no GPU: `bwd_preprocess` → zeroed pools → the
//! four task-build kernels → `msa_backward_sm90` (TMA, mbarrier pipelines, wgmma,
//! setmaxnreg) → `bwd_postprocess`, launched as `msa_runtime::backward::MsaBackward::run`
//! launches them, and compared with the f32 CPU reference at the seed's tolerances. Then
//! planted pipeline bugs in the same kernel text, each of which must be reported.

use std::time::Instant;

use half::bf16;
use msa_runtime::backward::TileMapSpec;
use msa_runtime::contract::{HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS};
use msa_runtime::kernels::{bwd_postprocess, bwd_preprocess, msa_backward_sm90};
use msa_runtime::reference::{self, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{build_schedule, causal_support, Schedule};
use msa_sim::task_build::{task_build_modules, Arch, TaskBuild};
use msa_sim::{
    Arg, FaultKind, Gpu, LaunchConfig, Limits, Module, SimError, SimTensorMap, TmaCompletion,
};

const Q_ROW: usize = NUM_Q_HEADS * HEAD_DIM;
const KV_ROW: usize = NUM_KV_HEADS * HEAD_DIM;
/// The H200's SM count: the grid the runtime launches there.
const H200_SMS: usize = 132;

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

/// A causal problem over documents of `lengths` tokens, with its reference gradients.
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

fn case(lengths: &[i32], seed: u64) -> Case {
    let mut cu = vec![0];
    for l in lengths {
        cu.push(cu[cu.len() - 1] + l);
    }
    let t = *cu.last().unwrap() as usize;
    let q2k = causal_support(&cu);
    let mut rng = Rng(seed);
    let (q, q32) = rng.bf16s(t * Q_ROW);
    let (_, k32) = rng.bf16s(t * KV_ROW);
    let (_, v32) = rng.bf16s(t * KV_ROW);
    let (dout, do32) = rng.bf16s(t * Q_ROW);
    let t0 = Instant::now();
    let fwd = reference::forward(&q32, &k32, &v32, &q2k, &cu).expect("forward");
    let out = to_bf16(&fwd.out);
    let out32: Vec<f32> = out.iter().map(|x| x.to_f32()).collect();
    let expected = reference::backward(&q32, &k32, &v32, &q2k, &cu, &out32, &fwd.lse, &do32)
        .expect("backward");
    println!(
        "documents {lengths:?}: T = {t}, W = {}, CPU reference {:.2} s",
        expected.workspace_rows,
        t0.elapsed().as_secs_f64()
    );
    let schedule = build_schedule(&q2k, &cu, 64).expect("schedule");
    assert_eq!(schedule.workspace_rows(), expected.workspace_rows);
    Case {
        schedule,
        q,
        k_aligned: to_bf16(&reference::to_aligned(&k32, &cu, NUM_KV_HEADS).unwrap()),
        v_aligned: to_bf16(&reference::to_aligned(&v32, &cu, NUM_KV_HEADS).unwrap()),
        dout,
        lse: fwd.lse,
        out,
        expected,
    }
}

fn module(variants: &[((i32, i32), &'static str)]) -> Module {
    Module::parse(Arch::Sm90.ptx(variants).expect("an sm_90 variant")).expect("parses")
}

/// dq `[T,64,128]`, dk and dv `[W,4,128]` as f32, and the main kernel's task rows.
struct Grads {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    tasks: i32,
}

/// The runtime's launch sequence on the simulator, with `main_ptx` as the main kernel.
fn run(c: &Case, main_ptx: &str, limits: Limits, num_sms: usize) -> Result<Grads, SimError> {
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
    let pre = module(bwd_preprocess::VARIANTS);
    gpu.launch(
        pre.kernel(bwd_preprocess::NAME).unwrap(),
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
    let modules = task_build_modules(Arch::Sm90)?;
    let build = TaskBuild::run(&mut gpu, &modules, &c.schedule, num_sms)?;
    let tasks = gpu.read::<i32>(build.region(build.layout.desc), 1)?[0];
    let before_main = started.elapsed();

    // 4. The main kernel, with the maps the runtime encodes.
    let map = |spec: Result<TileMapSpec, _>, base| {
        let spec = spec.expect("valid map spec");
        SimTensorMap::from_spec(&spec, base)
            .expect("valid map")
            .arg()
    };
    let main = Module::parse(main_ptx)?;
    let kernel = main.kernel(msa_backward_sm90::NAME).expect("entry");
    let cfg = LaunchConfig::new(
        (build.sizes.grid_launch as u32, 1, 1),
        msa_backward_sm90::THREADS,
    )
    .with_dynamic_shared(msa_backward_sm90::DYNAMIC_SHARED_BYTES);
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
    let t_main = Instant::now();
    let stats = gpu.launch(kernel, &cfg, &args)?;
    let main_time = t_main.elapsed();

    // 5. Postprocess.
    let dq = gpu.alloc("dq", 2 * t * Q_ROW);
    let dk = gpu.alloc("dk", 2 * w * KV_ROW);
    let dv = gpu.alloc("dv", 2 * w * KV_ROW);
    let post = module(bwd_postprocess::VARIANTS);
    gpu.launch(
        post.kernel(bwd_postprocess::NAME).unwrap(),
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
    println!(
        "  {tasks} task rows on {} CTAs ({num_sms} SMs): preprocess + task build {:.2} s, \
         main kernel {:.2} s ({} warp instructions), total {:.2} s",
        cfg.grid[0],
        before_main.as_secs_f64(),
        main_time.as_secs_f64(),
        stats.warp_instructions,
        started.elapsed().as_secs_f64()
    );
    let f32s = |p, n| -> Result<Vec<f32>, SimError> {
        Ok(gpu.read::<bf16>(p, n)?.iter().map(|x| x.to_f32()).collect())
    };
    Ok(Grads {
        dq: f32s(dq, t * Q_ROW)?,
        dk: f32s(dk, w * KV_ROW)?,
        dv: f32s(dv, w * KV_ROW)?,
        tasks,
    })
}

fn check(c: &Case, g: &Grads, label: &str) {
    let e = &c.expected;
    let mut failures = Vec::new();
    for (tol, name, got, want) in [
        (DQ_TOLERANCE, "dq", &g.dq, &e.dq),
        (DK_TOLERANCE, "dk_aligned", &g.dk, &e.dk_aligned),
        (DV_TOLERANCE, "dv_aligned", &g.dv, &e.dv_aligned),
    ] {
        match tol.check(name, got, want) {
            Ok(stats) => println!("  {label} {name}: {stats}"),
            Err(msg) => failures.push(msg),
        }
    }
    assert!(failures.is_empty(), "{label}:\n{}", failures.join("\n"));
}

fn main_ptx() -> &'static str {
    Arch::Sm90
        .ptx(msa_backward_sm90::VARIANTS)
        .expect("the sm_90 main kernel")
}

#[test]
fn backward_sm90_small_documents_matches_the_reference() {
    // The documents of tests/backward.rs case (a) — several documents, partial key blocks,
    // one-token documents, a full 128-token one — plus a trailing one-token document: with
    // T = 395 the last preprocess tile has an odd row count and `bwd_preprocess` runs a
    // full-mask `shfl.sync` with half a warp branched away, which the simulator rejects.
    let c = case(&[127, 129, 1, 2, 3, 5, 128, 1], 7001);
    // `MSA_SIM_SMS=n` sizes the walk for another SM count (the grid, tasks per CTA).
    let sms = std::env::var("MSA_SIM_SMS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(H200_SMS);
    let g = run(&c, main_ptx(), Limits::default(), sms).unwrap_or_else(|e| panic!("{e}"));
    assert!(g.tasks > 0);
    check(&c, &g, "deferred TMA");
}

#[test]
fn backward_sm90_case_a_exactly() {
    let c = case(&[127, 129, 1, 2, 3, 5, 128], 7001);
    let g = run(&c, main_ptx(), Limits::default(), H200_SMS).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "case (a)");
}

#[test]
fn backward_sm90_with_tma_completing_at_issue_matches_the_reference() {
    // Copies land as soon as they are issued: a producer that refilled a stage before both
    // consumers released it would corrupt what they read. Fewer SMs: several tasks and
    // segments per CTA, so both Q/dO stages and the K/V stage are reused.
    let c = case(&[127, 129, 4], 7002);
    let limits = Limits {
        tma_completion: TmaCompletion::Immediate,
        ..Limits::default()
    };
    let g = run(&c, main_ptx(), limits, 2).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "immediate TMA, 2 SMs");
}

// ---------------------------------------------------------------------------------------------
// Planted bugs in the shipped kernel text
// ---------------------------------------------------------------------------------------------

/// The main kernel with the `nth` (0-based) line containing `needle` replaced by `with(line)`
/// (several lines joined by `\n`, or none); the instruction forms are matched rather than
/// register names, so the edits survive a regeneration of the kernel.
fn planted(needle: &str, nth: usize, with: impl Fn(&str) -> String) -> String {
    let mut seen = 0;
    let mut out = Vec::new();
    let mut edited = false;
    for line in main_ptx().lines() {
        if line.contains(needle) {
            if seen == nth {
                let new = with(line);
                assert_ne!(new, line, "the edit of `{line}` must change it");
                if !new.is_empty() {
                    out.push(new);
                }
                edited = true;
                seen += 1;
                continue;
            }
            seen += 1;
        }
        out.push(line.to_string());
    }
    assert!(
        edited,
        "line {nth} with `{needle}` not found ({seen} found)"
    );
    out.join("\n") + "\n"
}

/// The main kernel without its `nth` `mbarrier.try_wait` loop (the wait and the retry
/// branch after it).
fn without_wait(nth: usize) -> String {
    let lines: Vec<&str> = main_ptx().lines().collect();
    let at = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| l.contains("mbarrier.try_wait"))
        .nth(nth)
        .map(|(i, _)| i)
        .expect("the wait exists");
    assert!(lines[at + 1].contains("bra"), "{}", lines[at + 1]);
    let kept: Vec<&str> = lines[..at]
        .iter()
        .chain(&lines[at + 2..])
        .copied()
        .collect();
    kept.join("\n") + "\n"
}

/// Two documents and one SM: a few tasks and both Q/dO stages reused in each CTA.
fn tiny() -> Case {
    case(&[100, 60], 7010)
}

fn expect_error(text: &str, limits: Limits, want: impl Fn(&SimError) -> bool, needle: &str) {
    let c = tiny();
    let err = match run(&c, text, limits, 1) {
        Ok(_) => panic!("the planted bug went unnoticed"),
        Err(e) => e,
    };
    let msg = err.to_string();
    println!("{msg}");
    assert!(want(&err), "unexpected error: {msg}");
    assert!(msg.contains(needle), "`{needle}` missing in: {msg}");
}

fn fault(want: impl Fn(&FaultKind) -> bool) -> impl Fn(&SimError) -> bool {
    move |e| matches!(e, SimError::Fault { kind, .. } if want(kind))
}

#[test]
fn the_tiny_case_passes_unmodified() {
    let c = tiny();
    let g = run(&c, main_ptx(), Limits::default(), 1).unwrap_or_else(|e| panic!("{e}"));
    assert!(g.tasks >= 3, "{} tasks", g.tasks);
    check(&c, &g, "tiny");
}

#[test]
fn missing_proxy_fence_before_the_dq_wgmma_is_reported() {
    let text = planted("fence.proxy.async.shared::cta;", 0, |_| String::new());
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Proxy(_))),
        "with no fence.proxy.async by that thread since",
    );
}

#[test]
fn expect_tx_short_of_the_copies_is_reported() {
    // The Q/dO stage expects one 2 KiB box less than its 32 copies carry.
    let text = planted("mbarrier.arrive.expect_tx", 1, |l| {
        l.replace(", 65536;", ", 63488;")
    });
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Mbarrier(_))),
        "the copies carry more bytes than the phase's expect_tx",
    );
}

#[test]
fn expect_tx_beyond_the_copies_deadlocks_naming_the_mbarrier() {
    let text = planted("mbarrier.arrive.expect_tx", 1, |l| {
        l.replace(", 65536;", ", 67584;")
    });
    expect_error(
        &text,
        Limits::default(),
        |e| matches!(e, SimError::Deadlock(_)),
        "tx-count 2048, 0 TMA copies in flight",
    );
}

#[test]
fn consumer_skipping_the_q_full_wait_is_reported() {
    // The consumers' Q/dO wait is the fourth try_wait.
    let text = without_wait(3);
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Mbarrier(_) | FaultKind::Tma(_))),
        "",
    );
}

#[test]
fn reading_an_accumulator_before_wgmma_wait_group_is_reported() {
    let text = planted("wgmma.wait_group.sync.aligned", 0, |_| String::new());
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Wgmma(_))),
        "still in flight",
    );
}

#[test]
fn missing_wgmma_fence_before_the_register_a_mma_is_reported() {
    // The second fence orders the P^T/dS^T fragments (written by cvt) before the RS MMAs.
    let text = planted("wgmma.fence.sync.aligned", 1, |_| String::new());
    expect_error(
        &text,
        Limits::default(),
        fault(|k| matches!(k, FaultKind::Wgmma(_))),
        "was accessed after the warp's last wgmma.fence",
    );
}

#[test]
fn register_pool_overflow_deadlocks_at_setmaxnreg() {
    // 40 producer registers + 2 × 240 consumer registers, × 128 threads > 65536.
    let text = planted("setmaxnreg.dec", 0, |l| l.replace(" 24;", " 40;"));
    expect_error(
        &text,
        Limits::default(),
        |e| matches!(e, SimError::Deadlock(_)),
        "setmaxnreg.inc to 240 waits for registers",
    );
}

#[test]
fn producer_skipping_the_q_empty_wait_corrupts_results_with_immediate_tma() {
    // The producer's Q/dO empty wait is the second try_wait: without it, copies landing at
    // issue overwrite a stage before the consumers have read it.
    let text = without_wait(1);
    let c = tiny();
    let limits = Limits {
        tma_completion: TmaCompletion::Immediate,
        ..Limits::default()
    };
    match run(&c, &text, limits, 1) {
        Err(e) => println!("reported: {e}"),
        Ok(g) => {
            let e = &c.expected;
            let dq = DQ_TOLERANCE.check("dq", &g.dq, &e.dq);
            let dk = DK_TOLERANCE.check("dk", &g.dk, &e.dk_aligned);
            assert!(
                dq.is_err() || dk.is_err(),
                "the overwritten stages went unnoticed"
            );
        }
    }
}
