//! Host runtime of the MSA (MiniMax Sparse Attention) backward kernels.
//!
//! The crate holds the schedule contract shared with the kernels ([`contract`], [`schedule`]),
//! an f32 CPU reference of the attention ([`reference`]), and the CUDA driver glue that JIT-loads
//! the PTX in `generated/` and launches it.

pub mod contract;
pub mod reference;
pub mod schedule;

pub use contract::*;
pub use schedule::ScheduleError;
