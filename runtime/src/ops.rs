//! Launch wrappers of the standalone kernels: each validates its inputs, picks the PTX variant
//! of the device and launches without synchronizing; generic over the [`Backend`], with
//! cudarc-view wrappers for a CUDA stream.
//!
//! Layer 3 of the crate (the host flow); the cudarc wrappers are layer 5, in the `stream`
//! child, re-exported here.

use crate::backend::{Backend, Span};
use crate::buffers::{check_regions, Region};
use crate::contract::{HEAD_DIM, NUM_KV_HEADS, NUM_Q_HEADS};
use crate::error::RuntimeError;
use crate::kernels::{bwd_postprocess, bwd_postprocess_det, bwd_preprocess, bwd_preprocess_det};
use half::bf16;

mod stream;
pub use stream::{run_postprocess, run_preprocess};

/// Tokens per CTA of `bwd_preprocess`: one CTA per 128 rows `(t, h)` (its `ROWS_PER_CTA`,
/// tied to this by a test).
pub const PREPROCESS_TOKENS_PER_CTA: usize = 2;
/// Checks that a buffer of `len` elements holds the `expected` elements of `shape`.
pub(crate) fn check_len(
    field: &'static str,
    len: usize,
    expected: usize,
    shape: &str,
) -> Result<(), RuntimeError> {
    if len == expected {
        Ok(())
    } else {
        Err(RuntimeError::input(
            field,
            format!("{len} elements"),
            format!("{expected} elements ({shape})"),
        ))
    }
}

/// A `u32` kernel argument, or the error naming `field`.
/// `v` as a kernel's `u32` parameter `field`.
pub(crate) fn u32_arg(field: &'static str, v: usize) -> Result<u32, RuntimeError> {
    u32::try_from(v).map_err(|_| RuntimeError::input(field, v, "at most u32::MAX"))
}

/// `n` CTAs as a grid's x dimension, named `field` in the error.
pub(crate) fn grid_dim(field: &'static str, n: usize) -> Result<u32, RuntimeError> {
    // The grid's x dimension holds at most 2^31 - 1 CTAs.
    u32::try_from(n)
        .ok()
        .filter(|&v| v <= i32::MAX as u32)
        .ok_or_else(|| RuntimeError::input(field, n, "a grid of at most 2^31-1 CTAs"))
}

/// `delta[t, h] = Σ_d out[t, h, d] · dout[t, h, d]` in fp32, on any [`Backend`].
///
/// `out` and `dout` are `[T, 64, 128]` bf16, `delta` is `[T, 64]` fp32.
pub fn preprocess<B: Backend>(
    backend: &mut B,
    out: Span<bf16>,
    dout: Span<bf16>,
    delta: Span<f32>,
    num_tokens: usize,
) -> Result<(), RuntimeError> {
    let rows = num_tokens * NUM_Q_HEADS;
    check_len("out", out.len, rows * HEAD_DIM, "[T, 64, 128]")?;
    check_len("dout", dout.len, rows * HEAD_DIM, "[T, 64, 128]")?;
    check_len("delta", delta.len, rows, "[T, 64]")?;
    let tokens = u32_arg("num_tokens", num_tokens)?;
    if num_tokens == 0 {
        return Ok(());
    }
    let blocks = grid_dim("num_tokens", num_tokens.div_ceil(PREPROCESS_TOKENS_PER_CTA))?;
    backend.load(&bwd_preprocess::KERNEL)?;
    let args = bwd_preprocess::args(out.ptr(), dout.ptr(), delta.ptr_mut(), tokens);
    // SAFETY: every buffer length was checked against num_tokens above.
    unsafe { backend.launch(&bwd_preprocess::KERNEL, (blocks, 1, 1), &args) }
}

/// Finishes the gradients on any [`Backend`]: de-interleaves the bf16 dQ pool
/// `[T, 32, 128, 2]` into `dq [T, 64, 128]` and casts the fp32 pools `dk_pool`, `dv_pool`
/// `[W, 4, 128]` to bf16 `dk`, `dv` with round-to-nearest-even. `W` must be a multiple of 128.
///
/// `dq_pool` may be `dq` itself (same base): the de-interleave then runs in place, which is
/// how the backward uses it with the Blackwell kernel's pool (the Hopper kernel writes
/// `[T, 64, 128]` already: it passes `num_tokens = 0` and empty dQ spans, and only the dK/dV
/// cast runs). Otherwise no output may overlap another buffer.
///
/// # Errors
/// [`RuntimeError::Input`] for a wrong length or `W`, [`RuntimeError::NullBuffer`] and
/// [`RuntimeError::Overlap`] from the buffer checks, and the backend's launch errors.
#[allow(clippy::too_many_arguments)]
pub fn postprocess<B: Backend>(
    backend: &mut B,
    dq_pool: Span<bf16>,
    dk_pool: Span<f32>,
    dv_pool: Span<f32>,
    dq: Span<bf16>,
    dk: Span<bf16>,
    dv: Span<bf16>,
    num_tokens: usize,
    workspace_rows: usize,
) -> Result<(), RuntimeError> {
    if !workspace_rows.is_multiple_of(128) {
        return Err(RuntimeError::input(
            "workspace_rows",
            workspace_rows,
            "a multiple of 128",
        ));
    }
    let dq_len = num_tokens * NUM_Q_HEADS * HEAD_DIM;
    let kv_len = workspace_rows * NUM_KV_HEADS * HEAD_DIM;
    check_len("dq_pool", dq_pool.len, dq_len, "[T, 32, 128, 2]")?;
    check_len("dq", dq.len, dq_len, "[T, 64, 128]")?;
    check_len("dk_pool", dk_pool.len, kv_len, "[W, 4, 128]")?;
    check_len("dv_pool", dv_pool.len, kv_len, "[W, 4, 128]")?;
    check_len("dk", dk.len, kv_len, "[W, 4, 128]")?;
    check_len("dv", dv.len, kv_len, "[W, 4, 128]")?;
    // Empty buffers (T = 0 or W = 0) may be null and hold nothing to overlap. In place,
    // `dq` covers exactly the pool's bytes, so checking `dq` checks both.
    let mut regions = Vec::with_capacity(6);
    if kv_len > 0 {
        regions.push(Region::input("dk_pool", dk_pool)?);
        regions.push(Region::input("dv_pool", dv_pool)?);
        regions.push(Region::output("dk", dk)?);
        regions.push(Region::output("dv", dv)?);
    }
    if dq_len > 0 {
        regions.push(Region::output("dq", dq)?);
        if dq_pool.addr != dq.addr {
            regions.push(Region::input("dq_pool", dq_pool)?);
        }
    }
    check_regions(
        &regions,
        false,
        "dq_pool == dq (the in-place de-interleave)",
    )?;
    let tokens = u32_arg("num_tokens", num_tokens)?;
    let ws = u32_arg("workspace_rows", workspace_rows)?;
    let blocks = (2 * num_tokens).max(workspace_rows / 2);
    if blocks == 0 {
        return Ok(());
    }
    let blocks = grid_dim("num_tokens/workspace_rows", blocks)?;
    backend.load(&bwd_postprocess::KERNEL)?;
    let args = bwd_postprocess::args(
        dq_pool.ptr(),
        dk_pool.ptr(),
        dv_pool.ptr(),
        dq.ptr_mut(),
        dk.ptr_mut(),
        dv.ptr_mut(),
        tokens,
        ws,
    );
    // SAFETY: every buffer length was checked against num_tokens and workspace_rows above.
    unsafe { backend.launch(&bwd_postprocess::KERNEL, (blocks, 2, 1), &args) }
}

/// Words of the deterministic mode's `bounds` buffer (mirrors `codegen`'s
/// `fixed_point::BOUND_WORDS`; a test compares them).
pub const BOUND_WORDS: usize = 32;

/// The deterministic mode's fixed-point buffers (`docs/design.md` §3.8): the pools the main
/// kernel reduces into with integer atomics and the bounds their units come from.
#[derive(Debug, Clone, Copy)]
pub struct FixedPointPools {
    /// dQ as integer-valued f32 `[T, 4, 4, 128, 4]`: token, group, head quad, `d`, and the
    /// quad's heads `2p, 2p+1, 2p+8, 2p+9` of the group.
    pub dq: Span<f32>,
    /// dK, one signed 64-bit word per element of `[W, 4, 128]`, viewed as i32 pairs.
    pub dk: Span<i32>,
    /// dV, as `dk`.
    pub dv: Span<i32>,
    /// `a[t, g]` `[T, 4]` (f32 bits), the per-row dQ bound, written by the preprocess.
    pub row_bounds: Span<i32>,
    /// The group maxima ([`BOUND_WORDS`] words, f32 bits); zero before the preprocess.
    pub bounds: Span<i32>,
}

impl FixedPointPools {
    fn check(&self, num_tokens: usize, workspace_rows: usize) -> Result<(), RuntimeError> {
        let kv = workspace_rows * NUM_KV_HEADS * HEAD_DIM;
        check_len(
            "dq_pool",
            self.dq.len,
            num_tokens * NUM_Q_HEADS * HEAD_DIM,
            "[T, 4, 4, 128, 4] f32",
        )?;
        check_len("dk_pool", self.dk.len, 2 * kv, "[W, 4, 128] i64")?;
        check_len("dv_pool", self.dv.len, 2 * kv, "[W, 4, 128] i64")?;
        check_len(
            "row_bounds",
            self.row_bounds.len,
            4 * num_tokens,
            "[T, 4] u32",
        )?;
        check_len("bounds", self.bounds.len, BOUND_WORDS, "[32] u32")
    }
}

/// The deterministic mode's preprocess on any [`Backend`]: `delta` as [`preprocess`], and the
/// bounds the fixed-point units come from (`pools.row_bounds`, and `pools.bounds`, which must
/// be zero before the launch: the CTAs fold their maxima into it) from `out`, `dout`, `q` `[T, 64, 128]` and `k_aligned`, `v_aligned`
/// `[W, 4, 128]` bf16.
///
/// # Errors
/// [`RuntimeError::Input`] for a wrong length, and the backend's launch errors.
#[allow(clippy::too_many_arguments)]
pub fn preprocess_deterministic<B: Backend>(
    backend: &mut B,
    out: Span<bf16>,
    dout: Span<bf16>,
    q: Span<bf16>,
    k_aligned: Span<bf16>,
    v_aligned: Span<bf16>,
    delta: Span<f32>,
    pools: &FixedPointPools,
    num_tokens: usize,
    workspace_rows: usize,
) -> Result<(), RuntimeError> {
    let rows = num_tokens * NUM_Q_HEADS;
    let kv = workspace_rows * NUM_KV_HEADS * HEAD_DIM;
    check_len("out", out.len, rows * HEAD_DIM, "[T, 64, 128]")?;
    check_len("dout", dout.len, rows * HEAD_DIM, "[T, 64, 128]")?;
    check_len("q", q.len, rows * HEAD_DIM, "[T, 64, 128]")?;
    check_len("k_aligned", k_aligned.len, kv, "[W, 4, 128]")?;
    check_len("v_aligned", v_aligned.len, kv, "[W, 4, 128]")?;
    check_len("delta", delta.len, rows, "[T, 64]")?;
    pools.check(num_tokens, workspace_rows)?;
    let tokens = u32_arg("num_tokens", num_tokens)?;
    let ws = u32_arg("workspace_rows", workspace_rows)?;
    let blocks = num_tokens.max(workspace_rows).div_ceil(128);
    if blocks == 0 {
        return Ok(());
    }
    let blocks = grid_dim("num_tokens/workspace_rows", blocks)?;
    backend.load(&bwd_preprocess_det::KERNEL)?;
    let args = bwd_preprocess_det::args(
        out.ptr(),
        dout.ptr(),
        q.ptr(),
        k_aligned.ptr(),
        v_aligned.ptr(),
        delta.ptr_mut(),
        pools.row_bounds.ptr_mut(),
        pools.bounds.ptr_mut(),
        tokens,
        ws,
    );
    // blockIdx.y: the query tokens of each KV group, then the K/V rows of each group.
    let y = (2 * NUM_KV_HEADS) as u32;
    // SAFETY: every buffer length was checked against num_tokens and workspace_rows above.
    unsafe { backend.launch(&bwd_preprocess_det::KERNEL, (blocks, y, 1), &args) }
}

/// The deterministic mode's postprocess on any [`Backend`]: decodes the fixed-point pools of
/// `pools` into `dq [T, 64, 128]` and `dk`, `dv` `[W, 4, 128]` bf16.
///
/// # Errors
/// [`RuntimeError::Input`] for a wrong length, and the backend's launch errors.
pub fn postprocess_deterministic<B: Backend>(
    backend: &mut B,
    pools: &FixedPointPools,
    dq: Span<bf16>,
    dk: Span<bf16>,
    dv: Span<bf16>,
    num_tokens: usize,
    workspace_rows: usize,
) -> Result<(), RuntimeError> {
    let kv = workspace_rows * NUM_KV_HEADS * HEAD_DIM;
    pools.check(num_tokens, workspace_rows)?;
    check_len(
        "dq",
        dq.len,
        num_tokens * NUM_Q_HEADS * HEAD_DIM,
        "[T, 64, 128]",
    )?;
    check_len("dk", dk.len, kv, "[W, 4, 128]")?;
    check_len("dv", dv.len, kv, "[W, 4, 128]")?;
    let tokens = u32_arg("num_tokens", num_tokens)?;
    let ws = u32_arg("workspace_rows", workspace_rows)?;
    let blocks = num_tokens.max(workspace_rows / 2);
    if blocks == 0 {
        return Ok(());
    }
    let blocks = grid_dim("num_tokens/workspace_rows", blocks)?;
    backend.load(&bwd_postprocess_det::KERNEL)?;
    let args = bwd_postprocess_det::args(
        pools.dq.ptr(),
        pools.dk.ptr(),
        pools.dv.ptr(),
        pools.row_bounds.ptr(),
        pools.bounds.ptr(),
        dq.ptr_mut(),
        dk.ptr_mut(),
        dv.ptr_mut(),
        tokens,
        ws,
    );
    // SAFETY: every buffer length was checked against num_tokens and workspace_rows above.
    unsafe { backend.launch(&bwd_postprocess_det::KERNEL, (blocks, 2, 1), &args) }
}
