//! Layer 5, the cudarc convenience API of the device schedule build: a non-blocking read of
//! the status block into pinned memory.

use super::{decode_status, ResidentSchedule, ScheduleBuildSizes, STATUS_WORDS};
use crate::cuda::CudaBackend;
use crate::error::RuntimeError;
use cudarc::driver::{result, CudaEvent, PinnedHostSlice};

impl ResidentSchedule<CudaBackend> {
    /// Enqueues a copy of the status block to pinned host memory without blocking; the
    /// handle's [`StatusReadback::poll`] and [`StatusReadback::wait`] give the verdict.
    /// (Allocates pinned memory and records an event: call it outside a graph capture.)
    pub fn read_status(&self, backend: &CudaBackend) -> Result<StatusReadback, RuntimeError> {
        let stream = backend.stream();
        // SAFETY: pinned memory of the status words, written only by the copy below.
        let mut host = unsafe { stream.context().alloc_pinned::<i32>(STATUS_WORDS) }
            .map_err(RuntimeError::driver("cuMemHostAlloc"))?;
        let dst = host
            .as_mut_slice()
            .map_err(RuntimeError::driver("cuMemHostAlloc"))?;
        // SAFETY: the status block lies inside the allocation; `host` lives in the returned
        // handle, which reads it only after `done` has completed.
        unsafe { result::memcpy_dtoh_async(dst, self.status_ptr().addr(), stream.cu_stream()) }
            .map_err(RuntimeError::driver("cuMemcpyDtoHAsync(schedule status)"))?;
        let done = stream
            .record_event(None)
            .map_err(RuntimeError::driver("cuEventRecord"))?;
        Ok(StatusReadback {
            host,
            done,
            sizes: self.sizes,
        })
    }
}

/// The status block on its way to the host.
pub struct StatusReadback {
    host: PinnedHostSlice<i32>,
    done: CudaEvent,
    sizes: ScheduleBuildSizes,
}

impl StatusReadback {
    /// The verdict if the copy has finished, without blocking.
    pub fn poll(&self) -> Option<Result<(), RuntimeError>> {
        if !self.done.is_complete() {
            return None;
        }
        Some(self.decode())
    }

    /// Blocks until the copy has finished and returns the verdict.
    pub fn wait(&self) -> Result<(), RuntimeError> {
        self.done
            .synchronize()
            .map_err(RuntimeError::driver("cuEventSynchronize"))?;
        self.decode()
    }

    fn decode(&self) -> Result<(), RuntimeError> {
        let s = self
            .host
            .as_slice()
            .map_err(RuntimeError::driver("cuEventSynchronize"))?;
        decode_status(s, &self.sizes)
    }
}
