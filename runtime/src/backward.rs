//! The MSA backward host flow (seed-design §1.5, §3.1): validation, TMA descriptors, the cached
//! gradient workspace and the launch sequence
//! `preprocess → zero pools → task build → main kernel → postprocess`, all on one stream and
//! without a host sync.
//!
//! [`MsaBackward`] owns the workspace of one device context and reuses it across calls; the free
//! function [`run_backward`] keeps one per device ordinal.

use crate::contract::{BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS};
use crate::device::{driver_present, Device};
use crate::error::RuntimeError;
use crate::kernels::{
    bwd_postprocess, bwd_preprocess, msa_backward_sm100, msa_backward_sm90, task_assign_segments,
    task_scan_bins, task_scan_work, task_scatter_tables,
};
use crate::ops::{check_len, run_postprocess, run_preprocess};
use crate::schedule::Schedule;
use crate::tasks::{DeviceSchedule, TaskBuildSizes, TaskWorkspace};
use crate::tma::TensorMap;
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DeviceSlice,
};
use half::bf16;
use std::collections::HashMap;
use std::mem::{size_of, ManuallyDrop, MaybeUninit};
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, OnceLock};

/// Elements of one token's query-side row `[64, 128]` (q, dO, O, dQ).
const Q_ROW: usize = NUM_Q_HEADS * HEAD_DIM;
/// Elements of one workspace row `[4, 128]` (K, V, dK, dV).
const KV_ROW: usize = NUM_KV_HEADS * HEAD_DIM;
/// Workspace regions start on 256-byte boundaries (seed-design §3.1).
const REGION_ALIGN: usize = 256;
/// TMA and the 128-bit vector loads of the small kernels need 16-byte aligned bases.
const BASE_ALIGN: u64 = 16;

// ---------------------------------------------------------------------------------------------
// Tensor maps

/// Parameters of one rank-3 bf16 tiled tensor map, innermost dimension first, in the form
/// `cuTensorMapEncodeTiled` takes them. All maps use swizzle 128B, no interleave, L2 promotion
/// 256B and OOB fill NONE (out-of-bounds elements read as zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileMapSpec {
    /// The tensor the map describes; error messages name it.
    pub map: &'static str,
    /// Elements per dimension, innermost first.
    pub global_dim: [u64; 3],
    /// Byte strides of dimensions 1 and 2 (dimension 0 is contiguous).
    pub global_strides: [u64; 2],
    /// The box (tile) one TMA load moves, innermost first.
    pub box_dim: [u32; 3],
    /// Element strides inside the box.
    pub element_strides: [u32; 3],
}

impl TileMapSpec {
    /// The map of a query-side tensor `[T, 64, 128]` bf16 (`q`, `grad_out`): globalDim
    /// `[128, 64, T]`, strides `[256, 16384]` bytes, box `[64, 16, 1]` = 16 heads × 64 d of one
    /// token, the K-major SW128 sub-block the MMA reads (seed-design §3.3).
    ///
    /// # Errors
    /// [`RuntimeError::TensorMap`] unless `1 <= num_tokens <= 2^32`.
    pub fn query_rows(map: &'static str, num_tokens: usize) -> Result<Self, RuntimeError> {
        if num_tokens == 0 || num_tokens as u64 > 1 << 32 {
            return Err(RuntimeError::TensorMap {
                map,
                what: "token count T (globalDim[2])",
                found: num_tokens.to_string(),
                expected: "1 <= T <= 2^32".into(),
            });
        }
        Ok(TileMapSpec {
            map,
            global_dim: [HEAD_DIM as u64, NUM_Q_HEADS as u64, num_tokens as u64],
            global_strides: [(HEAD_DIM * 2) as u64, (Q_ROW * 2) as u64],
            box_dim: [64, 16, 1],
            element_strides: [1, 1, 1],
        })
    }

    /// The map of an aligned key-side tensor `[W, 4, 128]` bf16 (`k_aligned`, `v_aligned`):
    /// globalDim `[128, 4, W]`, strides `[256, 1024]` bytes, box `[64, 1, 128]` = one 128-key
    /// block of one kv head, 64 d wide.
    ///
    /// # Errors
    /// [`RuntimeError::TensorMap`] unless `W` is a positive multiple of 128 and at most 2^32
    /// (every key block must be a full tile, seed-design §1.5).
    pub fn key_rows(map: &'static str, workspace_rows: usize) -> Result<Self, RuntimeError> {
        if workspace_rows == 0
            || !workspace_rows.is_multiple_of(BLOCK_SIZE)
            || workspace_rows as u64 > 1 << 32
        {
            return Err(RuntimeError::TensorMap {
                map,
                what: "workspace rows W (globalDim[2])",
                found: workspace_rows.to_string(),
                expected: "a positive multiple of 128, at most 2^32".into(),
            });
        }
        Ok(TileMapSpec {
            map,
            global_dim: [HEAD_DIM as u64, NUM_KV_HEADS as u64, workspace_rows as u64],
            global_strides: [(HEAD_DIM * 2) as u64, (KV_ROW * 2) as u64],
            box_dim: [64, 1, BLOCK_SIZE as u32],
            element_strides: [1, 1, 1],
        })
    }

    /// Checks the parameters and `base` against the rules of `cuTensorMapEncodeTiled` for bf16,
    /// no interleave and swizzle 128B, so that a bad input gets a precise error instead of the
    /// driver's bare `CUDA_ERROR_INVALID_VALUE`.
    ///
    /// # Errors
    /// [`RuntimeError::TensorMap`] naming the first violated rule.
    pub fn validate(&self, base: u64) -> Result<(), RuntimeError> {
        let fail = |what: &'static str, found: String, expected: &str| {
            Err(RuntimeError::TensorMap {
                map: self.map,
                what,
                found,
                expected: expected.into(),
            })
        };
        if base == 0 || !base.is_multiple_of(BASE_ALIGN) {
            return fail(
                "base address",
                format!("{base:#x}"),
                "a non-null, 16-byte aligned device address",
            );
        }
        for &d in &self.global_dim {
            if d == 0 || d > 1 << 32 {
                return fail(
                    "globalDim",
                    format!("{:?}", self.global_dim),
                    "each in 1..=2^32",
                );
            }
        }
        for &s in &self.global_strides {
            if !s.is_multiple_of(16) || s >= 1 << 40 {
                return fail(
                    "globalStrides",
                    format!("{:?}", self.global_strides),
                    "multiples of 16 bytes below 2^40",
                );
            }
        }
        for &b in &self.box_dim {
            if b == 0 || b > 256 {
                return fail("boxDim", format!("{:?}", self.box_dim), "each in 1..=256");
            }
        }
        // Swizzle 128B: the inner box row is at most the 128-byte swizzle span, and (no
        // interleave) its byte size must be a multiple of 16.
        let inner_bytes = self.box_dim[0] as usize * size_of::<bf16>();
        if inner_bytes > 128 || !inner_bytes.is_multiple_of(16) {
            return fail(
                "boxDim[0]",
                format!("{} ({inner_bytes} bytes)", self.box_dim[0]),
                "a multiple of 16 bytes, at most 128 bytes (swizzle 128B)",
            );
        }
        for &e in &self.element_strides {
            if e == 0 || e > 8 {
                return fail(
                    "elementStrides",
                    format!("{:?}", self.element_strides),
                    "each in 1..=8",
                );
            }
        }
        Ok(())
    }

    /// Validates, then encodes the map over the device address `base`.
    ///
    /// Encoding only packs the parameters; the memory is read by the kernel that receives the
    /// map, which must keep `base` alive and sized for [`TileMapSpec::bytes`].
    ///
    /// # Errors
    /// [`RuntimeError::TensorMap`] from [`TileMapSpec::validate`], [`RuntimeError::NoDriver`]
    /// without libcuda, and [`RuntimeError::TensorMapEncode`] when the driver refuses.
    pub fn encode(&self, base: u64) -> Result<TensorMap, RuntimeError> {
        self.validate(base)?;
        if !driver_present() {
            return Err(RuntimeError::NoDriver);
        }
        let mut map = MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: every array has `rank` (or `rank - 1` for the strides) entries and outlives
        // the call; the driver writes the 128-byte descriptor into `map` and reads no memory
        // at `base`.
        let result = unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                3,
                base as *mut std::ffi::c_void,
                self.global_dim.as_ptr(),
                self.global_strides.as_ptr(),
                self.box_dim.as_ptr(),
                self.element_strides.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        result
            .result()
            .map_err(|source| RuntimeError::TensorMapEncode {
                map: self.map,
                params: format!(
                    "base {base:#x}, globalDim {:?}, globalStrides {:?}, boxDim {:?}",
                    self.global_dim, self.global_strides, self.box_dim
                ),
                source,
            })?;
        // SAFETY: the driver initialised the descriptor on success (and it was zeroed before).
        Ok(TensorMap(unsafe { map.assume_init() }))
    }

    /// Bytes of the tensor the map spans: `globalDim[2] · globalStrides[1]`.
    pub fn bytes(&self) -> u64 {
        self.global_dim[2] * self.global_strides[1]
    }
}

// ---------------------------------------------------------------------------------------------
// The gradient workspace

/// Byte offsets of the regions of the gradient workspace (seed-design §3.1), each rounded up to
/// 256 bytes: the bf16 dQ pool `[T, 32, 128, 2]`, the fp32 dK then dV pools `[W, 4, 128]` and
/// delta fp32 `[T, 64]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLayout {
    /// Tokens `T` the regions are sized for.
    pub num_tokens: usize,
    /// Workspace rows `W` the regions are sized for.
    pub workspace_rows: usize,
    /// Offset of the dQ pool.
    pub dq_pool: usize,
    /// Offset of the dK pool.
    pub dk_pool: usize,
    /// Offset of the dV pool.
    pub dv_pool: usize,
    /// Offset of delta.
    pub delta: usize,
    /// Total bytes (a multiple of 256).
    pub bytes: usize,
}

impl PoolLayout {
    /// Lays out the regions for `num_tokens` tokens and `workspace_rows` rows.
    ///
    /// # Errors
    /// [`RuntimeError::Input`] if the byte count overflows `usize`.
    pub fn new(num_tokens: usize, workspace_rows: usize) -> Result<Self, RuntimeError> {
        let overflow = || {
            RuntimeError::input(
                "schedule",
                format!("T = {num_tokens}, W = {workspace_rows}"),
                "a gradient workspace whose byte size fits in usize",
            )
        };
        let dq_bytes = num_tokens
            .checked_mul(Q_ROW * size_of::<bf16>())
            .ok_or_else(overflow)?;
        let kv_bytes = workspace_rows
            .checked_mul(KV_ROW * size_of::<f32>())
            .ok_or_else(overflow)?;
        let delta_bytes = num_tokens
            .checked_mul(NUM_Q_HEADS * size_of::<f32>())
            .ok_or_else(overflow)?;
        let mut at = 0usize;
        let mut take = |bytes: usize| -> Result<usize, RuntimeError> {
            let start = at;
            at = at
                .checked_add(bytes)
                .and_then(|end| end.checked_next_multiple_of(REGION_ALIGN))
                .ok_or_else(overflow)?;
            Ok(start)
        };
        let dq_pool = take(dq_bytes)?;
        let dk_pool = take(kv_bytes)?;
        let dv_pool = take(kv_bytes)?;
        let delta = take(delta_bytes)?;
        Ok(PoolLayout {
            num_tokens,
            workspace_rows,
            dq_pool,
            dk_pool,
            dv_pool,
            delta,
            bytes: at,
        })
    }
}

/// A typed window over part of an allocation another `CudaSlice` owns. It is leaked on drop,
/// so only the owner frees the memory (the idea of `TaskWorkspace`'s regions): separate
/// windows can be borrowed mutably at the same time, which one slice's `slice_mut` cannot.
struct Window<T>(ManuallyDrop<CudaSlice<T>>);

impl<T> Window<T> {
    /// # Safety
    /// `[base + offset, base + offset + len·size_of::<T>())` must lie inside one device
    /// allocation that outlives the window, overlap no other window, and be aligned for `T`.
    unsafe fn new(stream: &Arc<CudaStream>, base: u64, offset: usize, len: usize) -> Self {
        Window(ManuallyDrop::new(
            stream.upgrade_device_ptr::<T>(base + offset as u64, len),
        ))
    }
}

impl<T> Deref for Window<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.0
    }
}

impl<T> DerefMut for Window<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.0
    }
}

impl<T> Drop for Window<T> {
    fn drop(&mut self) {
        // SAFETY: the window is not used after this. `leak` makes the window's stream wait on
        // its recorded uses and releases its events without freeing the owner's memory.
        let slice = unsafe { ManuallyDrop::take(&mut self.0) };
        slice.leak();
    }
}

/// The one raw allocation of the gradient pools and delta, carved by a [`PoolLayout`].
///
/// Field order matters: the windows drop (leak) before `storage` frees the memory.
struct GradientPools {
    layout: PoolLayout,
    dq_pool: Window<bf16>,
    dk_pool: Window<f32>,
    dv_pool: Window<f32>,
    delta: Window<f32>,
    // Never read: it owns the memory the windows view and frees it last.
    #[allow(dead_code)]
    storage: CudaSlice<u64>,
}

impl GradientPools {
    fn new(stream: &Arc<CudaStream>, layout: PoolLayout) -> Result<Self, RuntimeError> {
        // u64 words: the 256-byte rounded total is a whole number of them.
        // SAFETY: left uninitialised on purpose; every call zeroes the pools it uses and the
        // preprocess writes every delta element it uses before anything reads them.
        let storage = unsafe { stream.alloc::<u64>(layout.bytes / size_of::<u64>()) }
            .map_err(RuntimeError::driver("cuMemAlloc(gradient workspace)"))?;
        let (base, guard) = storage.device_ptr(stream);
        drop(guard);
        let (t, w) = (layout.num_tokens, layout.workspace_rows);
        // SAFETY: PoolLayout's regions are disjoint, 256-byte aligned and end at or before
        // `layout.bytes`; `storage` is declared after the windows, so it outlives them.
        let pools = unsafe {
            GradientPools {
                dq_pool: Window::new(stream, base, layout.dq_pool, t * Q_ROW),
                dk_pool: Window::new(stream, base, layout.dk_pool, w * KV_ROW),
                dv_pool: Window::new(stream, base, layout.dv_pool, w * KV_ROW),
                delta: Window::new(stream, base, layout.delta, t * NUM_Q_HEADS),
                layout,
                storage,
            }
        };
        Ok(pools)
    }

    fn fits(&self, num_tokens: usize, workspace_rows: usize) -> bool {
        num_tokens <= self.layout.num_tokens && workspace_rows <= self.layout.workspace_rows
    }
}

// ---------------------------------------------------------------------------------------------
// The backward

/// The gradients of one backward call, all bf16.
pub struct Gradients {
    /// `dQ`, compact `[T, 64, 128]`.
    pub dq: CudaSlice<bf16>,
    /// `dK` in the aligned workspace layout `[W, 4, 128]`; padding rows are zero.
    pub dk_aligned: CudaSlice<bf16>,
    /// `dV` in the aligned workspace layout `[W, 4, 128]`; padding rows are zero.
    pub dv_aligned: CudaSlice<bf16>,
}

/// The MSA backward of one device context with its cached workspace.
///
/// Holds the gradient workspace (one allocation: dQ pool, dK/dV pools, delta), the task-build
/// workspace and the main kernel's function. The gradient workspace grows to the largest
/// `(T, W)` seen and never shrinks; the task workspace is reused while its sizes fit. Calling
/// with a stream of another context drops the cache and starts over on that context.
#[derive(Default)]
pub struct MsaBackward {
    context: Option<Arc<CudaContext>>,
    main: Option<(MainKernel, CudaFunction)>,
    aux_loaded: bool,
    pools: Option<GradientPools>,
    tasks: Option<TaskWorkspace>,
    // The last call's schedule upload, kept until the next call so its buffers are freed
    // stream-ordered after the kernels that read them, never by a synchronizing free here.
    schedule: Option<DeviceSchedule>,
    allocations: usize,
}

impl std::fmt::Debug for MsaBackward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MsaBackward")
            .field("ordinal", &self.context.as_ref().map(|c| c.ordinal()))
            .field("capacity", &self.capacity())
            .field("allocations", &self.allocations)
            .finish()
    }
}

/// The capabilities the main kernel has a variant for, for error messages.
const SUPPORTED: &str = "9.0 (msa_backward_sm90), 10.0 (msa_backward_sm100)";

/// Which main kernel a device runs; both take the same parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MainKernel {
    Sm90,
    Sm100,
}

/// Checks that `view` lives on the stream's context.
fn check_context<T>(
    field: &'static str,
    view: &CudaView<'_, T>,
    stream: &CudaStream,
) -> Result<(), RuntimeError> {
    let (have, want) = (view.stream().context(), stream.context());
    if have.cu_ctx() == want.cu_ctx() {
        return Ok(());
    }
    let found = if have.ordinal() == want.ordinal() {
        format!("another context on device {}", have.ordinal())
    } else {
        format!("device {}", have.ordinal())
    };
    Err(RuntimeError::input(
        field,
        found,
        format!("memory of the stream's context (device {})", want.ordinal()),
    ))
}

/// Checks the 16-byte alignment of a device address.
fn check_aligned(field: &'static str, ptr: u64) -> Result<(), RuntimeError> {
    if ptr.is_multiple_of(BASE_ALIGN) {
        Ok(())
    } else {
        Err(RuntimeError::input(
            field,
            format!("base address {ptr:#x}"),
            "a 16-byte aligned device address",
        ))
    }
}

impl MsaBackward {
    /// An empty cache; nothing is allocated until the first [`MsaBackward::run`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Device allocations the cache has made so far (gradient and task workspaces). A repeated
    /// call with the same schedule shape makes none.
    pub fn allocation_count(&self) -> usize {
        self.allocations
    }

    /// `(T, W)` the gradient workspace is sized for, if allocated.
    pub fn capacity(&self) -> Option<(usize, usize)> {
        self.pools
            .as_ref()
            .map(|p| (p.layout.num_tokens, p.layout.workspace_rows))
    }

    /// Runs the backward and returns `dq [T,64,128]`, `dk_aligned`, `dv_aligned [W,4,128]`.
    ///
    /// Inputs (seed-design §1.5): `q`, `grad_out`, `out` `[T, 64, 128]` bf16, `k_aligned`,
    /// `v_aligned` `[W, 4, 128]` bf16 in the aligned workspace layout, `lse [T, 64]` fp32, with
    /// `T = schedule.num_tokens()` and `W = schedule.workspace_rows()`. Every base address must
    /// be 16-byte aligned and every buffer must belong to the stream's context.
    ///
    /// Everything is enqueued on `stream` (preprocess, pool zeroing, task build, main kernel,
    /// postprocess) without a host sync. All checks, kernel loading and workspace allocation
    /// happen before the first enqueue, so an error never leaves the stream half-written.
    ///
    /// # Errors
    /// - [`RuntimeError::Input`] naming the field for a wrong length, a misaligned base, a
    ///   buffer of another context, or a workspace too large to address.
    /// - [`RuntimeError::UnsupportedArch`] on any capability but 9.0 (`msa_backward_sm90`) and
    ///   10.0 (`msa_backward_sm100`, which has been assembled by ptxas but never executed).
    /// - [`RuntimeError::TensorMap`]/[`RuntimeError::TensorMapEncode`],
    ///   [`RuntimeError::TooManyBins`], [`RuntimeError::Jit`] and [`RuntimeError::Driver`].
    #[allow(clippy::too_many_arguments)] // the seed's run_backward signature
    pub fn run(
        &mut self,
        stream: &Arc<CudaStream>,
        q: &CudaView<'_, bf16>,
        k_aligned: &CudaView<'_, bf16>,
        v_aligned: &CudaView<'_, bf16>,
        grad_out: &CudaView<'_, bf16>,
        lse: &CudaView<'_, f32>,
        out: &CudaView<'_, bf16>,
        schedule: &Schedule,
    ) -> Result<Gradients, RuntimeError> {
        let t = schedule.num_tokens();
        let w = schedule.workspace_rows();

        // 1. Shapes and devices: pure host checks.
        let q_len = t.checked_mul(Q_ROW);
        let kv_len = w.checked_mul(KV_ROW);
        let (Some(q_len), Some(kv_len)) = (q_len, kv_len) else {
            return Err(RuntimeError::input(
                "schedule",
                format!("T = {t}, W = {w}"),
                "element counts that fit in usize",
            ));
        };
        check_len("q", q.len(), q_len, "[T, 64, 128] bf16")?;
        check_len("k_aligned", k_aligned.len(), kv_len, "[W, 4, 128] bf16")?;
        check_len("v_aligned", v_aligned.len(), kv_len, "[W, 4, 128] bf16")?;
        check_len("grad_out", grad_out.len(), q_len, "[T, 64, 128] bf16")?;
        check_len("lse", lse.len(), t * NUM_Q_HEADS, "[T, 64] f32")?;
        check_len("out", out.len(), q_len, "[T, 64, 128] bf16")?;
        if t > 0 && (w == 0 || !w.is_multiple_of(BLOCK_SIZE)) {
            return Err(RuntimeError::input(
                "schedule.workspace_rows",
                w,
                "a positive multiple of 128",
            ));
        }
        check_context("q", q, stream)?;
        check_context("k_aligned", k_aligned, stream)?;
        check_context("v_aligned", v_aligned, stream)?;
        check_context("grad_out", grad_out, stream)?;
        check_context("lse", lse, stream)?;
        check_context("out", out, stream)?;
        // Base addresses. The guards of the four TMA-read tensors are held until the main
        // kernel is enqueued: cudarc cannot see reads through a tensor map, so the guards
        // record those reads for its cross-stream tracking. (Taking a pointer enqueues at most
        // an event wait, in multi-stream mode, never a write.)
        let (q_ptr, q_guard) = q.device_ptr(stream);
        let (do_ptr, do_guard) = grad_out.device_ptr(stream);
        let (k_ptr, k_guard) = k_aligned.device_ptr(stream);
        let (v_ptr, v_guard) = v_aligned.device_ptr(stream);
        if t > 0 {
            check_aligned("q", q_ptr)?;
            check_aligned("k_aligned", k_ptr)?;
            check_aligned("v_aligned", v_ptr)?;
            check_aligned("grad_out", do_ptr)?;
            check_aligned("lse", lse.device_ptr(stream).0)?;
            check_aligned("out", out.device_ptr(stream).0)?;
        }

        // 2. Architecture dispatch and kernel loading (JIT errors surface here).
        let device = Device::of(stream.context())?;
        self.bind(stream.context());
        let (main_kind, main) = self.main_function(&device)?;
        if t == 0 {
            // No tokens: nothing to launch (a validated Schedule always has T >= 1).
            let alloc = |source| RuntimeError::Driver {
                call: "cuMemAlloc(gradients)",
                source,
            };
            return Ok(Gradients {
                dq: stream.null().map_err(alloc)?,
                dk_aligned: stream.alloc_zeros(kv_len).map_err(alloc)?,
                dv_aligned: stream.alloc_zeros(kv_len).map_err(alloc)?,
            });
        }
        self.load_aux(&device)?;
        let sizes = TaskBuildSizes::new(schedule, device.sm_count())?;
        let grid = u32::try_from(sizes.grid_launch)
            .ok()
            .filter(|&g| g <= i32::MAX as u32)
            .ok_or_else(|| {
                RuntimeError::input(
                    "schedule",
                    format!("{} CTAs for the main kernel", sizes.grid_launch),
                    "a grid of at most 2^31-1 CTAs",
                )
            })?;

        // 3. Tensor maps.
        let tmap_q = TileMapSpec::query_rows("q", t)?.encode(q_ptr)?;
        let tmap_do = TileMapSpec::query_rows("grad_out", t)?.encode(do_ptr)?;
        let tmap_k = TileMapSpec::key_rows("k_aligned", w)?.encode(k_ptr)?;
        let tmap_v = TileMapSpec::key_rows("v_aligned", w)?.encode(v_ptr)?;

        // 4. Workspaces and outputs (allocations only; nothing is written yet).
        let pools = ensure_pools(&mut self.pools, &mut self.allocations, stream, t, w)?;
        let tasks = ensure_tasks(
            &mut self.tasks,
            &mut self.allocations,
            stream,
            sizes,
            schedule.work_capacity(),
        )?;
        let alloc = |source| RuntimeError::Driver {
            call: "cuMemAlloc(gradients)",
            source,
        };
        // SAFETY: the postprocess writes every element of the three outputs.
        let (mut dq, mut dk, mut dv) = unsafe {
            (
                stream.alloc::<bf16>(q_len).map_err(alloc)?,
                stream.alloc::<bf16>(kv_len).map_err(alloc)?,
                stream.alloc::<bf16>(kv_len).map_err(alloc)?,
            )
        };

        // 5. The launch sequence (seed-design §3.1).
        let delta_len = t * NUM_Q_HEADS;
        run_preprocess(
            stream,
            out,
            grad_out,
            &mut pools.delta.slice_mut(..delta_len),
            t,
        )?;
        let zero = |source| RuntimeError::Driver {
            call: "cuMemsetD8Async(gradient pools)",
            source,
        };
        stream
            .memset_zeros(&mut pools.dq_pool.slice_mut(..q_len))
            .map_err(zero)?;
        stream
            .memset_zeros(&mut pools.dk_pool.slice_mut(..kv_len))
            .map_err(zero)?;
        stream
            .memset_zeros(&mut pools.dv_pool.slice_mut(..kv_len))
            .map_err(zero)?;
        let dev_schedule = DeviceSchedule::upload(stream, schedule)?;
        tasks.build(stream, &dev_schedule)?;
        if grid > 0 {
            // SAFETY: the maps span q/grad_out [T,64,128] and k/v [W,4,128], whose lengths
            // were checked; lse, delta and the pools are [T,64], [T,64], [T,64,128] and
            // [W,4,128]; the task tables come from a workspace built for `sizes`, whose grid
            // bound is `grid`.
            let launch = match main_kind {
                MainKernel::Sm90 => msa_backward_sm90::launch,
                MainKernel::Sm100 => msa_backward_sm100::launch,
            };
            unsafe {
                launch(
                    stream,
                    &main,
                    (grid, 1, 1),
                    &tmap_q,
                    &tmap_do,
                    &tmap_k,
                    &tmap_v,
                    lse,
                    &pools.delta.slice(..delta_len),
                    &tasks.task_meta().as_view(),
                    &tasks.task_qrows().as_view(),
                    &tasks.task_qpos().as_view(),
                    &tasks.desc().as_view(),
                    &mut pools.dq_pool.slice_mut(..q_len),
                    &mut pools.dk_pool.slice_mut(..kv_len),
                    &mut pools.dv_pool.slice_mut(..kv_len),
                )
            }
            .map_err(RuntimeError::driver(
                "cuLaunchKernel(msa_backward main kernel)",
            ))?;
        }
        drop((q_guard, do_guard, k_guard, v_guard));
        run_postprocess(
            stream,
            &pools.dq_pool.slice(..q_len),
            &pools.dk_pool.slice(..kv_len),
            &pools.dv_pool.slice(..kv_len),
            &mut dq.as_view_mut(),
            &mut dk.as_view_mut(),
            &mut dv.as_view_mut(),
            t,
            w,
        )?;
        // Replacing the previous upload frees it stream-ordered behind that call's kernels.
        self.schedule = Some(dev_schedule);
        Ok(Gradients {
            dq,
            dk_aligned: dk,
            dv_aligned: dv,
        })
    }

    /// Drops everything cached for another context; the buffers belong to that context.
    fn bind(&mut self, ctx: &Arc<CudaContext>) {
        if self
            .context
            .as_ref()
            .is_some_and(|c| c.cu_ctx() == ctx.cu_ctx())
        {
            return;
        }
        let allocations = self.allocations;
        *self = MsaBackward {
            context: Some(ctx.clone()),
            allocations,
            ..MsaBackward::default()
        };
    }

    /// The main kernel for the device's capability, with its dynamic shared memory limit set
    /// (once; the attribute belongs to the loaded function).
    fn main_function(
        &mut self,
        device: &Device,
    ) -> Result<(MainKernel, CudaFunction), RuntimeError> {
        if let Some(main) = &self.main {
            return Ok(main.clone());
        }
        let (major, minor) = device.capability();
        let ordinal = device.context().ordinal();
        let (kind, name, variants, smem) = match (major, minor) {
            (9, 0) => (
                MainKernel::Sm90,
                msa_backward_sm90::NAME,
                msa_backward_sm90::VARIANTS,
                msa_backward_sm90::DYNAMIC_SHARED_BYTES,
            ),
            (10, 0) => (
                MainKernel::Sm100,
                msa_backward_sm100::NAME,
                msa_backward_sm100::VARIANTS,
                msa_backward_sm100::DYNAMIC_SHARED_BYTES,
            ),
            _ => {
                return Err(RuntimeError::UnsupportedArch {
                    kernel: "msa_backward",
                    ordinal,
                    major,
                    minor,
                    supported: SUPPORTED.into(),
                })
            }
        };
        let f = device.function(name, variants)?;
        f.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(RuntimeError::driver(
            "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
        ))?;
        self.main = Some((kind, f.clone()));
        Ok((kind, f))
    }

    /// JIT-loads the helper kernels once, so a JIT failure surfaces before anything is
    /// enqueued rather than in the middle of the sequence.
    fn load_aux(&mut self, device: &Device) -> Result<(), RuntimeError> {
        if self.aux_loaded {
            return Ok(());
        }
        let kernels: [(&'static str, Variants); 6] = [
            (bwd_preprocess::NAME, bwd_preprocess::VARIANTS),
            (bwd_postprocess::NAME, bwd_postprocess::VARIANTS),
            (task_scan_work::NAME, task_scan_work::VARIANTS),
            (task_assign_segments::NAME, task_assign_segments::VARIANTS),
            (task_scan_bins::NAME, task_scan_bins::VARIANTS),
            (task_scatter_tables::NAME, task_scatter_tables::VARIANTS),
        ];
        for (name, variants) in kernels {
            device.function(name, variants)?;
        }
        self.aux_loaded = true;
        Ok(())
    }
}

/// The gradient pools, grown (never shrunk) to hold `(t, w)`.
fn ensure_pools<'a>(
    slot: &'a mut Option<GradientPools>,
    allocations: &mut usize,
    stream: &Arc<CudaStream>,
    t: usize,
    w: usize,
) -> Result<&'a mut GradientPools, RuntimeError> {
    let pools = match slot.take() {
        Some(p) if p.fits(t, w) => p,
        old => {
            let (ct, cw) = old
                .as_ref()
                .map_or((0, 0), |p| (p.layout.num_tokens, p.layout.workspace_rows));
            let layout = PoolLayout::new(t.max(ct), w.max(cw))?;
            // Free the smaller one first (stream-ordered) to keep the peak down.
            drop(old);
            let p = GradientPools::new(stream, layout)?;
            *allocations += 1;
            p
        }
    };
    Ok(slot.insert(pools))
}

/// The task-build workspace, reused while it fits `sizes` exactly.
fn ensure_tasks<'a>(
    slot: &'a mut Option<TaskWorkspace>,
    allocations: &mut usize,
    stream: &Arc<CudaStream>,
    sizes: TaskBuildSizes,
    work_capacity: usize,
) -> Result<&'a mut TaskWorkspace, RuntimeError> {
    let tasks = match slot.take() {
        Some(ws) if ws.fits(&sizes, work_capacity) => ws,
        old => {
            drop(old);
            let ws = TaskWorkspace::new(stream, sizes, work_capacity)?;
            *allocations += 1;
            ws
        }
    };
    Ok(slot.insert(tasks))
}

/// The generated `VARIANTS` of a kernel: PTX per compute capability.
type Variants = &'static [((i32, i32), &'static str)];

/// One cached [`MsaBackward`] per device ordinal, for [`run_backward`].
fn cache() -> &'static Mutex<HashMap<usize, Arc<Mutex<MsaBackward>>>> {
    static CACHE: OnceLock<Mutex<HashMap<usize, Arc<Mutex<MsaBackward>>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The MSA backward (seed-design §1.5 `run_backward`) with a process-wide workspace cache per
/// device ordinal; see [`MsaBackward::run`] for the inputs, the launch sequence and the errors.
///
/// Calls on the same device serialize on the cache's lock while they enqueue (the GPU work
/// itself is asynchronous).
#[allow(clippy::too_many_arguments)] // the seed's run_backward signature
pub fn run_backward(
    stream: &Arc<CudaStream>,
    q: &CudaView<'_, bf16>,
    k_aligned: &CudaView<'_, bf16>,
    v_aligned: &CudaView<'_, bf16>,
    grad_out: &CudaView<'_, bf16>,
    lse: &CudaView<'_, f32>,
    out: &CudaView<'_, bf16>,
    schedule: &Schedule,
) -> Result<Gradients, RuntimeError> {
    let entry = {
        let mut map = cache().lock().unwrap_or_else(|e| e.into_inner());
        map.entry(stream.context().ordinal()).or_default().clone()
    };
    // A panic mid-call leaves every cached field either valid or empty, so a poisoned lock is
    // safe to reuse.
    let mut backward = entry.lock().unwrap_or_else(|e| e.into_inner());
    backward.run(
        stream, q, k_aligned, v_aligned, grad_out, lse, out, schedule,
    )
}
