//! The general instruction families, one file per PTX ISA chapter (or group of related
//! chapters). Each file adds its methods to `impl KernelBuilder` and holds the enums and
//! traits only its instructions use, with the rejection tests of its checks. The tensor-core
//! families are [`super::wgmma`] and [`super::tcgen05`].

pub mod arith;
pub mod atomic;
pub mod control;
pub mod convert;
pub mod memory;
pub mod mma;
pub mod sync;
