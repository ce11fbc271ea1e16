//! A typed PTX builder: register types, the instruction IR, the builder kernel descriptions
//! call, and the printer.
//!
//! The builder's core is [`builder`]; its instructions are grouped by PTX ISA family, each
//! family a file that extends `impl KernelBuilder`: [`ops`] for the general chapters,
//! [`wgmma`] for Hopper's and [`tcgen05`] for Blackwell's tensor cores.

pub mod builder;
pub mod ir;
pub mod operand;
pub mod ops;
pub mod print;
pub mod tcgen05;
pub mod types;
pub mod wgmma;

pub use builder::*;
pub use ir::{HostElem, Kernel, ParamKind};
pub use operand::*;
pub use ops::arith::{Cmp, Widen};
pub use ops::atomic::{AtomBits, AtomOp};
pub use ops::convert::{CvtFrom, SReg};
pub use ops::memory::L2Evict;
pub use ops::sync::Shfl;
pub use types::*;

/// Helpers the families' unit tests share.
#[cfg(test)]
mod testing {
    use super::KernelBuilder;
    use crate::error::CodegenError;
    use crate::target::Target;

    /// A 128-thread `sm_90a` builder.
    pub(super) fn builder() -> KernelBuilder {
        KernelBuilder::new("t", Target::Sm90a, (128, 1, 1))
    }

    /// The errors `finish` reports; panics if it succeeds.
    pub(super) fn errors(b: KernelBuilder) -> Vec<String> {
        match b.finish() {
            Err(CodegenError::Kernel { errors, .. }) => errors,
            other => panic!("expected a codegen error, got {other:?}"),
        }
    }
}
