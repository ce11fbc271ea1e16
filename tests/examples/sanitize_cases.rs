//! The cases `scripts/sanitize.sh` runs under compute-sanitizer: each runs the whole
//! `run_backward` (preprocess, task build, main kernel, postprocess) once on the GPU and
//! compares the gradients with the CPU reference at the seed tolerances.
//!
//! ```sh
//! cargo run -p msa-tests --release --example sanitize_cases -- all
//! cargo run -p msa-tests --release --example sanitize_cases -- packed-holes two-docs
//! ```
//!
//! Each case runs three times: with the host schedule (`build_schedule`, uploaded), in the
//! deterministic mode (`MsaBackward::set_deterministic`, its three `_det` kernels) on the same
//! schedule, and on the device path: compact K/V packed by `to_aligned`, the schedule built on the device from
//! `q2k` (`ResidentSchedule`), the backward on it, and `from_aligned` of dK/dV (compared
//! with the reference's compact dK/dV), and the forward (`run_forward` on the same device
//! inputs; `out` and `lse` against the reference forward), then the experimental KV-parallel
//! forward (`MsaForwardKv::run_on`, with the f32 and the f16 `o_pool`, then the f16 one with
//! the max pass's exact references, then both with the probe's, then the f16 one with every
//! L2 hint on under 32-query windows, then the paired f16 pool under the probe's and the
//! bound's references, and with paired K/V under the probe's) on that forward's schedule,
//! checked the same way. Every
//! sm_90a kernel of the runtime runs at least once.
//!
//! Cases:
//! - `packed-holes`: five short documents (1, 127, 129, 300, 700 tokens), random top-16 in
//!   shuffled slots with −1 holes;
//! - `two-docs`: documents of 700 and 1348 tokens, random top-16;
//! - `doc2k`: one document of 2048 tokens, random top-16.
//!
//! Exit status 1 when a case's gradients miss the tolerances or the backward fails; 2 for a
//! usage error or when no GPU is usable.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use msa_runtime::contract::Locality;
use msa_runtime::contract::NUM_KV_HEADS;
use msa_runtime::forward_kv::{L2Hints, MsaForwardKv, OPool, Reference, FORWARD_KV_LOCALITY};
use msa_runtime::reference::{self, DK_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{
    from_aligned, run_backward, run_forward, to_aligned, CudaBackend, ForwardBuffers, MsaBackward,
    ResidentSchedule, ScheduleBuildSizes, Span,
};
use msa_tests::cases::{compare, compare_forward, docs, random_top16, DeviceInputs, Problem};
use msa_tests::Rng;
use std::process::ExitCode;
use std::sync::Arc;

/// (name, document lengths, selection seed, data seed).
const CASES: [(&str, &[i32], u64, u64); 3] = [
    ("packed-holes", &[1, 127, 129, 300, 700], 18_001, 18_002),
    ("two-docs", &[700, 1348], 18_003, 18_004),
    ("doc2k", &[2048], 18_005, 18_006),
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let wanted: Vec<&str> = if args.is_empty() || args.iter().any(|a| a == "all") {
        CASES.iter().map(|c| c.0).collect()
    } else {
        args.iter().map(String::as_str).collect()
    };
    if let Some(bad) = wanted.iter().find(|w| !CASES.iter().any(|c| c.0 == **w)) {
        let names: Vec<&str> = CASES.iter().map(|c| c.0).collect();
        eprintln!("unknown case `{bad}`; cases: {}, all", names.join(", "));
        return ExitCode::from(2);
    }
    let stream = match msa_runtime::Device::open(0) {
        Ok(dev) => dev.context().default_stream(),
        Err(e) => {
            eprintln!("no usable GPU: {e}");
            return ExitCode::from(2);
        }
    };
    let mut failed = false;
    for &(name, lengths, sel_seed, data_seed) in CASES.iter().filter(|c| wanted.contains(&c.0)) {
        let cu = docs(lengths);
        let q2k = random_top16(&cu, &mut Rng::new(sel_seed));
        let p = Problem::new(name, cu, q2k.clone(), data_seed);
        let inputs = DeviceInputs::upload(&stream, &p);
        let result = inputs
            .run(&stream, &p.schedule, None)
            .map_err(|e| e.to_string())
            .and_then(|g| compare(&stream, &p, &g, "run_backward"))
            .and_then(|mut lines| {
                // The deterministic mode's kernels (bwd_preprocess_det, the _det main kernel,
                // bwd_postprocess_det) on the same inputs.
                let mut det = MsaBackward::new();
                det.set_deterministic(true);
                let g = inputs
                    .run(&stream, &p.schedule, Some(&mut det))
                    .map_err(|e| e.to_string())?;
                lines.extend(compare(&stream, &p, &g, "deterministic")?);
                lines.extend(device_path(&stream, &p, &inputs, &q2k)?);
                Ok(lines)
            });
        match result {
            Ok(lines) => {
                lines.iter().for_each(|l| println!("{l}"));
                println!("case {name}: ok");
            }
            Err(msg) => {
                println!("case {name}: FAILED\n{msg}");
                failed = true;
            }
        }
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// The device path of one case: `to_aligned` of the compact K/V, the schedule built on the
/// device, the backward on it, `from_aligned` of dK/dV, then the forward on the same inputs;
/// dQ, the compact dK/dV, `out` and `lse` against the reference.
fn device_path(
    stream: &Arc<CudaStream>,
    p: &Problem,
    inputs: &DeviceInputs,
    q2k: &[i32],
) -> Result<Vec<String>, String> {
    let e = |x: msa_runtime::RuntimeError| x.to_string();
    let cu = p.schedule.cu_seqlens();
    let compact = |aligned: &[bf16]| -> Result<Vec<bf16>, String> {
        let f: Vec<f32> = aligned.iter().map(|x| x.to_f32()).collect();
        let c = reference::from_aligned(&f, cu, NUM_KV_HEADS).map_err(|x| x.to_string())?;
        Ok(c.iter().map(|&x| bf16::from_f32(x)).collect())
    };
    let up = |v: &[bf16]| stream.clone_htod(v).map_err(|x| x.to_string());
    let (k, v) = (up(&compact(&p.k_aligned)?)?, up(&compact(&p.v_aligned)?)?);
    let (k_al, v_al) = to_aligned(stream, &p.schedule, &k.as_view(), &v.as_view()).map_err(e)?;

    let (t, w) = (p.schedule.num_tokens(), p.schedule.workspace_rows());
    let mut backend = CudaBackend::new(stream).map_err(e)?;
    let sizes = ScheduleBuildSizes::new(t, cu.len() - 1, w, 64).map_err(e)?;
    let mut schedule = ResidentSchedule::new(&mut backend, sizes).map_err(e)?;
    let d_q2k = stream.clone_htod(q2k).map_err(|x| x.to_string())?;
    let d_cu = stream.clone_htod(cu).map_err(|x| x.to_string())?;
    let qs = Span::new(d_q2k.device_ptr(stream).0, q2k.len());
    let cs = Span::new(d_cu.device_ptr(stream).0, cu.len());
    schedule.build(&mut backend, qs, cs).map_err(e)?;
    let g = run_backward(
        stream,
        &inputs.q.as_view(),
        &k_al.as_view(),
        &v_al.as_view(),
        &inputs.grad_out.as_view(),
        &inputs.lse.as_view(),
        &inputs.out.as_view(),
        &schedule,
    )
    .map_err(e)?;
    schedule.status(&mut backend).map_err(e)?;
    let mut lines = compare(stream, p, &g, "device schedule")?;
    let (dk, dv) = from_aligned(
        stream,
        &p.schedule,
        &g.dk_aligned.as_view(),
        &g.dv_aligned.as_view(),
    )
    .map_err(e)?;
    let f32s = |x: &cudarc::driver::CudaSlice<bf16>| -> Result<Vec<f32>, String> {
        let h = stream.clone_dtoh(x).map_err(|x| x.to_string())?;
        Ok(h.iter().map(|v| v.to_f32()).collect())
    };
    let (dk, dv) = (f32s(&dk)?, f32s(&dv)?);
    let want_dk = reference::from_aligned(&p.expected.dk_aligned, cu, NUM_KV_HEADS)
        .map_err(|x| x.to_string())?;
    let want_dv = reference::from_aligned(&p.expected.dv_aligned, cu, NUM_KV_HEADS)
        .map_err(|x| x.to_string())?;
    let sk = DK_TOLERANCE.check("dk (from_aligned)", &dk, &want_dk)?;
    let sv = DV_TOLERANCE.check("dv (from_aligned)", &dv, &want_dv)?;
    lines.push(format!(
        "{} (device path) dk compact: {sk}; dv compact: {sv}",
        p.name
    ));

    // The forward (its own device schedule build, then `msa_forward_sm90`).
    let fwd = run_forward(
        stream,
        &inputs.q.as_view(),
        &k_al.as_view(),
        &v_al.as_view(),
        &d_q2k.as_view(),
        &d_cu.as_view(),
    )
    .map_err(e)?;
    let out = f32s(&fwd.out)?;
    let want: Vec<f32> = p.out.iter().map(|x| x.to_f32()).collect();
    let lse = stream.clone_dtoh(&fwd.lse).map_err(|x| x.to_string())?;
    let line = compare_forward("run_forward", &out, &lse, &want, &p.lse)
        .map_err(|x| format!("{}: {x}", p.name))?;
    lines.push(format!("{} (run_forward) {line}", p.name));

    // The experimental KV-parallel forward on the same schedule (bound, task build,
    // `msa_forward_kv_sm90`, combine, and the gated recompute launches).
    let t = inputs.q.len() / (64 * 128);
    let mut out_kv = stream
        .alloc_zeros::<bf16>(t * 64 * 128)
        .map_err(|x| x.to_string())?;
    let mut lse_kv = stream
        .alloc_zeros::<f32>(t * 64)
        .map_err(|x| x.to_string())?;
    let span = |x: &cudarc::driver::CudaSlice<bf16>| Span::new(x.device_ptr(stream).0, x.len());
    let io = ForwardBuffers {
        q: span(&inputs.q),
        k_aligned: span(&k_al),
        v_aligned: span(&v_al),
        q2k: Span::new(d_q2k.device_ptr(stream).0, d_q2k.len()),
        out: Span::new(out_kv.device_ptr_mut(stream).0, t * 64 * 128),
        lse: Span::new(lse_kv.device_ptr_mut(stream).0, t * 64),
    };
    let mut backend = CudaBackend::new(stream).map_err(e)?;
    // Both o_pool types (the f16 one runs its own pass and combine kernels), the exact
    // references (the max pass and fwd_kv_reference) and the probe's (the default).
    // Then the defaults with every L2 hint on and windows of 32 queries (capped under one
    // query per key block: many bins). Last, the paired f16 pool (`fwd_kv_homes`, its own
    // pass and combine) under the probe and under the bound (every row recomputed).
    let small = Locality::capped(0, 2, 5);
    let plain = (FORWARD_KV_LOCALITY, L2Hints::NONE, (false, false));
    let paired = (FORWARD_KV_LOCALITY, L2Hints::NONE, (true, false));
    let paired_kv = (FORWARD_KV_LOCALITY, L2Hints::NONE, (true, true));
    let ways = [
        (OPool::F32, Reference::Bound, plain),
        (OPool::F16, Reference::Bound, plain),
        (OPool::F16, Reference::ExactMax, plain),
        (OPool::F16, Reference::Probe, plain),
        (OPool::F32, Reference::Probe, plain),
        (
            OPool::F16,
            Reference::Probe,
            (small, L2Hints::ALL, (false, false)),
        ),
        (OPool::F16, Reference::Probe, paired),
        (OPool::F16, Reference::Bound, paired),
        (OPool::F16, Reference::Probe, paired_kv),
    ];
    for (pool, refs, (locality, hints, (paired, paired_kv))) in ways {
        let mut kv = MsaForwardKv::new()
            .with_o_pool(pool)
            .with_reference(refs)
            .with_locality(locality)
            .map_err(e)?
            .with_l2_hints(hints)
            .with_paired_pool(paired)
            .with_paired_kv(paired_kv);
        kv.run_on(&mut backend, &io, &fwd.schedule).map_err(e)?;
        let recomputed = kv.status(&mut backend).map_err(e)?;
        let out = f32s(&out_kv)?;
        let lse = stream.clone_dtoh(&lse_kv).map_err(|x| x.to_string())?;
        let how = format!("{pool:?} pool, {refs:?}, {hints:?}, paired {paired}, K/V {paired_kv}");
        let line = compare_forward("MsaForwardKv", &out, &lse, &want, &p.lse)
            .map_err(|x| format!("{} ({how}): {x}", p.name))?;
        lines.push(format!(
            "{} (MsaForwardKv, {how}) {line}; {recomputed} rows recomputed",
            p.name
        ));
    }
    Ok(lines)
}
