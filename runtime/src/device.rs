//! Devices: opening them without panicking, memoized facts (capability, SM count),
//! JIT-loading the generated PTX variant that matches the device, and the pinned staging
//! ring of large uploads.
//!
//! Layer 4 of the crate (the CUDA backend), with [`crate::cuda`].

use crate::backend::select_variant;
use crate::error::RuntimeError;
use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, PinnedHostSlice,
};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Whether the CUDA driver library can be loaded. cudarc panics on the first driver call
/// when it cannot, so every entry point asks this first.
///
/// With the `dynamic-loading` feature (the default) this probes for the shared library
/// without calling the driver. Without it, the dependency graph chose cudarc's linking mode:
/// under `dynamic-linking` libcuda was linked when the process started, so the answer is
/// `true`; under a graph that loads it at run time (burn's `fallback-dynamic-loading`) the
/// first driver call is made here once, and cudarc's panic for a missing library is caught
/// and answered `false` (its message still reaches the panic hook; a `panic = "abort"`
/// profile aborts instead, so enable `msa-runtime/dynamic-loading` there).
pub fn driver_present() -> bool {
    #[cfg(feature = "dynamic-loading")]
    {
        // SAFETY: only probes for the shared library; no driver call is made.
        unsafe { sys::is_culib_present() }
    }
    #[cfg(not(feature = "dynamic-loading"))]
    {
        static PRESENT: OnceLock<bool> = OnceLock::new();
        *PRESENT.get_or_init(|| {
            std::panic::catch_unwind(|| {
                let mut version = 0;
                // SAFETY: writes one int; needs no context.
                unsafe { sys::cuDriverGetVersion(&mut version) };
            })
            .is_ok()
        })
    }
}

/// An opened device with its memoized facts and loaded modules.
pub struct Device {
    ctx: Arc<CudaContext>,
    capability: (i32, i32),
    sm_count: usize,
    // Loaded entry functions by kernel name (each keeps its module alive).
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    staging: Mutex<StagingRing>,
    // The stream of forked uploads (`Backend::fork_uploads`), made on first use.
    upload_stream: Mutex<Option<Arc<CudaStream>>>,
}

/// Uploads of at least this many bytes go through the device's pinned staging ring
/// ([`Device::upload_staged`]): from pageable memory the driver stages the copy itself at a
/// fraction of the link's rate while the stream waits (2.3 ms for the host schedule of the
/// 64K-token bench case on the H200).
pub(crate) const STAGED_UPLOAD_MIN: usize = 1 << 20;
/// Bytes of one staging buffer; a larger upload takes several in turn.
const STAGING_CHUNK: usize = 8 << 20;
/// Staging buffers per device (so at most `STAGING_BUFFERS · STAGING_CHUNK` = 32 MiB of
/// pinned host memory): the host can stage that much ahead of the copies the stream has run.
const STAGING_BUFFERS: usize = 4;

/// One pinned buffer and the event after the last copy out of it.
struct Staging {
    host: PinnedHostSlice<u8>,
    copied: Option<CudaEvent>,
}

/// The staging buffers, used round-robin.
#[derive(Default)]
struct StagingRing {
    buffers: Vec<Staging>,
    next: usize,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ctx.ordinal())
            .field("capability", &self.capability)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

/// Opened devices by context handle: modules belong to a context, so two contexts on one
/// ordinal get separate entries.
fn registry() -> &'static Mutex<HashMap<usize, Arc<Device>>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<Device>>>> = OnceLock::new();
    DEVICES.get_or_init(Default::default)
}

fn key(ctx: &CudaContext) -> usize {
    ctx.cu_ctx() as usize
}

impl Device {
    /// Opens device `ordinal` (its primary context), once per process.
    pub fn open(ordinal: usize) -> Result<Arc<Device>, RuntimeError> {
        if !driver_present() {
            return Err(RuntimeError::NoDriver);
        }
        // The primary context: cudarc retains the same one on every call.
        let ctx = CudaContext::new(ordinal)
            .map_err(|source| RuntimeError::NoDevice { ordinal, source })?;
        Self::of(&ctx)
    }

    /// The device of a context, memoized per context (its modules are loaded there).
    pub fn of(ctx: &Arc<CudaContext>) -> Result<Arc<Device>, RuntimeError> {
        let mut devices = registry().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = devices.get(&key(ctx)) {
            return Ok(d.clone());
        }
        let device = Arc::new(Self::from_context(ctx.clone())?);
        devices.insert(key(ctx), device.clone());
        Ok(device)
    }

    /// The device already opened for the context handle `ctx`, if any.
    pub(crate) fn registered(ctx: usize) -> Option<Arc<Device>> {
        let devices = registry().lock().unwrap_or_else(|e| e.into_inner());
        devices.get(&ctx).cloned()
    }

    fn from_context(ctx: Arc<CudaContext>) -> Result<Device, RuntimeError> {
        let capability = ctx.compute_capability().map_err(RuntimeError::driver(
            "cuDeviceGetAttribute(compute capability)",
        ))?;
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(RuntimeError::driver(
                "cuDeviceGetAttribute(multiprocessor count)",
            ))?;
        Ok(Device {
            ctx,
            capability,
            sm_count: sm_count.max(1) as usize,
            functions: Mutex::new(HashMap::new()),
            staging: Mutex::default(),
            upload_stream: Mutex::default(),
        })
    }

    /// The stream that forked uploads run on ([`crate::Backend::fork_uploads`]), one per
    /// device, made on first use and kept for the process, as the device is. Made through
    /// the driver rather than cudarc's `new_stream`, which would switch the context into
    /// cudarc's multi-stream mode (an event recorded per buffer use). Backends of several
    /// streams share it: each caller's own events order its uploads, so sharing can only
    /// make one caller's uploads wait for another's.
    pub(crate) fn upload_stream(&self) -> Result<Arc<CudaStream>, RuntimeError> {
        let mut side = self.upload_stream.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = side.as_ref() {
            return Ok(s.clone());
        }
        self.ctx
            .bind_to_thread()
            .map_err(RuntimeError::driver("cuCtxSetCurrent"))?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(RuntimeError::driver("cuStreamCreate"))?;
        // SAFETY: `raw` is a stream of this context that is never destroyed: it lives as
        // long as the device, that is, as the process.
        let s = unsafe { self.ctx.wrap_borrowed_stream(raw) };
        *side = Some(s.clone());
        Ok(s)
    }

    /// Copies `bytes` to device address `dst` on `stream` through the pinned staging ring, one
    /// chunk of at most 8 MiB per buffer: each chunk is copied into a buffer on the host
    /// (after waiting for that buffer's previous copy to the device to finish) and from there
    /// to the device, stream-ordered, at the link's rate. `bytes` may be dropped on return.
    /// Returns `Ok(false)`, having issued nothing, when no pinned memory can be had or the
    /// stream is capturing a graph (a capture must not wait on events); the caller then
    /// copies from pageable memory. Uploads of several threads take the ring in turn.
    ///
    /// # Safety
    /// `dst` must address at least `bytes.len()` bytes of this device's context, and the
    /// context must be current.
    pub(crate) unsafe fn upload_staged(
        &self,
        stream: &Arc<CudaStream>,
        dst: u64,
        bytes: &[u8],
    ) -> Result<bool, RuntimeError> {
        let capture = stream
            .capture_status()
            .map_err(RuntimeError::driver("cuStreamIsCapturing"))?;
        if capture != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return Ok(false);
        }
        let mut ring = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        for (k, chunk) in bytes.chunks(STAGING_CHUNK).enumerate() {
            let mut i = ring.next.min(ring.buffers.len());
            if i == ring.buffers.len() {
                // Grow the ring while it is short; without more pinned memory, reuse the
                // first buffer, or (no buffer at all, so nothing is issued yet) decline.
                // SAFETY: `u8` has no invalid bit patterns; the buffer is written before a
                // copy reads it.
                match unsafe { self.ctx.alloc_pinned::<u8>(STAGING_CHUNK) } {
                    Ok(host) => ring.buffers.push(Staging { host, copied: None }),
                    Err(_) if ring.buffers.is_empty() => return Ok(false),
                    Err(_) => i = 0,
                }
            }
            ring.next = (i + 1) % STAGING_BUFFERS;
            let s = &mut ring.buffers[i];
            if let Some(e) = s.copied.take() {
                e.synchronize()
                    .map_err(RuntimeError::driver("cuEventSynchronize"))?;
            }
            let host = s
                .host
                .as_mut_slice()
                .map_err(RuntimeError::driver("cuEventSynchronize"))?;
            host[..chunk.len()].copy_from_slice(chunk);
            let at = dst + (k * STAGING_CHUNK) as u64;
            // SAFETY: `at` addresses `chunk.len()` bytes of `dst`'s range (the caller's
            // contract); the pinned source stays untouched until `copied` has completed.
            unsafe { result::memcpy_htod_async(at, &host[..chunk.len()], stream.cu_stream()) }
                .map_err(RuntimeError::driver("cuMemcpyHtoDAsync"))?;
            s.copied = Some(
                stream
                    .record_event(None)
                    .map_err(RuntimeError::driver("cuEventRecord"))?,
            );
        }
        Ok(true)
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Compute capability `(major, minor)`, read once.
    pub fn capability(&self) -> (i32, i32) {
        self.capability
    }

    /// Number of streaming multiprocessors, read once; it sizes the backward CTA walk.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// The kernel's entry function, JIT-loading the PTX variant for this device on first use.
    ///
    /// `variants` pairs compute capabilities with PTX text (the generated `VARIANTS`).
    pub fn function(
        &self,
        kernel: &'static str,
        variants: &[((i32, i32), &str)],
    ) -> Result<CudaFunction, RuntimeError> {
        let mut functions = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = functions.get(kernel) {
            return Ok(f.clone());
        }
        let ptx = select_variant(kernel, variants, self.capability, self.ctx.ordinal())?;
        let f = self
            .load(kernel, ptx)?
            .load_function(kernel)
            .map_err(RuntimeError::driver("cuModuleGetFunction"))?;
        functions.insert(kernel, f.clone());
        Ok(f)
    }

    fn load(&self, kernel: &'static str, ptx: &str) -> Result<Arc<CudaModule>, RuntimeError> {
        let (major, minor) = self.capability;
        self.ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(|source| RuntimeError::Jit {
                kernel,
                major,
                minor,
                source,
                log: jit_error_log(&self.ctx, ptx),
            })
    }
}

/// Loads `ptx` again through cuModuleLoadDataEx to capture the JIT's error log.
fn jit_error_log(ctx: &Arc<CudaContext>, ptx: &str) -> String {
    const LOG_BYTES: usize = 16 * 1024;
    let Ok(src) = std::ffi::CString::new(ptx) else {
        return "PTX text contains a NUL byte".into();
    };
    if ctx.bind_to_thread().is_err() {
        return "(could not bind the context to read the log)".into();
    }
    let mut log = vec![0u8; LOG_BYTES];
    let mut options = [
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    let mut values = [
        log.as_mut_ptr() as *mut std::ffi::c_void,
        LOG_BYTES as *mut std::ffi::c_void,
    ];
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: the option arrays and the log buffer outlive the call; the size option is
    // passed by value in the pointer slot, as the driver API specifies.
    let result = unsafe {
        sys::cuModuleLoadDataEx(
            &mut module,
            src.as_ptr() as *const std::ffi::c_void,
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    };
    if result == sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the module was just loaded by us and is not shared.
        unsafe { sys::cuModuleUnload(module) };
        return "(the second load succeeded; no log)".into();
    }
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    let text = String::from_utf8_lossy(&log[..end]).trim().to_string();
    if text.is_empty() {
        "(the driver wrote no log)".into()
    } else {
        text
    }
}
