//! The CUDA driver as a [`Backend`]: one stream of one context, kernels JIT-loaded through
//! [`Device`], memory as raw device addresses.
//!
//! Layer 4 of the crate (the CUDA backend): it uses layers 1 and 2 only.

use crate::backend::{Backend, KernelArg, KernelSpec, MapElem, TileMapSpec};
use crate::device::{driver_present, Device, STAGED_UPLOAD_MIN};
use crate::error::RuntimeError;
use crate::tma::TensorMap;
use cudarc::driver::{
    result, sys, CudaContext, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use std::mem::MaybeUninit;
use std::sync::Arc;

/// Work issued on one CUDA stream. Cheap to create: the device's facts and modules are
/// memoized per context by [`Device`].
#[derive(Debug, Clone)]
pub struct CudaBackend {
    stream: Arc<CudaStream>,
    device: Arc<Device>,
    // `cuStreamGetId`: unique over the process, also for the legacy and per-thread default
    // streams (whose handles are shared by every context or thread).
    stream_id: u64,
    // Between `fork_uploads` and `join_uploads`: the stream uploads go to.
    uploads: Option<Arc<CudaStream>>,
}

impl CudaBackend {
    /// The backend of `stream`.
    ///
    /// # Errors
    /// [`RuntimeError::Driver`] when the device's attributes or the stream's id cannot be
    /// read.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self, RuntimeError> {
        stream
            .context()
            .bind_to_thread()
            .map_err(RuntimeError::driver("cuCtxSetCurrent"))?;
        Ok(CudaBackend {
            stream: stream.clone(),
            device: Device::of(stream.context())?,
            stream_id: stream_id(stream.cu_stream())?,
            uploads: None,
        })
    }

    /// The backend of a stream another library owns (PyTorch, candle, burn/cubecl, a CUDA C++
    /// extension), given as its raw driver handle: the entry point for frameworks whose
    /// cudarc version or stream type differs from this crate's. Cast the handle with
    /// `as msa_runtime::cudarc::driver::sys::CUstream` (a `cudaStream_t` is the same
    /// pointer). Nothing is synchronized: the work is enqueued on that stream, in its order.
    ///
    /// The stream must belong to a device's primary context (the one the CUDA runtime API,
    /// PyTorch, candle and cubecl use); the legacy default stream (null) and
    /// `CU_STREAM_PER_THREAD` are taken in the calling thread's current context.
    ///
    /// # Safety
    /// `stream` must be a valid stream handle, and stay alive (not destroyed by its owner)
    /// as long as this backend or anything allocated through it (a workspace of an
    /// [`crate::MsaBackward`], a [`crate::ResidentSchedule`]) exists: those free their memory
    /// on it. [`crate::run_backward_raw`]'s cache holds such allocations until
    /// [`crate::release_workspace_raw`].
    ///
    /// # Errors
    /// [`RuntimeError::NoDriver`] without libcuda, [`RuntimeError::Driver`] naming the call
    /// that failed (an invalid handle, no current context for the null stream), and
    /// [`RuntimeError::Input`] for a stream of a non-primary context.
    pub unsafe fn from_raw_stream(stream: sys::CUstream) -> Result<Self, RuntimeError> {
        if !crate::device::driver_present() {
            return Err(RuntimeError::NoDriver);
        }
        // SAFETY: initialising the driver is idempotent and needs no arguments.
        unsafe { sys::cuInit(0) }
            .result()
            .map_err(RuntimeError::driver("cuInit"))?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: the caller guarantees `stream` is a valid handle; `ctx` is written.
        unsafe { sys::cuStreamGetCtx(stream, &mut ctx) }
            .result()
            .map_err(RuntimeError::driver("cuStreamGetCtx"))?;
        let context = primary_context_of(ctx)?;
        // SAFETY: `stream` belongs to `context` (its context was just read from it); the
        // caller keeps it alive as documented above, and orders other work on it itself.
        let stream = unsafe { context.wrap_borrowed_stream(stream) };
        Self::new(&stream)
    }

    /// The stream work is issued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The stream an upload issued now goes to: the device's upload stream between
    /// [`Backend::fork_uploads`] and [`Backend::join_uploads`], [`CudaBackend::stream`]
    /// otherwise.
    pub(crate) fn upload_queue(&self) -> &Arc<CudaStream> {
        self.uploads.as_ref().unwrap_or(&self.stream)
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    fn bind(&self, call: &'static str) -> Result<(), RuntimeError> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(RuntimeError::driver(call))
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaSlice<u8>;

    fn capability(&self) -> (i32, i32) {
        self.device.capability()
    }

    fn sm_count(&self) -> usize {
        self.device.sm_count()
    }

    fn ordinal(&self) -> usize {
        self.stream.context().ordinal()
    }

    fn memory_space(&self) -> u64 {
        self.stream.context().cu_ctx() as u64
    }

    fn queue(&self) -> u64 {
        self.stream_id
    }

    fn alloc(&mut self, what: &'static str, bytes: usize) -> Result<CudaSlice<u8>, RuntimeError> {
        // SAFETY: left uninitialised on purpose; the host flow writes (or zeroes) every byte
        // it reads.
        unsafe { self.stream.alloc::<u8>(bytes.max(1)) }.map_err(|source| RuntimeError::Alloc {
            what,
            bytes,
            source,
        })
    }

    fn address(&self, buffer: &CudaSlice<u8>) -> u64 {
        buffer.device_ptr(&self.stream).0
    }

    fn fork_uploads(&mut self) -> Result<(), RuntimeError> {
        self.bind("cuCtxSetCurrent")?;
        // Under a graph capture the uploads stay on the stream: the shared upload stream
        // would otherwise join the capture (and could join two at once).
        let capture = self
            .stream
            .capture_status()
            .map_err(RuntimeError::driver("cuStreamIsCapturing"))?;
        if self.uploads.is_none()
            && capture == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        {
            let side = self.device.upload_stream()?;
            side.join(&self.stream)
                .map_err(RuntimeError::driver("cuStreamWaitEvent"))?;
            self.uploads = Some(side);
        }
        Ok(())
    }

    fn join_uploads(&mut self) -> Result<(), RuntimeError> {
        if let Some(side) = self.uploads.take() {
            self.bind("cuCtxSetCurrent")?;
            self.stream
                .join(&side)
                .map_err(RuntimeError::driver("cuStreamWaitEvent"))?;
        }
        Ok(())
    }

    fn upload(&mut self, _what: &'static str, dst: u64, bytes: &[u8]) -> Result<(), RuntimeError> {
        self.bind("cuCtxSetCurrent")?;
        let stream = self.upload_queue();
        // SAFETY (both copies): `dst` addresses at least `bytes.len()` bytes of this
        // context's memory (the host flow's own allocations), and the context is current.
        if bytes.len() >= STAGED_UPLOAD_MIN
            && unsafe { self.device.upload_staged(stream, dst, bytes) }?
        {
            return Ok(());
        }
        // From pageable memory the call returns once `bytes` has been staged, so the slice
        // may be dropped afterwards.
        unsafe { result::memcpy_htod_async(dst, bytes, stream.cu_stream()) }
            .map_err(RuntimeError::driver("cuMemcpyHtoDAsync"))
    }

    fn zero(&mut self, _what: &'static str, dst: u64, bytes: usize) -> Result<(), RuntimeError> {
        self.bind("cuCtxSetCurrent")?;
        // SAFETY: `dst` addresses at least `bytes` bytes of this context's memory.
        unsafe { result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
            .map_err(RuntimeError::driver("cuMemsetD8Async"))
    }

    fn copy(
        &mut self,
        _what: &'static str,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<(), RuntimeError> {
        self.bind("cuCtxSetCurrent")?;
        // SAFETY: `src` and `dst` address at least `bytes` bytes of this context's memory
        // each, and do not overlap.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(RuntimeError::driver("cuMemcpyDtoDAsync"))
    }

    fn download(
        &mut self,
        _what: &'static str,
        src: u64,
        bytes: usize,
    ) -> Result<Vec<u8>, RuntimeError> {
        self.bind("cuCtxSetCurrent")?;
        let mut host = vec![0u8; bytes];
        // SAFETY: `src` addresses at least `bytes` bytes; the stream is synchronized before
        // `host` is read or dropped.
        unsafe { result::memcpy_dtoh_async(&mut host, src, self.stream.cu_stream()) }
            .map_err(RuntimeError::driver("cuMemcpyDtoHAsync"))?;
        self.stream
            .synchronize()
            .map_err(RuntimeError::driver("cuStreamSynchronize"))?;
        Ok(host)
    }

    fn load(&mut self, kernel: &KernelSpec) -> Result<(), RuntimeError> {
        let f = self.device.function(kernel.name, kernel.variants)?;
        if kernel.dynamic_shared_bytes > 48 * 1024 {
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                kernel.dynamic_shared_bytes as i32,
            )
            .map_err(RuntimeError::driver(
                "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
            ))?;
        }
        Ok(())
    }

    fn tensor_map(&mut self, spec: &TileMapSpec, base: u64) -> Result<TensorMap, RuntimeError> {
        spec.encode(base)
    }

    unsafe fn launch(
        &mut self,
        kernel: &KernelSpec,
        grid: (u32, u32, u32),
        args: &[KernelArg],
    ) -> Result<(), RuntimeError> {
        let f = self.device.function(kernel.name, kernel.variants)?;
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: kernel.threads,
            shared_mem_bytes: kernel.dynamic_shared_bytes,
        };
        let mut builder = self.stream.launch_builder(&f);
        for a in args {
            match a {
                KernelArg::Ptr(p) => builder.arg(p),
                KernelArg::U32(v) => builder.arg(v),
                KernelArg::I32(v) => builder.arg(v),
                KernelArg::TensorMap(m) => builder.arg(m),
            };
        }
        // SAFETY: the caller guarantees the arguments match the kernel (see the trait).
        unsafe { builder.launch(cfg) }
            .map(|_| ())
            .map_err(|source| RuntimeError::Launch {
                kernel: kernel.name,
                source,
            })
    }
}

impl TileMapSpec {
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
                match self.elem {
                    MapElem::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                    MapElem::F32 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32,
                    MapElem::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
                },
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
        Ok(TensorMap::from(unsafe { map.assume_init() }))
    }
}

/// The process-unique id of a stream of the current context.
fn stream_id(stream: sys::CUstream) -> Result<u64, RuntimeError> {
    let mut id: std::ffi::c_ulonglong = 0;
    // SAFETY: `stream` is a live stream of the current context (or a special handle the
    // driver resolves in it); `id` is written.
    unsafe { sys::cuStreamGetId(stream, &mut id) }
        .result()
        .map_err(RuntimeError::driver("cuStreamGetId"))?;
    Ok(id)
}

/// The cudarc context of `ctx` if it is its device's primary context.
fn primary_context_of(ctx: sys::CUcontext) -> Result<Arc<CudaContext>, RuntimeError> {
    if let Some(device) = Device::registered(ctx as usize) {
        return Ok(device.context().clone());
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: `ctx` is a live context (the driver just returned it for a live stream); it is
    // made current for the query and popped again.
    unsafe {
        sys::cuCtxPushCurrent_v2(ctx)
            .result()
            .map_err(RuntimeError::driver("cuCtxPushCurrent"))?;
        let got = sys::cuCtxGetDevice(&mut dev).result();
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        sys::cuCtxPopCurrent_v2(&mut popped)
            .result()
            .map_err(RuntimeError::driver("cuCtxPopCurrent"))?;
        got.map_err(RuntimeError::driver("cuCtxGetDevice"))?;
    }
    let count = CudaContext::device_count().map_err(RuntimeError::driver("cuDeviceGetCount"))?;
    let ordinal = (0..count.max(0) as usize)
        .find(|&i| {
            let mut d: sys::CUdevice = -1;
            // SAFETY: `i` is below the device count; `d` is written.
            let ok = unsafe { sys::cuDeviceGet(&mut d, i as i32) }
                .result()
                .is_ok();
            ok && d == dev
        })
        .ok_or_else(|| {
            RuntimeError::input("stream", format!("device handle {dev}"), "a visible device")
        })?;
    let primary =
        CudaContext::new(ordinal).map_err(|source| RuntimeError::NoDevice { ordinal, source })?;
    if primary.cu_ctx() != ctx {
        return Err(RuntimeError::input(
            "stream",
            format!("a stream of a non-primary context on device {ordinal}"),
            "a stream of the device's primary context (as the CUDA runtime, PyTorch, candle \
             and cubecl use)",
        ));
    }
    Ok(primary)
}
