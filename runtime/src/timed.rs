//! [`TimedBackend`]: the CUDA backend with a pair of CUDA events around every operation it
//! issues, for a per-operation cost breakdown of a real call sequence (the kernels, the
//! zeroing and the uploads of one backward, in the order and with the overlap they really
//! have). `bench --breakdown` prints one.
//!
//! Layer 4 of the crate (the CUDA backend): it uses layers 1, 2 and [`CudaBackend`].

use crate::backend::{Backend, KernelArg, KernelSpec, TileMapSpec};
use crate::cuda::CudaBackend;
use crate::error::RuntimeError;
use crate::tma::TensorMap;
use cudarc::driver::{sys, CudaEvent, CudaSlice};

/// What one timed operation was: a kernel's entry name, or the label the host flow gave a
/// zeroing, upload or copy (`"dq pool"`, `"schedule"`, ...).
pub type OpName = &'static str;

/// A [`CudaBackend`] that records a CUDA event before and after each launch, zeroing,
/// upload and copy. The events cost a few microseconds each on the stream; the breakdown is for
/// measurement, not for production calls.
pub struct TimedBackend {
    inner: CudaBackend,
    ops: Vec<(OpName, CudaEvent, CudaEvent)>,
}

impl TimedBackend {
    /// Times the work `inner` issues.
    pub fn new(inner: CudaBackend) -> Self {
        TimedBackend {
            inner,
            ops: Vec::new(),
        }
    }

    /// The backend work is issued through.
    pub fn inner(&self) -> &CudaBackend {
        &self.inner
    }

    /// Forgets the operations recorded so far (after warm-up calls, say).
    pub fn clear(&mut self) {
        self.ops.clear();
    }

    /// Waits for the stream, then returns each operation recorded since the last
    /// [`TimedBackend::take`] or [`TimedBackend::clear`], in issue order: its name, its start
    /// in ms after the first operation's start, and its duration in ms. The gaps between one
    /// operation's end and the next one's start are the stream's idle time (or the events' own
    /// cost).
    ///
    /// # Errors
    /// [`RuntimeError::Driver`] when the stream cannot be synchronized or an event read.
    pub fn take(&mut self) -> Result<Vec<(OpName, f32, f32)>, RuntimeError> {
        self.inner
            .stream()
            .synchronize()
            .map_err(RuntimeError::driver("cuStreamSynchronize"))?;
        let ops = std::mem::take(&mut self.ops);
        let Some((_, first, _)) = ops.first() else {
            return Ok(Vec::new());
        };
        let read = || RuntimeError::driver("cuEventElapsedTime");
        ops.iter()
            .map(|(name, start, end)| {
                let at = first.elapsed_ms(start).map_err(read())?;
                let ms = start.elapsed_ms(end).map_err(read())?;
                Ok((*name, at, ms))
            })
            .collect()
    }

    /// Records `issue` between two events under `name`, on the stream it goes to (the
    /// upload stream for a forked upload).
    fn timed(
        &mut self,
        name: OpName,
        upload: bool,
        issue: impl FnOnce(&mut CudaBackend) -> Result<(), RuntimeError>,
    ) -> Result<(), RuntimeError> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let record = || RuntimeError::driver("cuEventRecord");
        let stream = if upload {
            self.inner.upload_queue()
        } else {
            self.inner.stream()
        }
        .clone();
        let start = stream.record_event(flags).map_err(record())?;
        issue(&mut self.inner)?;
        let end = stream.record_event(flags).map_err(record())?;
        self.ops.push((name, start, end));
        Ok(())
    }
}

impl Backend for TimedBackend {
    type Buffer = CudaSlice<u8>;

    fn capability(&self) -> (i32, i32) {
        self.inner.capability()
    }

    fn sm_count(&self) -> usize {
        self.inner.sm_count()
    }

    fn ordinal(&self) -> usize {
        self.inner.ordinal()
    }

    fn memory_space(&self) -> u64 {
        self.inner.memory_space()
    }

    fn queue(&self) -> u64 {
        self.inner.queue()
    }

    fn alloc(&mut self, what: &'static str, bytes: usize) -> Result<Self::Buffer, RuntimeError> {
        self.inner.alloc(what, bytes)
    }

    fn address(&self, buffer: &Self::Buffer) -> u64 {
        self.inner.address(buffer)
    }

    fn upload(&mut self, what: &'static str, dst: u64, bytes: &[u8]) -> Result<(), RuntimeError> {
        self.timed(what, true, |b| b.upload(what, dst, bytes))
    }

    fn fork_uploads(&mut self) -> Result<(), RuntimeError> {
        self.inner.fork_uploads()
    }

    fn join_uploads(&mut self) -> Result<(), RuntimeError> {
        self.inner.join_uploads()
    }

    fn zero(&mut self, what: &'static str, dst: u64, bytes: usize) -> Result<(), RuntimeError> {
        self.timed(what, false, |b| b.zero(what, dst, bytes))
    }

    fn copy(
        &mut self,
        what: &'static str,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<(), RuntimeError> {
        self.timed(what, false, |b| b.copy(what, dst, src, bytes))
    }

    fn download(
        &mut self,
        what: &'static str,
        src: u64,
        bytes: usize,
    ) -> Result<Vec<u8>, RuntimeError> {
        self.inner.download(what, src, bytes)
    }

    fn load(&mut self, kernel: &KernelSpec) -> Result<(), RuntimeError> {
        self.inner.load(kernel)
    }

    fn tensor_map(&mut self, spec: &TileMapSpec, base: u64) -> Result<TensorMap, RuntimeError> {
        self.inner.tensor_map(spec, base)
    }

    unsafe fn launch(
        &mut self,
        kernel: &KernelSpec,
        grid: (u32, u32, u32),
        args: &[KernelArg],
    ) -> Result<(), RuntimeError> {
        // SAFETY: forwarded unchanged; the caller upholds `launch`'s contract.
        self.timed(kernel.name, false, |b| unsafe {
            b.launch(kernel, grid, args)
        })
    }
}
