//! The KV-parallel forward: `msa_forward_kv_*_sm90` on the backward's task tables, where every
//! selected (block, query slot) pair adds its rows' `Σ exp(S·scale − R)·v` (by TMA
//! reduce-add), `Σ exp(S·scale − R)` and `max S·scale·log2e` into pools against a per-row
//! reference `R` (see the kernel's module docs for the design).
//!
//! - [`MsaForwardKv::run_on`]: the whole forward on the device, no host sync. By default
//!   ([`Reference::Probe`], [`OPool::F16`]): `fwd_kv_key_max` (max|v|, the f16 pool's
//!   scale), the task build from a [`ResidentSchedule`] (its idle SMs zero `o_pool`),
//!   `fwd_kv_probe` (R = the row's largest logit against the first key of each block it sees,
//!   a lower bound of its maximum; it also zeroes `l_pool`), the sum pass, the combine
//!   (`out = o/l`, `lse = R + ln l`, each row judged by its sum), then the pass and the
//!   combine again for the rows outside the pool's window, with their `lse` as reference
//!   (both launches return at once when there is none). [`Reference::ExactMax`] takes R from a max pass (`msa_forward_kv_max_sm90`,
//!   then `fwd_kv_reference`: each row's maximum) and judges rows by it; [`Reference::Bound`]
//!   from `fwd_kv_bound` (scale·‖q‖·max‖k‖ over the row's selected blocks).
//!   [`MsaForwardKv::status`] gives the number of rows recomputed, or
//!   [`RuntimeError::ForwardReferenceRange`] for rows still bad (their `lse` is NaN, `out` 0).
//! - [`MsaForwardKv::run_to_pools`]: the sum pass alone with the caller's R and pools, and
//!   [`combine_row`], the combine's host form, for tests.
//! - [`ForwardAlgorithm`]: when [`MsaAttention`](crate::MsaAttention) takes this forward
//!   rather than [`MsaForward`](crate::MsaForward).
//!
//! Checked against the CPU reference on the simulator and on the H200; timed there
//! (`bench/results/h200-2026-12-03-s15-forward.md`).

use crate::backend::{Backend, KernelSpec, Ptr, PtrMut, Span, TileMapSpec};
use crate::buffers::{check_regions, Region};
use crate::contract::{Locality, BLOCK_SIZE, HEAD_DIM, KV_ROW, NUM_Q_HEADS, Q_ROW};
use crate::error::RuntimeError;
use crate::forward::buffers::ForwardBuffers;
use crate::kernels::{
    fwd_kv_bound, fwd_kv_combine, fwd_kv_combine_f16, fwd_kv_combine_f16p, fwd_kv_homes,
    fwd_kv_key_max, fwd_kv_pair_kv, fwd_kv_probe, fwd_kv_reference, msa_forward_kv_f16_sm90,
    msa_forward_kv_f16p_sm90, msa_forward_kv_max_sm90, msa_forward_kv_sm90,
};
use crate::ops::{check_len, grid_dim, u32_arg};
use crate::schedule_build::ResidentSchedule;
use crate::tasks::{ScheduleShape, TaskBuildSizes, TaskWorkspace};
use crate::tma::TensorMap;
use half::bf16;

/// The device buffers of one KV-parallel pass; `T` and `W` come from the schedule.
#[derive(Debug, Clone, Copy)]
pub struct ForwardKvBuffers {
    /// `q [T, 64, 128]` bf16.
    pub q: Span<bf16>,
    /// `k_aligned [W, 4, 128]` bf16 in the schedule's aligned layout.
    pub k_aligned: Span<bf16>,
    /// `v_aligned`, as `k_aligned`.
    pub v_aligned: Span<bf16>,
    /// `reference [T, 64]` f32: per row, a value at or above every `S·scale` of its keys
    /// (natural-log units), e.g. `scale·‖q‖·max‖k‖`.
    pub reference: Span<f32>,
    /// Output `o_pool [T, 64, 128]`: `Σ exp(S·scale − R)·v` per row, each task's rows added
    /// by the TMA unit, in f32 or f16 ([`OPool`]). (bf16 adds, as the backward's dQ, were
    /// 2.1 ms faster at packed64k than f32 but put `out` a bf16 step off: 0.031 max-abs
    /// against 0.025.)
    pub o_pool: OPoolSpan,
    /// Output `l_pool [T, 64]` f32: `Σ exp(S·scale − R)` per row.
    pub l_pool: Span<f32>,
    /// Output `m_pool [T, 64]` u32: the order-preserving key ([`max_from_key`]) of the row's
    /// largest `S·scale·log2e`; 0 for a row no task touched.
    pub m_pool: Span<u32>,
}

/// The element type of the KV forward's `o_pool`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OPool {
    /// f32: twice the bytes reduced, 1.3-1.5× slower on the H200, no range to manage.
    F32,
    /// f16 (the default), half the bytes the TMA reduces. Each row's reference is lowered
    /// by `ln c`, `c = 2^⌊log2(8 / max|v|)⌋`, so that no sum leaves f16's range; rows whose
    /// maximum lies more than 7 below the lowered reference (their sums would reach f16's
    /// subnormals) are recomputed with `R' = max − ln c`, which [`Reference::ExactMax`]
    /// makes needless.
    #[default]
    F16,
}

/// `o_pool` with its element type.
#[derive(Debug, Clone, Copy)]
pub enum OPoolSpan {
    /// f32 elements.
    F32(Span<f32>),
    /// f16 elements, as their bits.
    F16(Span<u16>),
}

impl OPoolSpan {
    fn kind(&self) -> OPool {
        match self {
            OPoolSpan::F32(_) => OPool::F32,
            OPoolSpan::F16(_) => OPool::F16,
        }
    }

    fn addr(&self) -> u64 {
        match self {
            OPoolSpan::F32(s) => s.addr,
            OPoolSpan::F16(s) => s.addr,
        }
    }

    fn len(&self) -> usize {
        match self {
            OPoolSpan::F32(s) => s.len,
            OPoolSpan::F16(s) => s.len,
        }
    }

    fn region(&self) -> Result<Region, RuntimeError> {
        match *self {
            OPoolSpan::F32(s) => Region::output("o_pool", s),
            OPoolSpan::F16(s) => Region::output("o_pool", s),
        }
    }
}

impl OPool {
    /// Bytes per element.
    fn bytes(self) -> usize {
        match self {
            OPool::F32 => 4,
            OPool::F16 => 2,
        }
    }
}

/// How [`MsaForwardKv::run_on`] gets each row's reference `R`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reference {
    /// The Cauchy-Schwarz bound `scale·‖q‖·max‖k‖` over the row's selected blocks
    /// (`fwd_kv_key_max`, `fwd_kv_bound`): 0.3 ms at packed64k, but on unit-variance inputs
    /// it lies about 9 above the row's maximum, past the f16 pool's window of 7, so that
    /// nearly every row of an f16 pool is recomputed.
    Bound,
    /// The row's exact maximum from a max pass over the task tables
    /// (`msa_forward_kv_max_sm90`: the S GEMMs and the mask alone; then `fwd_kv_reference`),
    /// so that every row with a finite maximum lies in either pool's window (the default
    /// until session 18: 3.6 ms at packed64k, and no recompute).
    ExactMax,
    /// A lower bound of the row's maximum with no pass over the task tables
    /// (`fwd_kv_probe`): the largest logit of the row against the first key of each block it
    /// selects and sees (sixteen `mma.sync` per token and KV head). The combine then judges
    /// each row by its sum rather than its maximum (the sum is at least about 1 at the probed
    /// key, and must stay under f16's range) and recomputes the rows outside with their
    /// `lse` as reference. Rows whose probed keys lie far below their maximum (a sum past
    /// 7500 times the pool's scale, `PROBE_SUM_MAX` of the kernels' `forward_kv_rows`) cost
    /// the recompute pass. The default.
    #[default]
    Probe,
}

/// The KV-parallel pass's host flow; it keeps the task-build workspace between calls.
pub struct MsaForwardKv<B: Backend> {
    /// (memory space, queue) the workspaces belong to: a call on another stream or device
    /// drops them (freed stream-ordered on their own stream) and allocates new ones, as
    /// [`MsaBackward`](crate::MsaBackward) does.
    owner: Option<(u64, u64)>,
    /// The task order's locality rule (see [`MsaForwardKv::with_locality`]).
    locality: Locality,
    /// `run_on`'s `o_pool` element type (see [`MsaForwardKv::with_o_pool`]).
    pool: OPool,
    /// `run_on`'s reference (see [`MsaForwardKv::with_reference`]).
    reference: Reference,
    /// CTAs per walk (see [`MsaForwardKv::with_walk_split`]).
    walk_split: u32,
    /// The passes' L2 eviction hints (see [`MsaForwardKv::with_l2_hints`]); `None` for
    /// [`L2Hints::auto`] per call.
    l2_hints: Option<L2Hints>,
    /// Whether `run_on`'s f16 `o_pool` is paired (see [`MsaForwardKv::with_paired_pool`]).
    paired: bool,
    /// Whether the paired pass also loads K/V from paired tiles (see
    /// [`MsaForwardKv::with_paired_kv`]).
    paired_kv: bool,
    /// The paired pool and its homes, kept between calls.
    pair_pool: Option<PairPool<B>>,
    tasks: Option<TaskWorkspace<B>>,
    /// [`run_on`](MsaForwardKv::run_on)'s pools, reference, key maxima and status word, and
    /// their size in bytes.
    work: Option<(B::Buffer, usize)>,
    /// The status word of the last [`run_on`](MsaForwardKv::run_on).
    status_at: Option<u64>,
}

impl<B: Backend> Default for MsaForwardKv<B> {
    fn default() -> Self {
        MsaForwardKv {
            owner: None,
            locality: FORWARD_KV_LOCALITY,
            pool: OPool::F16,
            reference: Reference::Probe,
            walk_split: FORWARD_KV_WALK_SPLIT,
            l2_hints: None,
            paired: false,
            paired_kv: false,
            pair_pool: None,
            tasks: None,
            work: None,
            status_at: None,
        }
    }
}

/// The pairs `fwd_kv_homes` labels first (`l2_sides::ANCHORS` in codegen; a test ties the
/// two): a paired pool holds at least this many.
pub const PAIR_ANCHORS: usize = 64;
/// Bytes of one copy of a paired pool's row (16 heads × 128 d f16), and the alignment of
/// the pool: the L2 partitions' interleave (`l2_sides::CHUNK_BYTES`).
pub const PAIR_CHUNK_BYTES: usize = 4096;

/// 4 KiB chunks of one K or V tile's image (`l2_sides::KV_CHUNKS`; a test ties the two).
pub const PAIR_KV_CHUNKS: usize = 8;

/// The paired `o_pool` ([`MsaForwardKv::with_paired_pool`]): [`PAIR_ANCHORS`] pairs of 4 KiB
/// chunks for the side probes, then `rows` pairs, then `2 · PAIR_KV_CHUNKS` pairs per K/V
/// tile ([`MsaForwardKv::with_paired_kv`]), from `base` (4 KiB aligned); after them
/// `homes [pairs]` u32, labelled once when the buffer was allocated, and the tiles' masks
/// `[kv_tiles, 2]` u32.
struct PairPool<B: Backend> {
    _buf: B::Buffer,
    rows: usize,
    kv_tiles: usize,
    base: u64,
    homes: u64,
}

impl<B: Backend> PairPool<B> {
    /// Pairs of a pool for `rows` rows and `kv_tiles` K/V tiles, the anchors' included.
    fn pairs(rows: usize, kv_tiles: usize) -> usize {
        PAIR_ANCHORS + rows + 2 * PAIR_KV_CHUNKS * kv_tiles
    }

    /// A pool for `rows` rows and `kv_tiles` K/V tiles, its homes labelled by `fwd_kv_homes`
    /// on the backend's stream (no host sync).
    fn new(backend: &mut B, rows: usize, kv_tiles: usize) -> Result<Self, RuntimeError> {
        let pairs = Self::pairs(rows, kv_tiles);
        let bytes = pairs * 2 * PAIR_CHUNK_BYTES + 4 * pairs + 8 * kv_tiles + PAIR_CHUNK_BYTES;
        let buf = backend.alloc("forward_kv paired o_pool", bytes)?;
        let raw = backend.address(&buf);
        let base = raw.div_ceil(PAIR_CHUNK_BYTES as u64) * PAIR_CHUNK_BYTES as u64;
        let homes = base + (pairs * 2 * PAIR_CHUNK_BYTES) as u64;
        // SAFETY: `base` (4 KiB aligned) spans `pairs` pairs of 4 KiB chunks and `homes`
        // `pairs` words, both inside the buffer just allocated.
        unsafe { label_pair_homes(backend, base, homes, pairs, None) }?;
        Ok(PairPool {
            _buf: buf,
            rows,
            kv_tiles,
            base,
            homes,
        })
    }

    /// The K/V tiles' `(pairs, homes, masks)`: past the anchors' and the rows' pairs and
    /// labels, and after all labels.
    fn kv(&self) -> (u64, u64, u64) {
        let first = Self::pairs(self.rows, 0);
        let pairs = Self::pairs(self.rows, self.kv_tiles);
        (
            self.base + (first * 2 * PAIR_CHUNK_BYTES) as u64,
            self.homes + 4 * first as u64,
            self.homes + 4 * pairs as u64,
        )
    }
}

/// Labels the L2 homes of a paired pool's `pairs` pairs of 4 KiB chunks at `base` into
/// `homes [pairs]` u32 with `fwd_kv_homes` (label 0: chunk 0's home; see
/// [`MsaForwardKv::with_paired_pool`]) on the backend's queue, no host sync: phase 0 on one
/// CTA labels the anchors, then phase 1 on `ctas` CTAs the rest (`None`: the runtime's
/// choice, `min(ceil(pairs / 4), 4 · SMs)`). Which warp times which pair follows from `ctas`;
/// the labels should not.
///
/// # Safety
/// `base` must be 4 KiB aligned and span `2 · pairs` chunks of 4 KiB, and `homes` `pairs`
/// u32 words, both device memory of the backend that nothing else uses meanwhile. The
/// chunks' contents are left as they are (the timed atomics add 0).
pub unsafe fn label_pair_homes<B: Backend>(
    backend: &mut B,
    base: u64,
    homes: u64,
    pairs: usize,
    ctas: Option<u32>,
) -> Result<(), RuntimeError> {
    backend.load(&fwd_kv_homes::KERNEL)?;
    let n = u32_arg("paired pool pairs", pairs)?;
    let warps = fwd_kv_homes::KERNEL.threads.0 as usize / 32;
    let grid1 = match ctas {
        Some(c) => c,
        None => grid_dim(
            "fwd_kv_homes CTAs",
            pairs.div_ceil(warps).min(4 * backend.sm_count()),
        )?,
    };
    for (phase, grid) in [(0u32, 1u32), (1, grid1)] {
        let args = fwd_kv_homes::args(PtrMut::new(base), PtrMut::new(homes), n, phase);
        // SAFETY: the caller's: `base` spans `pairs` pairs of 4 KiB chunks and `homes`
        // `pairs` words; the atomics add 0.
        unsafe { backend.launch(&fwd_kv_homes::KERNEL, (grid, 1, 1), &args) }?;
    }
    Ok(())
}

/// How many CTAs share each walk of the task tables in the KV forward's passes (default of
/// [`MsaForwardKv::with_walk_split`]). The walks are cut for the backward (64 rows each at
/// scale). In `bench/results/h200-2026-12-07-s22-forward.md`, halves took the sum pass
/// −3.7 / −17 / −6.6 % at packed64k / doc64k / doc8k on an H100 and −1.5 / +0.7 / −0.4 % on
/// the H200 (within its spread); 4 and 8 parts were slower on both.
pub const FORWARD_KV_WALK_SPLIT: u32 = 2;

/// The L2 eviction priorities of the KV forward's TMA traffic ([`MsaForwardKv::with_l2_hints`];
/// [`L2Hints::auto`] by default). The passes take them as the bits of their `l2_hints` parameter
/// (`codegen`'s `forward_kv_sm90::L2Stream` mirrors them); an unhinted stream keeps the
/// normal priority. K/V are read once per segment, while each query's Q and `o_pool` rows are
/// read and added again by its other blocks' tasks within a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct L2Hints {
    /// The K/V loads `evict_first` (bit 0).
    pub kv_evict_first: bool,
    /// The Q loads `evict_last` (bit 1).
    pub q_evict_last: bool,
    /// The `o_pool` reduce-adds `evict_last` (bit 2).
    pub o_evict_last: bool,
}

impl L2Hints {
    /// No hint: every stream at the normal priority.
    pub const NONE: L2Hints = L2Hints {
        kv_evict_first: false,
        q_evict_last: false,
        o_evict_last: false,
    };
    /// Every hint.
    pub const ALL: L2Hints = L2Hints {
        kv_evict_first: true,
        q_evict_last: true,
        o_evict_last: true,
    };

    /// The default hints of a call on `num_tokens` tokens in `num_docs` documents: K/V
    /// `evict_first` where the documents hold [`L2_HINTS_MIN_MEAN_DOC`] tokens or more on
    /// average, none below. On an H100 (`bench/results/h100-2026-12-07-s24-forward-long.md`),
    /// under the same windows, the hint took the sum pass 9.5 % lower at doc256k and doc1m and
    /// 2 % at doc64k; at packed64k, whose documents are short, it was 5 % higher in one run.
    /// Q and `o_pool` `evict_last` besides took the pass 1-2 % lower past 128K tokens, within
    /// the runs' spread, and stay off.
    pub fn auto(num_tokens: usize, num_docs: usize) -> L2Hints {
        L2Hints {
            kv_evict_first: num_tokens / num_docs.max(1) >= L2_HINTS_MIN_MEAN_DOC,
            ..L2Hints::NONE
        }
    }

    /// The kernels' `l2_hints` word.
    pub fn bits(self) -> u32 {
        u32::from(self.kv_evict_first)
            | u32::from(self.q_evict_last) << 1
            | u32::from(self.o_evict_last) << 2
    }
}

/// The mean document length (tokens) from which [`L2Hints::auto`] marks the K/V loads
/// `evict_first`: 512 key blocks, from which [`FORWARD_KV_LOCALITY`]'s windows of 2048
/// queries hold 16 MB of Q and `o_pool` rows per index head, and each window streams at least
/// 32 MB of K/V past them.
pub const L2_HINTS_MIN_MEAN_DOC: usize = 1 << 16;

/// The largest [`MsaForwardKv::with_walk_split`].
pub const MAX_WALK_SPLIT: u32 = 16;

/// The KV forward's default task order: windows of at least 512 queries and 4 queries per key
/// block of the document. The backward's [`Locality::default`] (8192-query windows) keeps its
/// segments long for the dK/dV flushes; the forward has none, and its f32 `o_pool` reductions
/// miss L2 when a window's rows (32 KB each) span 256 MB. On the H200
/// (`bench/results/h200-2026-12-03-s14-forward-kv.md`, call 4) this rule took the whole
/// forward from 20.25 / 12.13 / 2.71 ms to 15.20 / 9.08 / 1.98 ms at packed64k / doc32k /
/// doc8k. `9,0` and `10,2` were within 1-7 %, `11,3` and `12,4` 5-28 % slower.
///
/// The cap of 2048 queries (session 24): past 64K tokens `4·B` queries hold more rows than L2
/// keeps (8 KB of Q and f16 `o_pool` per query and index head: 64 MB at doc256k, 256 MB at
/// doc1m). On an H100 (`bench/results/h100-2026-12-07-s24-forward-long.md`), with
/// [`L2Hints::auto`]'s K/V hint, windows of 2^11 took the sum pass from 60.1 to 41.1 ms at
/// doc256k and from 327 to 271 ms at doc1m (2^12: 44.4 and 266 ms). Documents of up to 64K
/// tokens keep their windows. The bins then grow as `T²/2^18` per index head (4.2 M at 1M
/// tokens, 16.8 M in all).
pub const FORWARD_KV_LOCALITY: Locality = Locality::capped(9, 2, 11);

/// Which forward [`MsaAttention`](crate::MsaAttention) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ForwardAlgorithm {
    /// The KV-parallel forward where it was measured faster (a 9.0 device, the default
    /// mode, documents of [`KV_FORWARD_MIN_MEAN_DOC`] tokens or more on average, and its
    /// workspace allocated), the Q-parallel one otherwise.
    #[default]
    Auto,
    /// `msa_forward_sm90` / `msa_forward_sm100`: bitwise reproducible, no workspace.
    QParallel,
    /// [`MsaForwardKv`] with its defaults (9.0 only): its `o_pool` sums are float adds in
    /// whatever order the tasks finish, and its workspace is about 17 KB per token (f16
    /// `o_pool [T, 64, 128]`; `l`, `m`, `R [T, 64]`) besides the task tables.
    KvParallel,
}

/// The mean document length (tokens) from which [`ForwardAlgorithm::Auto`] takes the KV
/// forward. The Q-parallel kernel executes a tile for every block any of its 4 queries
/// selected, a waste that grows with the document; the KV forward wastes no tile but adds
/// its rows in L2, at a cost flat with length. On the H200 with the probe reference
/// (`bench/results/h200-2026-12-03-s18-forward.md`, calls 2-3; the whole KV forward against
/// the Q-parallel kernel alone) the KV forward took 1.17× the Q-parallel time at 64K tokens
/// in 2K-token documents, and was 1.13× faster in 4K-token documents, 1.56× at doc8k, 1.69×
/// at packed64k (mean 6.5K), 2.1× at doc16k and 3.4× at doc64k. The crossover lies near
/// 3.3K; this threshold is the shortest mean measured faster.
pub const KV_FORWARD_MIN_MEAN_DOC: usize = 4096;

impl ForwardAlgorithm {
    /// Whether a forward of `t` tokens in `docs` documents against `w` aligned K/V rows, on
    /// capability `cc` of device `ordinal`, runs the KV forward (`false`: the Q-parallel one).
    /// `deterministic`: the caller's mode wants a bitwise reproducible forward.
    ///
    /// # Errors
    /// For [`ForwardAlgorithm::KvParallel`]: [`RuntimeError::UnsupportedArch`] on any
    /// capability but 9.0, and [`RuntimeError::Input`] naming `forward_algorithm` in
    /// deterministic mode.
    pub fn uses_kv(
        self,
        cc: (i32, i32),
        ordinal: usize,
        (t, docs, w): (usize, usize, usize),
        deterministic: bool,
    ) -> Result<bool, RuntimeError> {
        match self {
            ForwardAlgorithm::QParallel => Ok(false),
            ForwardAlgorithm::KvParallel if cc != (9, 0) => Err(RuntimeError::UnsupportedArch {
                kernel: "msa_forward_kv",
                ordinal,
                major: cc.0,
                minor: cc.1,
                supported: "9.0 (msa_forward_kv_sm90)".into(),
            }),
            ForwardAlgorithm::KvParallel if deterministic => Err(RuntimeError::input(
                "forward_algorithm",
                "KvParallel in deterministic mode",
                "QParallel or Auto (the KV forward adds its rows with float atomics)",
            )),
            ForwardAlgorithm::KvParallel => Ok(true),
            ForwardAlgorithm::Auto => Ok(cc == (9, 0)
                && !deterministic
                && docs > 0
                && t / docs >= KV_FORWARD_MIN_MEAN_DOC
                && w > 0
                && w.is_multiple_of(BLOCK_SIZE)),
        }
    }
}

/// Rows per CTA of the row kernels (`forward_kv_rows::ROWS_PER_CTA`, tied by a test).
pub const ROW_KERNEL_ROWS_PER_CTA: usize = 8;

/// Rows per CTA of `fwd_kv_combine` and `fwd_kv_combine_f16` (one per 8 lanes;
/// `forward_kv_rows::COMBINE_ROWS_PER_CTA`, tied by a test).
pub const COMBINE_ROWS_PER_CTA: usize = 32;

/// Rows per CTA of `fwd_kv_reference` (`forward_kv_rows::REFERENCE_ROWS_PER_CTA`, tied by a
/// test): one per thread.
pub const REFERENCE_ROWS_PER_CTA: usize = 256;

/// The combine's grid cap per SM (`forward_kv_rows::COMBINE_MAX_CTAS_PER_SM`, tied by a
/// test): it strides over the rows, so the gated second combine is a few thousand CTAs.
pub const COMBINE_MAX_CTAS_PER_SM: usize = 32;

/// Grid of a row kernel over `rows` warp-sized items (128-element rows; the bound's
/// (token, KV head) groups).
fn row_grid(rows: usize) -> Result<u32, RuntimeError> {
    grid_dim("rows", rows.div_ceil(ROW_KERNEL_ROWS_PER_CTA))
}

impl<B: Backend> MsaForwardKv<B> {
    /// A flow with no workspace yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The same flow with the task order's locality rule `locality` (default
    /// [`FORWARD_KV_LOCALITY`]): smaller windows keep each window's `o_pool` rows in L2 while
    /// its tasks add into them, at the price of shorter segments.
    ///
    /// # Errors
    /// [`RuntimeError::Input`] naming `locality` when a field is out of range.
    pub fn with_locality(mut self, locality: Locality) -> Result<Self, RuntimeError> {
        locality
            .validate()
            .map_err(|e| RuntimeError::input("locality", e, "fields within Locality's bounds"))?;
        self.locality = locality;
        self.tasks = None;
        Ok(self)
    }

    /// The same flow with each walk of the task tables split between `parts` CTAs (default
    /// [`FORWARD_KV_WALK_SPLIT`]), the passes' grid `parts` times the walks'.
    ///
    /// # Errors
    /// [`RuntimeError::Input`] naming `walk_split` unless `parts` is a power of two from 1 to
    /// [`MAX_WALK_SPLIT`].
    pub fn with_walk_split(mut self, parts: u32) -> Result<Self, RuntimeError> {
        if !parts.is_power_of_two() || parts > MAX_WALK_SPLIT {
            return Err(RuntimeError::input(
                "walk_split",
                parts,
                format!("a power of two from 1 to {MAX_WALK_SPLIT}"),
            ));
        }
        self.walk_split = parts;
        Ok(self)
    }

    /// The same flow with the passes' L2 eviction hints `hints` on every call (default
    /// [`L2Hints::auto`] of each call's token and document counts).
    pub fn with_l2_hints(mut self, hints: L2Hints) -> Self {
        self.l2_hints = Some(hints);
        self
    }

    /// The same flow with [`MsaForwardKv::run_on`]'s references from `reference` (default
    /// [`Reference::Probe`]).
    pub fn with_reference(mut self, reference: Reference) -> Self {
        self.reference = reference;
        self
    }

    /// The workspaces belong to `backend`'s stream from here on: those of another stream or
    /// device are dropped.
    fn claim(&mut self, backend: &B) {
        let owner = (backend.memory_space(), backend.queue());
        if self.owner != Some(owner) {
            self.tasks = None;
            self.work = None;
            self.pair_pool = None;
            self.status_at = None;
            self.owner = Some(owner);
        }
    }

    /// Whether [`MsaForwardKv::run_on`]'s f16 `o_pool` is paired (default off: correct on the
    /// GPU; its one timing, 14-24 % slower in `bench/results/h100-2026-12-08-s29-paired.md`,
    /// ran with side probes that timed nothing, fixed in session 30 and not yet re-timed): each
    /// `(token, index head)` row gets two 4 KiB copies, one homed in each L2 partition, and
    /// each warp of the sum pass adds into the copy on its own side, so that no reduction
    /// crosses the L2 fabric; the combine adds the copies. Twice the pool's memory
    /// (`T × 32 KiB`), labelled once per allocation by `fwd_kv_homes`. The f32 pool and
    /// [`MsaForwardKv::run_to_pools`] keep the `[T, 64, 128]` layout.
    pub fn with_paired_pool(mut self, paired: bool) -> Self {
        self.paired = paired;
        self
    }

    /// Whether, with the paired pool, the sum pass also loads K/V from paired tiles (default
    /// off; correct on the GPU, timed only with session 29's broken side labels):
    /// `fwd_kv_pair_kv` writes each (key block, KV head) tile's K and V images into two 4 KiB
    /// copies per chunk, one homed in each L2 partition, on every call (`4 KiB` per aligned
    /// key), and the pass's producer loads each chunk from the copy on its own side, so that
    /// K/V misses would not cross the fabric either. Without the paired pool (or with the f32 pool) it
    /// changes nothing.
    pub fn with_paired_kv(mut self, paired_kv: bool) -> Self {
        self.paired_kv = paired_kv;
        self
    }

    /// The same flow with [`MsaForwardKv::run_on`]'s `o_pool` in `pool` (default
    /// [`OPool::F16`]).
    pub fn with_o_pool(mut self, pool: OPool) -> Self {
        self.pool = pool;
        self
    }

    /// Issues the whole forward on `backend`'s stream, with no host sync: the task build, the
    /// reference per row (the probe's lower bound of its maximum, the max pass's exact
    /// maximum, or the bound `scale·‖q‖·max‖k‖` over its selected blocks: [`Reference`]), the
    /// pass into pools of its own, the combine into `io.out` and `io.lse`, and the gated
    /// recompute pass and combine (`io.q2k` must be the selection `schedule` was built from;
    /// its length is checked). Then [`MsaForwardKv::status`] gives the verdict.
    ///
    /// # Errors
    /// As [`MsaForwardKv::run_to_pools`], and [`RuntimeError::Overlap`] for an output on an
    /// input or the other output.
    pub fn run_on(
        &mut self,
        backend: &mut B,
        io: &ForwardBuffers,
        schedule: &ResidentSchedule<B>,
    ) -> Result<(), RuntimeError> {
        let z = *schedule.sizes();
        let (t, w) = check_inputs(backend, schedule, [io.q, io.k_aligned, io.v_aligned])?;
        io.check_q2k_and_outputs(t)?;
        self.claim(backend);
        io.check_no_overlap()?;
        // One workspace: o [T, 64, 128] (f32 or f16), l, m and R [T, 64] each, kmax2
        // [W/128, 4], the two status words and the max|v| word, each region 256-byte aligned.
        let rows = t * NUM_Q_HEADS;
        let blocks = w / BLOCK_SIZE;
        let align = |x: usize| x.div_ceil(256) * 256;
        let pairs = 4 * t;
        let paired = self.paired && self.pool == OPool::F16 && t > 0;
        let kv_tiles = if paired && self.paired_kv {
            4 * blocks
        } else {
            0
        };
        if paired
            && self
                .pair_pool
                .as_ref()
                .is_none_or(|p| p.rows < pairs || p.kv_tiles < kv_tiles)
        {
            // The old pool goes first: the two need not fit together.
            self.pair_pool = None;
            self.pair_pool = Some(PairPool::new(backend, pairs, kv_tiles)?);
        }
        let kv = (kv_tiles > 0).then(|| self.pair_pool.as_ref().expect("allocated").kv());
        let pair = paired.then(|| {
            let p = self.pair_pool.as_ref().expect("allocated");
            (p.base, p.homes)
        });
        // A paired pool lives in its own buffer; the workspace then holds no o.
        let o_b = if paired {
            0
        } else {
            align(self.pool.bytes() * t * Q_ROW)
        };
        let (r_b, k_b) = (align(4 * rows), align(16 * blocks));
        let bytes = o_b + 3 * r_b + k_b + 256;
        if self.work.as_ref().is_none_or(|(_, have)| *have < bytes) {
            self.work = None;
            let buf = backend.alloc("forward_kv workspace", bytes)?;
            self.work = Some((buf, bytes));
        }
        let base = backend.address(&self.work.as_ref().expect("allocated").0);
        let pools = ForwardKvBuffers {
            q: io.q,
            k_aligned: io.k_aligned,
            v_aligned: io.v_aligned,
            reference: Span::new(base + (o_b + 2 * r_b) as u64, rows),
            o_pool: match (self.pool, pair) {
                (OPool::F32, _) => OPoolSpan::F32(Span::new(base, t * Q_ROW)),
                (OPool::F16, None) => OPoolSpan::F16(Span::new(base, t * Q_ROW)),
                // The rows' pairs past the anchors, as a span of their first T × 16 KiB (of
                // 32; `prepare` zeroes both halves): the tensor map the pass is given spans
                // them, and reads none.
                (OPool::F16, Some((o, _))) => OPoolSpan::F16(Span::new(
                    o + (PAIR_ANCHORS * 2 * PAIR_CHUNK_BYTES) as u64,
                    t * Q_ROW,
                )),
            },
            l_pool: Span::new(base + o_b as u64, rows),
            m_pool: Span::new(base + (o_b + r_b) as u64, rows),
        };
        let kmax2 = Span::<u32>::new(base + (o_b + 3 * r_b) as u64, 4 * blocks);
        let status = Span::<u32>::new(kmax2.addr + k_b as u64, 2);
        // max|v| over V, for the f16 pool's scale; null (not computed) for the f32 pool.
        let vmax = match self.pool {
            OPool::F32 => Ptr::new(0),
            OPool::F16 => Ptr::new(status.addr + 8),
        };
        self.status_at = None;
        // The key maxima feed the bound; max|v| (the same launch) the f16 pool's scale.
        let bound = self.reference == Reference::Bound;
        let key_max = bound || self.pool == OPool::F16;
        if t > 0 {
            // The kernels this call launches, and no other.
            let mut kernels: Vec<&KernelSpec> = vec![match (self.pool, pair) {
                (OPool::F32, _) => &fwd_kv_combine::KERNEL,
                (OPool::F16, None) => &fwd_kv_combine_f16::KERNEL,
                (OPool::F16, Some(_)) => &fwd_kv_combine_f16p::KERNEL,
            }];
            if key_max {
                kernels.push(&fwd_kv_key_max::KERNEL);
            }
            if kv.is_some() {
                kernels.push(&fwd_kv_pair_kv::KERNEL);
            }
            match self.reference {
                Reference::Bound => kernels.push(&fwd_kv_bound::KERNEL),
                Reference::Probe => kernels.push(&fwd_kv_probe::KERNEL),
                Reference::ExactMax => {
                    kernels.extend([&msa_forward_kv_max_sm90::KERNEL, &fwd_kv_reference::KERNEL])
                }
            }
            for k in kernels {
                backend.load(k)?;
            }
        }
        backend.zero("forward_kv kmax2, status and max|v|", kmax2.addr, k_b + 12)?;
        if t == 0 {
            // No row: nothing to launch, and a verdict of no row recomputed.
            self.status_at = Some(status.addr);
            return Ok(());
        }
        if key_max {
            let key_rows = 4 * w;
            // The key maxima only for the bound (a null kmax2 skips them).
            let kmax2_out = if bound {
                kmax2.ptr_mut()
            } else {
                PtrMut::new(0)
            };
            let args = fwd_kv_key_max::args(
                io.k_aligned.ptr(),
                kmax2_out,
                io.v_aligned.ptr(),
                PtrMut::new(vmax.addr()),
                u32_arg("key rows", key_rows)?,
            );
            // SAFETY: k_aligned and v_aligned are [W, 4, 128] (checked above), kmax2
            // [W/128, 4] or null (then K is not read); vmax is one word of the workspace, or null
            // (then V is not read).
            unsafe { backend.launch(&fwd_kv_key_max::KERNEL, (row_grid(key_rows)?, 1, 1), &args) }?;
        }
        if bound {
            let docs = z.num_documents;
            let args = fwd_kv_bound::args(
                io.q.ptr(),
                io.q2k.ptr(),
                schedule.cu_seqlens_ptr(),
                Ptr::new(schedule.refs().ws_starts),
                kmax2.ptr(),
                vmax,
                pools.reference.ptr_mut(),
                u32_arg("groups", 4 * t)?,
                u32_arg("num_tokens", t)?,
                u32_arg("num_docs", docs)?,
                u32_arg("num_blocks", blocks)?,
            );
            // SAFETY: q is [T, 64, 128] and q2k [4, T, 16] (both checked), cu_seqlens [D+1]
            // and the workspace starts [D] are the schedule's own (tokens 0..T, checked by
            // `check_inputs`), kmax2 [W/128, 4] (ids past it are not read), the reference
            // [T, 64].
            unsafe { backend.launch(&fwd_kv_bound::KERNEL, (row_grid(4 * t)?, 1, 1), &args) }?;
        }
        if let Some((kv_pairs, kv_homes, masks)) = kv {
            let args = fwd_kv_pair_kv::args(
                io.k_aligned.ptr(),
                io.v_aligned.ptr(),
                PtrMut::new(kv_pairs),
                Ptr::new(kv_homes),
                PtrMut::new(masks),
            );
            // SAFETY: k_aligned and v_aligned are [W, 4, 128] (checked), read in whole tiles of
            // 128 keys; the pool holds 16 pairs, 16 labels and 2 mask words per tile of W/128
            // blocks × 4 heads (`PairPool::kv`).
            let grid = grid_dim("paired K/V tiles", 2 * kv_tiles)?;
            unsafe { backend.launch(&fwd_kv_pair_kv::KERNEL, (grid, 1, 1), &args) }?;
        }
        let zero_o = match self.reference {
            Reference::ExactMax => ZeroO::InMaxPass,
            Reference::Probe => ZeroO::InProbe,
            Reference::Bound => ZeroO::Prepare,
        };
        let kv_load = kv.map(|(pairs, _, masks)| (pairs, masks));
        match self.prepare(backend, &pools, schedule, zero_o, pair, kv_load)? {
            Some(launch) => {
                match self.reference {
                    // The bound is in place already (before `prepare`).
                    Reference::Bound => {}
                    // After `prepare` (which left the pools to it): the probe writes every
                    // row's m_pool word, a key for a row that sees a block and 0 for one that
                    // sees none (the combine's test for an empty row), and zeroes l_pool for
                    // the sum pass (the task build zeroed o_pool).
                    Reference::Probe => {
                        let args = fwd_kv_probe::args(
                            io.q.ptr(),
                            io.k_aligned.ptr(),
                            io.q2k.ptr(),
                            schedule.cu_seqlens_ptr(),
                            Ptr::new(schedule.refs().ws_starts),
                            vmax,
                            pools.reference.ptr_mut(),
                            pools.m_pool.ptr_mut(),
                            u32_arg("groups", 4 * t)?,
                            u32_arg("num_tokens", t)?,
                            u32_arg("num_docs", z.num_documents)?,
                            u32_arg("num_blocks", blocks)?,
                            pools.l_pool.ptr_mut(),
                        );
                        // SAFETY: q is [T, 64, 128], k_aligned [W, 4, 128] and q2k [4, T, 16] (all
                        // checked), cu_seqlens [D+1] and the workspace starts [D] are the
                        // schedule's own, a block id at or past W/128 is not read (nor any other
                        // that the row does not see: those read K row 0); vmax is one word of the
                        // workspace or null (f32 pool); the reference, m_pool and l_pool are
                        // [T, 64].
                        let grid = row_grid(4 * t)?;
                        unsafe { backend.launch(&fwd_kv_probe::KERNEL, (grid, 1, 1), &args) }?;
                    }
                    // The exact maxima into m_pool (and o_pool zeroed beside them), then R
                    // from them.
                    Reference::ExactMax => {
                        self.launch_pass(backend, Pass::Max, &pools, &launch, None)?;
                        let args = fwd_kv_reference::args(
                            pools.m_pool.ptr(),
                            vmax,
                            pools.reference.ptr_mut(),
                            u32_arg("rows", rows)?,
                        );
                        let grid = grid_dim("rows", rows.div_ceil(REFERENCE_ROWS_PER_CTA))?;
                        // SAFETY: m_pool and the reference are [T, 64]; vmax is one word of the
                        // workspace (set by fwd_kv_key_max), or null (f32 pool: not read).
                        unsafe { backend.launch(&fwd_kv_reference::KERNEL, (grid, 1, 1), &args) }?;
                    }
                }
                let pass = Pass::Sum(self.pool);
                // Under the exact reference m_pool already holds every row's maximum, under
                // the probe its lower bound (the combine needs only whether the row sees a
                // block): the sum passes get a null one and skip theirs.
                let sum_pools = ForwardKvBuffers {
                    m_pool: if bound { pools.m_pool } else { Span::new(0, 0) },
                    ..pools
                };
                self.launch_pass(backend, pass, &sum_pools, &launch, None)?;
                self.combine(backend, &pools, io, status, vmax, None, pair)?;
                // The rows the first combine handed back, with their exact maxima (under the
                // probe, their lse) as references; both launches return at once when there is
                // none.
                self.launch_pass(backend, pass, &sum_pools, &launch, Some(status))?;
                self.combine(backend, &pools, io, status, vmax, Some(status), pair)?;
            }
            // No task: the combine writes every row empty.
            None => self.combine(backend, &pools, io, status, vmax, None, pair)?,
        }
        self.status_at = Some(status.addr);
        Ok(())
    }

    /// The verdict on the last [`MsaForwardKv::run_on`]: `Ok` with the number of rows that were
    /// recomputed, with their exact maximum (or, under the probe, their `lse`) as reference,
    /// because the first reference left them outside the pool's window. Synchronizes.
    ///
    /// # Errors
    /// [`RuntimeError::ForwardReferenceRange`] with the count of rows still out of range after
    /// the recompute (a NaN or infinite logit; their `lse` is NaN, `out` 0),
    /// [`RuntimeError::Input`] before the first call, and the backend's download errors.
    pub fn status(&self, backend: &mut B) -> Result<u32, RuntimeError> {
        let Some(at) = self.status_at else {
            return Err(RuntimeError::input(
                "MsaForwardKv::status",
                "no completed call",
                "an MsaForwardKv that has run",
            ));
        };
        let words = backend.download("forward_kv status", at, 8)?;
        let word =
            |i: usize| u32::from_le_bytes([words[i], words[i + 1], words[i + 2], words[i + 3]]);
        match word(4) {
            0 => Ok(word(0)),
            rows => Err(RuntimeError::ForwardReferenceRange { rows }),
        }
    }

    /// One combine over every row (`gate` None: the first; `Some`: the second, gated on the
    /// count of rows handed back), of the paired pool's `(o, homes)` when given.
    #[allow(clippy::too_many_arguments)]
    fn combine(
        &self,
        backend: &mut B,
        pools: &ForwardKvBuffers,
        io: &ForwardBuffers,
        status: Span<u32>,
        vmax: Ptr<u32>,
        gate: Option<Span<u32>>,
        pair: Option<(u64, u64)>,
    ) -> Result<(), RuntimeError> {
        let rows = pools.l_pool.len;
        let gate_ptr = gate.map_or(Ptr::new(0), |g| g.ptr());
        let second = u32::from(gate.is_some());
        let on_sum = u32::from(self.reference == Reference::Probe);
        let cap = grid_dim("combine CTAs", COMBINE_MAX_CTAS_PER_SM * backend.sm_count())?;
        let grid = grid_dim("rows", rows.div_ceil(COMBINE_ROWS_PER_CTA))?.min(cap);
        let (kernel, args) = match pools.o_pool {
            OPoolSpan::F32(o) => (
                &fwd_kv_combine::KERNEL,
                fwd_kv_combine::args(
                    o.ptr_mut(),
                    pools.l_pool.ptr_mut(),
                    pools.m_pool.ptr(),
                    pools.reference.ptr_mut(),
                    io.out.ptr_mut(),
                    io.lse.ptr_mut(),
                    status.ptr_mut(),
                    gate_ptr,
                    second,
                    on_sum,
                    u32_arg("rows", rows)?,
                ),
            ),
            // The paired pool's combine takes the same parameters (a codegen test checks
            // it), `o_pool` then the pool's start (the kernel skips the anchors).
            OPoolSpan::F16(o) => (
                match pair {
                    Some(_) => &fwd_kv_combine_f16p::KERNEL,
                    None => &fwd_kv_combine_f16::KERNEL,
                },
                fwd_kv_combine_f16::args(
                    pair.map_or(o.ptr_mut(), |(base, _)| PtrMut::new(base)),
                    pools.l_pool.ptr_mut(),
                    pools.m_pool.ptr(),
                    pools.reference.ptr_mut(),
                    io.out.ptr_mut(),
                    io.lse.ptr_mut(),
                    status.ptr_mut(),
                    gate_ptr,
                    vmax,
                    second,
                    on_sum,
                    u32_arg("rows", rows)?,
                ),
            ),
        };
        // SAFETY: the pools and the reference are [T, 64, 128] / [T, 64]; out and lse were
        // checked to be [T, 64, 128] and [T, 64]; status is two words and vmax the word after
        // them (f16 pool); a null gate is never read; the kernel strides over `rows` whatever
        // the grid.
        unsafe { backend.launch(kernel, (grid, 1, 1), &args) }
    }

    /// Issues the pass on `backend`'s stream: the task build from `schedule` (built from the
    /// same `q2k` and `cu_seqlens` earlier on this stream), the three pools zeroed, one launch.
    /// No host sync.
    ///
    /// # Errors
    /// - [`RuntimeError::Input`] naming the field for a wrong length or a schedule of another
    ///   memory space or of context-parallel rows; [`RuntimeError::NullBuffer`];
    ///   [`RuntimeError::Overlap`] for a pool on an input or another pool.
    /// - [`RuntimeError::UnsupportedArch`] on any capability but 9.0.
    /// - Tensor-map, JIT and launch errors from the backend.
    pub fn run_to_pools(
        &mut self,
        backend: &mut B,
        io: &ForwardKvBuffers,
        schedule: &ResidentSchedule<B>,
    ) -> Result<(), RuntimeError> {
        // The caller's pools have the `[T, 64, 128]` layout.
        match self.prepare(backend, io, schedule, ZeroO::Prepare, None, None)? {
            Some(launch) => {
                let pass = Pass::Sum(io.o_pool.kind());
                self.launch_pass(backend, pass, io, &launch, None)
            }
            None => Ok(()),
        }
    }

    /// [`MsaForwardKv::run_to_pools`] up to the launch: checks, kernels, tensor maps, the task
    /// build and the zeroed pools (`o_pool` left to the max pass or to the task build, and
    /// the other two to the probe, as `zero_o` names, when the pass launches); `None` when
    /// there is nothing to launch. With a paired pool's `(o, homes)`, `io.o_pool` spans the
    /// first halves of its rows' pairs; `kv`, the paired K/V tiles' `(pairs, masks)`, comes
    /// only with it.
    fn prepare(
        &mut self,
        backend: &mut B,
        io: &ForwardKvBuffers,
        schedule: &ResidentSchedule<B>,
        zero_o: ZeroO,
        pair: Option<(u64, u64)>,
        kv: Option<(u64, u64)>,
    ) -> Result<Option<PassLaunch>, RuntimeError> {
        self.claim(backend);
        let z = *schedule.sizes();
        let (t, w) = check_inputs(backend, schedule, [io.q, io.k_aligned, io.v_aligned])?;
        check_len(
            "reference",
            io.reference.len,
            t * NUM_Q_HEADS,
            "[T, 64] f32",
        )?;
        check_len("o_pool", io.o_pool.len(), t * Q_ROW, "[T, 64, 128]")?;
        check_len("l_pool", io.l_pool.len, t * NUM_Q_HEADS, "[T, 64] f32")?;
        check_len("m_pool", io.m_pool.len, t * NUM_Q_HEADS, "[T, 64] u32")?;
        if t == 0 {
            return Ok(None);
        }
        check_regions(
            &[
                Region::input("q", io.q)?,
                Region::input("k_aligned", io.k_aligned)?,
                Region::input("v_aligned", io.v_aligned)?,
                Region::input("reference", io.reference)?,
                io.o_pool.region()?,
                Region::output("l_pool", io.l_pool)?,
                Region::output("m_pool", io.m_pool)?,
            ],
            false,
            "no pool on an input or another pool",
        )?;
        // The task build loads its own kernels (`TaskWorkspace::build_from`).
        backend.load(pass_kernel(Pass::Sum(io.o_pool.kind()), pair.is_some()))?;
        let shape = ScheduleShape {
            num_tokens: z.num_tokens,
            num_docs: z.num_documents,
            edge_capacity: z.edge_capacity,
            work_capacity: z.work_capacity,
        };
        let sizes = TaskBuildSizes::for_shape(shape, backend.sm_count(), self.locality)?;
        let grid = sizes.main_grid()?;
        let ctas = grid_dim(
            "walk-split CTAs",
            (grid as usize).saturating_mul(self.walk_split as usize),
        )?;
        let tmap_q = backend.tensor_map(&TileMapSpec::query_rows("q", t)?, io.q.addr)?;
        let tmap_k =
            backend.tensor_map(&TileMapSpec::key_rows("k_aligned", w)?, io.k_aligned.addr)?;
        let tmap_v =
            backend.tensor_map(&TileMapSpec::key_rows("v_aligned", w)?, io.v_aligned.addr)?;
        let o_map = match io.o_pool.kind() {
            OPool::F32 => TileMapSpec::query_rows_f32("o_pool", t)?,
            OPool::F16 => TileMapSpec::query_rows_f16("o_pool", t)?,
        };
        let tmap_o = backend.tensor_map(&o_map, io.o_pool.addr())?;
        let tasks = match self.tasks.take() {
            Some(ws) if ws.fits(&sizes, z.work_capacity) => ws,
            old => {
                drop(old);
                TaskWorkspace::new(backend, sizes, z.work_capacity)?
            }
        };
        let tasks = self.tasks.insert(tasks);
        // A paired pool zeroes both copies of each row's pair.
        let o_bytes = match pair {
            Some(_) => 2 * io.o_pool.kind().bytes() * io.o_pool.len(),
            None => io.o_pool.kind().bytes() * io.o_pool.len(),
        };
        // The max pass zeroes o_pool itself, when it launches and the count fits its word.
        let o_words = u32::try_from(o_bytes / 16)
            .ok()
            .filter(|&w| w < 1 << 31 && zero_o == ZeroO::InMaxPass && grid > 0);
        // The probe runs only when the pass does; without it the combine reads the pools.
        let in_probe = zero_o == ZeroO::InProbe && grid > 0;
        // Under the probe, the task build's idle SMs zero o_pool.
        let in_build = in_probe.then_some((io.o_pool.addr(), o_bytes));
        if o_words.is_none() && !in_probe {
            backend.zero("o_pool", io.o_pool.addr(), o_bytes)?;
        }
        if !in_probe {
            backend.zero("l_pool", io.l_pool.addr, 4 * io.l_pool.len)?;
            backend.zero("m_pool", io.m_pool.addr, 4 * io.m_pool.len)?;
        }
        tasks.build_zeroing(backend, &schedule.refs(), in_build)?;
        Ok((grid > 0).then_some(PassLaunch {
            maps: [tmap_q, tmap_k, tmap_v, tmap_o],
            ctas,
            split_log2: self.walk_split.trailing_zeros(),
            l2_hints: self
                .l2_hints
                .unwrap_or_else(|| L2Hints::auto(z.num_tokens, z.num_documents))
                .bits(),
            zero: o_words.map(|w| (io.o_pool.addr(), w)),
            pair,
            kv,
        }))
    }

    /// One launch of the pass on the tables [`MsaForwardKv::prepare`] built; with a `gate`,
    /// it does nothing while the gate's first word is zero.
    fn launch_pass(
        &self,
        backend: &mut B,
        pass: Pass,
        io: &ForwardKvBuffers,
        launch: &PassLaunch,
        gate: Option<Span<u32>>,
    ) -> Result<(), RuntimeError> {
        let tasks = self.tasks.as_ref().expect("prepare built the task tables");
        // Only the max pass zeroes o_pool (it precedes every add into it).
        let zero = launch.zero.filter(|_| pass == Pass::Max);
        let [tmap_q, tmap_k, tmap_v, tmap_o] = &launch.maps;
        // Only the f16 sum pass adds into a paired pool.
        let pair = launch.pair.filter(|_| pass == Pass::Sum(OPool::F16));
        let kv = launch.kv.filter(|_| pair.is_some());
        // Every pass takes the same parameters (a codegen test checks it).
        let args = msa_forward_kv_sm90::args(
            tmap_q,
            tmap_k,
            tmap_v,
            tmap_o,
            io.reference.ptr(),
            tasks.task_meta(),
            tasks.task_qrows(),
            tasks.task_qpos(),
            tasks.desc(),
            io.l_pool.ptr_mut(),
            io.m_pool.ptr_mut(),
            gate.map_or(Ptr::new(0), |g| g.ptr()),
            PtrMut::new(zero.map_or(0, |(at, _)| at)),
            zero.map_or(0, |(_, words)| words),
            launch.split_log2,
            launch.l2_hints,
            PtrMut::new(pair.map_or(0, |(o, _)| o)),
            Ptr::new(pair.map_or(0, |(_, h)| h)),
            Ptr::new(kv.map_or(0, |(p, _)| p)),
            Ptr::new(kv.map_or(0, |(_, m)| m)),
        );
        let kernel = pass_kernel(pass, pair.is_some());
        // SAFETY: the maps span q and o_pool [T,64,128] and k/v [W,4,128], whose lengths
        // were checked; reference, l_pool and m_pool are [T,64]; the task tables come
        // from a workspace built for the launch's grid; a null gate is never read; `zero`
        // is null or o_pool's own 16-byte words; a paired pool holds its anchors' and the
        // rows' pairs and their labels (`PairPool::new`), and with `kv` the tiles' pairs and
        // masks that `fwd_kv_pair_kv` wrote for these K/V (`PairPool::kv`).
        unsafe { backend.launch(kernel, (launch.ctas, 1, 1), &args) }
    }
}

/// Which kernel a launch of the pass runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// The sums into an `o_pool` of this type.
    Sum(OPool),
    /// The row maxima alone (and `o_pool`'s zeroing).
    Max,
}

/// The kernel of a pass (all take the same parameters); `paired`, the f16 sum pass into a
/// paired pool.
fn pass_kernel(pass: Pass, paired: bool) -> &'static KernelSpec {
    match (pass, paired) {
        (Pass::Sum(OPool::F32), _) => &msa_forward_kv_sm90::KERNEL,
        (Pass::Sum(OPool::F16), false) => &msa_forward_kv_f16_sm90::KERNEL,
        (Pass::Sum(OPool::F16), true) => &msa_forward_kv_f16p_sm90::KERNEL,
        (Pass::Max, _) => &msa_forward_kv_max_sm90::KERNEL,
    }
}

/// What [`MsaForwardKv::launch_pass`] needs from [`MsaForwardKv::prepare`].
struct PassLaunch {
    maps: [TensorMap; 4],
    /// The walks' grid times the walk split.
    ctas: u32,
    /// log2 of the walk split.
    split_log2: u32,
    /// [`L2Hints::bits`].
    l2_hints: u32,
    /// `o_pool`'s address and 16-byte words, when the max pass is to zero it (then
    /// `prepare` did not).
    zero: Option<(u64, u32)>,
    /// The paired pool's `(o, homes)`, or `None` for the `tmap_o` layout.
    pair: Option<(u64, u64)>,
    /// With `pair`, the paired K/V tiles' `(pairs, masks)`, or `None` for the tensor maps.
    kv: Option<(u64, u64)>,
}

/// Who zeroes the pools: `prepare` (memsets), the max pass that precedes the sum pass
/// (`o_pool`), or under the probe the task build's spare CTAs (`o_pool`) and the probe
/// (`l_pool`; it writes all of `m_pool`), when the pass launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ZeroO {
    Prepare,
    InMaxPass,
    InProbe,
}

/// The checks both entry points make before any launch: a 9.0 device, a schedule of its
/// memory space over every token, Q `[T, 64, 128]` and K/V `[W, 4, 128]` bf16 with `W` a
/// positive multiple of 128 (when `T > 0`). Returns `(T, W)`.
fn check_inputs<B: Backend>(
    backend: &B,
    schedule: &ResidentSchedule<B>,
    [q, k, v]: [Span<bf16>; 3],
) -> Result<(usize, usize), RuntimeError> {
    let cc = backend.capability();
    if cc != (9, 0) {
        return Err(RuntimeError::UnsupportedArch {
            kernel: "msa_forward_kv",
            ordinal: backend.ordinal(),
            major: cc.0,
            minor: cc.1,
            supported: "9.0 (msa_forward_kv_sm90)".into(),
        });
    }
    if schedule.memory_space() != backend.memory_space() {
        return Err(RuntimeError::input(
            "schedule",
            "a resident schedule of another memory space",
            "one built on this backend's device",
        ));
    }
    let rows = schedule.query_rows();
    let t = schedule.sizes().num_tokens;
    if rows.start != 0 || rows.len() != t {
        return Err(RuntimeError::input(
            "schedule",
            format!("query rows {rows:?} of {t} tokens"),
            "a schedule over every token (context-parallel ranks are not supported)",
        ));
    }
    let w = schedule.sizes().workspace_rows;
    check_len("q", q.len, t * Q_ROW, "[T, 64, 128] bf16")?;
    check_len("k_aligned", k.len, w * KV_ROW, "[W, 4, 128] bf16")?;
    check_len("v_aligned", v.len, w * KV_ROW, "[W, 4, 128] bf16")?;
    if t > 0 && (w == 0 || !w.is_multiple_of(BLOCK_SIZE)) {
        return Err(RuntimeError::input(
            "schedule.workspace_rows",
            w,
            "a positive multiple of 128",
        ));
    }
    Ok((t, w))
}

/// The row maximum an `m_pool` key holds (log2 units of `S·scale`), or `None` for a row no
/// task touched or whose every key was masked.
pub fn max_from_key(key: u32) -> Option<f32> {
    let bits = if key & 0x8000_0000 != 0 {
        key & 0x7fff_ffff
    } else {
        !key
    };
    let m = f32::from_bits(bits);
    (m.is_finite()).then_some(m)
}

/// How far below its reference a row's maximum may lie (natural-log units) before its terms
/// lose range in f32: `exp(−87)` is f32's smallest normal, and a row sums up to 2048 terms.
/// `fwd_kv_combine` uses the same window (`forward_kv_rows::MAX_GAP`; a test ties the two).
pub const MAX_REFERENCE_GAP: f32 = 60.0;
/// How far above its reference a row's maximum may lie (`forward_kv_rows::MAX_EXCESS`).
pub const MAX_REFERENCE_EXCESS: f32 = 1.0;

/// One row of the combine: `(out, lse)` from its pools and its reference, `Ok(None)` for a
/// row with no key (`out = 0`, `lse = −∞`), and `Err(gap)` for a row whose maximum lies more
/// than [`MAX_REFERENCE_GAP`] below `reference` (or above it), which must be recomputed with a
/// closer reference.
#[allow(clippy::type_complexity)]
pub fn combine_row(
    o: &[f32],
    l: f32,
    m_key: u32,
    reference: f32,
) -> Result<Option<([f32; HEAD_DIM], f32)>, f32> {
    let Some(m2) = max_from_key(m_key) else {
        return Ok(None);
    };
    let m = m2 * std::f32::consts::LN_2;
    let gap = reference - m;
    if !(-MAX_REFERENCE_EXCESS..=MAX_REFERENCE_GAP).contains(&gap) || l <= 0.0 {
        return Err(gap);
    }
    let mut out = [0.0f32; HEAD_DIM];
    for (dst, x) in out.iter_mut().zip(o) {
        *dst = x / l;
    }
    Ok(Some((out, reference + l.ln())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_takes_the_kv_forward_only_where_it_was_measured_faster() {
        let (h100, b200) = ((9, 0), (10, 0));
        let long = (
            2 * KV_FORWARD_MIN_MEAN_DOC,
            2,
            2 * KV_FORWARD_MIN_MEAN_DOC + 256,
        );
        let auto = |cc, shape, det| ForwardAlgorithm::Auto.uses_kv(cc, 0, shape, det).unwrap();
        assert!(auto(h100, long, false));
        // Deterministic mode, SM100, short documents, no document, a ragged W: Q-parallel.
        assert!(!auto(h100, long, true));
        assert!(!auto(b200, long, false));
        let short = (
            2 * KV_FORWARD_MIN_MEAN_DOC - 1,
            2,
            2 * KV_FORWARD_MIN_MEAN_DOC + 256,
        );
        assert!(!auto(h100, short, false));
        assert!(!auto(h100, (0, 0, 0), false));
        assert!(!auto(h100, (long.0, long.1, long.2 + 1), false));
        // The explicit choices.
        let q = ForwardAlgorithm::QParallel;
        assert!(!q.uses_kv(h100, 0, long, false).unwrap());
        let kv = ForwardAlgorithm::KvParallel;
        assert!(kv.uses_kv(h100, 0, short, false).unwrap());
        let e = kv.uses_kv(b200, 2, long, false).unwrap_err().to_string();
        assert!(
            e.contains("msa_forward_kv") && e.contains("10.0 (device 2)"),
            "{e}"
        );
        let e = kv.uses_kv(h100, 0, long, true).unwrap_err().to_string();
        assert!(
            e.contains("forward_algorithm") && e.contains("deterministic"),
            "{e}"
        );
    }

    #[test]
    fn auto_hints_mark_kv_evict_first_only_for_long_documents_on_average() {
        let long = L2Hints::auto(2 * L2_HINTS_MIN_MEAN_DOC, 2);
        assert_eq!(long.bits(), 1, "K/V evict_first alone");
        assert_eq!(
            L2Hints::auto(2 * L2_HINTS_MIN_MEAN_DOC - 1, 2),
            L2Hints::NONE
        );
        // 30 documents of 35K tokens (packed1m): none; no document: as one.
        assert_eq!(L2Hints::auto(1 << 20, 30), L2Hints::NONE);
        assert_eq!(L2Hints::auto(L2_HINTS_MIN_MEAN_DOC, 0), long);
        assert_eq!(L2Hints::auto(usize::MAX, usize::MAX), L2Hints::NONE);
        assert_eq!((L2Hints::NONE.bits(), L2Hints::ALL.bits()), (0, 7));
    }

    #[test]
    fn the_default_windows_are_capped_only_past_64k_tokens() {
        let l = FORWARD_KV_LOCALITY;
        assert!(l.validate().is_ok());
        // 4 queries per block up to 512 blocks, then 2048 queries.
        for (blocks, log2) in [
            (1, 9),
            (128, 9),
            (256, 10),
            (512, 11),
            (1024, 11),
            (8192, 11),
        ] {
            assert_eq!(l.window_log2(blocks), log2, "{blocks} blocks");
        }
    }

    fn key(x: f32) -> u32 {
        // The kernel's key: the sign bit set for a non-negative value, all bits flipped for a
        // negative one.
        let u = x.to_bits();
        if u & 0x8000_0000 != 0 {
            !u
        } else {
            u | 0x8000_0000
        }
    }

    #[test]
    fn keys_order_as_their_floats_and_decode() {
        let xs = [f32::NEG_INFINITY, -3.5, -0.0, 0.0, 1e-30, 2.0, 77.25];
        for w in xs.windows(2) {
            assert!(key(w[0]) <= key(w[1]), "{} {}", w[0], w[1]);
        }
        assert!(
            key(f32::NEG_INFINITY) > 0,
            "a zeroed pool lies below every key"
        );
        assert_eq!(max_from_key(key(-3.5)), Some(-3.5));
        assert_eq!(max_from_key(key(77.25)), Some(77.25));
        assert_eq!(max_from_key(key(f32::NEG_INFINITY)), None);
        assert_eq!(max_from_key(0), None);
    }

    #[test]
    fn combine_rejects_a_reference_far_above_the_row() {
        let o = [1.0f32; HEAD_DIM];
        let m2 = 2.0 / std::f32::consts::LN_2; // a row maximum of 2 (natural log)
        let (out, lse) = combine_row(&o, 4.0, key(m2), 10.0).unwrap().unwrap();
        assert!((out[0] - 0.25).abs() < 1e-7);
        assert!((lse - (10.0 + 4.0f32.ln())).abs() < 1e-6);
        assert!(combine_row(&o, 4.0, key(m2), 70.0).is_err());
        assert!(
            combine_row(&o, 4.0, key(m2), 0.0).is_err(),
            "R below the maximum"
        );
        assert_eq!(combine_row(&o, 0.0, 0, 10.0), Ok(None));
    }
}
