//! The MSA backward as a candle 0.11 `CustomOp3`, run zero-copy on candle's own CUDA stream
//! and checked against the f32 CPU reference (`msa_runtime::reference`) within the
//! tolerances of `docs/design.md` §4.3.
//!
//! candle and msa-runtime share one cudarc 0.19 (msa-runtime with `default-features = false`,
//! so that candle's `dynamic-linking` and CUDA version apply), so candle's `CudaSlice`s and
//! `Arc<CudaStream>` are passed to the runtime as they are:
//! - `q`, `grad_out`, `out` (the op's operands) and `lse` are read where candle keeps them;
//! - compact `k`, `v` are packed once, on the device, into the zero-padded aligned layout the
//!   kernel reads (`msa_runtime::to_aligned`; the padding contract of `BackwardBuffers`);
//! - the op's output is one flat buffer `[dQ | dK | dV]`: the backward writes dQ into it
//!   directly, and `from_aligned_on` writes the compact dK/dV rows from the kernel's aligned
//!   output; [`msa_backward`] hands back three views of it (`narrow`, no copy).
//!
//! Everything is enqueued on candle's stream, in its order, with no host sync; candle's next
//! ops on the results follow on the same stream.
//!
//! Build and run: `examples/candle/README.md`. Without a GPU it says so and exits.

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp3, DType, Device, Layout, Shape, Storage, Tensor,
};
use half::bf16;
use msa_runtime::cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut};
use msa_runtime::reference::{self, DK_TOLERANCE, DQ_TOLERANCE, DV_TOLERANCE};
use msa_runtime::{
    build_schedule, causal_support, from_aligned_on, to_aligned, BackwardBuffers, CudaBackend,
    MsaBackward, Schedule, Span, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS,
};
use std::sync::{Arc, Mutex};

/// Elements of one query-side token row `[64, 128]`.
const Q_ROW: usize = NUM_Q_HEADS * HEAD_DIM;
/// Elements of one key-side token row `[4, 128]`.
const KV_ROW: usize = NUM_KV_HEADS * HEAD_DIM;

/// The backward on `(q, grad_out, out)`; the other inputs and the schedule are held here.
struct MsaBackwardOp {
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    schedule: Arc<Schedule>,
    // The cached workspaces, reused by every call on candle's stream.
    backward: Arc<Mutex<MsaBackward>>,
}

fn wrap<E: std::error::Error + Send + Sync + 'static>(e: E) -> candle_core::Error {
    candle_core::Error::wrap(e)
}

/// The elements of a contiguous `storage` of `expected` elements, in place.
fn view<'a, T: candle_core::cuda_backend::CudaDType>(
    name: &str,
    storage: &'a CudaStorage,
    layout: &Layout,
    expected: usize,
) -> candle_core::Result<CudaView<'a, T>> {
    if !layout.is_contiguous() || layout.shape().elem_count() != expected {
        bail!(
            "msa-backward: `{name}` must be contiguous with {expected} elements, got shape {:?} \
             strides {:?}",
            layout.shape(),
            layout.stride()
        );
    }
    let start = layout.start_offset();
    Ok(storage.as_cuda_slice::<T>()?.slice(start..start + expected))
}

/// `f` on the CUDA storage of a held tensor.
fn with_cuda<R>(
    name: &str,
    t: &Tensor,
    f: impl FnOnce(&CudaStorage, &Layout) -> candle_core::Result<R>,
) -> candle_core::Result<R> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => f(s, layout),
        _ => bail!("msa-backward: `{name}` must be on a CUDA device"),
    }
}

/// A device span of a view, with the guard that records the access for cudarc's
/// cross-stream tracking (held until the work is enqueued).
fn span<'a, T>(v: &'a CudaView<'_, T>, stream: &'a CudaStream) -> (Span<T>, impl Drop + 'a) {
    let (addr, guard) = v.device_ptr(stream);
    (Span::new(addr, v.len()), guard)
}

impl CustomOp3 for MsaBackwardOp {
    fn name(&self) -> &'static str {
        "msa-backward"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        bail!("msa-backward runs on CUDA devices only")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        q_l: &Layout,
        grad_out: &CudaStorage,
        grad_out_l: &Layout,
        out: &CudaStorage,
        out_l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let s = &*self.schedule;
        let (t, w) = (s.num_tokens(), s.workspace_rows());
        let device = q.device().clone();
        // candle's stream: every launch below is enqueued there.
        let stream = device.cuda_stream();
        let q = view::<bf16>("q", q, q_l, t * Q_ROW)?;
        let grad_out = view::<bf16>("grad_out", grad_out, grad_out_l, t * Q_ROW)?;
        let out = view::<bf16>("out", out, out_l, t * Q_ROW)?;
        with_cuda("k", &self.k, |k, k_l| {
            with_cuda("v", &self.v, |v, v_l| {
                with_cuda("lse", &self.lse, |lse, lse_l| {
                    let k = view::<bf16>("k", k, k_l, t * KV_ROW)?;
                    let v = view::<bf16>("v", v, v_l, t * KV_ROW)?;
                    let lse = view::<f32>("lse", lse, lse_l, t * NUM_Q_HEADS)?;
                    let (k_aligned, v_aligned) = to_aligned(&stream, s, &k, &v).map_err(wrap)?;
                    // SAFETY: the backward's launches write every element: dQ, and dK/dV
                    // through the aligned buffers and `from_aligned_on`.
                    let alloc = |n: usize| unsafe { stream.alloc::<bf16>(n) }.map_err(wrap);
                    let (mut dk_aligned, mut dv_aligned) = (alloc(w * KV_ROW)?, alloc(w * KV_ROW)?);
                    let mut grads: CudaSlice<bf16> = alloc(t * (Q_ROW + 2 * KV_ROW))?;
                    let mut backend = CudaBackend::new(&stream).map_err(wrap)?;
                    {
                        let (ka, va) = (k_aligned.as_view(), v_aligned.as_view());
                        let (q, _g0) = span(&q, &stream);
                        let (ka, _g1) = span(&ka, &stream);
                        let (va, _g2) = span(&va, &stream);
                        let (grad_out, _g3) = span(&grad_out, &stream);
                        let (lse, _g4) = span(&lse, &stream);
                        let (out, _g5) = span(&out, &stream);
                        let (dka, _g6) = dk_aligned.device_ptr_mut(&stream);
                        let (dva, _g7) = dv_aligned.device_ptr_mut(&stream);
                        let (g, _g8) = grads.device_ptr_mut(&stream);
                        let dq = Span::new(g, t * Q_ROW);
                        let dk = Span::new(g + 2 * (t * Q_ROW) as u64, t * KV_ROW);
                        let dv = Span::new(dk.addr + 2 * (t * KV_ROW) as u64, t * KV_ROW);
                        let (dka, dva) = (Span::new(dka, w * KV_ROW), Span::new(dva, w * KV_ROW));
                        let io = BackwardBuffers {
                            q,
                            k_aligned: ka,
                            v_aligned: va,
                            grad_out,
                            lse,
                            out,
                            dq,
                            dk_aligned: dka,
                            dv_aligned: dva,
                        };
                        let mut backward = self.backward.lock().unwrap_or_else(|e| e.into_inner());
                        backward.run_on(&mut backend, &io, s).map_err(wrap)?;
                        from_aligned_on(&mut backend, s, dka, dva, dk, dv).map_err(wrap)?;
                    }
                    // The aligned buffers are freed stream-ordered, behind the launches.
                    drop((k_aligned, v_aligned, dk_aligned, dv_aligned));
                    let len = grads.len();
                    Ok((
                        CudaStorage::wrap_cuda_slice(grads, device.clone()),
                        Shape::from(len),
                    ))
                })
            })
        })
    }
}

/// The MSA backward on candle tensors: `q`, `grad_out`, `out` `[T, 64, 128]` bf16, compact
/// `k`, `v` `[T, 4, 128]` bf16 and `lse [T, 64]` f32 on one CUDA device, for `schedule`.
/// Returns compact `dq [T, 64, 128]`, `dk`, `dv [T, 4, 128]` bf16: views of one buffer.
#[allow(clippy::too_many_arguments)]
fn msa_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
    out: &Tensor,
    schedule: &Arc<Schedule>,
    backward: &Arc<Mutex<MsaBackward>>,
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let op = MsaBackwardOp {
        k: k.clone(),
        v: v.clone(),
        lse: lse.clone(),
        schedule: schedule.clone(),
        backward: backward.clone(),
    };
    let t = schedule.num_tokens();
    let flat = q.apply_op3_no_bwd(grad_out, out, &op)?;
    let dq = flat
        .narrow(0, 0, t * Q_ROW)?
        .reshape((t, NUM_Q_HEADS, HEAD_DIM))?;
    let dk = flat
        .narrow(0, t * Q_ROW, t * KV_ROW)?
        .reshape((t, NUM_KV_HEADS, HEAD_DIM))?;
    let dv =
        flat.narrow(0, t * (Q_ROW + KV_ROW), t * KV_ROW)?
            .reshape((t, NUM_KV_HEADS, HEAD_DIM))?;
    Ok((dq, dk, dv))
}

/// splitmix64 normals, bf16-rounded, with their exact f32 values.
fn normals(seed: u64, n: usize) -> (Vec<bf16>, Vec<f32>) {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    let b: Vec<bf16> = (0..n)
        .map(|_| {
            let (u1, u2) = (1.0 - next(), next());
            let x = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
            bf16::from_f64(x)
        })
        .collect();
    let f = b.iter().map(|x| x.to_f32()).collect();
    (b, f)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = match Device::new_cuda(0) {
        Ok(d) => d,
        Err(e) => {
            println!("no CUDA device ({e}); nothing to run");
            return Ok(());
        }
    };
    // Three documents, causal selection (every earlier block: at most 16 per query here).
    let cu = [0, 1000, 1996, 2100];
    let q2k = causal_support(&cu)?;
    let schedule = Arc::new(build_schedule(&q2k, &cu, 64)?);
    let t = schedule.num_tokens();

    let (q, q32) = normals(1, t * Q_ROW);
    let (k, k32) = normals(2, t * KV_ROW);
    let (v, v32) = normals(3, t * KV_ROW);
    let (grad_out, do32) = normals(4, t * Q_ROW);
    let fwd = reference::forward(&q32, &k32, &v32, &q2k, &cu)?;
    // The kernel sees the bf16 output; the reference backward gets the same values.
    let out: Vec<bf16> = fwd.out.iter().map(|&x| bf16::from_f32(x)).collect();
    let out32: Vec<f32> = out.iter().map(|x| x.to_f32()).collect();
    let expected = reference::backward(&q32, &k32, &v32, &q2k, &cu, &out32, &fwd.lse, &do32)?;

    let qs = (t, NUM_Q_HEADS, HEAD_DIM);
    let ks = (t, NUM_KV_HEADS, HEAD_DIM);
    let q = Tensor::from_vec(q, qs, &device)?;
    let k = Tensor::from_vec(k, ks, &device)?;
    let v = Tensor::from_vec(v, ks, &device)?;
    let grad_out = Tensor::from_vec(grad_out, qs, &device)?;
    let out = Tensor::from_vec(out, qs, &device)?;
    let lse = Tensor::from_vec(fwd.lse.clone(), (t, NUM_Q_HEADS), &device)?;

    let backward = Arc::new(Mutex::new(MsaBackward::new()));
    let mut failed = false;
    for call in 0..2 {
        let (dq, dk, dv) = msa_backward(&q, &k, &v, &grad_out, &lse, &out, &schedule, &backward)?;
        // candle's own ops continue on its stream, behind the backward.
        let got = |x: &Tensor| -> candle_core::Result<Vec<f32>> {
            x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
        };
        let checks = [
            (DQ_TOLERANCE.check("dq", &got(&dq)?, &expected.dq), "dq"),
            (DK_TOLERANCE.check("dk", &got(&dk)?, &expected.dk), "dk"),
            (DV_TOLERANCE.check("dv", &got(&dv)?, &expected.dv), "dv"),
        ];
        for (r, name) in checks {
            match r {
                Ok(stats) => println!("call {call}: {name} vs the CPU reference: {stats}"),
                Err(e) => {
                    println!("call {call}: FAILED {e}");
                    failed = true;
                }
            }
        }
    }
    let b = backward.lock().unwrap_or_else(|e| e.into_inner());
    println!(
        "T = {t}, W = {}, on candle's stream; workspace allocations over both calls: {}",
        schedule.workspace_rows(),
        b.allocation_count()
    );
    if failed {
        return Err("the backward on candle's stream does not match the CPU reference".into());
    }
    println!("ok");
    Ok(())
}
