//! What a launch is given: its shape ([`LaunchConfig`]), its arguments ([`Arg`]) and how the
//! arguments become the kernel's parameter buffer.
//!
//! Below both the executor and the tensor maps (which build their own [`Arg`]), so neither has
//! to import the other.

use crate::memory::DevPtr;
use crate::module::Kernel;

/// Grid and block shape and dynamic shared memory of a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchConfig {
    /// CTAs per dimension.
    pub grid: [u32; 3],
    /// Threads per CTA per dimension.
    pub block: [u32; 3],
    /// Bytes of dynamic shared memory.
    pub dynamic_shared_bytes: u32,
}

impl LaunchConfig {
    /// A launch of `grid` CTAs of `block` threads without dynamic shared memory.
    pub fn new(grid: (u32, u32, u32), block: (u32, u32, u32)) -> Self {
        LaunchConfig {
            grid: [grid.0, grid.1, grid.2],
            block: [block.0, block.1, block.2],
            dynamic_shared_bytes: 0,
        }
    }

    /// The same launch with `bytes` of dynamic shared memory.
    pub fn with_dynamic_shared(mut self, bytes: u32) -> Self {
        self.dynamic_shared_bytes = bytes;
        self
    }
}

/// A kernel argument.
#[derive(Debug, Clone, PartialEq)]
pub enum Arg {
    /// A device pointer (for `.u64`/`.b64` parameters).
    Ptr(DevPtr),
    /// `.u32` / `.b32`
    U32(u32),
    /// `.s32`
    I32(i32),
    /// `.u64` / `.b64`
    U64(u64),
    /// `.s64`
    I64(i64),
    /// `.f32`
    F32(f32),
    /// An opaque blob for an array parameter (e.g. a 128-byte tensor map).
    Bytes(Vec<u8>),
}

/// Lays `args` out as the bytes of `kernel`'s `.param` space, checking each argument's kind and
/// size against its parameter.
///
/// # Errors
/// A message naming the parameter when the count or a kind does not match.
pub(crate) fn param_buffer(kernel: &Kernel, args: &[Arg]) -> Result<Vec<u8>, String> {
    if args.len() != kernel.params.len() {
        return Err(format!(
            "{} arguments given, the kernel declares {} parameters ({})",
            args.len(),
            kernel.params.len(),
            kernel
                .params
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let mut buf = vec![0u8; kernel.param_bytes as usize];
    for (i, (p, a)) in kernel.params.iter().zip(args).enumerate() {
        let bytes: Vec<u8> = match (p.array, p.size, a) {
            (None, 8, Arg::Ptr(v)) => v.0.to_le_bytes().to_vec(),
            (None, 8, Arg::U64(v)) => v.to_le_bytes().to_vec(),
            (None, 8, Arg::I64(v)) => v.to_le_bytes().to_vec(),
            (None, 4, Arg::U32(v)) => v.to_le_bytes().to_vec(),
            (None, 4, Arg::I32(v)) => v.to_le_bytes().to_vec(),
            (None, 4, Arg::F32(v)) => v.to_le_bytes().to_vec(),
            (Some(_), n, Arg::Bytes(b)) if b.len() == n as usize => b.clone(),
            _ => {
                return Err(format!(
                    "argument {i} for parameter `{}` ({} bytes{}) has the wrong kind: {a:?}",
                    p.name,
                    p.size,
                    if p.ptr { ", pointer" } else { "" }
                ))
            }
        };
        let at = p.offset as usize;
        buf[at..at + bytes.len()].copy_from_slice(&bytes);
    }
    Ok(buf)
}
