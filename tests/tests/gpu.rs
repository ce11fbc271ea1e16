//! GPU tests of the standalone kernels against the CPU reference. They skip without a GPU and
//! fail when `REQUIRE_GPU=1` is set and none is usable.

use half::bf16;
use msa_runtime::{reference, run_postprocess, run_preprocess, Device, RuntimeError};
use msa_tests::{gpu_stream, Rng};

fn random_bf16(rng: &mut Rng, n: usize, scale: f32) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(rng.uniform() * scale))
        .collect()
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

#[test]
fn preprocess_matches_reference() {
    let Some(stream) = gpu_stream() else { return };
    let mut rng = Rng::new(20260902);
    // 300 tokens: two full 128-row CTAs and a partial third.
    for tokens in [1usize, 300] {
        let n = tokens * 64 * 128;
        let out = random_bf16(&mut rng, n, 2.0);
        let dout = random_bf16(&mut rng, n, 2.0);
        let d_out = stream.clone_htod(&out).unwrap();
        let d_dout = stream.clone_htod(&dout).unwrap();
        let mut d_delta = stream.alloc_zeros::<f32>(tokens * 64).unwrap();
        run_preprocess(
            &stream,
            &d_out.as_view(),
            &d_dout.as_view(),
            &mut d_delta.as_view_mut(),
            tokens,
        )
        .unwrap();
        let got = stream.clone_dtoh(&d_delta).unwrap();
        let (out32, dout32) = (to_f32(&out), to_f32(&dout));
        let expected = reference::preprocess_delta(&out32, &dout32, tokens).unwrap();
        // Products of bf16 values are exact in f32; only the summation order differs, so the
        // error is bounded by a few ulps of Σ|o·do|.
        let mut worst = 0.0f32;
        for (row, (g, e)) in got.iter().zip(&expected).enumerate() {
            let mag: f32 = out32[row * 128..][..128]
                .iter()
                .zip(&dout32[row * 128..][..128])
                .map(|(a, b)| (a * b).abs())
                .sum();
            let bound = 128.0 * f32::EPSILON * mag + 1e-30;
            assert!(
                (g - e).abs() <= bound,
                "delta[{row}] (t={}, h={}): gpu {g}, reference {e}, bound {bound}",
                row / 64,
                row % 64
            );
            worst = worst.max((g - e).abs() / bound.max(f32::MIN_POSITIVE));
        }
        println!(
            "preprocess T={tokens}: {} values, worst error {worst:.3} of the bound",
            got.len()
        );
    }
}

#[test]
fn postprocess_is_bit_exact() {
    let Some(stream) = gpu_stream() else { return };
    let mut rng = Rng::new(20260903);
    // cu_seqlens [0, 3, 5, 300]: W = 128 + 128 + 384 = 640.
    let tokens = 300usize;
    let ws_rows = 640usize;
    let dq_pool = random_bf16(&mut rng, tokens * 64 * 128, 4.0);
    let kv = ws_rows * 4 * 128;
    let mut dk_pool: Vec<f32> = (0..kv).map(|_| rng.uniform() * 3.0).collect();
    let dv_pool: Vec<f32> = (0..kv).map(|_| rng.uniform() * 1e-3).collect();
    // Ties and specials that round-to-nearest-even must get right.
    dk_pool[..6].copy_from_slice(&[
        1.0 + 2f32.powi(-8),
        1.0078125 + 2f32.powi(-8),
        -0.0,
        f32::INFINITY,
        1e-40,
        -3.0e38,
    ]);
    let d_dq_pool = stream.clone_htod(&dq_pool).unwrap();
    let d_dk_pool = stream.clone_htod(&dk_pool).unwrap();
    let d_dv_pool = stream.clone_htod(&dv_pool).unwrap();
    let mut d_dq = stream.alloc_zeros::<bf16>(tokens * 64 * 128).unwrap();
    let mut d_dk = stream.alloc_zeros::<bf16>(kv).unwrap();
    let mut d_dv = stream.alloc_zeros::<bf16>(kv).unwrap();
    run_postprocess(
        &stream,
        &d_dq_pool.as_view(),
        &d_dk_pool.as_view(),
        &d_dv_pool.as_view(),
        &mut d_dq.as_view_mut(),
        &mut d_dk.as_view_mut(),
        &mut d_dv.as_view_mut(),
        tokens,
        ws_rows,
    )
    .unwrap();
    let (dq, dk, dv) = (
        stream.clone_dtoh(&d_dq).unwrap(),
        stream.clone_dtoh(&d_dk).unwrap(),
        stream.clone_dtoh(&d_dv).unwrap(),
    );
    let (edq, edk, edv) = reference::postprocess(&dq_pool, &dk_pool, &dv_pool).unwrap();
    for (name, got, want) in [("dq", &dq, &edq), ("dk", &dk, &edk), ("dv", &dv, &edv)] {
        let bad: Vec<usize> = (0..got.len())
            .filter(|&i| got[i].to_bits() != want[i].to_bits())
            .take(5)
            .collect();
        assert!(
            bad.is_empty(),
            "{name}: first mismatches {:?}",
            bad.iter()
                .map(|&i| (i, got[i].to_bits(), want[i].to_bits()))
                .collect::<Vec<_>>()
        );
        println!("postprocess {name}: {} values bit-exact", got.len());
    }
}

#[test]
fn launch_inputs_are_validated_before_the_gpu_is_touched() {
    let Some(stream) = gpu_stream() else { return };
    let a = stream.alloc_zeros::<bf16>(64 * 128).unwrap();
    let mut d = stream.alloc_zeros::<f32>(63).unwrap();
    let err =
        run_preprocess(&stream, &a.as_view(), &a.as_view(), &mut d.as_view_mut(), 1).unwrap_err();
    assert!(
        matches!(err, RuntimeError::Input { field: "delta", .. }),
        "{err}"
    );
    let pool = stream.alloc_zeros::<f32>(100 * 512).unwrap();
    let mut out = stream.alloc_zeros::<bf16>(100 * 512).unwrap();
    let mut dq = stream.alloc_zeros::<bf16>(0).unwrap();
    let (mut o2, dq_pool) = (
        stream.alloc_zeros::<bf16>(100 * 512).unwrap(),
        stream.alloc_zeros::<bf16>(0).unwrap(),
    );
    let err = run_postprocess(
        &stream,
        &dq_pool.as_view(),
        &pool.as_view(),
        &pool.as_view(),
        &mut dq.as_view_mut(),
        &mut out.as_view_mut(),
        &mut o2.as_view_mut(),
        0,
        100,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            RuntimeError::Input {
                field: "workspace_rows",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn jit_failures_carry_the_driver_log_and_unknown_archs_are_named() {
    let Some(stream) = gpu_stream() else { return };
    let dev = Device::of(stream.context()).unwrap();
    let cc = dev.capability();
    let broken = ".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry broken() { bogus.instruction; }\n";
    match dev.function("broken", &[(cc, broken)]) {
        Err(RuntimeError::Jit { log, .. }) => {
            assert!(log.contains("bogus") || log.contains("error"), "log: {log}");
            println!("JIT log: {log}");
        }
        other => panic!("expected a JIT error, got {other:?}"),
    }
    match dev.function("other_arch", &[((1, 0), broken)]) {
        Err(e @ RuntimeError::UnsupportedArch { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("{}.{}", cc.0, cc.1)) && msg.contains("1.0"),
                "{msg}"
            );
        }
        other => panic!("expected UnsupportedArch, got {other:?}"),
    }
    println!("device: capability {cc:?}, {} SMs", dev.sm_count());
}

#[test]
fn staged_uploads_arrive_whole_and_in_order() {
    use cudarc::driver::DevicePtr;
    use msa_runtime::{Backend, CudaBackend};
    let Some(stream) = gpu_stream() else { return };
    let mut backend = CudaBackend::new(&stream).unwrap();
    // Below the staging threshold, one chunk, several chunks, and enough uploads to go round
    // the staging ring more than once before the stream runs them (the host must wait for a
    // buffer's previous copy before refilling it).
    let sizes = [
        100_000usize,
        (1 << 20) + 3,
        (8 << 20) - 1,
        (8 << 20) + 5,
        (20 << 20) + 7,
        (3 << 20) + 1,
        (9 << 20) + 2,
    ];
    let mut rng = Rng::new(20_261_202);
    let data: Vec<Vec<u8>> = sizes
        .iter()
        .map(|&n| (0..n).map(|_| rng.next_u64() as u8).collect())
        .collect();
    let bufs: Vec<_> = sizes
        .iter()
        .map(|&n| stream.alloc_zeros::<u8>(n).unwrap())
        .collect();
    for round in 0..2 {
        for (d, b) in data.iter().zip(&bufs) {
            // The host copy is dropped right after the call: the upload must not read it later.
            let host: Vec<u8> = d.iter().map(|x| x.wrapping_add(round)).collect();
            backend
                .upload("staged", b.device_ptr(&stream).0, &host)
                .unwrap();
        }
        for (d, b) in data.iter().zip(&bufs) {
            let got = stream.clone_dtoh(b).unwrap();
            let want: Vec<u8> = d.iter().map(|x| x.wrapping_add(round)).collect();
            assert!(got == want, "{} bytes, round {round}: differ", d.len());
        }
    }
}

#[test]
fn forked_uploads_follow_earlier_work_and_precede_work_after_the_join() {
    use cudarc::driver::DevicePtr;
    use msa_runtime::{Backend, CudaBackend};
    let Some(stream) = gpu_stream() else { return };
    let mut backend = CudaBackend::new(&stream).unwrap();
    let n = (12 << 20) + 9; // two staging chunks and a tail
    let mut rng = Rng::new(20_261_210);
    let host: Vec<u8> = (0..n).map(|_| (rng.next_u64() as u8) | 1).collect();
    let dst = stream.alloc_zeros::<u8>(n).unwrap();
    let seen = stream.alloc_zeros::<u8>(n).unwrap();
    let other = stream.alloc_zeros::<u8>(64 << 20).unwrap();
    let (dst_p, seen_p) = (dst.device_ptr(&stream).0, seen.device_ptr(&stream).0);
    let other_p = other.device_ptr(&stream).0;
    for round in 0..3u8 {
        let bytes: Vec<u8> = host.iter().map(|x| x.wrapping_add(2 * round)).collect();
        // Before the fork, on the stream: the upload must land after this zeroing.
        backend.zero("dst", dst_p, n).unwrap();
        backend.fork_uploads().unwrap();
        backend.upload("forked", dst_p, &bytes).unwrap();
        // Work between fork and join that leaves `dst` alone (as the preprocess does).
        backend.zero("other", other_p, 64 << 20).unwrap();
        backend.join_uploads().unwrap();
        // After the join, on the stream: this copy must see the whole upload.
        backend.copy("seen", seen_p, dst_p, n).unwrap();
        let got = stream.clone_dtoh(&seen).unwrap();
        let wrong = got.iter().zip(&bytes).filter(|(a, b)| a != b).count();
        assert_eq!(wrong, 0, "round {round}: {wrong} of {n} bytes differ");
    }
    // Joining without a fork is a no-op.
    backend.join_uploads().unwrap();
}
