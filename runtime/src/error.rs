//! The runtime's error type.

use cudarc::driver::DriverError;

/// Everything that can go wrong between the caller and the GPU.
///
/// Input errors name the offending field, the value found and the expectation.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// libcuda could not be loaded: no NVIDIA driver on this machine.
    #[error("the CUDA driver library (libcuda.so) is not installed on this machine")]
    NoDriver,
    /// The driver is present but the device cannot be opened.
    #[error("CUDA device {ordinal} is not available: {source}")]
    NoDevice {
        /// Device ordinal asked for.
        ordinal: usize,
        /// The driver's answer.
        source: DriverError,
    },
    /// No PTX variant exists for the device's architecture.
    #[error(
        "kernel `{kernel}` has no variant for compute capability {major}.{minor} (device {ordinal}); supported: {supported}"
    )]
    UnsupportedArch {
        /// The kernel.
        kernel: &'static str,
        /// Device ordinal.
        ordinal: usize,
        /// Capability major.
        major: i32,
        /// Capability minor.
        minor: i32,
        /// The capabilities that have a variant.
        supported: String,
    },
    /// The driver's JIT rejected a PTX module.
    #[error("JIT compilation of `{kernel}` for compute capability {major}.{minor} failed ({source}); driver log:\n{log}")]
    Jit {
        /// The kernel.
        kernel: &'static str,
        /// Capability major.
        major: i32,
        /// Capability minor.
        minor: i32,
        /// The driver's error.
        source: DriverError,
        /// The JIT's error log (from cuModuleLoadDataEx's log buffers).
        log: String,
    },
    /// A driver call failed.
    #[error("CUDA driver call `{call}` failed: {source}")]
    Driver {
        /// What was being done.
        call: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// A device allocation failed.
    #[error("allocating {bytes} bytes for the {what} failed: {source}")]
    Alloc {
        /// What the memory was for.
        what: &'static str,
        /// Bytes asked for.
        bytes: usize,
        /// The driver's error.
        source: DriverError,
    },
    /// Enqueuing a kernel launch failed.
    #[error("launching `{kernel}` failed: {source}")]
    Launch {
        /// The kernel.
        kernel: &'static str,
        /// The driver's error.
        source: DriverError,
    },
    /// A simulated device (the `msa-sim` backend) failed: a kernel fault it detected (out of
    /// bounds, deadlock, race, ...), or a refused operation.
    #[error("simulated `{call}` failed: {source}")]
    Simulator {
        /// The kernel or operation.
        call: String,
        /// The simulator's error; downcast it to inspect the fault.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// An input does not satisfy the contract.
    #[error("input `{field}`: found {found}, expected {expected}")]
    Input {
        /// The argument or field.
        field: &'static str,
        /// What was passed.
        found: String,
        /// What is required.
        expected: String,
    },
    /// A collective of the context-parallel flow failed (`crate::cp`): NCCL missing or
    /// returning an error, or a logical rank of a `HostGroup` gone.
    #[error("collective `{call}` failed: {message}")]
    Collective {
        /// The call, e.g. `ncclAllGather`.
        call: &'static str,
        /// What went wrong.
        message: String,
    },
    /// A buffer of the backward has a null base address.
    #[error("input `{field}`: found a null base address (0x0), expected a device address")]
    NullBuffer {
        /// The buffer.
        field: &'static str,
    },
    /// Two buffers of the backward overlap where they must not: an output with another output,
    /// or an output with an input (see `MsaBackward::allow_in_place`).
    #[error(
        "buffers `{first}` (bytes {first_bytes:#x?}) and `{second}` (bytes {second_bytes:#x?}) \
         overlap; {allowed}"
    )]
    Overlap {
        /// The first buffer, in `BackwardBuffers` field order.
        first: &'static str,
        /// Its device byte range.
        first_bytes: std::ops::Range<u64>,
        /// The second buffer.
        second: &'static str,
        /// Its device byte range.
        second_bytes: std::ops::Range<u64>,
        /// What is allowed instead.
        allowed: String,
    },
    /// The schedule is invalid, or larger than the backward supports
    /// ([`crate::ScheduleError::Capacity`]).
    #[error(transparent)]
    Schedule(#[from] crate::schedule::ScheduleError),
    /// The device schedule build flagged its input: the first fault, as the host
    /// `build_schedule` would report it for the same `q2k` and `cu_seqlens`. The flagged
    /// schedule has no work, so a backward run on it wrote zero gradients.
    #[error("the device schedule build rejected its input: {0}")]
    ScheduleFlagged(crate::schedule::ScheduleError),
    /// A context-parallel backward ran in a group where these ranks' device-built schedules
    /// were flagged: their queries contributed nothing to any rank's dK/dV, so every rank's
    /// dK/dV lacks them ([`crate::cp::CpBackward::status`]).
    #[error(
        "context-parallel backward: the device schedule of rank(s) {ranks:?} rejected its \
         selection, so their queries contributed nothing to any rank's dK/dV; each such \
         rank's RankSchedule::status names the fault"
    )]
    CpRankFlagged {
        /// The flagged ranks, ascending.
        ranks: Vec<usize>,
    },
    /// The KV-parallel forward ([`crate::forward_kv::MsaForwardKv`]) left rows it could not
    /// normalise even against their exact maximum or their `lse` (a NaN or infinite logit):
    /// their `lse` is NaN and their `out` 0, never a wrong finite value.
    #[error(
        "KV-parallel forward: {rows} row(s) could not be normalised against their own maximum \
         or lse (a NaN or infinite logit?): their lse is NaN and their out 0"
    )]
    ForwardReferenceRange {
        /// How many rows.
        rows: u32,
    },
    /// A TMA descriptor's parameters violate the tensor-map rules; checked before encoding.
    #[error("tensor map `{map}`: {what} is {found}, expected {expected}")]
    TensorMap {
        /// The tensor the map describes (`q`, `grad_out`, `k_aligned`, `v_aligned`).
        map: &'static str,
        /// The parameter, e.g. `base address` or `globalDim[2]`.
        what: &'static str,
        /// The value found.
        found: String,
        /// What the rules require.
        expected: String,
    },
    /// `cuTensorMapEncodeTiled` refused a descriptor the host-side checks accepted.
    #[error("cuTensorMapEncodeTiled failed for tensor map `{map}` ({params}): {source}")]
    TensorMapEncode {
        /// The tensor the map describes.
        map: &'static str,
        /// The parameters passed, for the report.
        params: String,
        /// The driver's error.
        source: DriverError,
    },
}

impl RuntimeError {
    pub(crate) fn driver(call: &'static str) -> impl FnOnce(DriverError) -> RuntimeError {
        move |source| RuntimeError::Driver { call, source }
    }

    pub(crate) fn input(
        field: &'static str,
        found: impl ToString,
        expected: impl ToString,
    ) -> Self {
        RuntimeError::Input {
            field,
            found: found.to_string(),
            expected: expected.to_string(),
        }
    }
}
