//! Layer 5, the cudarc convenience API of the task build: a non-blocking read of the
//! descriptor's flags into pinned memory.

use super::TaskWorkspace;
use crate::cuda::CudaBackend;
use crate::error::RuntimeError;
use cudarc::driver::{result, CudaEvent, PinnedHostSlice};

impl TaskWorkspace<CudaBackend> {
    /// Enqueues a copy of the descriptor's flags word to pinned host memory without blocking.
    pub fn read_flags(&self, backend: &CudaBackend) -> Result<FlagsReadback, RuntimeError> {
        let stream = backend.stream();
        // SAFETY: pinned memory of one i32, written only by the copy below.
        let mut host = unsafe { stream.context().alloc_pinned::<i32>(1) }
            .map_err(RuntimeError::driver("cuMemHostAlloc"))?;
        let dst = host
            .as_mut_slice()
            .map_err(RuntimeError::driver("cuMemHostAlloc"))?;
        // SAFETY: word 7 of the descriptor is inside the workspace; `host` lives in the
        // returned handle, which is read only after `done` has completed.
        unsafe { result::memcpy_dtoh_async(dst, self.desc().addr() + 28, stream.cu_stream()) }
            .map_err(RuntimeError::driver("cuMemcpyDtoHAsync(flags)"))?;
        let done = stream
            .record_event(None)
            .map_err(RuntimeError::driver("cuEventRecord"))?;
        Ok(FlagsReadback { host, done })
    }
}

/// The flags word on its way to the host.
pub struct FlagsReadback {
    host: PinnedHostSlice<i32>,
    done: CudaEvent,
}

impl FlagsReadback {
    /// The flags if the copy has finished, without blocking.
    pub fn poll(&self) -> Option<i32> {
        if self.done.is_complete() {
            self.host.as_slice().ok().map(|s| s[0])
        } else {
            None
        }
    }

    /// Blocks until the copy has finished and returns the flags.
    pub fn wait(&self) -> Result<i32, RuntimeError> {
        self.done
            .synchronize()
            .map_err(RuntimeError::driver("cuEventSynchronize"))?;
        let s = self
            .host
            .as_slice()
            .map_err(RuntimeError::driver("cuEventSynchronize"))?;
        Ok(s[0])
    }
}
