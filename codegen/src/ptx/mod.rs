//! A typed PTX builder: register types, the instruction IR, the builder kernel descriptions
//! call, and the printer.

pub mod builder;
pub mod ir;
pub mod print;
pub mod tcgen05;
pub mod types;

pub use builder::*;
pub use ir::{HostElem, Kernel, ParamKind};
pub use types::*;
