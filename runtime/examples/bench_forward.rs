//! Times the MSA forward on the benchmark cases `bench/msa_inputs.py --write DIR` dumps (the
//! same `q2k`/`cu_seqlens` files `bench/baselines.py` and `bench/forward_baselines.py` use):
//!
//! ```text
//! cargo build --release -p msa-runtime --example bench_forward
//! target/release/examples/bench_forward DIR doc8k,packed64k [REPS] [RULE;RULE...]
//! ```
//!
//! Lines `kv, f32 pool, bound`, `kv, f16 pool, bound` and `kv, f32 pool, exact max` time the
//! KV forward with other `o_pool` types and references than its defaults (f16, exact max). The optional
//! last argument times the KV forward once more per rule, one line each: a rule is
//! `MIN,BLOCKS[,MAX][/HINTS]`, the task order's `msa_runtime::contract::Locality
//! { min_window_log2, blocks_log2, max_window_log2 }` (no cap without `MAX`) and the L2
//! eviction hints `forward_kv::L2Hints` as a list of `kv`, `q`, `o` (none without it), e.g.
//! `9,2;9,0,12/kv;9,0/kv,q,o`.
//!
//! Per case: `kernel ms` is one `MsaForward::run_on` (the `msa_forward_sm90` launch) on a
//! schedule built once; `run_forward ms` is one whole `run_forward` call (the device schedule
//! build, the output allocations and the kernel); `kv ms` is one
//! `forward_kv::MsaForwardKv::run_on` (the KV-parallel forward with its defaults: f16 pool,
//! max pass, task build, sum pass, combine) on the same schedule, and `kv vs sm90` the
//! largest difference of its `out` from `msa_forward_sm90`'s (and of `lse`), with its verdict
//! (rows recomputed). Lines after each case give the KV forward's median ms per operation
//! (through `TimedBackend`) and what `MsaAttention::forward` takes with the algorithm `Auto`
//! picks. Medians over REPS (default 20) calls between
//! CUDA events after 3 warm-up calls, a 256 MiB L2 flush before each. Useful forward FLOP =
//! `2·(128 + 128)·16·Σ keys attended` (keys summed over the 4 index heads and all tokens, ×16
//! query heads per index head). Inputs are uniform bf16 (timing does not depend on them).
//! Without a GPU it says so and exits 0.
//!
//! With `BENCH_KV_ONLY=1` it times the KV forward alone (its line and its default breakdown;
//! `kernel`, `run_forward` and the comparison with `msa_forward_sm90` print `-`, and each
//! rule of the last argument adds a line `case @RULE` and its breakdown): the
//! form for A/B runs of two builds. `BENCH_KV_WALK_SPLIT=N` gives the KV forward's default line
//! and breakdown `MsaForwardKv::with_walk_split(N)`, `BENCH_KV_PAIRED=1` every KV line
//! `MsaForwardKv::with_paired_pool(true)`, and `BENCH_KV_PAIRED=kv` that and
//! `with_paired_kv(true)`.

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use msa_runtime::backend::Backend;
use msa_runtime::contract::Locality;
use msa_runtime::forward_kv::{L2Hints, MsaForwardKv, OPool, Reference};
use msa_runtime::reference::keys_attended;
use msa_runtime::{
    run_forward, workspace_layout, CudaBackend, ForwardAlgorithm, ForwardBuffers, MsaAttention,
    MsaForward, ResidentSchedule, ScheduleBuildSizes, Span, TimedBackend,
};
use std::error::Error;
use std::sync::Arc;

mod common;
use common::read_i32s;

type Res<T> = Result<T, Box<dyn Error>>;

fn random_bf16(n: usize, seed: u64) -> Vec<bf16> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / (1u64 << 24) as f32;
            bf16::from_f32((2.0 * u - 1.0) * 3f32.sqrt())
        })
        .collect()
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// The largest `|a − b|` of two bf16 outputs.
fn max_abs_diff(a: &[bf16], b: &[bf16]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x.to_f32() - y.to_f32()).abs())
        .fold(0f32, f32::max)
}

/// The times of `reps` calls of `call` after 3 warm-ups, each between CUDA events with the L2
/// flushed before it; what the calls return is dropped at the end. The times are read
/// after one synchronization at the end, as `bench/baselines.py` times its baselines, so that
/// both sides are timed the same way. (Until session 16 each call's time was read right after
/// it, which also made the stream wait for the host to issue the next call; on the H200 the
/// two methods gave times within the run-to-run spread.)
fn time_calls<T>(
    stream: &Arc<CudaStream>,
    flush: &mut CudaSlice<u8>,
    reps: usize,
    mut call: impl FnMut() -> Res<T>,
) -> Res<Vec<f32>> {
    let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    for _ in 0..3 {
        drop(call()?);
    }
    stream.synchronize()?;
    // What the calls return lives until the end: freeing it mid-loop could wait for the
    // device.
    let mut events = Vec::with_capacity(reps);
    let mut kept = Vec::with_capacity(reps);
    for _ in 0..reps {
        stream.memset_zeros(flush)?;
        let a = stream.record_event(timing)?;
        kept.push(call()?);
        let b = stream.record_event(timing)?;
        events.push((a, b));
    }
    stream.synchronize()?;
    drop(kept);
    events.iter().map(|(a, b)| Ok(a.elapsed_ms(b)?)).collect()
}

/// [`time_calls`] of `fwd.run_on`, and the verdict of `status` after the last call.
fn time_kv(
    mut fwd: MsaForwardKv<CudaBackend>,
    (stream, flush): (&Arc<CudaStream>, &mut CudaSlice<u8>),
    backend: &mut CudaBackend,
    (io, schedule): (&ForwardBuffers, &ResidentSchedule<CudaBackend>),
    reps: usize,
) -> Res<(Vec<f32>, String)> {
    let ms = time_calls(stream, flush, reps, || {
        Ok(fwd.run_on(backend, io, schedule)?)
    })?;
    let verdict = match fwd.status(backend) {
        Ok(n) => format!("ok, {n} rows recomputed"),
        Err(e) => e.to_string(),
    };
    Ok((ms, verdict))
}

/// The median ms of each operation of `fwd.run_on` over 5 calls (after one untimed), through
/// a [`TimedBackend`] with a schedule of its own, as `" name ms;"` items.
fn breakdown(
    mut fwd: MsaForwardKv<TimedBackend>,
    stream: &Arc<CudaStream>,
    flush: &mut CudaSlice<u8>,
    io: &ForwardBuffers,
    sizes: ScheduleBuildSizes,
    (q2k, cu): (Span<i32>, Span<i32>),
) -> Res<String> {
    let mut timed = TimedBackend::new(CudaBackend::new(stream)?);
    let mut schedule = ResidentSchedule::new(&mut timed, sizes)?;
    schedule.build(&mut timed, q2k, cu)?;
    fwd.run_on(&mut timed, io, &schedule)?;
    stream.synchronize()?;
    timed.clear();
    let calls = 5;
    for _ in 0..calls {
        stream.memset_zeros(flush)?;
        fwd.run_on(&mut timed, io, &schedule)?;
    }
    let ops = timed.take()?;
    let per_call = ops.len() / calls;
    let mut line = String::new();
    for k in 0..per_call {
        let ms = median((0..calls).map(|c| ops[c * per_call + k].2).collect());
        line.push_str(&format!(" {} {ms:.3};", ops[k].0));
    }
    // The stream's time from the first operation's start to the last one's end, and how much
    // of it no operation ran (the events' own cost included); the largest such gap, and the
    // operation after it (in the median call by span).
    let call = |c: usize| &ops[c * per_call..(c + 1) * per_call];
    let span = |c: usize| {
        let o = call(c);
        o[per_call - 1].1 + o[per_call - 1].2 - o[0].1
    };
    let mut by_span: Vec<usize> = (0..calls).collect();
    by_span.sort_by(|&a, &b| span(a).total_cmp(&span(b)));
    let c = by_span[calls / 2];
    let o = call(c);
    let busy: f32 = o.iter().map(|op| op.2).sum();
    let (gap, before) = o
        .windows(2)
        .map(|w| (w[1].1 - (w[0].1 + w[0].2), w[1].0))
        .fold((0.0f32, ""), |a, g| if g.0 > a.0 { g } else { a });
    line.push_str(&format!(
        " span {:.3}, idle {:.3} (largest gap {gap:.3} before {before})",
        span(c),
        span(c) - busy
    ));
    Ok(line)
}

/// A sweep rule `MIN,BLOCKS[,MAX][/kv,q,o]`: its label, locality and L2 hints.
fn parse_rule(rule: &str) -> Res<(String, Locality, L2Hints)> {
    let (order, hints) = rule.split_once('/').unwrap_or((rule, ""));
    let n: Vec<u32> = order.split(',').map(str::parse).collect::<Result<_, _>>()?;
    let locality = match n[..] {
        [min, blocks] => Locality::uncapped(min, blocks),
        [min, blocks, max] => Locality::capped(min, blocks, max),
        _ => return Err(format!("rule {rule:?}: expected MIN,BLOCKS[,MAX]").into()),
    };
    let mut l2 = L2Hints::NONE;
    for h in hints.split(',').filter(|h| !h.is_empty()) {
        match h {
            "kv" => l2.kv_evict_first = true,
            "q" => l2.q_evict_last = true,
            "o" => l2.o_evict_last = true,
            _ => return Err(format!("rule {rule:?}: hint {h:?} is none of kv, q, o").into()),
        }
    }
    Ok((rule.to_string(), locality, l2))
}

/// The KV forward with its defaults, or with `split` CTAs per walk when given (and the
/// paired pool under `BENCH_KV_PAIRED=1`, and paired K/V too under `BENCH_KV_PAIRED=kv`).
fn kv_default<B: Backend>(split: Option<u32>) -> Res<MsaForwardKv<B>> {
    let how = std::env::var("BENCH_KV_PAIRED").unwrap_or_default();
    let fwd = MsaForwardKv::new()
        .with_paired_pool(how == "1" || how == "kv")
        .with_paired_kv(how == "kv");
    Ok(match split {
        Some(parts) => fwd.with_walk_split(parts)?,
        None => fwd,
    })
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(cases)) = (args.get(1), args.get(2)) else {
        return Err(
            "usage: bench_forward DIR case,case [REPS] [MIN,BLOCKS[,MAX][/kv,q,o];...]".into(),
        );
    };
    let reps: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(20);
    let localities = args
        .get(4)
        .map(|s| s.split(';').map(parse_rule).collect::<Res<Vec<_>>>())
        .transpose()?
        .unwrap_or_default();
    let dev = match msa_runtime::Device::open(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no GPU ({e}); nothing to time");
            return Ok(());
        }
    };
    let stream = dev.context().default_stream();
    let mut flush = stream.alloc_zeros::<u8>(256 << 20)?;
    let kv_only = std::env::var_os("BENCH_KV_ONLY").is_some_and(|v| v == "1");
    let split: Option<u32> = match std::env::var("BENCH_KV_WALK_SPLIT") {
        Ok(v) => Some(v.parse()?),
        Err(_) => None,
    };
    println!(
        "| case | T | kernel ms | useful TFLOP/s | run_forward ms | useful TFLOP/s | kv ms | \
         useful TFLOP/s | kv vs sm90: out max-abs, lse max-abs, verdict |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for name in cases.split(',') {
        let cu = read_i32s(&format!("{dir}/{name}.cu_seqlens.i32"))?;
        let q2k = read_i32s(&format!("{dir}/{name}.q2k.i32"))?;
        let t = *cu.last().ok_or("empty cu_seqlens")? as usize;
        let (starts, w) = workspace_layout(&cu)?;
        let keys: usize = keys_attended(&q2k, &cu)?.iter().sum();
        let flop = 2.0 * 256.0 * 16.0 * keys as f64;
        let q = stream.clone_htod(&random_bf16(t * 8192, 1))?;
        let kv_len = w * 512;
        // Aligned K/V: random rows for tokens, zeros for padding.
        let mut k_h = vec![bf16::ZERO; kv_len];
        let mut v_h = vec![bf16::ZERO; kv_len];
        let (kr, vr) = (random_bf16(t * 512, 2), random_bf16(t * 512, 3));
        for d in 0..cu.len() - 1 {
            let (s, e, ws) = (cu[d] as usize, cu[d + 1] as usize, starts[d] as usize);
            k_h[ws * 512..(ws + e - s) * 512].copy_from_slice(&kr[s * 512..e * 512]);
            v_h[ws * 512..(ws + e - s) * 512].copy_from_slice(&vr[s * 512..e * 512]);
        }
        let k = stream.clone_htod(&k_h)?;
        let v = stream.clone_htod(&v_h)?;
        let q2k_d = stream.clone_htod(&q2k)?;
        let cu_d = stream.clone_htod(&cu)?;
        let mut out = stream.alloc_zeros::<bf16>(t * 8192)?;
        let mut lse = stream.alloc_zeros::<f32>(t * 64)?;

        // The kernel alone, on a schedule built once.
        let mut backend = CudaBackend::new(&stream)?;
        let sizes = ScheduleBuildSizes::new(t, cu.len() - 1, w, 64)?;
        let mut schedule = ResidentSchedule::new(&mut backend, sizes)?;
        let q2k_s = Span::new(q2k_d.device_ptr(&stream).0, q2k.len());
        schedule.build(
            &mut backend,
            q2k_s,
            Span::new(cu_d.device_ptr(&stream).0, cu.len()),
        )?;
        schedule.status(&mut backend)?;
        let io = ForwardBuffers {
            q: Span::new(q.device_ptr(&stream).0, q.len()),
            k_aligned: Span::new(k.device_ptr(&stream).0, k.len()),
            v_aligned: Span::new(v.device_ptr(&stream).0, v.len()),
            q2k: q2k_s,
            out: Span::new(out.device_ptr_mut(&stream).0, t * 8192),
            lse: Span::new(lse.device_ptr_mut(&stream).0, t * 64),
        };
        let views = (q.as_view(), k.as_view(), v.as_view());
        let sel = (q2k_d.as_view(), cu_d.as_view());
        let (kernel, whole) = if kv_only {
            (Vec::new(), Vec::new())
        } else {
            let kernel = time_calls(&stream, &mut flush, reps, || {
                Ok(MsaForward.run_on(&mut backend, &io, &schedule)?)
            })?;
            let whole = time_calls(&stream, &mut flush, reps, || {
                Ok(run_forward(
                    &stream, &views.0, &views.1, &views.2, &sel.0, &sel.1,
                )?)
            })?;
            (kernel, whole)
        };
        // The KV-parallel forward on the same schedule, into outputs of its own (alone, into
        // the Q-parallel kernel's, which saves 16 GiB at 1M tokens).
        let own = if kv_only { 1 } else { t };
        let mut out_kv = stream.alloc_zeros::<bf16>(own * 8192)?;
        let mut lse_kv = stream.alloc_zeros::<f32>(own * 64)?;
        let io_kv = if kv_only {
            io
        } else {
            ForwardBuffers {
                out: Span::new(out_kv.device_ptr_mut(&stream).0, t * 8192),
                lse: Span::new(lse_kv.device_ptr_mut(&stream).0, t * 64),
                ..io
            }
        };
        let (kv, verdict) = time_kv(
            kv_default(split)?,
            (&stream, &mut flush),
            &mut backend,
            (&io_kv, &schedule),
            reps,
        )?;
        let rate = |ms: f32| flop / (ms as f64 * 1e-3) / 1e12;
        let sched = (q2k_s, Span::new(cu_d.device_ptr(&stream).0, cu.len()));
        if kv_only {
            let kvm = median(kv);
            println!(
                "| {name} | {t} | - | - | - | - | {kvm:.3} | {:.1} | -, -, {verdict} |",
                rate(kvm)
            );
            let fwd = kv_default(split)?;
            let line = breakdown(fwd, &stream, &mut flush, &io_kv, sizes, sched)?;
            println!("  kv breakdown (median of 5):{line}");
            // The locality sweep, each rule as the default line and its breakdown.
            for (rule, l, hints) in &localities {
                let label = format!("{name} @{rule}");
                let (ms, verdict) = time_kv(
                    kv_default(split)?.with_locality(*l)?.with_l2_hints(*hints),
                    (&stream, &mut flush),
                    &mut backend,
                    (&io_kv, &schedule),
                    reps,
                )?;
                let m = median(ms);
                println!(
                    "| {label} | {t} | - | - | - | - | {m:.3} | {:.1} | -, -, {verdict} |",
                    rate(m)
                );
                let fwd = kv_default(split)?.with_locality(*l)?.with_l2_hints(*hints);
                let line = breakdown(fwd, &stream, &mut flush, &io_kv, sizes, sched)?;
                println!("  kv breakdown (median of 5):{line}");
            }
            continue;
        }
        // The last kernel-loop call of MsaForward left its outputs in `out`/`lse`.
        MsaForward.run_on(&mut backend, &io, &schedule)?;
        let d_out = max_abs_diff(&stream.clone_dtoh(&out)?, &stream.clone_dtoh(&out_kv)?);
        let (a, b) = (stream.clone_dtoh(&lse)?, stream.clone_dtoh(&lse_kv)?);
        let d_lse = a
            .iter()
            .zip(&b)
            .filter(|(x, _)| x.is_finite())
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        let (km, wm, kvm) = (median(kernel), median(whole), median(kv));
        println!(
            "| {name} | {t} | {km:.3} | {:.1} | {wm:.3} | {:.1} | {kvm:.3} | {:.1} | \
             {d_out:.3e}, {d_lse:.3e}, {verdict} |",
            rate(km),
            rate(wm),
            rate(kvm)
        );
        let line = breakdown(
            kv_default(split)?,
            &stream,
            &mut flush,
            &io_kv,
            sizes,
            sched,
        )?;
        println!("  kv breakdown (median of 5):{line}");
        fn f32_bound<B: Backend>() -> MsaForwardKv<B> {
            MsaForwardKv::new()
                .with_o_pool(OPool::F32)
                .with_reference(Reference::Bound)
        }
        let line = breakdown(f32_bound(), &stream, &mut flush, &io_kv, sizes, sched)?;
        println!("  kv, f32 pool, bound, breakdown (median of 5):{line}");
        let exact = MsaForwardKv::new().with_reference(Reference::ExactMax);
        let line = breakdown(exact, &stream, &mut flush, &io_kv, sizes, sched)?;
        println!("  kv, f16 pool, exact max, breakdown (median of 5):{line}");
        // What a user of MsaAttention gets (schedule build, outputs, the algorithm Auto picks).
        let mut attn = MsaAttention::new();
        let auto =
            ForwardAlgorithm::Auto.uses_kv(backend.capability(), 0, (t, cu.len() - 1, w), false)?;
        let ms = time_calls(&stream, &mut flush, reps, || {
            Ok(attn.forward(&stream, &views.0, &views.1, &views.2, &sel.0, &sel.1)?)
        })?;
        let m = median(ms);
        println!(
            "  MsaAttention::forward (Auto: {}): {m:.3} ms, {:.1} useful TFLOP/s",
            if auto { "KV-parallel" } else { "Q-parallel" },
            flop / (m as f64 * 1e-3) / 1e12
        );
        // The other pools and references (the recompute counts say how many rows fell
        // outside the pool's window on these inputs), then the locality sweep.
        let mut variants = vec![
            ("f32 pool, bound".to_string(), f32_bound()),
            (
                "f16 pool, bound".to_string(),
                MsaForwardKv::new().with_reference(Reference::Bound),
            ),
            (
                "f16 pool, exact max".to_string(),
                MsaForwardKv::new().with_reference(Reference::ExactMax),
            ),
            (
                "f32 pool, probe".to_string(),
                MsaForwardKv::new().with_o_pool(OPool::F32),
            ),
        ];
        for (rule, l, hints) in &localities {
            let label = format!("rule {rule}");
            variants.push((
                label,
                MsaForwardKv::new().with_locality(*l)?.with_l2_hints(*hints),
            ));
        }
        for (label, fwd) in variants {
            let (ms, verdict) = time_kv(
                fwd,
                (&stream, &mut flush),
                &mut backend,
                (&io_kv, &schedule),
                reps,
            )?;
            let d = max_abs_diff(&stream.clone_dtoh(&out)?, &stream.clone_dtoh(&out_kv)?);
            let m = median(ms);
            println!(
                "  kv, {label}: {m:.3} ms, {:.1} useful TFLOP/s; out max-abs vs sm90 {d:.3e}, {verdict}",
                flop / (m as f64 * 1e-3) / 1e12
            );
        }
    }
    Ok(())
}
