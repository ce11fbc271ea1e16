//! Kernel descriptions. Each is a [`KernelDesc`]: a name, the targets it is emitted for, its
//! CTA shape, and a function that describes its body against the typed builder.

pub mod backward_sm100;
pub mod backward_sm90;
pub mod common;
pub mod fixed_point;
pub mod forward_kv_rows;
pub mod forward_kv_sm90;
pub mod forward_list;
pub mod forward_sm100;
pub mod forward_sm90;
pub mod kv_layout;
pub mod l2_sides;
pub mod postprocess;
pub mod preprocess;
pub mod schedule_build;
pub mod sm100;
pub mod task_build;

use crate::error::CodegenError;
use crate::ptx::{Kernel, KernelBuilder};
use crate::target::Target;

/// A kernel description: what the generator builds a kernel from.
///
/// The runtime's `KernelSpec` is the other end: the generated bindings turn each `KernelDesc`
/// and its built PTX into one, with the PTX text a backend loads and launches.
pub struct KernelDesc {
    /// Entry name (also the file stem under `generated/`).
    pub name: &'static str,
    /// What it computes, one sentence (goes into the manifest and the bindings' docs).
    pub about: &'static str,
    /// Targets it is emitted for.
    pub targets: &'static [Target],
    /// Threads per CTA.
    pub threads: (u32, u32, u32),
    /// Describes the body.
    pub describe: fn(&mut KernelBuilder),
}

impl KernelDesc {
    /// Builds the kernel for `target`.
    pub fn build(&self, target: Target) -> Result<Kernel, CodegenError> {
        let mut b = KernelBuilder::new(self.name, target, self.threads);
        (self.describe)(&mut b);
        b.finish()
    }
}

/// Every kernel, in output order.
pub fn all() -> &'static [KernelDesc] {
    &[
        preprocess::DESC,
        preprocess::DETERMINISTIC,
        postprocess::DESC,
        postprocess::DETERMINISTIC,
        kv_layout::TO_ALIGNED,
        kv_layout::FROM_ALIGNED,
        schedule_build::COUNT,
        schedule_build::SCATTER,
        schedule_build::ORDER,
        task_build::SCAN_WORK,
        task_build::ASSIGN_SEGMENTS,
        task_build::SCAN_BINS,
        task_build::SCATTER_TABLES,
        backward_sm90::DESC,
        backward_sm100::DESC,
        backward_sm90::DETERMINISTIC,
        backward_sm100::DETERMINISTIC,
        forward_sm90::DESC,
        forward_sm100::DESC,
        forward_kv_rows::KEY_MAX,
        forward_kv_rows::BOUND,
        forward_kv_rows::PROBE,
        forward_kv_sm90::DESC,
        forward_kv_sm90::DESC_F16,
        forward_kv_sm90::DESC_F16_PAIRED,
        forward_kv_sm90::DESC_MAX,
        forward_kv_rows::REFERENCE,
        forward_kv_rows::COMBINE,
        forward_kv_rows::COMBINE_F16,
        forward_kv_rows::COMBINE_F16_PAIRED,
        l2_sides::HOMES,
        l2_sides::PAIR_KV,
    ]
}
