//! The CUDA driver as a [`Backend`]: one stream of one context, kernels JIT-loaded through
//! [`Device`], memory as raw device addresses.

use crate::backend::{Backend, KernelArg, KernelSpec, TileMapSpec};
use crate::device::{driver_present, Device};
use crate::error::RuntimeError;
use crate::tma::TensorMap;
use cudarc::driver::{result, sys, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use std::mem::MaybeUninit;
use std::sync::Arc;

/// Work issued on one CUDA stream. Cheap to create: the device's facts and modules are
/// memoized per ordinal by [`Device`].
#[derive(Debug, Clone)]
pub struct CudaBackend {
    stream: Arc<CudaStream>,
    device: Arc<Device>,
}

impl CudaBackend {
    /// The backend of `stream`.
    ///
    /// # Errors
    /// [`RuntimeError::Driver`] when the device's attributes cannot be read.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self, RuntimeError> {
        Ok(CudaBackend {
            stream: stream.clone(),
            device: Device::of(stream.context())?,
        })
    }

    /// The stream work is issued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
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

    fn upload(&mut self, _what: &'static str, dst: u64, bytes: &[u8]) -> Result<(), RuntimeError> {
        self.bind("cuCtxSetCurrent")?;
        // SAFETY: `dst` addresses at least `bytes.len()` bytes of this context's memory (the
        // host flow's own allocations). From pageable memory the call returns once `bytes`
        // has been staged, so the slice may be dropped afterwards.
        unsafe { result::memcpy_htod_async(dst, bytes, self.stream.cu_stream()) }
            .map_err(RuntimeError::driver("cuMemcpyHtoDAsync"))
    }

    fn zero(&mut self, _what: &'static str, dst: u64, bytes: usize) -> Result<(), RuntimeError> {
        self.bind("cuCtxSetCurrent")?;
        // SAFETY: `dst` addresses at least `bytes` bytes of this context's memory.
        unsafe { result::memset_d8_async(dst, 0, bytes, self.stream.cu_stream()) }
            .map_err(RuntimeError::driver("cuMemsetD8Async"))
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
        Ok(TensorMap::from(unsafe { map.assume_init() }))
    }
}
