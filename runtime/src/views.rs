//! Layer 5, the cudarc convenience API: the two facts every cudarc-view entry point needs
//! before it hands raw [`Span`]s to the host flow.

use crate::backend::Span;
use crate::error::RuntimeError;
use cudarc::driver::{CudaStream, CudaView, DevicePtr, DeviceSlice, SyncOnDrop};

/// The span of a view a kernel reads, with the guard that records the read for cudarc's
/// cross-stream tracking (it cannot see accesses through raw addresses); hold the guard until
/// the kernels are enqueued.
pub(crate) fn read_span<'a, T>(
    view: &'a CudaView<'_, T>,
    stream: &'a CudaStream,
) -> (Span<T>, SyncOnDrop<'a>) {
    let (ptr, guard) = view.device_ptr(stream);
    (Span::new(ptr, view.len()), guard)
}

/// Checks that `view` lives on the stream's context.
pub(crate) fn check_context<T>(
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
