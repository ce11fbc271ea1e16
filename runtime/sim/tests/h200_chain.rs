//! The runtime's host flow on a real sm_90 GPU (`CudaBackend`) next to the same flow on the
//! simulator (`SimDevice`, sm90, the GPU's SM count), on the same inputs:
//!
//! - `bwd_preprocess`, the four task-build kernels and `bwd_postprocess` are deterministic:
//!   GPU and simulator must agree bit for bit.
//! - The whole backward (`MsaBackward::run_on`, main kernel `msa_backward_sm90`) accumulates
//!   dQ/dK/dV with atomics in an order that differs run to run: GPU and simulator must agree
//!   within the seed tolerances of each other (and each with the CPU reference).
//!
//! Without a GPU it prints `SKIP` and passes; with `REQUIRE_GPU=1` a missing GPU fails. Build
//! here with `cargo test --release -p msa-sim --test h200_chain --no-run` and run the binary on
//! the GPU machine with `REQUIRE_GPU=1 ... --nocapture --test-threads 1`.

use half::bf16;
use msa_runtime::backend::{bytes_of, from_bytes, Pod};
use msa_runtime::ops::{postprocess, preprocess};
use msa_runtime::reference::{DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::tasks::{DeviceSchedule, HostTaskTables, TaskBuildSizes, TaskWorkspace};
use msa_runtime::{
    build_schedule, causal_support, Backend, BackwardBuffers, CudaBackend, Device, MsaBackward,
    Schedule, Span,
};
use msa_sim::backward::{self, Case, Rng};
use msa_sim::device::{Arch, SimDevice};
use std::time::Instant;

fn gpu() -> Option<CudaBackend> {
    let skip = |why: String| {
        assert!(
            std::env::var("REQUIRE_GPU").as_deref() != Ok("1"),
            "REQUIRE_GPU=1: {why}"
        );
        eprintln!("SKIP: {why}");
        None
    };
    match Device::open(0) {
        Ok(d) if d.capability() == (9, 0) => {
            Some(CudaBackend::new(&d.context().default_stream()).expect("backend"))
        }
        Ok(d) => skip(format!("device capability {:?} is not 9.0", d.capability())),
        Err(e) => skip(format!("no GPU ({e})")),
    }
}

/// `data` in a fresh buffer of `b`.
fn put<B: Backend, T: Pod>(b: &mut B, data: &[T]) -> (B::Buffer, Span<T>) {
    let buf = b.alloc("test input", std::mem::size_of_val(data)).unwrap();
    let addr = b.address(&buf);
    b.upload("test input", addr, bytes_of(data)).unwrap();
    (buf, Span::new(addr, data.len()))
}

fn get<B: Backend, T: Pod>(b: &mut B, s: Span<T>) -> Vec<T> {
    from_bytes(
        &b.download("test output", s.addr, s.len * std::mem::size_of::<T>())
            .unwrap(),
    )
}

fn bits(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// First difference of two equal-length sequences, as a message.
fn first_diff<T: PartialEq + std::fmt::Debug>(what: &str, gpu: &[T], sim: &[T]) -> Option<String> {
    if gpu.len() != sim.len() {
        return Some(format!("{what}: {} vs {} elements", gpu.len(), sim.len()));
    }
    let n = gpu.iter().zip(sim).filter(|(a, b)| a != b).count();
    let i = gpu.iter().zip(sim).position(|(a, b)| a != b)?;
    Some(format!(
        "{what}: {n} of {} differ, first [{i}]: GPU {:?}, simulator {:?}",
        gpu.len(),
        gpu[i],
        sim[i]
    ))
}

fn delta_on<B: Backend>(b: &mut B, out: &[bf16], dout: &[bf16], t: usize) -> Vec<u32> {
    let (_o, o) = put(b, out);
    let (_d, d) = put(b, dout);
    let (_x, x) = put(b, &vec![f32::NAN; t * 64]);
    preprocess(b, o, d, x, t).unwrap();
    get(b, x).iter().map(|v: &f32| v.to_bits()).collect()
}

fn tables_on<B: Backend>(b: &mut B, s: &Schedule) -> HostTaskTables {
    let sizes = TaskBuildSizes::new(s, b.sm_count()).unwrap();
    let up = DeviceSchedule::upload(b, s).unwrap();
    let mut ws = TaskWorkspace::new(b, sizes, s.work_capacity()).unwrap();
    ws.build(b, &up).unwrap();
    ws.read_tables(b).unwrap()
}

fn post_on<B: Backend>(
    b: &mut B,
    pools: (&[bf16], &[f32], &[f32]),
    t: usize,
    w: usize,
) -> [Vec<u16>; 3] {
    let (_a, a) = put(b, pools.0);
    let (_k, k) = put(b, pools.1);
    let (_v, v) = put(b, pools.2);
    let poison = |n| vec![bf16::from_bits(0x7fc1); n];
    let (_q, dq) = put(b, &poison(pools.0.len()));
    let (_x, dk) = put(b, &poison(pools.1.len()));
    let (_y, dv) = put(b, &poison(pools.2.len()));
    postprocess(b, a, k, v, dq, dk, dv, t, w).unwrap();
    [bits(&get(b, dq)), bits(&get(b, dk)), bits(&get(b, dv))]
}

/// f32 values that exercise the bf16 rounding: ties both ways, subnormals, overflow.
fn tricky(rng: &mut Rng, i: usize) -> f32 {
    match i % 12 {
        0 => f32::from_bits(0x3f80_8000),
        1 => f32::from_bits(0x3f81_8000),
        2 => f32::from_bits(0xbf80_8001),
        3 => f32::from_bits(0x0000_0001),
        4 => f32::from_bits(0x0040_8000),
        5 => f32::MAX,
        6 => -0.0,
        7 => f32::from_bits(0x7f7f_8000),
        _ => rng.normal() * 2f32.powi((rng.next_u64() % 40) as i32 - 20),
    }
}

#[test]
fn preprocess_task_build_and_postprocess_agree_bit_for_bit() {
    let Some(mut cuda) = gpu() else { return };
    let sms = cuda.sm_count();
    let mut sim = SimDevice::new(Arch::Sm90, sms);
    let mut failures = Vec::new();
    let mut rng = Rng(42);

    for t in [1usize, 300, 1153] {
        let n = t * 64 * 128;
        let (out, _) = rng.bf16s(n);
        let (dout, _) = rng.bf16s(n);
        let g = delta_on(&mut cuda, &out, &dout, t);
        let s = delta_on(&mut sim, &out, &dout, t);
        match first_diff(&format!("bwd_preprocess T={t}"), &g, &s) {
            Some(d) => failures.push(d),
            None => println!(
                "bwd_preprocess T={t}: {} delta values bit-identical",
                g.len()
            ),
        }
    }

    let cu_of = |lengths: &[i32]| {
        let mut cu = vec![0];
        for l in lengths {
            cu.push(cu[cu.len() - 1] + l);
        }
        cu
    };
    for (label, lengths, qpw) in [
        (
            "docs (127,129,1,2,3,5,128)",
            vec![127, 129, 1, 2, 3, 5, 128],
            16,
        ),
        ("docs (1500,700,300)", vec![1500, 700, 300], 64),
        ("one document of 4093", vec![4093], 16),
    ] {
        let cu = cu_of(&lengths);
        let s = build_schedule(&causal_support(&cu).unwrap(), &cu, qpw).unwrap();
        let g = tables_on(&mut cuda, &s);
        let m = tables_on(&mut sim, &s);
        let diffs: Vec<String> = [
            first_diff("desc", &g.desc[..], &m.desc[..]),
            first_diff("task_meta", &g.meta, &m.meta),
            first_diff("task_qrows", &g.qrows, &m.qrows),
            first_diff("task_qpos", &g.qpos, &m.qpos),
        ]
        .into_iter()
        .flatten()
        .collect();
        if diffs.is_empty() {
            println!(
                "task build {label} qpw {qpw}, {sms} SMs: {} rows, descriptor {:?} and tables \
                 identical",
                g.desc[0], g.desc
            );
        } else {
            failures.push(format!("task build {label}: {}", diffs.join("; ")));
        }
    }

    for (t, w) in [(37usize, 128usize), (20, 256)] {
        let (dq_pool, _) = rng.bf16s(t * 64 * 128);
        let dk: Vec<f32> = (0..w * 512).map(|i| tricky(&mut rng, i)).collect();
        let dv: Vec<f32> = (0..w * 512).map(|i| tricky(&mut rng, i + 5)).collect();
        let g = post_on(&mut cuda, (&dq_pool, &dk, &dv), t, w);
        let s = post_on(&mut sim, (&dq_pool, &dk, &dv), t, w);
        let mut same = true;
        for (name, g, s) in [
            ("dq", &g[0], &s[0]),
            ("dk", &g[1], &s[1]),
            ("dv", &g[2], &s[2]),
        ] {
            if let Some(d) = first_diff(&format!("bwd_postprocess T={t} W={w} {name}"), g, s) {
                failures.push(d);
                same = false;
            }
        }
        if same {
            println!(
                "bwd_postprocess T={t} W={w}: {} + {} + {} outputs bit-identical",
                g[0].len(),
                g[1].len(),
                g[2].len()
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The whole backward on `b` for `c`: dq, dk, dv as bf16.
fn backward_on<B: Backend>(b: &mut B, c: &Case) -> [Vec<bf16>; 3] {
    let t = c.schedule.num_tokens();
    let w = c.schedule.workspace_rows();
    let (_q, q) = put(b, &c.q);
    let (_k, k_aligned) = put(b, &c.k_aligned);
    let (_v, v_aligned) = put(b, &c.v_aligned);
    let (_d, grad_out) = put(b, &c.dout);
    let (_l, lse) = put(b, &c.lse);
    let (_o, out) = put(b, &c.out);
    let (_x, dq) = put(b, &vec![bf16::ZERO; t * 64 * 128]);
    let (_y, dk_aligned) = put(b, &vec![bf16::ZERO; w * 512]);
    let (_z, dv_aligned) = put(b, &vec![bf16::ZERO; w * 512]);
    let io = BackwardBuffers {
        q,
        k_aligned,
        v_aligned,
        grad_out,
        lse,
        out,
        dq,
        dk_aligned,
        dv_aligned,
    };
    MsaBackward::<B>::new()
        .run_on(b, &io, &c.schedule)
        .unwrap_or_else(|e| panic!("{e}"));
    [get(b, dq), get(b, dk_aligned), get(b, dv_aligned)]
}

#[test]
fn backward_sm90_on_gpu_and_simulator_agree_within_the_seed_tolerances() {
    let Some(mut cuda) = gpu() else { return };
    let sms = cuda.sm_count();
    let mut failures = Vec::new();
    for lengths in [&[127, 129, 1, 2, 3, 5, 128][..], &[1153][..]] {
        let c = backward::case(lengths, 7002).unwrap();
        let g = backward_on(&mut cuda, &c);
        let mut sim = SimDevice::new(Arch::Sm90, sms);
        let started = Instant::now();
        let s = backward_on(&mut sim, &c);
        println!(
            "documents {lengths:?}: T = {}, W = {}; simulator {:.1} s",
            c.schedule.num_tokens(),
            c.schedule.workspace_rows(),
            started.elapsed().as_secs_f64()
        );
        let f = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
        let e = &c.expected;
        for (i, (tol, name, want)) in [
            (DQ_TOLERANCE, "dq", &e.dq),
            (DK_TOLERANCE, "dk_aligned", &e.dk_aligned),
            (DV_TOLERANCE, "dv_aligned", &e.dv_aligned),
        ]
        .into_iter()
        .enumerate()
        {
            let (gf, sf) = (f(&g[i]), f(&s[i]));
            let same = g[i].iter().zip(&s[i]).filter(|(a, b)| a == b).count();
            for (label, got, reference) in [
                ("GPU vs simulator", &gf, &sf),
                ("GPU vs CPU reference", &gf, want),
                ("simulator vs CPU reference", &sf, want),
            ] {
                match tol.check(name, got, reference) {
                    Ok(stats) => println!("  {name} {label}: {stats}"),
                    Err(m) => failures.push(format!("{lengths:?} {label}: {m}")),
                }
            }
            println!(
                "  {name}: {same} of {} bf16 values bit-identical between GPU and simulator",
                g[i].len()
            );
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
