//! The whole Blackwell backward on the simulator, no GPU: `bwd_preprocess` → zeroed pools →
//! the four task-build kernels (all `sm_100a` PTX) → `msa_backward_sm100` (TMEM, tcgen05.mma
//! SS and TS, tcgen05.commit → mbarrier, tcgen05.ld/st, TMA, setmaxnreg, 512 threads) →
//! `bwd_postprocess`, launched as `msa_runtime::backward::MsaBackward::run` launches them on a
//! compute-capability-10.0 device, and compared with the f32 CPU reference at the seed's
//! tolerances. Then planted bugs in the same kernel text, each of which must be reported.
//!
//! `msa_backward_sm100` has never run on SM100 hardware; this is the only execution of it.

use std::time::Instant;

use half::bf16;
use msa_runtime::backward::TileMapSpec;
use msa_runtime::contract::{HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS};
use msa_runtime::kernels::{bwd_postprocess, bwd_preprocess, msa_backward_sm100};
use msa_runtime::reference::{self, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{build_schedule, causal_support, Schedule};
use msa_sim::task_build::{task_build_modules, Arch, TaskBuild};
use msa_sim::{
    Arg, FaultKind, Gpu, LaunchConfig, Limits, Module, SimError, SimTensorMap, TmaCompletion,
};

const Q_ROW: usize = NUM_Q_HEADS * HEAD_DIM;
const KV_ROW: usize = NUM_KV_HEADS * HEAD_DIM;
/// The B200's SM count: the grid the runtime launches there.
const B200_SMS: usize = 148;

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
    Module::parse(Arch::Sm100.ptx(variants).expect("an sm_100a variant")).expect("parses")
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
    let modules = task_build_modules(Arch::Sm100)?;
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
    let kernel = main.kernel(msa_backward_sm100::NAME).expect("entry");
    let cfg = LaunchConfig::new(
        (build.sizes.grid_launch as u32, 1, 1),
        msa_backward_sm100::THREADS,
    )
    .with_dynamic_shared(msa_backward_sm100::DYNAMIC_SHARED_BYTES);
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
    Arch::Sm100
        .ptx(msa_backward_sm100::VARIANTS)
        .expect("the sm_100a main kernel")
}

#[test]
fn backward_sm100_case_a_matches_the_reference() {
    // The documents of tests/backward.rs case (a): several documents, partial key blocks,
    // one-token documents, a full 128-token one.
    let c = case(&[127, 129, 1, 2, 3, 5, 128], 7001);
    let sms = std::env::var("MSA_SIM_SMS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(B200_SMS);
    let g = run(&c, main_ptx(), Limits::default(), sms).unwrap_or_else(|e| panic!("{e}"));
    assert!(g.tasks > 0);
    check(&c, &g, "case (a), 148 SMs");
}

#[test]
fn backward_sm100_with_tma_completing_at_issue_matches_the_reference() {
    // Copies land as soon as they are issued: a producer that refilled a K/V or Q/dO stage
    // before the MMAs reading it completed would trip the operand check or corrupt results.
    let c = case(&[127, 129, 4], 7002);
    let limits = Limits {
        tma_completion: TmaCompletion::Immediate,
        ..Limits::default()
    };
    let g = run(&c, main_ptx(), limits, 2).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "immediate TMA, 2 SMs");
}

#[test]
fn backward_sm100_top16_window_on_two_sms_matches_the_reference() {
    // One 1153-token document with causal support: queries from block 16 on select a real
    // top-16 (their 16 nearest blocks, not all of them). Every CTA walks several task rows
    // and a key block's bucket holds more rows than one CTA walks, so buckets split across CTAs and the TMEM / shared-memory stages are reused. (2920 task
    // rows: the large regime, 16 rows per CTA.)
    let c = case(&[1153], 7004);
    let g = run(&c, main_ptx(), Limits::default(), 2).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "1153 tokens, 2 SMs");
}

#[test]
#[ignore = "about 130 s in release (40 s of it the CPU reference): run with --ignored"]
fn backward_sm100_long_document_on_few_sms_matches_the_reference() {
    // One 2177-token document with causal support (as in the H200 GPU tests), 4 SMs: the
    // large `chunk_map` regime (16 task rows per CTA).
    let c = case(&[2177], 7003);
    let g = run(&c, main_ptx(), Limits::default(), 4).unwrap_or_else(|e| panic!("{e}"));
    check(&c, &g, "2177 tokens, 4 SMs");
}

// ---------------------------------------------------------------------------------------------
// Planted bugs in the shipped kernel text
// ---------------------------------------------------------------------------------------------

/// The main kernel with the `nth` (0-based) line containing `needle` replaced by `with(line)`
/// (nothing when empty); instruction forms are matched rather than register names, so the
/// edits survive a regeneration of the kernel.
fn planted(needle: &str, nth: usize, with: impl Fn(&str) -> String) -> String {
    let mut seen = 0;
    let mut out = Vec::new();
    for line in main_ptx().lines() {
        if line.contains(needle) {
            if seen == nth {
                let new = with(line);
                assert_ne!(new, line, "the edit of `{line}` must change it");
                if !new.is_empty() {
                    out.push(new);
                }
                seen += 1;
                continue;
            }
            seen += 1;
        }
        out.push(line.to_string());
    }
    assert!(
        seen > nth,
        "line {nth} with `{needle}` not found ({seen} found)"
    );
    out.join("\n") + "\n"
}

/// The main kernel without the `mbarrier.try_wait` loop right before the first line that
/// contains `before`.
fn without_wait_before(before: &str) -> String {
    let lines: Vec<&str> = main_ptx().lines().collect();
    let target = lines
        .iter()
        .position(|l| l.contains(before))
        .expect("the instruction exists");
    let at = (0..target)
        .rev()
        .find(|&i| lines[i].contains("mbarrier.try_wait"))
        .expect("a wait before it");
    assert!(lines[at + 1].contains("bra"), "{}", lines[at + 1]);
    let kept: Vec<&str> = lines[..at]
        .iter()
        .chain(&lines[at + 2..])
        .copied()
        .collect();
    kept.join("\n") + "\n"
}

/// The main kernel without the load warp's Q/dO stage-empty wait: the `mbarrier.try_wait`
/// loop right before the first TMA copy into a Q/dO stage (mbarrier at offset 16 or 24 of the
/// barrier block, i.e. an operand ending in `+16];`).
fn without_q_empty_wait() -> String {
    let lines: Vec<&str> = main_ptx().lines().collect();
    let target = lines
        .iter()
        .position(|l| l.contains("cp.async.bulk.tensor") && l.trim_end().ends_with("+16];"))
        .expect("a Q/dO copy");
    let at = (0..target)
        .rev()
        .find(|&i| lines[i].contains("mbarrier.try_wait"))
        .expect("a wait before it");
    assert!(lines[at + 1].contains("bra"), "{}", lines[at + 1]);
    let kept: Vec<&str> = lines[..at]
        .iter()
        .chain(&lines[at + 2..])
        .copied()
        .collect();
    kept.join("\n") + "\n"
}

/// Two documents and one SM: a few tasks per CTA.
fn tiny() -> Case {
    case(&[100, 60], 7010)
}

fn expect_error(text: &str, want: impl Fn(&SimError) -> bool, needle: &str) {
    let c = tiny();
    let err = match run(&c, text, Limits::default(), 1) {
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

fn tcgen05_fault(e: &SimError) -> bool {
    fault(|k| matches!(k, FaultKind::Tcgen05(_)))(e)
}

#[test]
fn the_tiny_case_passes_unmodified() {
    let c = tiny();
    let g = run(&c, main_ptx(), Limits::default(), 1).unwrap_or_else(|e| panic!("{e}"));
    assert!(g.tasks >= 3, "{} tasks", g.tasks);
    check(&c, &g, "tiny");
}

#[test]
fn reading_tcgen05_ld_registers_before_wait_ld_is_reported() {
    let text = planted("tcgen05.wait::ld.sync.aligned", 0, |_| String::new());
    expect_error(&text, tcgen05_fault, "not yet waited for");
}

#[test]
fn publishing_p_without_wait_st_is_reported() {
    let text = planted("tcgen05.wait::st.sync.aligned", 0, |_| String::new());
    expect_error(&text, tcgen05_fault, "tcgen05.wait::st first");
}

#[test]
fn loading_s_without_waiting_for_its_commit_is_reported() {
    // The compute warps' wait on the S^T commit is the wait right before the first
    // tcgen05.ld: without it they read columns the G1 MMAs still write.
    let text = without_wait_before("tcgen05.ld.sync.aligned");
    expect_error(&text, tcgen05_fault, "tcgen05.ld");
}

#[test]
fn missing_proxy_fence_before_the_ds_mma_is_reported() {
    // The last of the three fences of a task: the dS^T panels of chunk 3 are read by the dQ
    // MMAs (the first two fences are redundant, the later ones cover the same threads'
    // earlier stores).
    let text = planted("fence.proxy.async.shared::cta;", 2, |_| String::new());
    expect_error(
        &text,
        fault(|k| matches!(k, FaultKind::Proxy(_))),
        "with no fence.proxy.async by that thread since",
    );
}

#[test]
fn a_hopper_style_descriptor_is_reported() {
    // 0x40004040 → 0x40000040: the SM100 version bit 46 cleared.
    let text = planted("1073758272", 0, |l| l.replace("1073758272", "1073741888"));
    expect_error(&text, tcgen05_fault, "version bits 46-48");
}

#[test]
fn a_tmem_store_outside_the_warps_lane_quadrant_is_reported() {
    // The first P store of each compute warp moved one quadrant (32 lanes) up.
    let text = planted("tcgen05.st.sync.aligned", 0, |l| {
        l.replace("[%b0]", "[%b0+2097152]")
    });
    expect_error(&text, tcgen05_fault, "may access only lanes");
}

#[test]
fn producer_skipping_the_q_stage_empty_wait_does_not_pass_silently() {
    // The Q/dO stage-empty wait (released by a tcgen05.commit after the MMAs that read the
    // stage): without it, copies landing at issue overwrite shared memory under MMAs still in
    // flight, or the stage's full-barrier phases run ahead of the consumers (today: a
    // deadlock report naming every warp's wait).
    let text = without_q_empty_wait();
    assert!(main_ptx().contains("tcgen05.commit"));
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
