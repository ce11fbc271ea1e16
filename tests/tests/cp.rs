//! Context parallelism on one GPU (`msa_runtime::cp`): `R` logical ranks, each a thread with
//! its own stream, exchanging through `HostGroup`. The reassembled gradients are checked
//! against the f32 CPU reference (seed tolerances) and against the single-device backward of
//! the whole sequence. With the `nccl` feature, one rank runs the same flow through NCCL on a
//! communicator of one (two ranks need two GPUs). The context-parallel forward runs on the
//! same logical ranks, chained into the backward on its own `out`, `lse` and schedule.
//!
//! GPU tests skip without a GPU and fail with `REQUIRE_GPU=1`. Run with `--release`.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use msa_runtime::reference::{DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE, O_TOLERANCE};
use msa_runtime::{
    Collective, CpBackward, CpBuffers, CpForward, CpForwardBuffers, CpLayout, CudaBackend,
    HostGroup, RankSchedule, RuntimeError, Span,
};
use msa_tests::cases::{docs, random_top16, to_f32, DeviceInputs, Problem, KV_ROW, Q_ROW};
use msa_tests::{gpu_stream, Rng};
use std::sync::Arc;

type RankGrads = (Vec<bf16>, Vec<bf16>, Vec<bf16>);

/// Rank `rank`'s backward on `stream` with the collective `comm`.
fn rank_run<C: Collective<CudaBackend>>(
    stream: &Arc<CudaStream>,
    comm: &mut C,
    layout: &CpLayout,
    p: &Problem,
    q2k: &[i32],
    rank: usize,
) -> Result<RankGrads, RuntimeError> {
    let rows = layout.token_rows(rank);
    let schedule = layout.local_schedule(rank, &layout.rank_q2k(rank, q2k)?, 64)?;
    let s = layout.slice_rows();
    // The rank's slice of the aligned K/V: rows [r·S, (r+1)·S), zero past W.
    let slice = |x: &[bf16]| layout.rank_slice(rank, x).expect("slice");
    let qr = rows.start * Q_ROW..rows.end * Q_ROW;
    let up = |x: &[bf16]| stream.clone_htod(x).unwrap();
    let (q, grad_out, out) = (
        up(&p.q[qr.clone()]),
        up(&p.grad_out[qr.clone()]),
        up(&p.out[qr]),
    );
    let lse = stream
        .clone_htod(&p.lse[rows.start * 64..rows.end * 64])
        .unwrap();
    let (k, v) = (up(&slice(&p.k_aligned)), up(&slice(&p.v_aligned)));
    let mut dq = stream.alloc_zeros::<bf16>(rows.len() * Q_ROW).unwrap();
    let mut dk = stream.alloc_zeros::<bf16>(s * KV_ROW).unwrap();
    let mut dv = stream.alloc_zeros::<bf16>(s * KV_ROW).unwrap();
    {
        let (nq, nkv) = (dq.len(), dk.len());
        let sp = |x: u64, n: usize| Span::<bf16>::new(x, n);
        let io = CpBuffers {
            q: sp(q.device_ptr(stream).0, q.len()),
            grad_out: sp(grad_out.device_ptr(stream).0, grad_out.len()),
            out: sp(out.device_ptr(stream).0, out.len()),
            lse: Span::new(lse.device_ptr(stream).0, lse.len()),
            k_slice: sp(k.device_ptr(stream).0, k.len()),
            v_slice: sp(v.device_ptr(stream).0, v.len()),
            dq: sp(dq.device_ptr_mut(stream).0, nq),
            dk_slice: sp(dk.device_ptr_mut(stream).0, nkv),
            dv_slice: sp(dv.device_ptr_mut(stream).0, nkv),
        };
        let mut backend = CudaBackend::new(stream)?;
        let mut backward = CpBackward::new();
        backward.run_on(&mut backend, comm, layout, &io, &schedule)?;
        // The group's gathered verdicts: every host schedule sends a zero word.
        backward.status(&mut backend)?;
    }
    let down = |x: &cudarc::driver::CudaSlice<bf16>| stream.clone_dtoh(x).unwrap();
    Ok((down(&dq), down(&dk), down(&dv)))
}

/// Checks the ranks' reassembled gradients against the reference and the single-device run.
/// `fwd` is the out/lse the ranks' backward read when not `p`'s: the single-device run reads
/// the same, so the two differ only in the order of the atomics.
fn check(
    stream: &Arc<CudaStream>,
    p: &Problem,
    layout: &CpLayout,
    per_rank: &[RankGrads],
    fwd: Option<(&[bf16], &[f32])>,
) {
    let w = layout.workspace_rows();
    let dq: Vec<bf16> = per_rank.iter().flat_map(|g| g.0.clone()).collect();
    let dk: Vec<bf16> = per_rank.iter().flat_map(|g| g.1.clone()).collect();
    let dv: Vec<bf16> = per_rank.iter().flat_map(|g| g.2.clone()).collect();
    assert!(dk[w * KV_ROW..]
        .iter()
        .chain(&dv[w * KV_ROW..])
        .all(|x| x.to_bits() == 0));
    let (dk, dv) = (&dk[..w * KV_ROW], &dv[..w * KV_ROW]);
    let e = &p.expected;
    for (tol, name, got, want) in [
        (DQ_TOLERANCE, "dq", &dq[..], &e.dq),
        (DK_TOLERANCE, "dk", dk, &e.dk_aligned),
        (DV_TOLERANCE, "dv", dv, &e.dv_aligned),
    ] {
        let stats = tol
            .check(name, &to_f32(got), want)
            .unwrap_or_else(|m| panic!("{} over {} ranks: {m}", p.name, layout.ranks()));
        println!(
            "{} over {} ranks, {name} vs reference: {stats}",
            p.name,
            layout.ranks()
        );
    }
    let mut inputs = DeviceInputs::upload(stream, p);
    if let Some((out, lse)) = fwd {
        inputs.out = stream.clone_htod(out).unwrap();
        inputs.lse = stream.clone_htod(lse).unwrap();
    }
    let single = inputs.run(stream, &p.schedule, None).unwrap();
    let one = |x: &cudarc::driver::CudaSlice<bf16>| to_f32(&stream.clone_dtoh(x).unwrap());
    for (name, got, want) in [
        ("dq", &dq[..], one(&single.dq)),
        ("dk", dk, one(&single.dk_aligned)),
        ("dv", dv, one(&single.dv_aligned)),
    ] {
        let stats = DQ_TOLERANCE
            .check(name, &to_f32(got), &want)
            .unwrap_or_else(|m| panic!("{} over {} ranks vs one GPU: {m}", p.name, layout.ranks()));
        println!(
            "{} over {} ranks, {name} vs one GPU: {stats}",
            p.name,
            layout.ranks()
        );
    }
}

/// `f(stream, comm, rank)` on `ranks` logical ranks, each a thread with a new stream of
/// `stream`'s context and its `HostGroup` handle; the results in rank order.
fn on_ranks<T: Send>(
    stream: &Arc<CudaStream>,
    ranks: usize,
    f: impl Fn(&Arc<CudaStream>, &mut HostGroup, usize) -> T + Sync,
) -> Vec<T> {
    let (ctx, f) = (stream.context().clone(), &f);
    std::thread::scope(|scope| {
        let hs: Vec<_> = HostGroup::new(ranks)
            .into_iter()
            .enumerate()
            .map(|(rank, mut comm)| {
                let ctx = &ctx;
                scope.spawn(move || f(&ctx.new_stream().unwrap(), &mut comm, rank))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn logical_ranks(name: &'static str, lengths: &[i32], ranks: usize, seed: u64) {
    let Some(stream) = gpu_stream() else { return };
    let cu = docs(lengths);
    let t = *cu.last().unwrap() as usize;
    let q2k = random_top16(&cu, &mut Rng::new(seed));
    let p = Problem::new(name, cu.clone(), q2k.clone(), seed + 1);
    let layout = CpLayout::new(&cu, ranks).unwrap();
    println!(
        "{name}: T = {t}, token rows {:?}",
        (0..ranks).map(|r| layout.token_rows(r)).collect::<Vec<_>>()
    );
    let per_rank = on_ranks(&stream, ranks, |s, comm, rank| {
        rank_run(s, comm, &layout, &p, &q2k, rank).unwrap()
    });
    check(&stream, &p, &layout, &per_rank, None);
}

#[test]
fn packed_documents_over_two_logical_ranks() {
    // Four documents; the boundary falls inside the second.
    logical_ranks("packed 4 docs", &[1000, 3000, 2500, 1692], 2, 51);
}

#[test]
fn one_document_over_three_logical_ranks() {
    logical_ranks("one document of 6000", &[6000], 3, 52);
}

#[cfg(feature = "nccl")]
#[test]
fn one_rank_through_nccl() {
    use msa_runtime::cp::{nccl_present, NcclCollective};
    let Some(stream) = gpu_stream() else { return };
    if !nccl_present() {
        assert!(
            std::env::var("REQUIRE_GPU").is_err(),
            "REQUIRE_GPU=1 but libnccl.so cannot be loaded"
        );
        return;
    }
    let cu = docs(&[700, 1348]);
    let q2k = random_top16(&cu, &mut Rng::new(53));
    let p = Problem::new("nccl world of 1", cu.clone(), q2k.clone(), 54);
    let layout = CpLayout::new(&cu, 1).unwrap();
    let id = cudarc::nccl::result::get_uniqueid().unwrap();
    let mut comm = NcclCollective::init_rank(id, 0, 1).unwrap();
    let g = rank_run(&stream, &mut comm, &layout, &p, &q2k, 0).unwrap();
    check(&stream, &p, &layout, &[g], None);
}

/// Rank `rank`'s forward (`CpForward`), then its backward on the forward's `out`, `lse` and
/// schedule (validated on the host, or with `device` built on the device from the rank's
/// device rows of the selection); returns `out`, `lse` and the gradients.
fn rank_chain(
    stream: &Arc<CudaStream>,
    comm: &mut HostGroup,
    layout: &CpLayout,
    p: &Problem,
    q2k: &[i32],
    rank: usize,
    device: bool,
) -> Result<(Vec<bf16>, Vec<f32>, RankGrads), RuntimeError> {
    let rows = layout.token_rows(rank);
    let (t, s) = (rows.len(), layout.slice_rows());
    let slice = |x: &[bf16]| layout.rank_slice(rank, x).expect("slice");
    let qr = rows.start * Q_ROW..rows.end * Q_ROW;
    let up = |x: &[bf16]| stream.clone_htod(x).unwrap();
    let (q, grad_out) = (up(&p.q[qr.clone()]), up(&p.grad_out[qr]));
    let (k, v) = (up(&slice(&p.k_aligned)), up(&slice(&p.v_aligned)));
    let mut out = stream.alloc_zeros::<bf16>(t * Q_ROW).unwrap();
    let mut lse = stream.alloc_zeros::<f32>(t * 64).unwrap();
    let mut dq = stream.alloc_zeros::<bf16>(t * Q_ROW).unwrap();
    let mut dk = stream.alloc_zeros::<bf16>(s * KV_ROW).unwrap();
    let mut dv = stream.alloc_zeros::<bf16>(s * KV_ROW).unwrap();
    {
        let sp = |x: u64, n: usize| Span::<bf16>::new(x, n);
        let (nq, nkv, nl) = (dq.len(), dk.len(), lse.len());
        let (q_s, k_s, v_s) = (
            sp(q.device_ptr(stream).0, q.len()),
            sp(k.device_ptr(stream).0, k.len()),
            sp(v.device_ptr(stream).0, v.len()),
        );
        let out_s = sp(out.device_ptr_mut(stream).0, nq);
        let lse_s = Span::<f32>::new(lse.device_ptr_mut(stream).0, nl);
        let mut backend = CudaBackend::new(stream)?;
        let fio = CpForwardBuffers {
            q: q_s,
            k_slice: k_s,
            v_slice: v_s,
            out: out_s,
            lse: lse_s,
        };
        let local_q2k = layout.rank_q2k(rank, q2k)?;
        let d_q2k = stream.clone_htod(&local_q2k).unwrap();
        let q2k_s = Span::<i32>::new(d_q2k.device_ptr(stream).0, d_q2k.len());
        let (host, resident) = if device {
            let mut rs = RankSchedule::new(&mut backend, layout, rank)?;
            CpForward::new().run_on_device(&mut backend, comm, layout, &fio, q2k_s, &mut rs)?;
            (None, Some(rs))
        } else {
            let schedule = CpForward::new().run_on(&mut backend, comm, layout, &fio, &local_q2k)?;
            (Some(schedule), None)
        };
        let io = CpBuffers {
            q: q_s,
            grad_out: sp(grad_out.device_ptr(stream).0, grad_out.len()),
            out: out_s,
            lse: lse_s,
            k_slice: k_s,
            v_slice: v_s,
            dq: sp(dq.device_ptr_mut(stream).0, nq),
            dk_slice: sp(dk.device_ptr_mut(stream).0, nkv),
            dv_slice: sp(dv.device_ptr_mut(stream).0, nkv),
        };
        let mut backward = CpBackward::new();
        match (&host, &resident) {
            (Some(s), _) => backward.run_on(&mut backend, comm, layout, &io, s)?,
            (None, Some(rs)) => {
                backward.run_on(&mut backend, comm, layout, &io, rs)?;
                rs.status(&mut backend)?;
            }
            (None, None) => unreachable!("one schedule"),
        }
        backward.status(&mut backend)?;
    }
    let down = |x: &cudarc::driver::CudaSlice<bf16>| stream.clone_dtoh(x).unwrap();
    let lse = stream.clone_dtoh(&lse).unwrap();
    Ok((down(&out), lse, (down(&dq), down(&dk), down(&dv))))
}

/// The context-parallel forward, then the backward, over two logical ranks, with host or
/// device rank schedules.
fn forward_chain(device: bool) {
    let Some(stream) = gpu_stream() else { return };
    let name = if device {
        "packed 4 docs, forward (device schedules)"
    } else {
        "packed 4 docs, forward"
    };
    let (lengths, ranks, seed) = ([1000, 3000, 2500, 1692], 2, 55);
    let cu = docs(&lengths);
    let q2k = random_top16(&cu, &mut Rng::new(seed));
    let p = Problem::new(name, cu.clone(), q2k.clone(), seed + 1);
    let layout = CpLayout::new(&cu, ranks).unwrap();
    let per_rank = on_ranks(&stream, ranks, |s, comm, rank| {
        rank_chain(s, comm, &layout, &p, &q2k, rank, device).unwrap()
    });
    let out: Vec<bf16> = per_rank.iter().flat_map(|r| r.0.clone()).collect();
    let lse: Vec<f32> = per_rank.iter().flat_map(|r| r.1.clone()).collect();
    let stats = O_TOLERANCE
        .check("out", &to_f32(&out), &to_f32(&p.out))
        .unwrap_or_else(|m| panic!("{name}: {m}"));
    let mut lse_err = 0f32;
    for (i, (&g, &e)) in lse.iter().zip(&p.lse).enumerate() {
        if e == f32::NEG_INFINITY {
            assert_eq!(g, e, "lse[{i}] of an empty row");
        } else {
            let d = (g - e).abs();
            assert!(d <= 1e-3, "{name}: lse[{i}] = {g}, want {e}");
            lse_err = lse_err.max(d);
        }
    }
    println!("{name} over {ranks} ranks: out vs reference {stats}, lse max-abs {lse_err:.2e}");
    let grads: Vec<RankGrads> = per_rank.into_iter().map(|r| r.2).collect();
    check(&stream, &p, &layout, &grads, Some((&out, &lse)));
}

#[test]
fn forward_then_backward_over_two_logical_ranks() {
    forward_chain(false);
}

#[test]
fn forward_then_backward_over_two_logical_ranks_on_device_schedules() {
    forward_chain(true);
}
