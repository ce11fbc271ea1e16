//! Context parallelism: one packed sequence split across `R` ranks (GPUs), each running the
//! backward for its own queries against the key blocks of every rank.
//!
//! # Rank layout
//! The split is made in the aligned workspace layout (`docs/design.md` §1.5), so that every
//! 128-key block, and every collective, is whole. With `B = W/128` key blocks of the dense
//! layout of `cu_seqlens`, every rank holds a *slice* of `S = ceil(B/R)·128` workspace rows:
//! rank `r` holds rows `[r·S, (r+1)·S)` (the last rank's slice ends in zero rows past `W`),
//! and the tokens whose aligned rows lie there, a contiguous range of compact rows
//! ([`CpLayout::token_rows`]). A document may straddle ranks; it is cut at one of its own
//! 128-token block boundaries. Per rank:
//! - its query-side tensors: `q`, `grad_out`, `out` `[T_r, 64, 128]`, `lse [T_r, 64]`, its
//!   rows of `q2k` (`[4, T_r, 16]`), and the output `dq [T_r, 64, 128]`;
//! - its K/V slice `[S, 4, 128]` (the rank's rows of the aligned layout: the
//!   documents' pieces of [`CpLayout::local_cu_seqlens`], packed as `to_aligned` packs
//!   documents, then zeros), and the outputs `dk_slice`/`dv_slice` of the same shape.
//!
//! # The flow ([`CpBackward::run_on`])
//! 1. All-gather K and V (bf16): every rank then holds the whole aligned K/V, `R·S` rows.
//!    Every rank's schedule verdict (a device-built schedule's flags word, zero for a host
//!    schedule) is gathered beside them, so that [`CpBackward::status`] reports a flagged
//!    rank on every rank: its queries are missing from every rank's dK/dV.
//! 2. The local backward: the local schedule ([`CpLayout::local_schedule`], the rank's
//!    queries against the CSR rows of every document, [`Schedule::restrict_queries`]) runs
//!    the usual preprocess, task build and main kernel; dQ is local and final. dK/dV stay in
//!    the fp32 pools, `R·S` rows, holding this rank's queries' share of every key block.
//! 3. Reduce-scatter the fp32 pools (a sum over ranks): rank `r` gets rows `[r·S, (r+1)·S)`
//!    summed, and the postprocess rounds them to bf16 into its `dk_slice`/`dv_slice`. The sum
//!    is exact fp32, so the precision is that of the single-device backward (one more fp32
//!    rounding per element).
//!
//! # The forward ([`CpForward::run_on`])
//! The rank validates its rows of the selection on the host and builds its schedule
//! ([`CpLayout::local_schedule`], returned for the backward), uploads the selection and the
//! documents' tables, all-gathers K and V as above and runs the forward kernel on its own
//! queries: the kernel's `first_token` parameter puts local row `i` at token
//! `token_rows(rank).start + i` of the packed sequence for the document search, while `q`,
//! `q2k`, `out` and `lse` stay local. `out` and `lse` are final on each rank (a row's keys are
//! all in the gathered K/V), so the forward needs no reduction.
//!
//! Communication is `2·(R−1)/R·S·R·1 KiB` per gather (K and V, bf16) and the same in fp32 ×2
//! per reduce-scatter, per rank. The gather is issued before the preprocess, the zeroing and
//! the task build, none of which reads K/V, and only the main kernel waits for it
//! ([`Collective::wait`]): `NcclCollective` runs its collectives on a stream of its own, so the
//! gather overlaps that work.
//!
//! A rank's schedule is validated on the host ([`CpLayout::local_schedule`]) or built on the
//! device from the rank's device rows of the selection ([`RankSchedule`], with no host copy or
//! sync; [`CpForward::run_on_device`]); [`CpBackward::run_on`] takes either ([`CpSchedule`]).
//!
//! The collectives are behind [`Collective`]: [`HostGroup`] runs `R` logical ranks in one
//! process (threads, each with its own backend) through host memory, for tests on one device
//! or on the simulator; `NcclCollective` (feature `nccl`; in the `stream` child) calls NCCL through
//! cudarc on the backend's stream.
//!
//! Layer 3 of the crate (the host flow, generic over [`Backend`]); the NCCL binding, its
//! `stream` child, is layer 5.

use crate::backend::{bytes_of, Backend, Ptr, Span};
use crate::backward::{BackwardBuffers, BackwardSchedule, MsaBackward};
use crate::buffers::{check_regions, Region};
use crate::contract::{BLOCK_SIZE, KV_ROW, NUM_INDEX_HEADS, NUM_Q_HEADS, Q_ROW, TOPK_BLOCKS};
use crate::error::RuntimeError;
use crate::forward::{ForwardBuffers, MsaForward, QueryRows, QUERIES_PER_WORK};
use crate::ops::{check_len, postprocess};
use crate::schedule::{build_schedule_for_rows, workspace_layout, Schedule, ScheduleError};
use crate::schedule_build::{ResidentSchedule, ScheduleBuildSizes};
use half::bf16;
use std::mem::{size_of, size_of_val};
use std::ops::Range;
use std::sync::{Arc, Barrier, Mutex};

// The NCCL binding (layer 5), re-exported so its path is `msa_runtime::cp::NcclCollective`.
#[cfg(feature = "nccl")]
mod stream;
#[cfg(feature = "nccl")]
pub use stream::{nccl_present, NcclCollective};

/// How a packed sequence is split across ranks (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpLayout {
    ranks: usize,
    cu_seqlens: Vec<i32>,
    workspace_starts: Vec<i32>,
    workspace_rows: usize,
    slice_blocks: usize,
    token_bounds: Vec<usize>,
}

impl CpLayout {
    /// The layout of the documents `cu_seqlens` over `ranks` ranks.
    ///
    /// # Errors
    /// [`RuntimeError::Schedule`] for an invalid `cu_seqlens`; [`RuntimeError::Input`] when
    /// `ranks` is 0, or such that some rank would hold no key block (each rank holds
    /// `ceil(B/R)` of the `B` blocks, so `R` must satisfy `(R−1)·ceil(B/R) < B`); the
    /// message names the nearest counts that do.
    pub fn new(cu_seqlens: &[i32], ranks: usize) -> Result<CpLayout, RuntimeError> {
        let (workspace_starts, workspace_rows) = workspace_layout(cu_seqlens)?;
        let blocks = workspace_rows / BLOCK_SIZE;
        if ranks == 0 {
            return Err(RuntimeError::input("ranks", 0, "at least 1"));
        }
        let slice_blocks = blocks.div_ceil(ranks);
        let fits = |r: usize| r >= 1 && (r - 1) * blocks.div_ceil(r) < blocks;
        if !fits(ranks) {
            // The valid counts are not every count up to B (7 blocks: 1-4 and 7), so name the
            // nearest ones.
            let below = (1..ranks.min(blocks + 1)).rev().find(|&r| fits(r));
            let above = (ranks + 1..=blocks).find(|&r| fits(r));
            let nearest = match (below, above) {
                (Some(b), Some(a)) => format!("{b} or {a}"),
                (Some(b), None) => b.to_string(),
                (None, Some(a)) => a.to_string(),
                (None, None) => "none".into(),
            };
            return Err(RuntimeError::input(
                "ranks",
                ranks,
                format!(
                    "a count R with (R−1)·ceil(B/R) < B = {blocks} key blocks, so that no \
                     rank's slice is empty (nearest: {nearest})"
                ),
            ));
        }
        // The compact row of each key block's first token; block B ends at T.
        let mut first_token = Vec::with_capacity(blocks + 1);
        for (d, &ws) in workspace_starts.iter().enumerate() {
            let len = (cu_seqlens[d + 1] - cu_seqlens[d]) as usize;
            debug_assert_eq!(ws as usize / BLOCK_SIZE, first_token.len());
            for j in 0..len.div_ceil(BLOCK_SIZE) {
                first_token.push(cu_seqlens[d] as usize + j * BLOCK_SIZE);
            }
        }
        let t = cu_seqlens[cu_seqlens.len() - 1] as usize;
        first_token.push(t);
        let token_bounds = (0..=ranks)
            .map(|r| first_token[(r * slice_blocks).min(blocks)])
            .collect();
        Ok(CpLayout {
            ranks,
            cu_seqlens: cu_seqlens.to_vec(),
            workspace_starts,
            workspace_rows,
            slice_blocks,
            token_bounds,
        })
    }

    /// Ranks `R`.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The whole sequence's `cu_seqlens`.
    pub fn cu_seqlens(&self) -> &[i32] {
        &self.cu_seqlens
    }

    /// Workspace rows `W` of the whole sequence (dense layout).
    pub fn workspace_rows(&self) -> usize {
        self.workspace_rows
    }

    /// Rows `S` of every rank's K/V slice, `ceil(B/R)·128`.
    pub fn slice_rows(&self) -> usize {
        self.slice_blocks * BLOCK_SIZE
    }

    /// Rows of the gathered K/V and of the dK/dV pools, `R·S >= W`.
    pub fn gathered_rows(&self) -> usize {
        self.ranks * self.slice_rows()
    }

    /// The compact rows of rank `rank`'s tokens (its queries); the ranges of all ranks tile
    /// `0..T` in order. Empty past the last rank.
    pub fn token_rows(&self, rank: usize) -> Range<usize> {
        match self.token_bounds.get(rank..rank + 2) {
            Some(b) => b[0]..b[1],
            None => 0..0,
        }
    }

    /// The workspace rows of rank `rank`'s slice that hold key blocks, inside
    /// `[rank·S, (rank+1)·S)`.
    pub fn block_rows(&self, rank: usize) -> Range<usize> {
        let s = self.slice_rows();
        let start = (rank * s).min(self.workspace_rows);
        start..((rank + 1) * s).min(self.workspace_rows)
    }

    /// The pieces of documents in rank `rank`'s token range, as `cu_seqlens` of its compact
    /// rows: the dense aligned layout of these pieces is exactly the rank's
    /// [`CpLayout::block_rows`], so `to_aligned` of the rank's compact K/V over them gives its
    /// slice (then pad it with zero rows up to [`CpLayout::slice_rows`]).
    pub fn local_cu_seqlens(&self, rank: usize) -> Vec<i32> {
        let rows = self.token_rows(rank);
        let mut cu = vec![0i32];
        for w in self.cu_seqlens.windows(2) {
            let (s, e) = (w[0] as usize, w[1] as usize);
            let (a, b) = (s.max(rows.start), e.min(rows.end));
            if a < b {
                cu.push(cu[cu.len() - 1] + (b - a) as i32);
            }
        }
        cu
    }

    /// Rank `rank`'s rows of a whole-sequence selection `q2k [4, T, 16]`, as the
    /// `q2k_local [4, T_r, 16]` of [`CpLayout::local_schedule`] (for a caller that holds the
    /// whole selection on the host).
    ///
    /// # Errors
    /// [`RuntimeError::Input`] when `q2k` is not `4·T·16` long.
    pub fn rank_q2k(&self, rank: usize, q2k: &[i32]) -> Result<Vec<i32>, RuntimeError> {
        let t = self.token_bounds[self.ranks];
        let per_head = t * TOPK_BLOCKS;
        check_len(
            "q2k",
            q2k.len(),
            NUM_INDEX_HEADS * per_head,
            "[4, T, 16] i32",
        )?;
        let rows = self.token_rows(rank);
        Ok(q2k
            .chunks_exact(per_head)
            .flat_map(|h| &h[rows.start * TOPK_BLOCKS..rows.end * TOPK_BLOCKS])
            .copied()
            .collect())
    }

    /// Rank `rank`'s K/V slice `[S, 4, 128]` of a whole aligned `[W, 4, 128]` buffer on the
    /// host: its [`CpLayout::block_rows`], then zero rows.
    ///
    /// # Errors
    /// [`RuntimeError::Input`] when `aligned` is not `W·512` long.
    pub fn rank_slice<T: Copy + Default>(
        &self,
        rank: usize,
        aligned: &[T],
    ) -> Result<Vec<T>, RuntimeError> {
        let w = self.workspace_rows;
        check_len("aligned", aligned.len(), w * KV_ROW, "[W, 4, 128]")?;
        let rows = self.block_rows(rank);
        let mut slice = vec![T::default(); self.slice_rows() * KV_ROW];
        slice[..rows.len() * KV_ROW]
            .copy_from_slice(&aligned[rows.start * KV_ROW..rows.end * KV_ROW]);
        Ok(slice)
    }

    /// Rank `rank`'s schedule from its rows of the selection, `q2k_local [4, T_r, 16]`: the
    /// CSR rows and work items of every document, with the rank's queries only
    /// ([`build_schedule_for_rows`]).
    ///
    /// # Errors
    /// As [`build_schedule_for_rows`]; a selection error names the compact row.
    pub fn local_schedule(
        &self,
        rank: usize,
        q2k_local: &[i32],
        queries_per_work: usize,
    ) -> Result<Schedule, ScheduleError> {
        if rank >= self.ranks {
            return Err(ScheduleError::Invalid {
                field: "rank".into(),
                found: rank.to_string(),
                expected: format!("below {} (the layout's ranks)", self.ranks),
            });
        }
        build_schedule_for_rows(
            q2k_local,
            &self.cu_seqlens,
            self.token_rows(rank),
            queries_per_work,
        )
    }
}

/// The collectives of one rank of a context-parallel group. A collective starts after the work
/// issued on the backend before it; it may run on a queue of its own (NCCL on a stream of its
/// own), overlapping the backend's later work, so work that reads its result is issued after
/// [`Collective::wait`]. Every rank of the group calls the same collectives in the same order,
/// as with NCCL.
pub trait Collective<B: Backend> {
    /// Ranks of the group.
    fn ranks(&self) -> usize;
    /// This rank, `0..ranks`.
    fn rank(&self) -> usize;
    /// `recv[r·n .. (r+1)·n]` = rank `r`'s `send` (`n = send.len`) on every rank;
    /// `recv.len == ranks·n`.
    fn all_gather_bf16(
        &mut self,
        backend: &mut B,
        send: Span<bf16>,
        recv: Span<bf16>,
    ) -> Result<(), RuntimeError>;
    /// In place: with `n = buf.len / ranks`, `buf[rank·n .. (rank+1)·n]` becomes the sum over
    /// ranks `r` of rank `r`'s `buf[rank·n ..]` (f32); the rest of `buf` is left undefined.
    fn reduce_scatter_f32_in_place(
        &mut self,
        backend: &mut B,
        buf: Span<f32>,
    ) -> Result<(), RuntimeError>;
    /// Makes the work issued on `backend` after this call wait for the collectives issued
    /// before it. The default does nothing, for collectives that complete in the backend's
    /// order (such as [`HostGroup`]'s, which are done when they return).
    fn wait(&mut self, backend: &mut B) -> Result<(), RuntimeError> {
        let _ = backend;
        Ok(())
    }
}

/// `comm`'s rank, after checking that it is a rank of `layout`'s group.
fn check_group<B: Backend, C: Collective<B>>(
    comm: &C,
    layout: &CpLayout,
) -> Result<usize, RuntimeError> {
    let (ranks, rank) = (comm.ranks(), comm.rank());
    if ranks != layout.ranks() || rank >= ranks {
        return Err(RuntimeError::input(
            "comm",
            format!("rank {rank} of {ranks}"),
            format!(
                "a rank of a group of {} (the layout's ranks)",
                layout.ranks()
            ),
        ));
    }
    Ok(rank)
}

/// A device buffer of at least `bytes` bytes from `cache`, reallocated when it is smaller.
fn cached<B: Backend>(
    backend: &mut B,
    cache: &mut Option<(B::Buffer, usize)>,
    what: &'static str,
    bytes: usize,
) -> Result<u64, RuntimeError> {
    if let Some((buf, have)) = cache.as_ref() {
        if *have >= bytes {
            return Ok(backend.address(buf));
        }
    }
    *cache = None;
    let buf = backend.alloc(what, bytes)?;
    let at = backend.address(&buf);
    *cache = Some((buf, bytes));
    Ok(at)
}

/// The gathered K and V, `R·S` rows each, in one cached buffer.
fn gathered_kv<B: Backend>(
    backend: &mut B,
    cache: &mut Option<(B::Buffer, usize)>,
    layout: &CpLayout,
) -> Result<(Span<bf16>, Span<bf16>), RuntimeError> {
    let g = layout.gathered_rows();
    let bytes = 2 * g * KV_ROW * size_of::<bf16>();
    let base = cached(backend, cache, "gathered K/V", bytes)?;
    let k_all = Span::<bf16>::new(base, g * KV_ROW);
    let v_all = Span::<bf16>::new(base + (g * KV_ROW * size_of::<bf16>()) as u64, g * KV_ROW);
    Ok((k_all, v_all))
}

/// Rank `rank`'s schedule of a layout built on the device from the rank's device rows of the
/// selection, with no host sync: a [`ResidentSchedule::new_for_rows`] over the layout's
/// documents and the rank's token rows. Its tables equal [`CpLayout::local_schedule`]'s except
/// the edge capacity (`16·T`, the whole sequence's); a bad selection is flagged on the device
/// (the rank's backward then has no work: its dq is zero and its queries contribute nothing
/// to any rank's dK/dV; [`RankSchedule::status`] names the fault, and every rank's
/// [`CpBackward::status`] names the flagged ranks).
pub struct RankSchedule<B: Backend> {
    rank: usize,
    cu_seqlens: Vec<i32>,
    // The layout's cu_seqlens on the device, the builds' input (uploaded once).
    cu_device: B::Buffer,
    resident: ResidentSchedule<B>,
}

impl<B: Backend> RankSchedule<B> {
    /// Allocates rank `rank`'s schedule of `layout` (its only allocations; the builds are
    /// stream-ordered kernel work).
    ///
    /// # Errors
    /// [`RuntimeError::Input`] for a rank outside the layout or a sequence the device build
    /// does not size ([`ScheduleBuildSizes::new`]); the backend's errors.
    pub fn new(backend: &mut B, layout: &CpLayout, rank: usize) -> Result<Self, RuntimeError> {
        if rank >= layout.ranks() {
            return Err(RuntimeError::input(
                "rank",
                rank,
                format!("below {} (the layout's ranks)", layout.ranks()),
            ));
        }
        let cu = layout.cu_seqlens();
        let t = cu[cu.len() - 1] as usize;
        let sizes =
            ScheduleBuildSizes::new(t, cu.len() - 1, layout.workspace_rows(), QUERIES_PER_WORK)?;
        let resident = ResidentSchedule::new_for_rows(backend, sizes, layout.token_rows(rank), cu)?;
        let cu_device = backend.alloc("rank schedule cu_seqlens", size_of_val(cu))?;
        let at = backend.address(&cu_device);
        backend.upload("rank schedule cu_seqlens", at, bytes_of(cu))?;
        Ok(RankSchedule {
            rank,
            cu_seqlens: cu.to_vec(),
            cu_device,
            resident,
        })
    }

    /// Builds the schedule from the rank's rows of the selection on the device, `q2k_local
    /// [4, T_r, 16]` int32 (document-local block ids): three launches, no host sync, no
    /// allocation, no copy (capturable).
    ///
    /// # Errors
    /// As [`ResidentSchedule::build`]: a wrong length or alignment of `q2k_local`, load and
    /// launch errors. A bad selection is not an error here (see [`RankSchedule::status`]).
    pub fn build(&mut self, backend: &mut B, q2k_local: Span<i32>) -> Result<(), RuntimeError> {
        let cu = Span::<i32>::new(backend.address(&self.cu_device), self.cu_seqlens.len());
        self.resident.build(backend, q2k_local, cu)
    }

    /// Waits for the last build and returns its verdict (see [`ResidentSchedule::status`]);
    /// synchronizes.
    pub fn status(&self, backend: &mut B) -> Result<(), RuntimeError> {
        self.resident.status(backend)
    }

    /// The rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The schedule on the device (its query rows are the rank's token rows).
    pub fn resident(&self) -> &ResidentSchedule<B> {
        &self.resident
    }
}

/// The schedule a rank's backward runs on: validated on the host ([`CpLayout::local_schedule`],
/// [`CpForward::run_on`]'s), or built on the device ([`RankSchedule`],
/// [`CpForward::run_on_device`]'s).
pub enum CpSchedule<'a, B: Backend> {
    /// A host schedule, uploaded by the call.
    Host(&'a Schedule),
    /// A schedule built on the device, read in place.
    Device(&'a RankSchedule<B>),
}

impl<'a, B: Backend> From<&'a Schedule> for CpSchedule<'a, B> {
    fn from(s: &'a Schedule) -> Self {
        CpSchedule::Host(s)
    }
}

impl<'a, B: Backend> From<&'a RankSchedule<B>> for CpSchedule<'a, B> {
    fn from(s: &'a RankSchedule<B>) -> Self {
        CpSchedule::Device(s)
    }
}

impl<'a, B: Backend> CpSchedule<'a, B> {
    /// The backward's schedule, after checking that this is rank `rank`'s of `layout`.
    fn checked(
        &self,
        layout: &CpLayout,
        rank: usize,
    ) -> Result<BackwardSchedule<'a, B>, RuntimeError> {
        match *self {
            CpSchedule::Host(schedule) => {
                if schedule.cu_seqlens() != layout.cu_seqlens()
                    || schedule.document_workspace_starts() != layout.workspace_starts.as_slice()
                {
                    return Err(RuntimeError::input(
                        "schedule",
                        "a schedule of other documents or another workspace layout",
                        "the layout's cu_seqlens in the dense workspace layout (CpLayout::local_schedule)",
                    ));
                }
                if schedule.query_rows() != layout.token_rows(rank) {
                    return Err(RuntimeError::input(
                        "schedule",
                        format!("query rows {:?}", schedule.query_rows()),
                        format!("rank {rank}'s token rows {:?}", layout.token_rows(rank)),
                    ));
                }
                Ok(BackwardSchedule::Host(schedule))
            }
            CpSchedule::Device(s) => {
                if s.cu_seqlens != layout.cu_seqlens() {
                    return Err(RuntimeError::input(
                        "schedule",
                        "a rank schedule of other documents",
                        "one made for this layout (RankSchedule::new)",
                    ));
                }
                if s.rank != rank {
                    return Err(RuntimeError::input(
                        "schedule",
                        format!("rank {}'s schedule", s.rank),
                        format!("rank {rank}'s (the communicator's rank)"),
                    ));
                }
                Ok(BackwardSchedule::Device(&s.resident))
            }
        }
    }
}

/// The buffers of one rank's context-parallel backward (see the module docs for the shapes).
#[derive(Debug, Clone, Copy)]
pub struct CpBuffers {
    /// `q [T_r, 64, 128]` bf16, the rank's queries.
    pub q: Span<bf16>,
    /// `grad_out [T_r, 64, 128]` bf16.
    pub grad_out: Span<bf16>,
    /// `out [T_r, 64, 128]` bf16.
    pub out: Span<bf16>,
    /// `lse [T_r, 64]` f32.
    pub lse: Span<f32>,
    /// The rank's K slice `[S, 4, 128]` bf16 (padding and tail rows zero).
    pub k_slice: Span<bf16>,
    /// The rank's V slice `[S, 4, 128]` bf16 (padding and tail rows zero).
    pub v_slice: Span<bf16>,
    /// Output `dq [T_r, 64, 128]` bf16.
    pub dq: Span<bf16>,
    /// Output: dK of the rank's slice `[S, 4, 128]` bf16, summed over all ranks' queries.
    pub dk_slice: Span<bf16>,
    /// Output: dV of the rank's slice `[S, 4, 128]` bf16.
    pub dv_slice: Span<bf16>,
}

/// One rank's context-parallel backward, with its cached workspaces (the backward's, and the
/// gathered K/V of `2·R·S` rows).
pub struct CpBackward<B: Backend> {
    backward: MsaBackward<B>,
    gathered: Option<(B::Buffer, usize)>,
    /// Every rank's schedule flags word, gathered by the last call (`R` words), then the zero
    /// word a host schedule sends.
    flags: Option<(B::Buffer, usize)>,
    /// Ranks of the last call (0 before the first).
    flag_ranks: usize,
}

impl<B: Backend> Default for CpBackward<B> {
    fn default() -> Self {
        CpBackward {
            backward: MsaBackward::new(),
            gathered: None,
            flags: None,
            flag_ranks: 0,
        }
    }
}

impl<B: Backend> CpBackward<B> {
    /// An empty cache; nothing is allocated until the first call.
    pub fn new() -> Self {
        Self::default()
    }

    /// The rank `comm.rank()`'s backward of `layout` on `schedule` (its
    /// [`CpLayout::local_schedule`], or its [`RankSchedule`] built on the device): all-gather
    /// K/V, the local backward, reduce-scatter of the fp32 dK/dV, postprocess (see the module
    /// docs). Every rank of the group must call it with the same layout.
    ///
    /// # Errors
    /// [`RuntimeError::Input`] when the group, the layout, the schedule and the buffers do not
    /// match (checked before anything is issued), and the backend's and the collective's
    /// errors.
    pub fn run_on<'s, C: Collective<B>>(
        &mut self,
        backend: &mut B,
        comm: &mut C,
        layout: &CpLayout,
        io: &CpBuffers,
        schedule: impl Into<CpSchedule<'s, B>>,
    ) -> Result<(), RuntimeError>
    where
        B: 's,
    {
        // Until this call has gathered the verdicts, `status` has none to report (not the
        // previous call's).
        self.flag_ranks = 0;
        let rank = check_group(comm, layout)?;
        let schedule = schedule.into();
        // A device-built schedule's flags word (the build's verdict); a host schedule was
        // validated before it existed and sends a zero word.
        let status = match &schedule {
            CpSchedule::Device(rs) => Some(rs.resident().status_ptr().addr()),
            CpSchedule::Host(_) => None,
        };
        let schedule = schedule.checked(layout, rank)?;
        let s = layout.slice_rows();
        let g = layout.gathered_rows();
        for (field, span) in [
            ("k_slice", io.k_slice),
            ("v_slice", io.v_slice),
            ("dk_slice", io.dk_slice),
            ("dv_slice", io.dv_slice),
        ] {
            check_len(field, span.len, s * KV_ROW, "[S, 4, 128] bf16")?;
        }
        // The gathered K/V, `2·R·S` rows, reused while it fits.
        let (k_all, v_all) = gathered_kv(backend, &mut self.gathered, layout)?;
        let ranks = layout.ranks();
        let flags = cached(
            backend,
            &mut self.flags,
            "rank schedule flags",
            4 * (ranks + 1),
        )?;

        let w = layout.workspace_rows();
        let bio = BackwardBuffers {
            q: io.q,
            k_aligned: k_all.prefix(w * KV_ROW),
            v_aligned: v_all.prefix(w * KV_ROW),
            grad_out: io.grad_out,
            lse: io.lse,
            out: io.out,
            dq: io.dq,
            dk_aligned: io.dk_slice,
            dv_aligned: io.dv_slice,
        };
        // Every check of the local backward before the gather is issued. The gather then
        // overlaps the preprocess, the zeroing and the task build (none reads K/V); the main
        // kernel waits for it.
        self.backward.check_to_pools(backend, &bio, &schedule, g)?;
        // Every rank's verdict to every rank (a flagged rank's queries contribute nothing to
        // any rank's dK/dV): two bf16 lanes carry each int32 word bit for bit.
        let send = match status {
            Some(at) => at,
            None => {
                let zero = flags + 4 * ranks as u64;
                backend.zero("rank schedule flags", zero, 4)?;
                zero
            }
        };
        comm.all_gather_bf16(backend, Span::new(send, 2), Span::new(flags, 2 * ranks))?;
        self.flag_ranks = ranks;
        comm.all_gather_bf16(backend, io.k_slice, k_all)?;
        comm.all_gather_bf16(backend, io.v_slice, v_all)?;
        let (dk_pool, dv_pool) =
            self.backward
                .run_to_pools(backend, &bio, schedule, g, &mut |b| comm.wait(b))?;
        comm.reduce_scatter_f32_in_place(backend, dk_pool)?;
        comm.reduce_scatter_f32_in_place(backend, dv_pool)?;
        comm.wait(backend)?;
        let chunk = |p: Span<f32>| {
            Span::<f32>::new(
                p.addr + (rank * s * KV_ROW * size_of::<f32>()) as u64,
                s * KV_ROW,
            )
        };
        postprocess(
            backend,
            Span::new(io.dq.addr, 0),
            chunk(dk_pool),
            chunk(dv_pool),
            Span::new(io.dq.addr, 0),
            io.dk_slice,
            io.dv_slice,
            0,
            s,
        )
    }

    /// The group's verdict on the last [`CpBackward::run_on`]: `Ok` when no rank's schedule
    /// was flagged, else [`RuntimeError::CpRankFlagged`] naming every flagged rank, on every
    /// rank. A flagged rank's queries contribute nothing to any rank's dK/dV, so its fault
    /// concerns the whole group, not only the rank whose [`RankSchedule::status`] names it.
    /// Synchronizes.
    ///
    /// # Errors
    /// [`RuntimeError::CpRankFlagged`] as above, [`RuntimeError::Input`] before the first
    /// call or after one that failed before its gathers, and the backend's download errors.
    pub fn status(&self, backend: &mut B) -> Result<(), RuntimeError> {
        let Some((buf, _)) = self.flags.as_ref().filter(|_| self.flag_ranks > 0) else {
            return Err(RuntimeError::input(
                "CpBackward::status",
                "no completed call (none yet, or the last one failed before its gathers)",
                "a CpBackward whose last run_on issued its gathers",
            ));
        };
        let at = backend.address(buf);
        let bytes = backend.download("rank schedule flags", at, 4 * self.flag_ranks)?;
        let ranks: Vec<usize> = bytes
            .chunks_exact(4)
            .enumerate()
            .filter(|(_, w)| w.iter().any(|&b| b != 0))
            .map(|(r, _)| r)
            .collect();
        if ranks.is_empty() {
            Ok(())
        } else {
            Err(RuntimeError::CpRankFlagged { ranks })
        }
    }
}

/// The buffers of one rank's context-parallel forward (see the module docs for the shapes).
#[derive(Debug, Clone, Copy)]
pub struct CpForwardBuffers {
    /// `q [T_r, 64, 128]` bf16, the rank's queries.
    pub q: Span<bf16>,
    /// The rank's K slice `[S, 4, 128]` bf16 (padding and tail rows zero).
    pub k_slice: Span<bf16>,
    /// The rank's V slice `[S, 4, 128]` bf16 (padding and tail rows zero).
    pub v_slice: Span<bf16>,
    /// Output `out [T_r, 64, 128]` bf16.
    pub out: Span<bf16>,
    /// Output `lse [T_r, 64]` f32.
    pub lse: Span<f32>,
}

/// One rank's context-parallel forward, with its cached device buffers: the gathered K/V
/// (`2·R·S` rows) and the rank's selection with the documents' tables. The buffers are reused
/// in the order of the backend's queue: keep one per stream, as for [`CpBackward`].
pub struct CpForward<B: Backend> {
    gathered: Option<(B::Buffer, usize)>,
    tables: Option<(B::Buffer, usize)>,
}

impl<B: Backend> Default for CpForward<B> {
    fn default() -> Self {
        CpForward {
            gathered: None,
            tables: None,
        }
    }
}

impl<B: Backend> CpForward<B> {
    /// An empty cache; nothing is allocated until the first call.
    pub fn new() -> Self {
        Self::default()
    }

    /// The rank `comm.rank()`'s forward of `layout`: its queries `io.q` (tokens
    /// [`CpLayout::token_rows`]) against the key blocks of every rank, with the rank's rows
    /// of the selection, `q2k_local [4, T_r, 16]` (document-local block ids, as
    /// [`CpLayout::rank_q2k`] cuts them). Validates the selection on the host and returns the
    /// rank's schedule ([`CpLayout::local_schedule`]), which [`CpBackward::run_on`] takes;
    /// then uploads the selection and the documents' tables, all-gathers K/V and runs the
    /// forward kernel on the rank's rows (`out`, `lse` local and final; no reduction). Every
    /// rank of the group must call it with the same layout.
    ///
    /// # Errors
    /// [`RuntimeError::Schedule`] for an invalid selection, [`RuntimeError::Input`] when the
    /// group, the layout and the buffers do not match (all checked before anything is
    /// issued), and the backend's and the collective's errors.
    pub fn run_on<C: Collective<B>>(
        &mut self,
        backend: &mut B,
        comm: &mut C,
        layout: &CpLayout,
        io: &CpForwardBuffers,
        q2k_local: &[i32],
    ) -> Result<Schedule, RuntimeError> {
        let rank = check_group(comm, layout)?;
        let rows = layout.token_rows(rank);
        let t = rows.len();
        let schedule = layout.local_schedule(rank, q2k_local, QUERIES_PER_WORK)?;
        check_forward_io(layout, rank, io, None)?;
        // One upload: q2k_local, cu_seqlens [D+1], the workspace starts [D], a zero status
        // word (the host validated the selection, so no row is flagged).
        let cu = layout.cu_seqlens();
        let starts = &layout.workspace_starts;
        let mut words = Vec::with_capacity(q2k_local.len() + cu.len() + starts.len() + 4);
        words.extend_from_slice(q2k_local);
        words.extend_from_slice(cu);
        words.extend_from_slice(starts);
        words.extend_from_slice(&[0; 4]);
        let word = size_of::<i32>();
        let base = cached(
            backend,
            &mut self.tables,
            "cp forward tables",
            words.len() * word,
        )?;
        let at = |i: usize| base + (i * word) as u64;
        let (q2k_at, cu_at) = (0, q2k_local.len());
        let (ws_at, status_at) = (cu_at + cu.len(), cu_at + cu.len() + starts.len());
        let qrows = QueryRows {
            cu_seqlens: Span::new(at(cu_at), cu.len()),
            ws_starts: Span::new(at(ws_at), starts.len()),
            status: Ptr::new(at(status_at)),
            first_token: rows.start,
        };
        backend.upload("cp forward tables", base, bytes_of(&words))?;
        let q2k = Span::new(at(q2k_at), q2k_local.len());
        let fio = self.gather(backend, comm, layout, io, q2k)?;
        MsaForward.launch(backend, &fio, t, layout.workspace_rows(), &qrows)?;
        Ok(schedule)
    }

    /// [`CpForward::run_on`] with the rank's rows of the selection on the device, `q2k_local
    /// [4, T_r, 16]`: builds `schedule` (rank `comm.rank()`'s [`RankSchedule`] of `layout`)
    /// from it on the device, all-gathers K/V and runs the forward kernel on the rank's rows.
    /// No host sync and no upload. A bad selection is flagged on the device: every row of the
    /// rank gets `out = 0`, `lse = −∞`, the backward on `schedule` has no work (zero
    /// gradients), and [`RankSchedule::status`] names the fault.
    ///
    /// # Errors
    /// [`RuntimeError::Input`] when the group, the layout, the schedule and the buffers do not
    /// match (all checked before anything is issued), and the backend's and the collective's
    /// errors.
    pub fn run_on_device<C: Collective<B>>(
        &mut self,
        backend: &mut B,
        comm: &mut C,
        layout: &CpLayout,
        io: &CpForwardBuffers,
        q2k_local: Span<i32>,
        schedule: &mut RankSchedule<B>,
    ) -> Result<(), RuntimeError> {
        let rank = check_group(comm, layout)?;
        CpSchedule::Device(schedule).checked(layout, rank)?;
        check_forward_io(layout, rank, io, Some(q2k_local))?;
        schedule.build(backend, q2k_local)?;
        let fio = self.gather(backend, comm, layout, io, q2k_local)?;
        MsaForward.run_on(backend, &fio, &schedule.resident)
    }

    /// All-gathers K/V into the cached buffer and waits for them: the forward's buffers over
    /// the whole sequence's aligned K/V, with the selection `q2k`.
    fn gather<C: Collective<B>>(
        &mut self,
        backend: &mut B,
        comm: &mut C,
        layout: &CpLayout,
        io: &CpForwardBuffers,
        q2k: Span<i32>,
    ) -> Result<ForwardBuffers, RuntimeError> {
        let (k_all, v_all) = gathered_kv(backend, &mut self.gathered, layout)?;
        comm.all_gather_bf16(backend, io.k_slice, k_all)?;
        comm.all_gather_bf16(backend, io.v_slice, v_all)?;
        comm.wait(backend)?;
        let w = layout.workspace_rows();
        Ok(ForwardBuffers {
            q: io.q,
            k_aligned: k_all.prefix(w * KV_ROW),
            v_aligned: v_all.prefix(w * KV_ROW),
            q2k,
            out: io.out,
            lse: io.lse,
        })
    }
}

/// The checks of a rank's forward buffers (and of `q2k_local` on the device), before any
/// collective is issued: lengths, then null, misaligned or overlapping buffers.
fn check_forward_io(
    layout: &CpLayout,
    rank: usize,
    io: &CpForwardBuffers,
    q2k_local: Option<Span<i32>>,
) -> Result<(), RuntimeError> {
    let t = layout.token_rows(rank).len();
    let s = layout.slice_rows();
    for (field, span) in [("k_slice", io.k_slice), ("v_slice", io.v_slice)] {
        check_len(field, span.len, s * KV_ROW, "[S, 4, 128] bf16")?;
    }
    check_len("q", io.q.len, t * Q_ROW, "[T_r, 64, 128] bf16")?;
    check_len("out", io.out.len, t * Q_ROW, "[T_r, 64, 128] bf16")?;
    check_len("lse", io.lse.len, t * NUM_Q_HEADS, "[T_r, 64] f32")?;
    let mut regions = vec![
        Region::input("q", io.q)?,
        Region::input("k_slice", io.k_slice)?,
        Region::input("v_slice", io.v_slice)?,
        Region::output("out", io.out)?,
        Region::output("lse", io.lse)?,
    ];
    if let Some(q2k) = q2k_local {
        let len = NUM_INDEX_HEADS * t * TOPK_BLOCKS;
        check_len("q2k_local", q2k.len, len, "[4, T_r, 16] int32")?;
        regions.push(Region::input("q2k_local", q2k)?);
    }
    check_regions(&regions, false, "no in-place forward")
}

/// `R` logical ranks in one process, each on its own thread and backend, exchanging through
/// host memory: the collectives download, meet at a barrier, and upload. For tests of the
/// context-parallel flow on one GPU or on the simulator; not fast.
///
/// Every rank must call every collective (as with NCCL): a rank that stops early (an error)
/// leaves the others waiting at the barrier.
pub struct HostGroup {
    rank: usize,
    ranks: usize,
    shared: Arc<Shared>,
}

struct Shared {
    barrier: Barrier,
    slots: Mutex<Vec<Vec<u8>>>,
}

impl HostGroup {
    /// The `ranks` members of one group, rank `r` at index `r`.
    pub fn new(ranks: usize) -> Vec<HostGroup> {
        let shared = Arc::new(Shared {
            barrier: Barrier::new(ranks),
            slots: Mutex::new(vec![Vec::new(); ranks]),
        });
        (0..ranks)
            .map(|rank| HostGroup {
                rank,
                ranks,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Puts this rank's bytes in its slot, waits for every rank, applies `read` to all slots,
    /// then waits again so that no slot is overwritten before every rank has read it.
    fn exchange<T>(
        &self,
        mine: Vec<u8>,
        read: impl FnOnce(&[Vec<u8>]) -> T,
    ) -> Result<T, RuntimeError> {
        let poisoned = |_| RuntimeError::Collective {
            call: "HostGroup",
            message: "another logical rank panicked".into(),
        };
        self.shared.slots.lock().map_err(poisoned)?[self.rank] = mine;
        self.shared.barrier.wait();
        let out = read(&self.shared.slots.lock().map_err(poisoned)?);
        self.shared.barrier.wait();
        Ok(out)
    }
}

impl<B: Backend> Collective<B> for HostGroup {
    fn ranks(&self) -> usize {
        self.ranks
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn all_gather_bf16(
        &mut self,
        backend: &mut B,
        send: Span<bf16>,
        recv: Span<bf16>,
    ) -> Result<(), RuntimeError> {
        let ranks = self.ranks;
        check_len("recv", recv.len, ranks * send.len, "ranks·send.len")?;
        let mine = backend.download("all_gather send", send.addr, 2 * send.len)?;
        let all = self.exchange(mine, |slots| slots.concat())?;
        if all.len() != 2 * recv.len {
            return Err(RuntimeError::input(
                "send",
                "buffers of different lengths on the ranks",
                "the same length on every rank",
            ));
        }
        backend.upload("all_gather recv", recv.addr, &all)
    }

    fn reduce_scatter_f32_in_place(
        &mut self,
        backend: &mut B,
        buf: Span<f32>,
    ) -> Result<(), RuntimeError> {
        let ranks = self.ranks;
        if !buf.len.is_multiple_of(ranks) {
            return Err(RuntimeError::input(
                "buf",
                buf.len,
                "a multiple of the ranks",
            ));
        }
        let n = buf.len / ranks;
        let rank = self.rank;
        let mine = backend.download("reduce_scatter buf", buf.addr, 4 * buf.len)?;
        // Summed in rank order, so every run gives the same bits.
        let sum = self.exchange(mine, |slots| {
            let mut acc = vec![0f32; n];
            for s in slots {
                let part = &s[4 * rank * n..4 * (rank + 1) * n];
                for (a, b) in acc.iter_mut().zip(part.chunks_exact(4)) {
                    *a += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            acc
        })?;
        let bytes: Vec<u8> = sum.iter().flat_map(|x| x.to_le_bytes()).collect();
        backend.upload(
            "reduce_scatter recv",
            buf.addr + (4 * rank * n) as u64,
            &bytes,
        )
    }
}
