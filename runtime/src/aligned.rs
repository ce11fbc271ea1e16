//! Moves between compact K/V `[T, 4, 128]` and the aligned workspace layout `[W, 4, 128]`
//! the backward reads (`docs/design.md` §1.5), on the device.
//!
//! The aligned layout gives each document a 128-row aligned region; the rows past a document's
//! end (and any gap between regions) are *padding*. The main kernels load every key block as
//! a full 128-row tile, so padding rows are read, and the backward requires them to be zero: a
//! NaN or Inf there makes NaN gradients (`0·NaN` in the dQ GEMM; see the `kv_layout` kernels'
//! description for why masking in the kernels cannot prevent it). [`to_aligned`] writes every
//! row of the aligned buffers, padding included, so buffers that start as garbage (a fresh
//! allocation, `torch.empty`) are safe; [`from_aligned`] brings dK/dV back to compact rows.
//!
//! Both are one launch each, stream-ordered, with no host sync.
//!
//! Layer 3 of the crate (the host flow); [`to_aligned`] and [`from_aligned`] are layer 5, in
//! the `stream` child, re-exported here.

use crate::backend::{bytes_of, Backend, Ptr, Span};
use crate::buffers::{check_regions, Region};
use crate::contract::BLOCK_SIZE;
use crate::error::RuntimeError;
use crate::kernels::{kv_from_aligned, kv_to_aligned};
use crate::ops::check_len;
use crate::schedule::Schedule;
use half::bf16;

mod stream;
pub use stream::{from_aligned, to_aligned};

pub(crate) use crate::contract::KV_ROW;

/// The table both layout kernels read, `[W/128, 2]` u32: for each workspace key block, the
/// compact row of its first row and how many of its 128 rows are real (the others are
/// padding). Blocks in a gap between documents have no real rows.
pub fn block_rows(schedule: &Schedule) -> Vec<u32> {
    let mut table = vec![0u32; 2 * (schedule.workspace_rows() / BLOCK_SIZE)];
    let cu = schedule.cu_seqlens();
    for (d, &ws) in schedule.document_workspace_starts().iter().enumerate() {
        // A validated schedule: offsets non-negative and non-decreasing, starts 128-aligned,
        // and every document's region inside W.
        let (start, len) = (cu[d] as usize, (cu[d + 1] - cu[d]) as usize);
        let first_block = ws as usize / BLOCK_SIZE;
        for j in 0..len.div_ceil(BLOCK_SIZE) {
            let kb = first_block + j;
            table[2 * kb] = (start + j * BLOCK_SIZE) as u32;
            table[2 * kb + 1] = (len - j * BLOCK_SIZE).min(BLOCK_SIZE) as u32;
        }
    }
    table
}

/// The checks and the launch shared by both directions: `compact` are `[T, 4, 128]` K and V
/// (or dK and dV), `aligned` the `[W, 4, 128]` ones; `to` says which pair is written.
fn launch<B: Backend>(
    backend: &mut B,
    schedule: &Schedule,
    compact: [(&'static str, Span<bf16>); 2],
    aligned: [(&'static str, Span<bf16>); 2],
    to: bool,
) -> Result<(), RuntimeError> {
    let (t, w) = (schedule.num_tokens(), schedule.workspace_rows());
    // A validated schedule has W <= i32::MAX and T <= W, so these products fit in usize.
    for (field, span) in compact {
        check_len(field, span.len, t * KV_ROW, "[T, 4, 128] bf16")?;
    }
    for (field, span) in aligned {
        check_len(field, span.len, w * KV_ROW, "[W, 4, 128] bf16")?;
    }
    let (read, written) = if to {
        (compact, aligned)
    } else {
        (aligned, compact)
    };
    let mut regions = Vec::with_capacity(4);
    for (field, span) in read {
        regions.push(Region::input(field, span)?);
    }
    for (field, span) in written {
        regions.push(Region::output(field, span)?);
    }
    // Never in place: the two layouts place the rows differently.
    check_regions(&regions, false, "(never: the layouts differ)")?;
    let kernel = if to {
        &kv_to_aligned::KERNEL
    } else {
        &kv_from_aligned::KERNEL
    };
    backend.load(kernel)?;
    let ws_rows = u32::try_from(w)
        .map_err(|_| RuntimeError::input("schedule.workspace_rows", w, "below 2^32"))?;
    // 16 bytes per thread, 1024 bytes per row: a CTA moves THREADS/64 rows.
    let rows_per_cta = kv_to_aligned::THREADS.0 / 64;
    let grid = (ws_rows / rows_per_cta, 2, 1);
    let table = block_rows(schedule);
    let storage = backend.alloc("block_rows", 4 * table.len())?;
    let table_addr = backend.address(&storage);
    backend.upload("block_rows", table_addr, bytes_of(&table))?;
    let table_ptr = Ptr::<u32>::new(table_addr);
    let args = if to {
        kv_to_aligned::args(
            compact[0].1.ptr(),
            compact[1].1.ptr(),
            table_ptr,
            aligned[0].1.ptr_mut(),
            aligned[1].1.ptr_mut(),
            ws_rows,
        )
    } else {
        kv_from_aligned::args(
            aligned[0].1.ptr(),
            aligned[1].1.ptr(),
            table_ptr,
            compact[0].1.ptr_mut(),
            compact[1].1.ptr_mut(),
            ws_rows,
        )
    };
    // SAFETY: the lengths were checked against T and W; the table has W/128 entries, each
    // naming rows inside [0, T) of a validated schedule; the grid covers W rows exactly.
    unsafe { backend.launch(kernel, grid, &args) }?;
    // Dropping the table frees it stream-ordered, after the kernel.
    drop(storage);
    Ok(())
}

/// Packs compact `k`, `v` `[T, 4, 128]` bf16 into `k_aligned`, `v_aligned` `[W, 4, 128]` in the
/// schedule's workspace layout, on any [`Backend`]: real rows are copied, every padding row is
/// written with zeros (the buffers' old contents never matter). One launch, no host sync.
///
/// # Errors
/// [`RuntimeError::Input`] for a wrong length or misaligned base, [`RuntimeError::NullBuffer`],
/// [`RuntimeError::Overlap`] when an aligned buffer overlaps another buffer of the call, and
/// the backend's load, allocation and launch errors. Nothing is issued on a check's error.
pub fn to_aligned_on<B: Backend>(
    backend: &mut B,
    schedule: &Schedule,
    k: Span<bf16>,
    v: Span<bf16>,
    k_aligned: Span<bf16>,
    v_aligned: Span<bf16>,
) -> Result<(), RuntimeError> {
    launch(
        backend,
        schedule,
        [("k", k), ("v", v)],
        [("k_aligned", k_aligned), ("v_aligned", v_aligned)],
        true,
    )
}

/// Gathers the real rows of `dk_aligned`, `dv_aligned` `[W, 4, 128]` bf16 into compact `dk`,
/// `dv` `[T, 4, 128]`, on any [`Backend`]. One launch, no host sync.
///
/// # Errors
/// As [`to_aligned_on`], with the compact buffers as the outputs.
pub fn from_aligned_on<B: Backend>(
    backend: &mut B,
    schedule: &Schedule,
    dk_aligned: Span<bf16>,
    dv_aligned: Span<bf16>,
    dk: Span<bf16>,
    dv: Span<bf16>,
) -> Result<(), RuntimeError> {
    launch(
        backend,
        schedule,
        [("dk", dk), ("dv", dv)],
        [("dk_aligned", dk_aligned), ("dv_aligned", dv_aligned)],
        false,
    )
}
