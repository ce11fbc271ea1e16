//! What the host flow needs from a device, as a trait, so that one code path (workspace
//! carving, tensor-map parameters, launch geometry, kernel order) drives both the CUDA driver
//! ([`crate::cuda::CudaBackend`]) and the `msa-sim` PTX simulator.
//!
//! Memory is addressed by plain 64-bit device addresses: the flow carves its own allocations
//! into regions, and the generated bindings ([`crate::kernels`]) turn typed [`Ptr`]s and
//! scalars into the [`KernelArg`] list of each kernel in declaration order.
//!
//! Layer 2 of the crate: the trait and the value types every layer above uses (the crate
//! documentation, "Layers").

use crate::contract::{BLOCK_SIZE, HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS};
use crate::error::RuntimeError;
use crate::tma::TensorMap;
use std::fmt;
use std::marker::PhantomData;

/// The 16-byte alignment TMA and the 128-bit vector accesses of the small kernels need.
pub(crate) const BASE_ALIGN: u64 = 16;

/// A kernel of `generated/`: its entry name, launch shape and PTX per compute capability
/// (each generated binding module has one as `KERNEL`).
#[derive(Debug, Clone, Copy)]
pub struct KernelSpec {
    /// Entry name in the PTX module.
    pub name: &'static str,
    /// Threads per CTA.
    pub threads: (u32, u32, u32),
    /// Dynamic shared memory each launch requests, in bytes.
    pub dynamic_shared_bytes: u32,
    /// PTX text per compute capability `(major, minor)`.
    pub variants: &'static [((i32, i32), &'static str)],
}

impl KernelSpec {
    /// The PTX for capability `cc`, or [`RuntimeError::UnsupportedArch`] naming the ones
    /// there are.
    pub fn ptx(&self, cc: (i32, i32), ordinal: usize) -> Result<&'static str, RuntimeError> {
        select_variant(self.name, self.variants, cc, ordinal)
    }
}

/// The PTX text of `variants` for capability `cc`, or [`RuntimeError::UnsupportedArch`]
/// naming `kernel`, device `ordinal` and the capabilities there are.
pub fn select_variant<'a>(
    kernel: &'static str,
    variants: &[((i32, i32), &'a str)],
    cc: (i32, i32),
    ordinal: usize,
) -> Result<&'a str, RuntimeError> {
    variants
        .iter()
        .find(|(v, _)| *v == cc)
        .map(|(_, p)| *p)
        .ok_or_else(|| RuntimeError::UnsupportedArch {
            kernel,
            ordinal,
            major: cc.0,
            minor: cc.1,
            supported: variants
                .iter()
                .map(|((a, b), _)| format!("{a}.{b}"))
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// A device address of `T` elements that a kernel reads.
pub struct Ptr<T> {
    addr: u64,
    elem: PhantomData<fn() -> T>,
}

/// A device address of `T` elements that a kernel writes.
pub struct PtrMut<T> {
    addr: u64,
    elem: PhantomData<fn() -> T>,
}

macro_rules! typed_address {
    ($name:ident) => {
        impl<T> $name<T> {
            /// The address `addr`, typed.
            pub const fn new(addr: u64) -> Self {
                Self {
                    addr,
                    elem: PhantomData,
                }
            }

            /// The raw address.
            pub const fn addr(self) -> u64 {
                self.addr
            }
        }

        impl<T> Clone for $name<T> {
            fn clone(&self) -> Self {
                *self
            }
        }

        impl<T> Copy for $name<T> {}

        impl<T> fmt::Debug for $name<T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:#x})", stringify!($name), self.addr)
            }
        }

        impl<T> From<$name<T>> for KernelArg {
            fn from(p: $name<T>) -> KernelArg {
                KernelArg::Ptr(p.addr)
            }
        }
    };
}

typed_address!(Ptr);
typed_address!(PtrMut);

/// One kernel argument as the driver receives it.
#[derive(Clone, Copy)]
pub enum KernelArg {
    /// A `.u64` device address.
    Ptr(u64),
    /// A `.u32` scalar.
    U32(u32),
    /// A `.s32` scalar.
    I32(i32),
    /// A 128-byte tensor map passed by value.
    TensorMap(TensorMap),
}

impl fmt::Debug for KernelArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelArg::Ptr(a) => write!(f, "Ptr({a:#x})"),
            KernelArg::U32(v) => write!(f, "U32({v})"),
            KernelArg::I32(v) => write!(f, "I32({v})"),
            KernelArg::TensorMap(_) => f.write_str("TensorMap(..)"),
        }
    }
}

impl From<u32> for KernelArg {
    fn from(v: u32) -> KernelArg {
        KernelArg::U32(v)
    }
}

impl From<i32> for KernelArg {
    fn from(v: i32) -> KernelArg {
        KernelArg::I32(v)
    }
}

impl From<&TensorMap> for KernelArg {
    fn from(m: &TensorMap) -> KernelArg {
        KernelArg::TensorMap(*m)
    }
}

/// `len` elements of `T` at a device address: an input or output of the backward.
pub struct Span<T> {
    /// First element.
    pub addr: u64,
    /// Elements.
    pub len: usize,
    elem: PhantomData<fn() -> T>,
}

impl<T> Span<T> {
    /// `len` elements at `addr`.
    pub const fn new(addr: u64, len: usize) -> Self {
        Span {
            addr,
            len,
            elem: PhantomData,
        }
    }

    /// The first `len` elements.
    pub const fn prefix(self, len: usize) -> Self {
        Span::new(self.addr, len)
    }

    /// The address as a kernel input.
    pub const fn ptr(self) -> Ptr<T> {
        Ptr::new(self.addr)
    }

    /// The address as a kernel output.
    pub const fn ptr_mut(self) -> PtrMut<T> {
        PtrMut::new(self.addr)
    }
}

impl<T> Clone for Span<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Span<T> {}

impl<T> fmt::Debug for Span<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Span({:#x}, {} elements)", self.addr, self.len)
    }
}

/// A device the MSA host flow can drive: the CUDA driver on one stream, or a simulator.
///
/// Operations are stream-ordered: each takes effect after the ones issued before it, and only
/// [`Backend::download`] waits for them. A backend reports a failure as a [`RuntimeError`]
/// naming the call; the host flow issues every fallible preparation (loading, allocation,
/// tensor maps) before its first write, so a failure never leaves work half-issued.
pub trait Backend {
    /// An owned device allocation, freed (stream-ordered) when dropped.
    type Buffer;

    /// Compute capability `(major, minor)`; it picks the PTX variants.
    fn capability(&self) -> (i32, i32);

    /// Streaming multiprocessors; they size the main kernel's CTA walk.
    fn sm_count(&self) -> usize;

    /// The device ordinal error messages name.
    fn ordinal(&self) -> usize;

    /// Identifies the memory space: buffers of a backend with another id are not usable here
    /// (a CUDA context, one simulated device).
    fn memory_space(&self) -> u64;

    /// Identifies the work queue (a CUDA stream) within the memory space: work issued on one
    /// queue runs in issue order, work on two queues is unordered. The host flow keeps each
    /// workspace on the queue that allocated it, so that its reuse and its stream-ordered
    /// free always come after every kernel that used it. A backend with one queue (the
    /// simulator) keeps the default.
    fn queue(&self) -> u64 {
        0
    }

    /// Allocates `bytes` of uninitialised device memory, 256-byte aligned.
    fn alloc(&mut self, what: &'static str, bytes: usize) -> Result<Self::Buffer, RuntimeError>;

    /// The device address of `buffer`.
    fn address(&self, buffer: &Self::Buffer) -> u64;

    /// Copies `bytes` to device address `dst`.
    fn upload(&mut self, what: &'static str, dst: u64, bytes: &[u8]) -> Result<(), RuntimeError>;

    /// Lets the [`upload`](Backend::upload)s issued from now until
    /// [`join_uploads`](Backend::join_uploads) run beside the work issued in between: they
    /// still follow everything issued before this call, and everything issued after the
    /// join follows them. The caller must not issue, in between, work that touches their
    /// destinations. A backend with one queue keeps the default, which keeps the uploads in
    /// queue order.
    fn fork_uploads(&mut self) -> Result<(), RuntimeError> {
        Ok(())
    }

    /// Ends [`fork_uploads`](Backend::fork_uploads): the work issued from now on follows the
    /// forked uploads.
    fn join_uploads(&mut self) -> Result<(), RuntimeError> {
        Ok(())
    }

    /// Sets `bytes` bytes at `dst` to zero.
    fn zero(&mut self, what: &'static str, dst: u64, bytes: usize) -> Result<(), RuntimeError>;

    /// Copies `bytes` bytes from device address `src` to `dst`, in queue order; the two
    /// ranges do not overlap.
    fn copy(
        &mut self,
        what: &'static str,
        dst: u64,
        src: u64,
        bytes: usize,
    ) -> Result<(), RuntimeError>;

    /// Waits for everything issued so far, then copies `bytes` bytes at `src` to the host.
    fn download(
        &mut self,
        what: &'static str,
        src: u64,
        bytes: usize,
    ) -> Result<Vec<u8>, RuntimeError>;

    /// Loads (JIT-compiles or parses) the kernel's variant for this device, so that a
    /// failure surfaces before anything is issued.
    fn load(&mut self, kernel: &KernelSpec) -> Result<(), RuntimeError>;

    /// Encodes a bf16 tiled tensor map over `base` as the spec describes.
    fn tensor_map(&mut self, spec: &TileMapSpec, base: u64) -> Result<TensorMap, RuntimeError>;

    /// Launches `kernel` on a grid of `grid` CTAs of `kernel.threads` threads.
    ///
    /// # Safety
    /// `args` must be the kernel's parameters in declaration order (use the generated
    /// `args` function), and every address must point at memory holding what the kernel
    /// reads and writes for the scalar arguments given.
    unsafe fn launch(
        &mut self,
        kernel: &KernelSpec,
        grid: (u32, u32, u32),
        args: &[KernelArg],
    ) -> Result<(), RuntimeError>;
}

/// The bytes of `v` in memory order (the host and both devices are little-endian), without
/// copying: uploads of large schedules stay a single memcpy.
pub fn bytes_of<T: Pod>(v: &[T]) -> &[u8] {
    // SAFETY: `Pod` types have no padding and no invalid bit patterns, so their memory is
    // `size_of_val(v)` initialised bytes; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Elements of `T` from memory-order bytes (a trailing partial element is ignored).
pub fn from_bytes<T: Pod>(b: &[u8]) -> Vec<T> {
    let n = b.len() / std::mem::size_of::<T>();
    let mut out = Vec::<T>::with_capacity(n);
    // SAFETY: `n` elements fit in the capacity and are fully written from `b` before
    // `set_len`; every bit pattern is a valid `T` (see `Pod`).
    unsafe {
        std::ptr::copy_nonoverlapping(
            b.as_ptr(),
            out.as_mut_ptr().cast::<u8>(),
            n * std::mem::size_of::<T>(),
        );
        out.set_len(n);
    }
    out
}

/// Plain element types that cross the host/device boundary as raw bytes.
///
/// # Safety
/// Implementors have no padding bytes, and every bit pattern of their size is a valid value.
pub unsafe trait Pod: Copy {}

// SAFETY: primitive integers and floats, and bf16 (a transparent u16), satisfy `Pod`.
unsafe impl Pod for u8 {}
// SAFETY: as above.
unsafe impl Pod for i32 {}
// SAFETY: as above.
unsafe impl Pod for u32 {}
// SAFETY: as above.
unsafe impl Pod for u64 {}
// SAFETY: as above.
unsafe impl Pod for f32 {}
// SAFETY: as above.
unsafe impl Pod for half::bf16 {}

/// The element type of a [`TileMapSpec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapElem {
    /// bf16: the operands.
    Bf16,
    /// f32: the KV forward's `o_pool`, which a TMA reduce-add accumulates.
    F32,
    /// f16: the KV forward's `o_pool` in its f16 mode.
    F16,
}

impl MapElem {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            MapElem::Bf16 | MapElem::F16 => 2,
            MapElem::F32 => 4,
        }
    }
}

/// Parameters of one rank-3 tiled tensor map, innermost dimension first, in the form
/// `cuTensorMapEncodeTiled` takes them. All maps use swizzle 128B, no interleave, L2 promotion
/// 256B and OOB fill NONE (out-of-bounds elements read as zero).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileMapSpec {
    /// The tensor the map describes; error messages name it.
    pub map: &'static str,
    /// The element type.
    pub elem: MapElem,
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
    /// token, the K-major SW128 sub-block the MMA reads (`docs/design.md` §3.3).
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
            elem: MapElem::Bf16,
            global_dim: [HEAD_DIM as u64, NUM_Q_HEADS as u64, num_tokens as u64],
            global_strides: [(HEAD_DIM * 2) as u64, (NUM_Q_HEADS * HEAD_DIM * 2) as u64],
            box_dim: [64, 16, 1],
            element_strides: [1, 1, 1],
        })
    }

    /// The map of a query-side f32 tensor `[T, 64, 128]` (the KV forward's `o_pool`):
    /// globalDim `[128, 64, T]`, strides `[512, 32768]` bytes, box `[32, 16, 1]` = 16 heads ×
    /// 32 d of one token (128-byte rows, the SW128 span).
    ///
    /// # Errors
    /// [`RuntimeError::TensorMap`] unless `1 <= num_tokens <= 2^32`.
    pub fn query_rows_f32(map: &'static str, num_tokens: usize) -> Result<Self, RuntimeError> {
        let bf16 = Self::query_rows(map, num_tokens)?;
        Ok(TileMapSpec {
            elem: MapElem::F32,
            global_strides: bf16.global_strides.map(|s| 2 * s),
            box_dim: [32, 16, 1],
            ..bf16
        })
    }

    /// The map of a query-side f16 tensor `[T, 64, 128]` (the KV forward's `o_pool` in its
    /// f16 mode): [`TileMapSpec::query_rows`]'s geometry with f16 elements.
    ///
    /// # Errors
    /// [`RuntimeError::TensorMap`] unless `1 <= num_tokens <= 2^32`.
    pub fn query_rows_f16(map: &'static str, num_tokens: usize) -> Result<Self, RuntimeError> {
        Ok(TileMapSpec {
            elem: MapElem::F16,
            ..Self::query_rows(map, num_tokens)?
        })
    }

    /// The map of an aligned key-side tensor `[W, 4, 128]` bf16 (`k_aligned`, `v_aligned`):
    /// globalDim `[128, 4, W]`, strides `[256, 1024]` bytes, box `[64, 1, 128]` = one 128-key
    /// block of one kv head, 64 d wide.
    ///
    /// # Errors
    /// [`RuntimeError::TensorMap`] unless `W` is a positive multiple of 128 and at most 2^32
    /// (every key block must be a full tile, `docs/design.md` §1.5).
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
            elem: MapElem::Bf16,
            global_dim: [HEAD_DIM as u64, NUM_KV_HEADS as u64, workspace_rows as u64],
            global_strides: [(HEAD_DIM * 2) as u64, (NUM_KV_HEADS * HEAD_DIM * 2) as u64],
            box_dim: [64, 1, BLOCK_SIZE as u32],
            element_strides: [1, 1, 1],
        })
    }

    /// Checks the parameters and `base` against the rules of `cuTensorMapEncodeTiled` for its
    /// element type, no interleave and swizzle 128B, so that a bad input gets a precise error instead of the
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
        let inner_bytes = self.box_dim[0] as usize * self.elem.bytes();
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

    /// Bytes of the tensor the map spans: `globalDim[2] · globalStrides[1]`.
    pub fn bytes(&self) -> u64 {
        self.global_dim[2] * self.global_strides[1]
    }
}
