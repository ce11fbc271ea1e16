//! The forward's device buffers and the checks both forwards make on them (`MsaForward` and
//! the KV-parallel `MsaForwardKv`), apart from `forward.rs` so that the KV forward, which
//! `forward`'s convenience API runs, does not import that module.

use crate::backend::Span;
use crate::buffers::{check_regions, Region};
use crate::contract::{NUM_INDEX_HEADS, NUM_Q_HEADS, Q_ROW, TOPK_BLOCKS};
use crate::error::RuntimeError;
use crate::ops::check_len;
use half::bf16;

/// The device buffers of one forward call; `T` and `W` come from the schedule's sizes.
#[derive(Debug, Clone, Copy)]
pub struct ForwardBuffers {
    /// `q [T, 64, 128]` bf16.
    pub q: Span<bf16>,
    /// `k_aligned [W, 4, 128]` bf16 in the schedule's aligned layout, zero padding rows.
    pub k_aligned: Span<bf16>,
    /// `v_aligned`, as `k_aligned`.
    pub v_aligned: Span<bf16>,
    /// `q2k [4, T, 16]` int32, the selection the schedule was built from.
    pub q2k: Span<i32>,
    /// Output `out [T, 64, 128]` bf16.
    pub out: Span<bf16>,
    /// Output `lse [T, 64]` f32.
    pub lse: Span<f32>,
}

impl ForwardBuffers {
    /// The lengths of `q2k`, `out` and `lse` for `t` tokens (both forwards check them).
    pub(crate) fn check_q2k_and_outputs(&self, t: usize) -> Result<(), RuntimeError> {
        let q2k_len = NUM_INDEX_HEADS * t * TOPK_BLOCKS;
        check_len("q2k", self.q2k.len, q2k_len, "[4, T, 16] int32")?;
        check_len("out", self.out.len, t * Q_ROW, "[T, 64, 128] bf16")?;
        check_len("lse", self.lse.len, t * NUM_Q_HEADS, "[T, 64] f32")
    }

    /// No output on an input or on the other output (both forwards check it).
    pub(crate) fn check_no_overlap(&self) -> Result<(), RuntimeError> {
        check_regions(
            &[
                Region::input("q", self.q)?,
                Region::input("k_aligned", self.k_aligned)?,
                Region::input("v_aligned", self.v_aligned)?,
                Region::input("q2k", self.q2k)?,
                Region::output("out", self.out)?,
                Region::output("lse", self.lse)?,
            ],
            false,
            "no in-place forward",
        )
    }
}
