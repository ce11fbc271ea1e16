//! `msa_forward_kv_sm90`: the KV-parallel MSA forward for Hopper (sm_90a), on the backward's
//! task tables, with its f16 variant `msa_forward_kv_f16_sm90` and its max pass
//! `msa_forward_kv_max_sm90`. Checked against the CPU reference on the simulator and on the
//! H200, timed there (below); `MsaAttention` takes it for long documents.
//!
//! # Why
//! `msa_forward_sm90` is Q-parallel: an m64 tile holds 4 queries, so with random selections it
//! executes a tile for every block any of them chose (packed64k: 7.4 TFLOP executed for 3.6
//! useful). The backward's task tables hold only selected (block, query) pairs: one task row
//! is 128 keys of one block × 8 query slots × 16 heads, so no tensor work is wasted. What they
//! lack for a forward is each row's softmax normaliser before its blocks' `P·V` are summed.
//!
//! # Design
//! One pass with a fixed reference per row instead of the online maximum. The caller gives
//! `reference [T, 64]` (natural-log units of `S·scale`), an upper bound of every logit of the
//! row, e.g. `scale·‖q‖·max‖k‖` (Cauchy-Schwarz). Each task then adds, for each of its rows,
//! - `Σ_k exp(S·scale − R)·v_k` into `o_pool [T, 64, 128]` f32,
//! - `Σ_k exp(S·scale − R)` into `l_pool [T, 64]` f32,
//! - `max_k S·scale·log2e` into `m_pool [T, 64]` (an order-preserving u32 key, 0 = untouched),
//!
//! and a combine gives `out = o/l`, `lse = R + ln l`. Every term is at most 1 (R bounds the
//! logits), so nothing overflows; the row maximum tells the combine how far below R the row
//! lies (`R − M`): terms under f32's range (`exp(−87)` relative to R) are lost, which is
//! harmless while `R − M` stays well under 87 and must otherwise be recomputed with `R = M`.
//!
//! - **Warpgroups.** 384 threads, the backward's roles: warp 0's lane 0 issues the TMA loads
//!   (K/V once per segment, Q per task as 16 boxes of 16 heads × 64 d, a −1 query row
//!   zero-filled); warp 1 gathers each task's row scalars (`−R·log2e`, −∞ for an empty slot;
//!   the slots' compact rows and positions); warpgroups 1 and 2 consume. Consumer `c` owns
//!   folded rows `64c .. 64c+64` (slots `4c .. 4c+4`), warp `w` exactly slot `4c + w`'s 16
//!   heads, and all 128 keys: no consumer waits for the other.
//! - **Per task** (wgmma m64, bf16 in, f32 accumulators in registers): `S = Q_c·Kᵀ`
//!   (m64n128k16 × 8, both operands K-major SW128); the causal predicate `qpos ≥ key` in
//!   workspace coordinates, only where a thread's keys reach past its query (the diagonal
//!   block); `P = exp2(S·scale·log2e − R·log2e)` as one `fma` and `ex2`; `O = P·V` with P rounded to
//!   bf16 in registers as the A fragment and V an MN-major descriptor; then the warp's row
//!   sums and maxima (quad shuffles, `red.add.f32` and `red.max.u32`) go to the pools, and its
//!   16 rows of O are staged in its own 8 KB (a lane-pair exchange, then sixteen
//!   `st.shared.v4.f32` as four SW128 boxes of 16 heads × 32 d), fenced for the async proxy,
//!   and added by lane 0's four `cp.reduce.async.bulk.tensor` (f32 add in L2, `tmap_o`). Lane
//!   0 waits for their reads (`cp.async.bulk.wait_group.read`) before the warp stages its next
//!   task's rows, and before the CTA exits. An empty slot's warp skips its reductions.
//! - **S a task ahead** (the f16 pass, with two K/V stages): each consumer issues the next
//!   task's S GEMM right after this task's `P·V` (FlashAttention-3's overlap within a
//!   warpgroup), so that it runs while the warp sums its rows, waits for `P·V` and stages O;
//!   across a segment end it reads the next segment's K/V stage. After the walk's last task it
//!   issues that task's GEMM again (its Q stage kept), so that no wgmma sits on a branch:
//!   ptxas serializes every wgmma of the kernel when one is issued or waited for on a path it
//!   cannot prove uniform, so the branches in between test values broadcast from lane 0 and
//!   the lane-0 and head-lane parts are predicated. The f32 pass (one K/V stage) issues each
//!   S GEMM at its task's start.
//! - **Plan.** [`plan`]: the register budgets, the shared layout ([`SmemPlan`]: K, V
//!   ([`kv_stages`]), Q × 2, the O staging, the barriers, the row scalars) and the pipelines
//!   ([`PipelinePlan`]: K/V released by each consumer warp at a segment's end, Q two stages
//!   released by each consumer warp after its S GEMM, the row scalars one stage released by
//!   every consumer thread after its own last read), checked at codegen time.
//!
//! # The f16 pool (`msa_forward_kv_f16_sm90`, the runtime's default pool)
//! [`OPool::F16`]: the same kernel with each warp's rows staged as f16 (`cvt.rn.f16x2.f32`,
//! `stmatrix`, two boxes of 16 heads × 64 d) and added by a TMA f16 reduce-add: the bf16
//! pool's bytes with 11 significant bits instead of 8. The caller lowers the reference so that
//! no sum leaves f16's range, and recomputes the rows whose sums would sink into its
//! subnormals (`forward_kv_rows`). Against the Cauchy-Schwarz bound, which on unit-variance
//! inputs lies about 9 above each row's maximum, that is nearly every row.
//!
//! # The paired pool (session 27; opt-in: correct on the GPU, speed not yet measured)
//! `msa_forward_kv_f16p_sm90` ([`DESC_F16_PAIRED`]) is the f16 pass adding each warp's
//! staged rows into the paired pool of [`l2_sides`] (`o_pair`, `o_homes`) instead of through
//! `tmap_o`: one `cp.reduce.async.bulk` f16 add of the staging's 4 KiB image into the copy of
//! the row homed in the warp's own L2 partition, so that no reduction crosses the fabric
//! between the partitions, which bounds the pass. Each consumer warp's lane 0 finds its side
//! at the start from an anchor pair, and loads the row's label right after the task's row
//! scalars. Its combine, `fwd_kv_combine_f16p`, adds the two copies. The other passes take
//! `o_pair` and `o_homes` (null) and read neither: their code is what it was before.
//!
//! With a non-null `kv_pair` (session 28; correct on the GPU, speed not yet measured), the
//! paired pass's producer also finds its side at the start and loads each segment's K and V
//! from the paired tiles of [`l2_sides::PAIR_KV`]: per tile the two 8-bit masks, then 16 bulk
//! copies of 4 KiB, each chunk of the SW128 image from the copy homed on its side, on the
//! stage's mbarrier (the same 64 KiB the tensor-map loads bring). With a null one it loads through
//! `tmap_k` and `tmap_v`, as the other passes do.
//!
//! # The probe's reference (the runtime's default since session 18)
//! The pass needs only that every row's terms stay in its pool's range, not that `R` bound
//! the logits. `fwd_kv_probe` (`forward_kv_rows`) gives a lower bound of each row's
//! maximum instead, its logit against the first key of each block it sees: terms may then
//! exceed 1, but the row sum is at least about 1, and the combine checks it against the f16
//! range (the pool's scale leaves it room up to 60000) and recomputes the rows beyond with
//! their `lse`. No pass precedes this one, and the sum pass gets a null `m_pool`.
//!
//! # The max pass (`msa_forward_kv_max_sm90`, [`Pass::Max`]; `Reference::ExactMax` only)
//! The same walk with K alone: the S GEMM, the mask and the rows' `red.max`, no V, no P·V, no
//! staging, no reference. `forward_kv_rows::REFERENCE` turns the maxima into the sum pass's
//! references, so that no row leaves either pool's window; the sum pass, given a null
//! `m_pool`, then skips its own maxima. The producer warpgroup's spare warps 2 and 3 zero
//! `o_pool` for the sum pass meanwhile (`zero`, `zero_words`): the pass keeps the tensor and
//! shared-memory pipes busy, not its stores.
//!
//! # Loads ahead
//! The producer thread loads each task's meta and 8 compact rows one task ahead; the gather
//! warp loads its words two tasks ahead and the references (addressed by those words) one
//! ahead, without branches, so that no load waits on another of its iteration. Before, each
//! task's TMA issue waited for two dependent global loads, which bounded the max pass.
//!
//! # Measured
//! The figures, session by session, are in `bench/README.md` ("The forward") and
//! `bench/results/`; what they settled for this kernel:
//! - The O reduction decides the pass: without it the pass took 5.1 ms at packed64k against
//!   20.3 with TMA f32 reduce-adds (H200, session 14). Hence TMA reduce-adds (registers'
//!   `red.global.add.v4.f32` took 24.2), the f16 pool (a bf16 pool missed `out`'s 0.025 by
//!   one bf16 step) and task windows whose `o_pool` rows stay in L2 between adds.
//! - The probe's reference (session 18) retired the max pass from the default: 4.1× fla.
//! - Kept: the mask on the diagonal block only, the loads ahead (session 16), two K/V stages
//!   and the S GEMM a task ahead (19), the consumer index through `redux.sync.min` (20), the
//!   row sums as a balanced tree and the pool addresses outside the lane predicate (21), each
//!   walk split between two CTAs (22), windows capped at 2048 queries and K/V `evict_first`
//!   past 64K tokens on average (24).
//! - Dropped, each slower in the same call: consumers taking turns (ping-pong), three Q
//!   stages, the row sums' `red.add` after the fence, exponentials on the FMA pipe, `P·V`
//!   issued k16 by k16, two walks per CTA (68 %: the rows leave L2), four or eight CTAs per walk.
//! - The bound (sessions 25-27): the L2 fabric between the two partitions (97 % active on an
//!   H100), which half of each task's reductions cross; long documents add read misses that
//!   cross it. Hence the paired pool (above), whose only timing (session 29) ran with side
//!   probes that timed nothing ([`l2_sides::latency`]).

use super::common::{self, k_major, mn_major};
use super::l2_sides;
use super::KernelDesc;
use crate::plan::pipeline::{Barriers, Pipe, Pipeline, PipelinePlan, TmaBox};
use crate::plan::roles::Role;
use crate::plan::sm90::{Sm90Plan, Sm90Warps, SLOTS};
use crate::plan::smem::{Buf, BufferSpec, Major, Placed, SmemPlan, TILE_BYTES, TILE_ROWS};
use crate::plan::PlanError;
use crate::ptx::*;
use crate::target::Target;

/// Threads per CTA: one producer warpgroup and two consumer warpgroups.
pub const THREADS: u32 = crate::plan::sm90::THREADS;
/// Registers of the producer warpgroup after `setmaxnreg.dec`.
pub const PRODUCER_REGS: u32 = 40;
/// Registers of each consumer warpgroup after `setmaxnreg.inc` (40·128 + 232·256 ≤ 64 Ki).
pub const CONSUMER_REGS: u32 = 232;

/// The element type of `o_pool`, and so of the O staging and `tmap_o`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OPool {
    /// f32: four boxes of 16 heads × 32 d per warp (8 KB staged).
    F32,
    /// f16: two boxes of 16 heads × 64 d per warp (4 KB staged, `stmatrix`), half the bytes
    /// reduced. The caller shifts the reference so that no sum leaves f16's range
    /// (`forward_kv_rows`).
    F16,
}

impl OPool {
    /// Staged bytes per consumer warp: 16 rows × 128 d.
    pub fn warp_bytes(self) -> u32 {
        match self {
            OPool::F32 => 16 * 128 * 4,
            OPool::F16 => 16 * 128 * 2,
        }
    }

    /// The TMA boxes of a warp's rows: (count, head dims per box); each box is 16 heads of
    /// 128-byte rows (2 KB).
    pub fn boxes(self) -> (u32, u32) {
        match self {
            OPool::F32 => (4, 32),
            OPool::F16 => (2, 64),
        }
    }
}

/// What a launch of the pass computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// The sums against the caller's reference, into an `o_pool` of this type (and the row
    /// maxima).
    Sum(OPool),
    /// Only the row maxima into `m_pool`: the S GEMM, the mask and `red.max`, no V, no P·V,
    /// no staging. `forward_kv_rows::REFERENCE` turns them into the sum pass's reference,
    /// so that the f16 pool's window holds every row.
    Max,
}

/// The kernel (f32 `o_pool`).
pub const DESC: KernelDesc = KernelDesc {
    name: "msa_forward_kv_sm90",
    about: "KV-parallel MSA forward for Hopper on the backward's task tables: per row, exp(S*scale - R)*V \
            (TMA reduce-add), its sum and the row maximum into f32 pools against a caller's upper bound R",
    targets: &[Target::Sm90a],
    threads: (THREADS, 1, 1),
    describe: |b| describe(b, Pass::Sum(OPool::F32), false),
};

/// The kernel with an f16 `o_pool`.
pub const DESC_F16: KernelDesc = KernelDesc {
    name: "msa_forward_kv_f16_sm90",
    about:
        "msa_forward_kv_sm90 with an f16 o_pool: the O rows staged as f16 (stmatrix) and added \
            by TMA f16 reduce-add, against a reference the caller shifted to keep the sums in range",
    targets: &[Target::Sm90a],
    threads: (THREADS, 1, 1),
    describe: |b| describe(b, Pass::Sum(OPool::F16), false),
};

/// The f16 kernel adding into the paired pool of [`l2_sides`] (`o_pair`, `o_homes`).
pub const DESC_F16_PAIRED: KernelDesc = KernelDesc {
    name: "msa_forward_kv_f16p_sm90",
    about: "msa_forward_kv_f16_sm90 adding each warp's staged rows into the copy of the paired \
            o_pool homed in its own L2 partition (one bulk f16 reduce-add), so that no \
            reduction crosses the fabric between the partitions",
    targets: &[Target::Sm90a],
    threads: (THREADS, 1, 1),
    describe: |b| describe(b, Pass::Sum(OPool::F16), true),
};

/// The max pass ([`Pass::Max`]), with the sum passes' parameters.
pub const DESC_MAX: KernelDesc = KernelDesc {
    name: "msa_forward_kv_max_sm90",
    about:
        "the KV-parallel forward's row maxima alone: S = Q*K^T on the task tables, the causal \
            mask and red.max of max S*scale*log2e into m_pool (the exact reference of the sum pass)",
    targets: &[Target::Sm90a],
    threads: (THREADS, 1, 1),
    describe: |b| describe(b, Pass::Max, false),
};

fn boxes(dims: [u32; 3], n: usize) -> Vec<TmaBox> {
    vec![
        TmaBox {
            dims: dims.to_vec(),
            elem_bytes: 2,
        };
        n
    ]
}

/// Stages of K/V: two in the f16 sum pass, so that the next segment's K/V loads while this
/// one's last tasks run instead of after all 8 consumer warps released it (a segment is
/// about 16-22 tasks at 64K tokens); one where the shared memory has no room (the f32
/// staging's 64 KB) or the pass was not measured with two (the max pass).
pub fn kv_stages(pass: Pass) -> u32 {
    match pass {
        Pass::Sum(OPool::F16) => 2,
        Pass::Sum(OPool::F32) | Pass::Max => 1,
    }
}

/// K/V: [`kv_stages`] stages of two 128-key × 64-d boxes each of K and V (of K alone for the
/// max pass), each released by each consumer warp (8 arrivals) at its segment's end.
pub fn kv_pipeline(pass: Pass) -> Pipeline {
    let fills = match pass {
        Pass::Sum(_) => vec![Buf::K, Buf::V],
        Pass::Max => vec![Buf::K],
    };
    let tiles = fills.len() as u32;
    Pipeline {
        tx: boxes([64, 1, 128], 2 * tiles as usize),
        declared_tx: Some(tiles * TILE_BYTES),
        fills,
        ..Pipeline::new("kv", kv_stages(pass), Role::Load, &[Role::Compute], 1, 8)
    }
}

/// Stages of Q and of the row scalars in the max pass. Its consumers do little besides the S
/// GEMM, so the producers must run further ahead; the shared memory the sum passes spend on
/// V and the O staging holds them.
pub const MAX_PASS_STAGES: u32 = 4;

/// A stream of the KV-parallel passes' TMA traffic whose L2 eviction priority the `l2_hints`
/// parameter sets, one bit each (the runtime's `L2Hints` mirrors the bits). K/V are read once
/// per segment, while each query's Q and `o_pool` rows are read and added again by its other
/// selected blocks' tasks within a window: past 64K tokens a window's rows outgrow L2
/// (session 23: 432 / 254 / 191 useful TFLOP/s at doc64k / doc256k / doc1m on an H100), and
/// the hints keep them there at the K/V's expense.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum L2Stream {
    /// The K/V loads: `evict_first` when hinted.
    Kv,
    /// The Q loads: `evict_last` when hinted.
    Q,
    /// The `o_pool` reduce-adds: `evict_last` when hinted.
    O,
}

impl L2Stream {
    /// Every stream, in bit order.
    pub const ALL: [L2Stream; 3] = [L2Stream::Kv, L2Stream::Q, L2Stream::O];

    /// The stream's bit of `l2_hints`.
    pub fn bit(self) -> u32 {
        match self {
            L2Stream::Kv => 1,
            L2Stream::Q => 2,
            L2Stream::O => 4,
        }
    }

    /// The priority its bit asks for.
    pub fn hinted(self) -> L2Evict {
        match self {
            L2Stream::Kv => L2Evict::First,
            L2Stream::Q | L2Stream::O => L2Evict::Last,
        }
    }
}

/// The policy register of `stream` under the `l2_hints` word `hints`: its hinted priority
/// where its bit is set, else `evict_normal` (the priority of an unhinted access). Created
/// once per thread that issues.
fn l2_policy(b: &mut KernelBuilder, hints: Reg<U32>, stream: L2Stream) -> Reg<B64> {
    let bit = b.and(hints, stream.bit());
    let on = b.setp(Cmp::Ne, bit, 0u32);
    let hinted = b.policy_fractional(stream.hinted(), 1.0);
    let normal = b.policy_fractional(L2Evict::Normal, 1.0);
    b.selp(hinted, normal, on)
}

/// Q: two stages ([`MAX_PASS_STAGES`] in the max pass) of 8 slots × 2 d-halves of 16 heads ×
/// 64 d, released by each consumer warp once its S GEMM has completed.
pub fn q_pipeline(pass: Pass) -> Pipeline {
    let stages = match pass {
        Pass::Sum(_) => 2,
        Pass::Max => MAX_PASS_STAGES,
    };
    Pipeline {
        tx: boxes([64, 16, 1], 16),
        declared_tx: Some(TILE_BYTES),
        fills: vec![Buf::Q],
        ..Pipeline::new("q", stages, Role::Load, &[Role::Compute], 1, 8)
    }
}

/// The row scalars: one stage ([`MAX_PASS_STAGES`] in the max pass), filled by the gather
/// warp's 32 lanes, released by each of the 256 consumer threads after its own last read.
pub fn rows_pipeline(pass: Pass) -> Pipeline {
    let stages = match pass {
        Pass::Sum(_) => 1,
        Pass::Max => MAX_PASS_STAGES,
    };
    Pipeline::new("rows", stages, Role::Scalar, &[Role::Compute], 32, 256)
}

/// The shared layout: K, V, Q (one tile per stage; K/V at the `kv` pipeline's stages), the O
/// staging (8 KB of f32 rows per consumer warp: two tiles' worth), the barriers, then the row
/// scalars (`−R·log2e` per folded row, the slots' compact rows and positions). The max pass
/// has neither V nor the staging.
pub fn smem_plan(pipelines: &PipelinePlan, pass: Pass) -> Result<SmemPlan, PlanError> {
    let stages = |name| pipelines.get(name).map(|p| p.pipeline.stages);
    let (kv, q, rows) = (stages("kv")?, stages("q")?, stages("rows")?);
    let mut buffers = vec![BufferSpec::tile(Buf::K, kv)];
    if let Pass::Sum(pool) = pass {
        buffers.push(BufferSpec::tile(Buf::V, kv));
        buffers.push(BufferSpec::tile(Buf::Q, q));
        // 8 consumer warps' staging: 64 KB in f32 (two tiles), 32 KB in f16 (one).
        buffers.push(BufferSpec::tile(
            Buf::OStage,
            8 * pool.warp_bytes() / TILE_BYTES,
        ));
    } else {
        buffers.push(BufferSpec::tile(Buf::Q, q));
    }
    buffers.extend([
        BufferSpec::barriers(pipelines.barrier_slots()),
        BufferSpec::scalar(Buf::Lse, TILE_ROWS, rows),
        BufferSpec::scalar(Buf::QRows, SLOTS, rows),
        BufferSpec::scalar(Buf::QPos, SLOTS, rows),
    ]);
    SmemPlan::layout(buffers)
}

/// The whole plan, checked: budgets, pipelines against the roles, the layout against the
/// TMA fills.
pub fn plan(pass: Pass) -> Result<Sm90Plan, PlanError> {
    let warps = Sm90Warps::new(PRODUCER_REGS, CONSUMER_REGS)?;
    let pipes = vec![kv_pipeline(pass), q_pipeline(pass), rows_pipeline(pass)];
    let pipelines = PipelinePlan::new(pipes, &warps)?;
    let smem = smem_plan(&pipelines, pass)?;
    Sm90Plan::new(warps, smem, pipelines, Vec::new(), Vec::new())
}

/// Dynamic shared memory requested: the layout and 1 KiB of slack for aligning the base to
/// the 1024-B swizzle atom at run time.
pub fn smem_bytes(plan: &Sm90Plan) -> u32 {
    plan.smem().total() + 1024
}

/// The kernel's parameters.
pub struct ForwardKvParams {
    /// Q `[T, 64, 128]` bf16, boxes of 16 heads × 64 d.
    pub tmap_q: TensorMapRef,
    /// K `[W, 4, 128]` bf16 (aligned), boxes of 128 keys × 64 d.
    pub tmap_k: TensorMapRef,
    /// V, as K.
    pub tmap_v: TensorMapRef,
    /// `o_pool [T, 64, 128]` f32, zeroed by the caller: each warp's 16 rows are added as four
    /// boxes of 16 heads × 32 d (`TileMapSpec::query_rows_f32`).
    pub tmap_o: TensorMapRef,
    /// `reference [T, 64]` f32: an upper bound of `S·scale` over the row's keys.
    pub reference: ParamRef<U64>,
    /// `task_meta [capacity, 4]`.
    pub meta: ParamRef<U64>,
    /// `task_qrows [capacity, 8]`.
    pub qrows: ParamRef<U64>,
    /// `task_qpos [capacity, 8]`.
    pub qpos: ParamRef<U64>,
    /// The CTA-walk descriptor.
    pub desc: ParamRef<U64>,
    /// `l_pool [T, 64]` f32, zeroed by the caller.
    pub l_pool: ParamRef<U64>,
    /// `m_pool [T, 64]` u32 order-preserving keys of the row maxima (log2 units), zeroed; or,
    /// for a sum pass, null: the max pass has filled it, and the rows' maxima are skipped.
    pub m_pool: ParamRef<U64>,
    /// A gate word, or null: a gated launch (the recompute pass) does nothing while the word
    /// is zero (no row to recompute).
    pub gate: ParamRef<U64>,
    /// Memory the max pass's spare warps zero beside their walk (`o_pool`, for the sum pass
    /// after it), or null; 16-byte aligned. The sum passes ignore it.
    pub zero: ParamRef<U64>,
    /// The 16-byte words at `zero`.
    pub zero_words: ParamRef<U32>,
    /// Each CTA walk is split in `2^walk_split_log2` parts, one per CTA, and the grid is
    /// launched that many times over ([`common::cta_walk_part`]).
    pub walk_split_log2: ParamRef<U32>,
    /// The L2 eviction hints, a bit per [`L2Stream`]; 0 for none.
    pub l2_hints: ParamRef<U32>,
    /// The paired `o_pool` ([`l2_sides`]): two 4 KiB copies per
    /// `(token, index head)` row, each warp adding into the one homed on its L2 side. Read by
    /// `msa_forward_kv_f16p_sm90` only; the other passes take it (null) and ignore it.
    pub o_pair: ParamRef<U64>,
    /// `homes [pairs]` u32 of the paired pool (`fwd_kv_homes`), read only with `o_pair`.
    pub o_homes: ParamRef<U64>,
    /// Paired K/V tiles ([`l2_sides::PAIR_KV`]), or null: with `o_pair`, the paired pass's
    /// producer loads each 4 KiB chunk of a segment's K/V image from the copy homed on its
    /// side instead of through `tmap_k`/`tmap_v`. The other passes ignore it.
    pub kv_pair: ParamRef<U64>,
    /// `masks [tiles, 2]` u32: per tile, K's and V's 8 chunk labels as bits (with `kv_pair`).
    pub kv_masks: ParamRef<U64>,
}

fn params(b: &mut KernelBuilder) -> ForwardKvParams {
    ForwardKvParams {
        tmap_q: b.param_tensor_map("tmap_q"),
        tmap_k: b.param_tensor_map("tmap_k"),
        tmap_v: b.param_tensor_map("tmap_v"),
        tmap_o: b.param_tensor_map("tmap_o"),
        reference: b.param_ptr("reference", HostElem::F32, false),
        meta: b.param_ptr("task_meta", HostElem::I32, false),
        qrows: b.param_ptr("task_qrows", HostElem::I32, false),
        qpos: b.param_ptr("task_qpos", HostElem::I32, false),
        desc: b.param_ptr("desc", HostElem::I32, false),
        l_pool: b.param_ptr("l_pool", HostElem::F32, true),
        m_pool: b.param_ptr("m_pool", HostElem::U32, true),
        gate: b.param_ptr("gate", HostElem::U32, false),
        zero: b.param_ptr("zero", HostElem::U32, true),
        zero_words: b.param_u32("zero_words"),
        walk_split_log2: b.param_u32("walk_split_log2"),
        l2_hints: b.param_u32("l2_hints"),
        o_pair: b.param_ptr("o_pair", HostElem::U16, true),
        o_homes: b.param_ptr("o_homes", HostElem::U32, false),
        kv_pair: b.param_ptr("kv_pair", HostElem::U16, false),
        kv_masks: b.param_ptr("kv_masks", HostElem::U32, false),
    }
}

/// The plan resolved for the roles, looked up once.
struct Resolved<'a> {
    k: Placed,
    /// V and the O staging: the sum passes only.
    v: Option<Placed>,
    q: Placed,
    o_stage: Option<Placed>,
    neg_ref: Placed,
    qrows: Placed,
    qpos: Placed,
    barriers: u32,
    kv: Pipe<'a>,
    q_pipe: Pipe<'a>,
    rows: Pipe<'a>,
}

fn resolve(plan: &Sm90Plan, pass: Pass) -> Result<Resolved<'_>, String> {
    let smem = plan.smem();
    let buf = |id| smem.buffer(id).copied().map_err(|e| e.to_string());
    let pipe = |name| plan.pipelines().get(name).map_err(|e| e.to_string());
    let r = Resolved {
        k: buf(Buf::K)?,
        v: smem.buffer(Buf::V).ok().copied(),
        q: buf(Buf::Q)?,
        o_stage: smem.buffer(Buf::OStage).ok().copied(),
        neg_ref: buf(Buf::Lse)?,
        qrows: buf(Buf::QRows)?,
        qpos: buf(Buf::QPos)?,
        barriers: buf(Buf::Barriers)?.offset,
        kv: pipe("kv")?,
        q_pipe: pipe("q")?,
        rows: pipe("rows")?,
    };
    // A sum pass reads V and stages O; the plan must hold both.
    if let Pass::Sum(_) = pass {
        for (name, placed) in [("V", r.v), ("O staging", r.o_stage)] {
            if placed.is_none() {
                return Err(format!("a sum pass needs the {name} buffer"));
            }
        }
    }
    Ok(r)
}

/// What every role reads.
struct Ctx<'a> {
    pass: Pass,
    r: &'a Resolved<'a>,
    p: &'a ForwardKvParams,
    base: Reg<U32>,
    bars: Barriers,
    walk: common::Walk,
    /// The paired pass's per-warp shared word for [`l2_sides::latency`].
    sink: Option<SharedAddr>,
}

fn describe(b: &mut KernelBuilder, pass: Pass, paired: bool) {
    if paired && pass != Pass::Sum(OPool::F16) {
        return b.error("only the f16 sum pass adds into the paired pool".into());
    }
    b.grid("[grid_launch_bound(capacity, num_sms) << walk_split_log2, 1, 1]");
    b.min_ctas_per_sm(1);
    let p = params(b);
    let plan = match plan(pass) {
        Ok(plan) => plan,
        Err(e) => return b.error(format!("SM90 KV forward plan: {e}")),
    };
    let r = match resolve(&plan, pass) {
        Ok(r) => r,
        Err(e) => return b.error(format!("SM90 KV forward plan: {e}")),
    };
    gate(b, &p.gate);
    let smem = b.dynamic_shared("smem", smem_bytes(&plan), 1024);
    let (_, base) = common::swizzle_aligned_base(b, &smem);
    let tid = b.sreg(SReg::TidX);
    let bars = common::sm90_barriers(b, base, r.barriers);
    let leader = common::init_barriers(b, tid, plan.pipelines(), &bars);
    b.comment("this CTA's part of a CTA walk: its interval of task rows");
    let desc = b.ld_param_ptr(&p.desc);
    let split = b.ld_param(&p.walk_split_log2);
    let walk = common::cta_walk_part(b, desc, split);
    let sink = paired.then(|| l2_sides::warp_sink(b, THREADS / 32));
    let ctx = Ctx {
        pass,
        r: &r,
        p: &p,
        base,
        bars,
        walk,
        sink,
    };

    // The max pass's spare warps zero `o_pool` for the sum pass: its tensor and shared
    // memory pipes are busy, its stores to DRAM are not.
    let spare = (pass == Pass::Max).then_some(|b: &mut KernelBuilder| zero_words(b, &p, tid));
    common::sm90_roles_with_spare(
        b,
        plan.warps(),
        (tid, leader),
        |b| producer(b, &ctx),
        |b| gather(b, &ctx, tid),
        spare,
        |b| match pass {
            Pass::Sum(pool) => consumer(b, &ctx, tid, pool),
            Pass::Max => max_consumer(b, &ctx, tid),
        },
    );
}

/// Spare threads `tid` 64..128 of every CTA: `st.global.v4` zeros over the `zero_words`
/// 16-byte words at `zero` (nothing when it is null), striding over the grid.
fn zero_words(b: &mut KernelBuilder, p: &ForwardKvParams, tid: Reg<U32>) {
    common::zero_words_strided(b, &p.zero, &p.zero_words, "zero", |b| {
        let cta = b.sreg(SReg::CtaidX);
        let ctas = b.sreg(SReg::NctaidX);
        let t = b.sub(tid, 64u32);
        let first = b.mad_lo(cta, 64u32, t);
        (first, b.mul_lo(ctas, 64u32))
    });
}

/// The launch's gate: with a non-null `gate` whose word is zero, every thread returns at once
/// (uniformly, before any barrier). Shared with `fwd_kv_combine`.
pub fn gate(b: &mut KernelBuilder, gate: &ParamRef<U64>) {
    let raw = b.ld_param(gate);
    let gated = b.setp(Cmp::Ne, raw, 0u64);
    b.if_then(gated, "gate", |b| {
        let at = b.ld_param_ptr(gate);
        let word = b.ld::<U32, _>(&global(at, 0));
        let closed = b.setp(Cmp::Eq, word, 0u32);
        b.if_then(closed, "gate_closed", |b| b.ret());
    });
}

/// Thread 0: K/V at each segment's start, Q for every task. Each task's meta and compact
/// rows are loaded a task ahead, so that their latency overlaps the previous task's issue and
/// stage wait instead of adding to them.
fn producer(b: &mut KernelBuilder, ctx: &Ctx) {
    let (p, r, base, bars) = (ctx.p, ctx.r, ctx.base, &ctx.bars);
    // Paired K/V (a non-null `kv_pair`, paired pass only): this thread's L2 side, from the
    // anchor pair its CTA's first consumer warp probes too.
    let paired_kv = ctx.sink.as_ref().map(|sink| {
        let raw = b.ld_param(&p.kv_pair);
        let on = b.setp(Cmp::Ne, raw, 0u64);
        let side = b.mov::<U32>(0u32);
        b.if_then(on, "kv_side", |b| {
            let cta = b.sreg(SReg::CtaidX);
            let anchor = b.shl(cta, 3u32);
            let anchor = b.and(anchor, l2_sides::ANCHORS - 1);
            let o = b.ld_param_ptr(&p.o_pair);
            let homes = b.ld_param_ptr(&p.o_homes);
            let s = l2_sides::side_from_anchor(b, o, homes, anchor, sink);
            b.set(side, s);
        });
        (on, side)
    });
    let qrows = b.ld_param_ptr(&p.qrows);
    let tq = b.tensor_map_addr(&p.tmap_q);
    let tk = b.tensor_map_addr(&p.tmap_k);
    let tv = r.v.map(|_| b.tensor_map_addr(&p.tmap_v));
    let hints = b.ld_param(&p.l2_hints);
    let kv_policy = Some(l2_policy(b, hints, L2Stream::Kv));
    let q_policy = Some(l2_policy(b, hints, L2Stream::Q));
    let prev = b.mov::<U32>(u32::MAX);
    let segments = b.mov::<U32>(0u32);
    let tasks = b.mov::<U32>(0u32);
    let next_meta: [Reg<U32>; 4] = std::array::from_fn(|_| b.reg());
    let next_rows: [Reg<S32>; 8] = std::array::from_fn(|_| b.reg());
    let fetch = |b: &mut KernelBuilder, row: Reg<U32>| {
        let m = common::task_meta_at(b, &p.meta, row);
        let q8 = common::load_task_qrows(b, qrows, row);
        for (dst, v) in next_meta.iter().zip(m) {
            b.set(*dst, v);
        }
        for (dst, v) in next_rows.iter().zip(q8) {
            b.set(*dst, v);
        }
    };
    let any = b.setp(Cmp::Lt, ctx.walk.lo, ctx.walk.hi);
    b.if_then(any, "first_task", |b| fetch(b, ctx.walk.lo));
    b.for_range(ctx.walk.lo, ctx.walk.hi, 1, "producer_row", |b, row| {
        let m: [Reg<U32>; 4] = std::array::from_fn(|i| b.mov::<U32>(next_meta[i]));
        let q8: [Reg<S32>; 8] = std::array::from_fn(|i| b.mov::<S32>(next_rows[i]));
        let next_row = b.add(row, 1u32);
        let more = b.setp(Cmp::Lt, next_row, ctx.walk.hi);
        b.if_then(more, "prefetch", |b| fetch(b, next_row));
        let counters = (prev, segments);
        match (r.v.as_ref().zip(tv), paired_kv) {
            (Some((v, tv)), Some((on, side))) => {
                common::on_new_segment(b, &r.kv, bars, counters, &m, |b, st| {
                    let tiles = [
                        r.k.stage_at(b, base, st.index),
                        v.stage_at(b, base, st.index),
                    ];
                    b.if_then(on, "kv_pairs", |b| {
                        let kv = PairedKv {
                            pairs: b.ld_param_ptr(&p.kv_pair),
                            masks: b.ld_param_ptr(&p.kv_masks),
                            side,
                        };
                        kv.load(b, tiles.clone(), &m, &st.full, kv_policy);
                    });
                    b.unless(on, "kv_maps", |b| {
                        common::load_kv_tiles(b, [tk, tv], tiles, &m, &st.full, kv_policy);
                    });
                });
            }
            (Some((v, tv)), None) => {
                let tiles = [(&r.k, base), (v, base)];
                common::load_kv_if_new_segment(
                    b,
                    &r.kv,
                    bars,
                    counters,
                    [tk, tv],
                    tiles,
                    &m,
                    kv_policy,
                );
            }
            (None, _) => {
                let tiles = [(&r.k, base)];
                common::load_kv_if_new_segment(
                    b,
                    &r.kv,
                    bars,
                    counters,
                    [tk],
                    tiles,
                    &m,
                    kv_policy,
                );
            }
        }
        let st = r.q_pipe.producer_acquire(b, bars, tasks);
        let q_tile = r.q.emit_stage_addr(b, base, st.index);
        common::load_q_tiles(b, tq, shared(q_tile, 0), q8, &m, &st.full, q_policy);
        let next = b.add(tasks, 1u32);
        b.set(tasks, next);
    });
}

/// The paired K/V of [`l2_sides::PAIR_KV`] as the producer reads it.
struct PairedKv {
    /// The tiles' pairs of 4 KiB chunks.
    pairs: Reg<U64>,
    /// `masks [tiles, 2]`.
    masks: Reg<U64>,
    /// The producer's L2 side.
    side: Reg<U32>,
}

impl PairedKv {
    /// The segment's K and V images into `tiles` (each 8 chunks of 4 KiB, the SW128 panels
    /// a tensor-map load would write), each chunk from its copy homed on this side, completing
    /// on `bar` (the stage's 64 KiB, as the tensor-map loads).
    fn load(
        &self,
        b: &mut KernelBuilder,
        tiles: [SharedAddr; 2],
        meta: &[Reg<U32>; 4],
        bar: &SharedAddr,
        policy: Option<Reg<B64>>,
    ) {
        // Tile `block·4 + kv head`; its K chunks are pairs `16·tile + c`, its V chunks
        // `16·tile + 8 + c`.
        let tile = b.mad_lo(meta[2], 4u32, meta[1]);
        let at = common::elem_bytes(b, self.masks, tile, 8);
        let masks: [Reg<U32>; 2] = b.ld_v(&at);
        let pair0 = b.shl(tile, 4u32);
        for (x, (dst, mask)) in tiles.into_iter().zip(masks).enumerate() {
            for c in 0..l2_sides::KV_CHUNKS {
                let label = b.shr(mask, c);
                let label = b.and(label, 1u32);
                let odd = b.xor(label, self.side);
                let pair = b.add(pair0, x as u32 * l2_sides::KV_CHUNKS + c);
                let chunk = b.shl(pair, 1u32);
                let chunk = b.add(chunk, odd);
                let src = common::elem_bytes(b, self.pairs, chunk, l2_sides::CHUNK_BYTES);
                let dst = dst.offset(i64::from(c * l2_sides::CHUNK_BYTES));
                b.bulk_load_hinted(&dst, &src, l2_sides::CHUNK_BYTES, bar, policy);
            }
        }
    }
}

/// Warp 1: per task, `−R·log2e` of its 128 folded rows (−∞ for an empty slot) and the 8
/// slots' compact rows and positions. Lane `4·slot + part` fills rows `4·lane .. 4·lane+4`.
///
/// The loads run two tasks ahead, branch-free, so that none waits on another of the same
/// iteration: task `row + 2`'s compact rows, positions and index head, and task `row + 1`'s
/// references, addressed by what the previous iteration loaded. Task `row`'s values, loaded
/// earlier, are stored once its stage is free.
fn gather(b: &mut KernelBuilder, ctx: &Ctx, tid: Reg<U32>) {
    let (p, r, base, bars) = (ctx.p, ctx.r, ctx.base, &ctx.bars);
    let (lo, hi) = (ctx.walk.lo, ctx.walk.hi);
    let g = common::gather_lane(b, tid);
    let sum = matches!(ctx.pass, Pass::Sum(_));
    let tasks = b.mov::<U32>(0u32);
    // Lanes 0..8 copy slot `lane`'s words; the others load the same words unused.
    let word = b.and(g.lane, 7u32);
    // What one task needs: its slot's compact row (the references' row), index head, the
    // word lane's position and compact row, and (a sum pass) the raw references.
    struct Rows {
        slot_row: Reg<S32>,
        head: Reg<U32>,
        qpos: Reg<S32>,
        qrow: Reg<S32>,
        reference: [Reg<F32>; 4],
    }
    let regs = |b: &mut KernelBuilder| Rows {
        slot_row: b.reg(),
        head: b.reg(),
        qpos: b.reg(),
        qrow: b.reg(),
        reference: std::array::from_fn(|_| b.reg()),
    };
    let (ready, early) = (regs(b), regs(b));
    // Task `row`'s words into `early` (all but the references).
    let load_words = |b: &mut KernelBuilder, row: Reg<U32>| {
        let row8 = b.shl(row, 3u32);
        let idx = b.add(row8, word);
        let qpos = b.ld_param_ptr(&p.qpos);
        let at = common::elem::<S32>(b, qpos, idx);
        let v = b.ld::<S32, _>(&at);
        b.set(early.qpos, v);
        let qrows = b.ld_param_ptr(&p.qrows);
        let at = common::elem::<S32>(b, qrows, idx);
        let v = b.ld::<S32, _>(&at);
        b.set(early.qrow, v);
        if sum {
            let idx = b.add(row8, g.slot);
            let at = common::elem::<S32>(b, qrows, idx);
            let v = b.ld::<S32, _>(&at);
            b.set(early.slot_row, v);
            let m = common::task_meta_at(b, &p.meta, row);
            b.set(early.head, m[1]);
        }
    };
    // `early` (loaded an iteration ago) into `ready`, with its references.
    let promote = |b: &mut KernelBuilder| {
        b.set(ready.qpos, early.qpos);
        b.set(ready.qrow, early.qrow);
        if sum {
            b.set(ready.slot_row, early.slot_row);
            let v = reference_rows(b, ctx, early.slot_row, early.head, &g);
            for (dst, x) in ready.reference.iter().zip(v) {
                b.set(*dst, x);
            }
        }
    };
    let any = b.setp(Cmp::Lt, lo, hi);
    b.if_then(any, "first_tasks", |b| {
        load_words(b, lo);
        promote(b);
        let second = b.add(lo, 1u32);
        let more = b.setp(Cmp::Lt, second, hi);
        b.if_then(more, "second_task", |b| load_words(b, second));
    });
    b.for_range(lo, hi, 1, "gather_row", |b, row| {
        // This task's values (the references only in a sum pass: the max pass never sets
        // them).
        let qpos = b.mov::<S32>(ready.qpos);
        let qrow = b.mov::<S32>(ready.qrow);
        let refs = sum.then(|| {
            let slot_row = b.mov::<S32>(ready.slot_row);
            let r4: [Reg<F32>; 4] = std::array::from_fn(|i| b.mov::<F32>(ready.reference[i]));
            (slot_row, r4)
        });
        let next_row = b.add(row, 1u32);
        let more = b.setp(Cmp::Lt, next_row, hi);
        b.if_then(more, "prefetch", |b| {
            promote(b);
            let after = b.add(row, 2u32);
            let more = b.setp(Cmp::Lt, after, hi);
            b.if_then(more, "prefetch_words", |b| load_words(b, after));
        });
        let st = r.rows.producer_acquire(b, bars, tasks);
        if let Some((slot_row, r4)) = refs {
            let neg_log2e = -(std::f64::consts::LOG2_E as f32);
            let valid = b.setp(Cmp::Ge, slot_row, 0i32);
            let r4 = r4.map(|x| {
                let y = b.fmul(x, neg_log2e);
                b.selp(y, f32::NEG_INFINITY, valid)
            });
            let at = b.add(base, g.lane16);
            let dst = r.neg_ref.stage_at(b, at, st.index);
            b.st_v(&dst, r4);
        }
        b.if_then(g.word_lane, "gather_slots", |b| {
            let lane4 = b.shl(g.lane, 2u32);
            let at = b.add(base, lane4);
            let dst = r.qpos.stage_at(b, at, st.index);
            b.st(&dst, qpos);
            let dst = r.qrows.stage_at(b, at, st.index);
            b.st(&dst, qrow);
        });
        r.rows.producer_commit(b, bars, &st);
        let next = b.add(tasks, 1u32);
        b.set(tasks, next);
    });
}

/// Gather lane `g`'s raw references of its four folded rows (index head `head`) for the
/// slot's compact row `slot_row`; an empty slot (−1) reads row 0's and the caller discards
/// them.
fn reference_rows(
    b: &mut KernelBuilder,
    ctx: &Ctx,
    slot_row: Reg<S32>,
    head: Reg<U32>,
    g: &common::GatherLane,
) -> [Reg<F32>; 4] {
    let head16 = b.shl(head, 4u32);
    let hcol = b.add(head16, g.part4);
    let valid = b.setp(Cmp::Ge, slot_row, 0i32);
    let r = b.selp(slot_row, 0i32, valid);
    let r = b.bitcast::<U32, S32>(r);
    let i = b.mad_lo(r, 64u32, hcol);
    let reference = b.ld_param_ptr(&ctx.p.reference);
    let a = common::elem::<F32>(b, reference, i);
    b.ld_global_nc_v(&a)
}

/// Bytes of one staged O box: 16 heads × 32 f32 (one 128-byte SW128 row per head).
const O_BOX_BYTES: u32 = 16 * 128;

/// A lane's part in staging its warp's 16 rows of the m64n128 f32 accumulator (the 16 heads of
/// its slot) as the four boxes of 16 heads × 32 d a TMA reduce-add of `tmap_o` reads
/// (`[16 heads][128 B]` each, SW128: 16-byte chunk `k` of row `h` at `k ^ (h & 7)`). After the
/// lane-pair exchange ([`common::pair_exchange_v4`]) lane `4·quad + pair` holds columns
/// `8j + 4·(pair >> 1) ..+4` of row `quad + 8·(pair & 1)`: chunk `2(j % 4) + (pair >> 1)` of
/// box `j / 4`, i.e. `2·((j % 4) ^ ((h & 7) >> 1)) + ((pair >> 1) ^ (h & 1))` after the
/// swizzle.
/// Sixteen `st.shared.v4.f32`, each warp-wide store four full 128-byte wavefronts.
struct OStageLane {
    /// `stage + 128·h + 16·((pair >> 1) ^ (h & 1))`.
    at: Reg<U32>,
    /// `(h & 7) >> 1`, XORed into `j % 4`.
    h2: Reg<U32>,
    is_odd: Reg<Pred>,
}

impl OStageLane {
    fn new(b: &mut KernelBuilder, lane: Reg<U32>, stage: &Reg<U32>) -> Self {
        let quad = b.shr(lane, 2u32);
        let odd = b.and(lane, 1u32);
        let is_odd = b.setp(Cmp::Ne, odd, 0u32);
        let h = b.mad_lo(odd, 8u32, quad);
        let hb = b.shr(lane, 1u32);
        let hb = b.and(hb, 1u32);
        let h1 = b.and(h, 1u32);
        let x = b.xor(hb, h1);
        let at = b.mad_lo(h, 128u32, *stage);
        let at = b.mad_lo(x, 16u32, at);
        let h2 = b.shr(h, 1u32);
        let h2 = b.and(h2, 3u32);
        OStageLane { at, h2, is_odd }
    }

    fn store(&self, b: &mut KernelBuilder, acc: &[Reg<F32>]) {
        for j in 0..16u32 {
            let v = common::pair_exchange_v4(b, acc, j, self.is_odd);
            let x = b.xor(self.h2, j % 4);
            let addr = b.mad_lo(x, 32u32, self.at);
            b.st_v(&shared(addr, i64::from(O_BOX_BYTES * (j / 4))), v);
        }
    }
}

/// The key column of accumulator register `i` of an m64n128 f32 fragment, relative to the
/// thread's first (`2·(lane % 4)`).
fn acc_col(i: usize) -> i32 {
    (8 * (i / 4) + i % 2) as i32
}

/// The order-preserving u32 key of an f32 (`u32` order = `f32` order, −0 below +0): the sign
/// bit set for a non-negative value, every bit flipped for a negative one. 0 lies below every
/// key of a non-NaN value, so a zeroed pool is below any maximum.
pub(super) fn order_key(b: &mut KernelBuilder, x: Reg<F32>) -> Reg<U32> {
    let bits = b.bitcast::<S32, F32>(x);
    let sign = b.shr(bits, 31u32);
    let sign = b.bitcast::<U32, S32>(sign);
    let mask = b.or(sign, 0x8000_0000u32);
    let u = b.bitcast::<U32, F32>(x);
    b.xor(u, mask)
}

/// A consumer thread's place: consumer `c` (folded rows `64c..`, slots `4c..4c+4`), its warp
/// (slot `4c + warp`) and lane, and the constants every consumer uses.
struct Lanes {
    lane: Reg<U32>,
    quad: Reg<U32>,
    col0: Reg<U32>,
    slot: Reg<U32>,
    slot4: Reg<U32>,
    /// This thread's accumulator rows: folded rows 16·slot + quad and + 8 (heads quad,
    /// quad+8), in bytes of f32.
    frow4: Reg<U32>,
    lane0: Reg<Pred>,
    head_lane: Reg<Pred>,
    zero: Reg<U32>,
    always: Reg<Pred>,
    never: Reg<Pred>,
    /// Consumer c's first Q row in bytes.
    c_rows: Reg<U32>,
}

impl Lanes {
    fn new(b: &mut KernelBuilder, tid: Reg<U32>) -> Self {
        let t = b.sub(tid, 128u32);
        let c = b.shr(t, 7u32);
        let tw = b.and(t, 127u32);
        let warp = b.shr(tw, 5u32);
        let lane = b.and(tw, 31u32);
        let quad = b.shr(lane, 2u32);
        let pair = b.and(lane, 3u32);
        let col0 = b.shl(pair, 1u32);
        // The slot is warp-uniform, and known so to ptxas through `redux.sync`: the S GEMM's
        // Q descriptors and the O staging's TMA source then stay on the uniform datapath.
        let slot = b.mad_lo(c, 4u32, warp);
        let slot = b.redux_min(slot);
        let slot4 = b.shl(slot, 2u32);
        let frow = b.mad_lo(slot, 16u32, quad);
        let frow4 = b.shl(frow, 2u32);
        let lane0 = b.setp(Cmp::Eq, lane, 0u32);
        let head_lane = b.setp(Cmp::Eq, pair, 0u32);
        let zero = b.mov::<U32>(0u32);
        let always = b.setp(Cmp::Eq, zero, 0u32);
        let never = b.setp(Cmp::Ne, zero, 0u32);
        let c_uniform = b.shr(slot, 2u32);
        let c_rows = b.mul_lo(c_uniform, 64 * 128);
        Lanes {
            lane,
            quad,
            col0,
            slot,
            slot4,
            frow4,
            lane0,
            head_lane,
            zero,
            always,
            never,
            c_rows,
        }
    }
}

/// `S = Q_c·Kᵀ` of the task whose Q lies in stage `q_index` and K in stage `kv_index`, into
/// `acc`, committed as one group (the caller has waited for both stages).
fn s_gemm(
    b: &mut KernelBuilder,
    ctx: &Ctx,
    l: &Lanes,
    (q_index, kv_index): (Reg<U32>, Reg<U32>),
    acc: &[Reg<F32>],
) {
    let (r, base) = (ctx.r, ctx.base);
    let q_tile = r.q.emit_stage_addr(b, base, q_index);
    let a_base = b.add(q_tile, l.c_rows);
    let k_addr = r.k.emit_stage_addr(b, base, kv_index);
    b.comment("S = Q_c*K^T");
    b.wgmma_fence();
    let a0 = k_major().emit(b, a_base);
    let b0 = k_major().emit(b, k_addr);
    common::wgmma_ss_k128(b, acc, Major::K, (a0, b0), (l.never, l.always));
    b.wgmma_commit();
}

/// The slot's query position and compact row from the gather warp's scalars of task `n`
/// (this thread's last read of them: the stage is released), and, for a sum pass, this
/// thread's two rows' `−R·log2e`.
fn read_rows(
    b: &mut KernelBuilder,
    ctx: &Ctx,
    l: &Lanes,
    n: Reg<U32>,
    with_ref: bool,
) -> (Reg<S32>, Reg<S32>, Option<[Reg<F32>; 2]>) {
    let (r, base, bars) = (ctx.r, ctx.base, &ctx.bars);
    b.comment("the gather warp's row scalars for this task");
    let rst = r.rows.consumer_wait(b, bars, n);
    let neg_ref = with_ref.then(|| {
        let at = b.add(base, l.frow4);
        let src = r.neg_ref.stage_at(b, at, rst.index);
        [b.ld::<F32, _>(&src), b.ld::<F32, _>(&src.offset(32))]
    });
    let sat = b.add(base, l.slot4);
    let src = r.qpos.stage_at(b, sat, rst.index);
    let qpos = b.ld::<S32, _>(&src);
    let src = r.qrows.stage_at(b, sat, rst.index);
    let qrow = b.ld::<S32, _>(&src);
    b.comment("this thread's last read of the row scalars");
    r.rows.consumer_release(b, bars, &rst);
    (qpos, qrow, neg_ref)
}

/// The causal mask `qpos ≥ key` on `acc` (key block `kb`), in place: masked logits become
/// −∞. Every block before the slot's own (the diagonal) needs none, so the warp skips it
/// there; after the wait the accumulator is plain registers.
fn mask_diagonal(b: &mut KernelBuilder, l: &Lanes, acc: &[Reg<F32>], qpos: Reg<S32>, kb: Reg<U32>) {
    b.comment("mask qpos >= key position, only in the diagonal block");
    let key0 = b.shl(kb, 7u32);
    let key0 = b.add(key0, l.col0);
    let key0 = b.bitcast::<S32, U32>(key0);
    // This thread's keys lie at key0 + acc_col(i); it needs no mask once its last is seen.
    let dq = b.sub(qpos, key0);
    let last = (0..64).map(acc_col).max().expect("64 columns");
    let full = b.setp(Cmp::Ge, dq, last);
    b.unless(full, "mask", |b| {
        for (i, s) in acc.iter().enumerate() {
            let seen = b.setp(Cmp::Ge, dq, acc_col(i));
            let y = b.selp(*s, f32::NEG_INFINITY, seen);
            b.set(*s, y);
        }
    });
}

/// This thread's two rows' maxima of `acc`, in log2 units (`S·scale·log2e`), scaled once
/// per row: scaling by a positive factor and rounding are monotonic, so this equals the
/// maximum of the scaled logits.
fn row_maxima(b: &mut KernelBuilder, acc: &[Reg<F32>]) -> Vec<Reg<F32>> {
    (0..2usize)
        .map(|rr| {
            let mx = common::thread_row_max(b, acc, rr);
            let mx = common::quad_max(b, mx);
            b.fmul(mx, common::SCALE_LOG2E)
        })
        .collect()
}

/// [`row_maxima`] of `acc` under the causal mask of [`mask_diagonal`], leaving `acc` as it
/// is: the max pass's form, written for its pipelined variant (ptxas serializes a wgmma
/// pipeline whose accumulators other instructions write) and kept as the H200 ran it.
fn masked_row_maxima(
    b: &mut KernelBuilder,
    l: &Lanes,
    acc: &[Reg<F32>],
    qpos: Reg<S32>,
    kb: Reg<U32>,
) -> Vec<Reg<F32>> {
    let key0 = b.shl(kb, 7u32);
    let key0 = b.add(key0, l.col0);
    let key0 = b.bitcast::<S32, U32>(key0);
    let dq = b.sub(qpos, key0);
    let last = (0..64).map(acc_col).max().expect("64 columns");
    let full = b.setp(Cmp::Ge, dq, last);
    let maxima: Vec<Reg<F32>> = (0..2).map(|_| b.reg()).collect();
    let thread_max = |b: &mut KernelBuilder, x: &[Reg<F32>]| {
        for (rr, dst) in maxima.iter().enumerate() {
            let mx = common::thread_row_max(b, x, rr);
            b.set(*dst, mx);
        }
    };
    let masked = b.label("masked_max");
    let done = b.label("max_done");
    b.bra_unless(full, &masked);
    thread_max(b, acc);
    b.bra(&done);
    b.place(&masked);
    b.comment("the diagonal block: masked logits count as -inf");
    let x: Vec<Reg<F32>> = acc
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let seen = b.setp(Cmp::Ge, dq, acc_col(i));
            b.selp(*s, f32::NEG_INFINITY, seen)
        })
        .collect();
    thread_max(b, &x);
    b.place(&done);
    maxima
        .iter()
        .map(|&m| {
            let mx = common::quad_max(b, m);
            b.fmul(mx, common::SCALE_LOG2E)
        })
        .collect()
}

/// The pool row of this thread's first accumulator row: compact row `qrow`, heads
/// `16·head + quad` (its second row is 8 further).
fn pool_row(b: &mut KernelBuilder, l: &Lanes, qrow: Reg<S32>, head: Reg<U32>) -> Reg<U32> {
    let qr = b.bitcast::<U32, S32>(qrow);
    let head16 = b.shl(head, 4u32);
    let prow = b.mad_lo(qr, 64u32, head16);
    b.add(prow, l.quad)
}

/// `red.max` of the two rows' maxima into `m_pool` at `prow` and `prow + 8`, by the lanes
/// where `lanes` holds: keys and addresses are computed in every lane, so that ptxas merges
/// none of them with old values.
fn red_row_maxima(
    b: &mut KernelBuilder,
    ctx: &Ctx,
    prow: Reg<U32>,
    row_max: &[Reg<F32>],
    lanes: Reg<Pred>,
) {
    let m_pool = b.ld_param_ptr(&ctx.p.m_pool);
    let at_m_pool = common::elem::<U32>(b, m_pool, prow);
    let keys: Vec<Reg<U32>> = row_max.iter().map(|mx| order_key(b, *mx)).collect();
    b.predicated(lanes, false, |b| {
        for (rr, key) in keys.into_iter().enumerate() {
            let at = at_m_pool.offset(ROW8_BYTES * rr as i64);
            b.red::<U32, _>(AtomOp::Max, &at, key);
        }
    });
}

/// Bytes between a thread's two accumulator rows in `l_pool` and `m_pool` (8 heads of 4).
const ROW8_BYTES: i64 = 8 * 4;

/// `Σ terms` as a balanced tree: its adds are independent level by level, where one chain
/// would make each wait for the last (the f32 add's latency, with two consumer warps per
/// scheduler to hide it).
fn tree_sum(b: &mut KernelBuilder, terms: &[Reg<F32>]) -> Reg<F32> {
    let mut level = terms.to_vec();
    while level.len() > 1 {
        level = level
            .chunks(2)
            .map(|pair| match pair {
                [x, y] => b.add(*x, *y),
                [x] => *x,
                _ => unreachable!("chunks of two"),
            })
            .collect();
    }
    level.pop().expect("at least one term")
}

/// The max pass's consumers: per task the S GEMM, the masked row maxima and their `red.max`.
/// (Issuing the next task's GEMM before this task's maxima, with two accumulators, was
/// 5-10 % slower on the H200: the consumers are not what limits this pass.)
fn max_consumer(b: &mut KernelBuilder, ctx: &Ctx, tid: Reg<U32>) {
    let (p, r, walk, bars) = (ctx.p, ctx.r, &ctx.walk, &ctx.bars);
    let l = Lanes::new(b, tid);
    let prev = b.mov::<U32>(u32::MAX);
    let segments = b.mov::<U32>(0u32);
    let next_head = b.mov::<U32>(0u32);
    let next_kb = b.mov::<U32>(0u32);
    // The K/V stage of the current segment.
    let kv_index = b.mov::<U32>(0u32);
    let any = b.setp(Cmp::Lt, walk.lo, walk.hi);
    b.if_then(any, "first_meta", |b| {
        let m = common::task_meta_at(b, &p.meta, walk.lo);
        b.set(next_head, m[1]);
        b.set(next_kb, m[2]);
    });
    b.for_range(walk.lo, walk.hi, 1, "max_task", |b, row| {
        let head = b.mov::<U32>(next_head);
        let kb = b.mov::<U32>(next_kb);
        let n = b.sub(row, walk.lo);
        let cur = common::bucket(b, &[l.zero, head, kb, l.zero]);
        let same = b.setp(Cmp::Eq, cur, prev);
        b.unless(same, "kv_wait", |b| {
            let st = r.kv.consumer_wait(b, bars, segments);
            b.set(kv_index, st.index);
            b.set(prev, cur);
        });
        let next_row = b.add(row, 1u32);
        let last_task = b.setp(Cmp::Ge, next_row, walk.hi);
        b.unless(last_task, "next_meta", |b| {
            let m = common::task_meta_at(b, &p.meta, next_row);
            b.set(next_head, m[1]);
            b.set(next_kb, m[2]);
        });
        let qst = r.q_pipe.consumer_wait(b, bars, n);
        let acc: Vec<Reg<F32>> = (0..64).map(|_| b.reg()).collect();
        s_gemm(b, ctx, &l, (qst.index, kv_index), &acc);
        let (qpos, qrow, _) = read_rows(b, ctx, &l, n, false);
        b.wgmma_wait(0);
        b.comment("this warp's wgmma reads of Q are complete: release the stage");
        b.predicated(l.lane0, false, |b| r.q_pipe.consumer_release(b, bars, &qst));
        b.comment("segment end: this warp's reads of K are complete");
        let next = common::bucket(b, &[l.zero, next_head, next_kb, l.zero]);
        let other_bucket = b.setp(Cmp::Ne, next, cur);
        let is_end = b.or_pred(other_bucket, last_task);
        b.if_then(is_end, "kv_release", |b| {
            let st = r.kv.locate(b, bars, segments.into());
            b.predicated(l.lane0, false, |b| r.kv.consumer_release(b, bars, &st));
            let next = b.add(segments, 1u32);
            b.set(segments, next);
        });
        let row_max = masked_row_maxima(b, &l, &acc, qpos, kb);
        b.comment("the warp's 16 row maxima into m_pool (a -1 slot has none)");
        let live = b.setp(Cmp::Ge, qrow, 0i32);
        b.if_then(live, "row_stats", |b| {
            let prow = pool_row(b, &l, qrow, head);
            red_row_maxima(b, ctx, prow, &row_max, l.head_lane);
        });
    });
}

/// `v` of lane 0 in every lane of the warp: a value ptxas knows to be warp-uniform.
fn uniform<T: Word>(b: &mut KernelBuilder, v: Reg<T>) -> Reg<T> {
    b.shfl(Shfl::Idx, v, 0, 0x1f)
}

/// The sum passes' consumers: per task the S GEMM, the mask, `P`, `O = P·V` and the row
/// sums (and maxima, unless `m_pool` is null), then the O rows staged and reduced.
///
/// With two K/V stages ([`kv_stages`]) the next task's S GEMM is issued right after this
/// task's `P·V` (FlashAttention-3's overlap within a warpgroup): it runs on the tensor pipe
/// while the warp waits for `P·V`, releases a finished segment and stages its O rows. At a
/// segment's end it reads the next segment's K/V stage, loaded under this one. With one stage
/// (the f32 pool) each S GEMM is issued at its task's start.
#[allow(clippy::too_many_lines)]
fn consumer(b: &mut KernelBuilder, ctx: &Ctx, tid: Reg<U32>, pool: OPool) {
    let (p, r, base) = (ctx.p, ctx.r, ctx.base);
    // Every branch between a wgmma's issue and its wait must be one ptxas can prove uniform,
    // or it serializes them all (C7518/C7519): what the branches test is broadcast from lane
    // 0 (the walk, the task meta, the slot's row), and the lane-0 and head-lane parts are
    // predicated instead.
    let walk = &common::Walk {
        lo: uniform(b, ctx.walk.lo),
        hi: uniform(b, ctx.walk.hi),
    };
    let bars = ctx.bars;
    let l = Lanes::new(b, tid);
    let (lane, slot, lane0, head_lane, zero) = (l.lane, l.slot, l.lane0, l.head_lane, l.zero);
    let (never, always) = (l.never, l.always);
    let scale_log2e = common::SCALE_LOG2E;
    let ahead = r.kv.pipeline.stages >= 2;
    // This warp's part of the O staging: consumer c's warp w at (4c + w)·warp_bytes.
    let (o_stage, v) = r
        .o_stage
        .zip(r.v)
        .expect("resolve() rejects a sum pass without V or the O staging");
    let stage = b.mad_lo(slot, pool.warp_bytes(), base);
    let stage = b.add(stage, o_stage.offset);
    let o_lane = OStageLane::new(b, lane, &stage);
    // The f16 staging's stmatrix addresses, once: ptxas recomputed them every task.
    let o_rows = (pool == OPool::F16).then(|| common::stage_rows_at(b, stage, lane));
    let hints = b.ld_param(&p.l2_hints);
    let o_policy = Some(l2_policy(b, hints, L2Stream::O));
    // Whether to compute the row maxima: unless m_pool is null (the max pass has filled
    // it). Uniform over the CTA.
    let raw = b.ld_param(&p.m_pool);
    let want_max = b.setp(Cmp::Ne, raw, 0u64);
    // The paired pool: lane 0 finds the warp's L2 side from an anchor pair of its own, so
    // that no line takes every warp's probes.
    let side = ctx.sink.as_ref().map(|sink| {
        let side = b.mov::<U32>(0u32);
        let cta = b.sreg(SReg::CtaidX);
        let anchor = b.mad_lo(cta, 8u32, slot);
        let anchor = b.and(anchor, l2_sides::ANCHORS - 1);
        b.predicated(lane0, false, |b| {
            let o = b.ld_param_ptr(&p.o_pair);
            let homes = b.ld_param_ptr(&p.o_homes);
            let s = l2_sides::side_from_anchor(b, o, homes, anchor, sink);
            b.set(side, s);
        });
        side
    });

    let (kv, qp) = (r.kv, r.q_pipe);
    let prev = b.mov::<U32>(u32::MAX);
    let segments = b.mov::<U32>(0u32);
    let tasks = b.mov::<U32>(0u32);
    // The task's (index head, kblock), loaded one task ahead.
    let next_head = b.mov::<U32>(0u32);
    let next_kb = b.mov::<U32>(0u32);
    // The K/V stage of the current task's segment, and (issuing ahead) of the next task's.
    let kv_index = b.mov::<U32>(0u32);
    let kv_next = b.mov::<U32>(0u32);
    // The S accumulator, written by the GEMM issued a task ahead when `ahead`.
    let s_acc: Vec<Reg<F32>> = (0..64).map(|_| b.reg()).collect();
    let any = b.setp(Cmp::Lt, walk.lo, walk.hi);
    b.if_then(any, "first_meta", |b| {
        let m = common::task_meta_at(b, &p.meta, walk.lo);
        let m = m.map(|x| uniform(b, x));
        b.set(next_head, m[1]);
        b.set(next_kb, m[2]);
        if ahead {
            b.comment("the first task's S GEMM, on the first segment's K/V");
            let cur = common::bucket(b, &[zero, m[1], m[2], zero]);
            b.set(prev, cur);
            let st = kv.consumer_wait(b, &bars, segments);
            b.set(kv_index, st.index);
            let qst = qp.consumer_wait(b, &bars, tasks);
            s_gemm(b, ctx, &l, (qst.index, kv_index), &s_acc);
        }
    });

    b.for_range(walk.lo, walk.hi, 1, "task", |b, row| {
        let head = b.mov::<U32>(next_head);
        let kb = b.mov::<U32>(next_kb);
        let cur = common::bucket(b, &[zero, head, kb, zero]);
        if !ahead {
            let same = b.setp(Cmp::Eq, cur, prev);
            b.unless(same, "kv_wait", |b| {
                let st = kv.consumer_wait(b, &bars, segments);
                b.set(kv_index, st.index);
                b.set(prev, cur);
            });
        }
        let next_row = b.add(row, 1u32);
        let last_task = b.setp(Cmp::Ge, next_row, walk.hi);
        b.unless(last_task, "next_meta", |b| {
            let m = common::task_meta_at(b, &p.meta, next_row);
            let (h, k) = (uniform(b, m[1]), uniform(b, m[2]));
            b.set(next_head, h);
            b.set(next_kb, k);
        });
        let next = common::bucket(b, &[zero, next_head, next_kb, zero]);
        let other_bucket = b.setp(Cmp::Ne, next, cur);

        let qst = if ahead {
            qp.locate(b, &bars, tasks.into())
        } else {
            let qst = qp.consumer_wait(b, &bars, tasks);
            s_gemm(b, ctx, &l, (qst.index, kv_index), &s_acc);
            qst
        };
        let (qpos, qrow, neg_ref) = read_rows(b, ctx, &l, tasks, true);
        let neg_ref = neg_ref.expect("read with the reference");
        // The paired pool's label of this slot's row, loaded a task's work before its use.
        let paired_row = side.map(|side| {
            let home = b.mov::<U32>(0u32);
            let q = b.max(qrow, 0i32);
            let q = b.bitcast::<U32, S32>(q);
            // Rows follow the anchors, which only the side probes touch.
            let pair = b.mad_lo(q, 4u32, head);
            let pair = b.add(pair, l2_sides::ANCHORS);
            b.predicated(lane0, false, |b| {
                let homes = b.ld_param_ptr(&p.o_homes);
                let at = common::elem::<U32>(b, homes, pair);
                let v = b.ld::<U32, _>(&at);
                b.set(home, v);
            });
            (pair, home, side)
        });

        b.wgmma_wait(0);
        b.comment("this warp's wgmma reads of Q are complete: release the stage");
        // (Issuing ahead, the walk's last task keeps its stage: its S GEMM runs once more.)
        let release = if ahead {
            let more = b.not_pred(last_task);
            b.and_pred(lane0, more)
        } else {
            lane0
        };
        b.predicated(release, false, |b| qp.consumer_release(b, &bars, &qst));

        mask_diagonal(b, &l, &s_acc, qpos, kb);
        let row_max: Vec<Reg<F32>> = (0..2).map(|_| b.mov::<F32>(f32::NEG_INFINITY)).collect();
        b.if_then(want_max, "row_max", |b| {
            for (dst, mx) in row_max.iter().zip(row_maxima(b, &s_acc)) {
                b.set(*dst, mx);
            }
        });
        b.comment("P = exp2(S*scale*log2e - R*log2e), O = P*V and the row sums");
        let v_addr = v.emit_stage_addr(b, base, kv_index);
        let mut pv = Vec::with_capacity(64);
        let mut terms: [Vec<Reg<F32>>; 2] = [Vec::with_capacity(32), Vec::with_capacity(32)];
        for (i, s) in s_acc.iter().enumerate() {
            let rr = (i / 2) % 2;
            let d = b.fma(*s, scale_log2e, neg_ref[rr]);
            let pe = b.ex2_approx(d);
            terms[rr].push(pe);
            pv.push(pe);
        }
        let frags = common::bf16_a_frags(b, &pv);

        b.comment("O = P*V (A from registers, V MN-major)");
        let o_acc: Vec<Reg<F32>> = (0..64).map(|_| b.reg()).collect();
        b.wgmma_fence();
        let v0 = mn_major().emit(b, v_addr);
        common::wgmma_rs_k128(b, &o_acc, &frags, v0, (never, always));
        b.wgmma_commit();
        if ahead {
            // After the walk's last task it is that task's again, on its kept Q stage and
            // K/V (its next meta is its own, so `other_bucket` is false): ptxas serializes
            // every wgmma when one is issued on a path it cannot prove uniform.
            b.comment("the next task's S GEMM, under this task's P*V, row sums and staging");
            b.set(kv_next, kv_index);
            b.if_then(other_bucket, "kv_next_wait", |b| {
                let seg = b.add(segments, 1u32);
                let st = kv.consumer_wait(b, &bars, seg);
                b.set(kv_next, st.index);
            });
            let step = b.selp(0u32, 1u32, last_task);
            let n1 = b.add(tasks, step);
            let qst_next = qp.consumer_wait(b, &bars, n1);
            s_gemm(b, ctx, &l, (qst_next.index, kv_next), &s_acc);
        }
        let mut l_row = Vec::with_capacity(2);
        for t in &terms {
            let mut l = tree_sum(b, t);
            for d in [1u32, 2] {
                let o = b.shfl(Shfl::Bfly, l, d, 0x1f);
                l = b.add(l, o);
            }
            l_row.push(l);
        }
        b.wgmma_wait(u32::from(ahead));

        b.comment("segment end: this warp's reads of K/V are complete");
        // (Issuing ahead, the repeated S GEMM after the walk's last task may still read the
        // last segment's K as it is released: harmless, as the producer loads nothing after
        // the walk's last task and the CTA then exits.)
        let is_end = b.or_pred(other_bucket, last_task);
        b.if_then(is_end, "kv_release", |b| {
            let st = kv.locate(b, &bars, segments.into());
            b.predicated(lane0, false, |b| kv.consumer_release(b, &bars, &st));
            let next = b.add(segments, 1u32);
            b.set(segments, next);
        });
        if ahead {
            b.set(kv_index, kv_next);
        }

        b.comment("the warp's 16 rows into the pools (a -1 slot has none)");
        let qrow = uniform(b, qrow);
        let live = b.setp(Cmp::Ge, qrow, 0i32);
        b.if_then(live, "pools", |b| {
            let prow = pool_row(b, &l, qrow, head);
            let l_pool = b.ld_param_ptr(&p.l_pool);
            // Addressed outside the predicate: values written under one are merged with
            // their old ones by ptxas (a `SEL` each).
            let at_l_pool = common::elem::<F32>(b, l_pool, prow);
            b.predicated(head_lane, false, |b| {
                for (rr, l_rr) in l_row.iter().enumerate() {
                    b.red_add_f32(&at_l_pool.offset(ROW8_BYTES * rr as i64), *l_rr);
                }
            });
            b.if_then(want_max, "m_pool", |b| {
                red_row_maxima(b, ctx, prow, &row_max, head_lane);
            });
            b.comment("its O rows into the warp's staging, TMA reduce-add into o_pool");
            // The warp's reduction of the previous task has read the staging by now (a whole
            // task later); lane 0 waits for it, then the warp meets before overwriting it.
            b.predicated(lane0, false, |b| b.bulk_wait_group_read(0));
            b.bar_warp_sync();
            match pool {
                OPool::F32 => o_lane.store(b, &o_acc),
                OPool::F16 => {
                    let rows = o_rows.as_ref().expect("planned for the f16 pool");
                    common::stage_rows_16_at(b, &o_acc, rows, |b, hi, lo| b.cvt_f16x2(hi, lo));
                }
            }
            // The async proxy reads the staged rows: each lane's stores are fenced, then the
            // warp meets before its lane 0 issues.
            b.fence_proxy_async_shared();
            b.bar_warp_sync();
            match paired_row {
                Some((pair, home, side)) => {
                    b.comment("paired pool: the staging's image into the copy homed on this side");
                    b.predicated(lane0, false, |b| {
                        let copy = b.xor(home, side);
                        let chunk = b.mad_lo(pair, 2u32, copy);
                        let o = b.ld_param_ptr(&p.o_pair);
                        let at = common::elem_bytes(b, o, chunk, l2_sides::CHUNK_BYTES);
                        let src = shared(stage, 0);
                        b.bulk_reduce_add_f16_hinted(&at, &src, l2_sides::CHUNK_BYTES, o_policy);
                        b.bulk_commit_group();
                    });
                }
                None => {
                    let map = b.tensor_map_addr(&p.tmap_o);
                    let h16 = b.shl(head, 4u32);
                    let h16 = b.bitcast::<S32, U32>(h16);
                    let (count, width) = pool.boxes();
                    let d0: Vec<Reg<S32>> = (0..count)
                        .map(|box_| b.mov::<S32>((width * box_) as i32))
                        .collect();
                    b.predicated(lane0, false, |b| {
                        for (box_, &d0) in (0..count).zip(&d0) {
                            let src = shared(stage, i64::from(O_BOX_BYTES * box_));
                            b.tma_reduce_add_3d_hinted(&src, map, [d0, h16, qrow], o_policy);
                        }
                        b.bulk_commit_group();
                    });
                }
            }
        });
        let next = b.add(tasks, 1u32);
        b.set(tasks, next);
    });
    if ahead {
        b.comment("the S GEMM issued after the last task (its own, again) is retired");
        b.wgmma_wait(0);
    }
    b.comment("the staged rows' last reduction has read them before the CTA exits");
    b.predicated(lane0, false, |b| b.bulk_wait_group_read(0));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::pipeline::Side;

    #[test]
    fn the_plan_places_every_buffer_within_the_shared_memory() {
        // The O staging: 8 warps × 16 rows × 128 d, 64 KB in f32, 32 KB in f16; K/V in one
        // stage beside the f32 staging, in two beside the f16 one.
        for (pool, staging, kv) in [(OPool::F32, 2 * TILE_BYTES, 1), (OPool::F16, TILE_BYTES, 2)] {
            let plan = plan(Pass::Sum(pool)).unwrap();
            let smem = plan.smem();
            let at = |id| smem.offset(id).unwrap();
            let q = 2 * kv * TILE_BYTES;
            assert_eq!(
                [at(Buf::K), at(Buf::V), at(Buf::Q), at(Buf::OStage)],
                [0, kv * TILE_BYTES, q, q + 2 * TILE_BYTES]
            );
            assert_eq!(plan.pipelines().get("kv").unwrap().pipeline.stages, kv);
            assert_eq!(8 * pool.warp_bytes(), staging);
            assert_eq!(at(Buf::Barriers), q + 2 * TILE_BYTES + staging);
            // The boxes cover a warp's 16 rows × 128 d in 2 KB boxes.
            let (count, width) = pool.boxes();
            assert_eq!(count * width, 128);
            assert_eq!(count * O_BOX_BYTES, pool.warp_bytes());
            // kv, q two, rows one: a full and an empty barrier per stage.
            assert_eq!(plan.pipelines().barrier_slots(), 2 * (kv + 2 + 1));
            assert!(smem_bytes(&plan) <= MAX_SHARED_BYTES);
        }
    }

    #[test]
    fn every_pass_takes_the_same_parameters() {
        // The runtime launches the f16, paired f16 and max passes with the f32 pass's binding.
        let f32_pass = DESC.build(Target::Sm90a).unwrap();
        for desc in [DESC_F16, DESC_F16_PAIRED, DESC_MAX] {
            assert_eq!(f32_pass.params, desc.build(Target::Sm90a).unwrap().params);
        }
    }

    #[test]
    fn every_tma_transfer_takes_its_streams_policy_selected_by_its_bit() {
        // Per pass: (K/V loads, Q loads, o_pool reduce-adds) each with a hinted and a normal
        // policy, and no TMA transfer without one (an unhinted transfer would ignore the bit).
        for (desc, streams) in [(DESC_F16, 3), (DESC, 3), (DESC_MAX, 2)] {
            let text = crate::ptx::print::body(&desc.build(Target::Sm90a).unwrap());
            let count = |what: &str| text.lines().filter(|l| l.contains(what)).count();
            let policy = |kind: &str| count(&format!("createpolicy.fractional.L2::{kind}."));
            assert_eq!(policy("evict_first"), 1, "{}: K/V", desc.name);
            assert_eq!(policy("evict_last"), streams - 1, "{}: Q, o", desc.name);
            assert_eq!(policy("evict_normal"), streams, "{}", desc.name);
            assert_eq!(count("selp.b64"), streams, "{}", desc.name);
            for bit in L2Stream::ALL.map(L2Stream::bit).iter().take(streams) {
                assert!(
                    text.lines().any(|l| l.trim().starts_with("and.b32")
                        && l.trim_end().ends_with(&format!(", {bit};"))),
                    "{}: bit {bit}",
                    desc.name
                );
            }
            let tma = text.lines().filter(|l| l.contains("bulk.tensor"));
            assert!(
                tma.clone().all(|l| l.contains(".L2::cache_hint")),
                "{}",
                desc.name
            );
            assert!(tma.count() > 0);
            assert_eq!(count("[l2_hints]"), if streams == 3 { 2 } else { 1 });
        }
    }

    #[test]
    fn the_max_pass_plans_no_v_and_no_staging_and_loads_k_alone() {
        let plan = plan(Pass::Max).unwrap();
        let smem = plan.smem();
        assert!(smem.buffer(Buf::V).is_err() && smem.buffer(Buf::OStage).is_err());
        assert_eq!(
            [smem.offset(Buf::K).unwrap(), smem.offset(Buf::Q).unwrap()],
            [0, TILE_BYTES]
        );
        let kv = plan.pipelines().get("kv").unwrap().pipeline;
        assert_eq!((kv.tx.len(), kv.declared_tx), (2, Some(TILE_BYTES)));
        // A sum pass's plan without V cannot be resolved.
        assert!(resolve(&plan, Pass::Sum(OPool::F32)).is_err());
        assert!(resolve(&plan, Pass::Max).is_ok());
    }

    #[test]
    fn the_plan_rejects_what_the_kernel_would_get_wrong() {
        let warps = Sm90Warps::new(PRODUCER_REGS, CONSUMER_REGS).unwrap();
        // A release count no role produces (the rows need each consumer thread's arrival).
        let rows = Pipeline {
            consumer_arrivals: 255,
            ..rows_pipeline(Pass::Max)
        };
        let e = PipelinePlan::new(
            vec![kv_pipeline(Pass::Max), q_pipeline(Pass::Max), rows],
            &warps,
        )
        .unwrap_err();
        assert!(
            matches!(
                &e,
                PlanError::Arrivals {
                    side: Side::Consumer,
                    ..
                }
            ),
            "{e}"
        );
        let f32 = Pass::Sum(OPool::F32);
        // Two K/V stages beside the f32 staging: past the shared memory.
        let kv2 = Pipeline {
            stages: 2,
            ..kv_pipeline(f32)
        };
        let pipes =
            PipelinePlan::new(vec![kv2, q_pipeline(f32), rows_pipeline(f32)], &warps).unwrap();
        let e = smem_plan(&pipes, f32).unwrap_err();
        assert!(matches!(e, PlanError::SmemTotal { .. }), "{e}");
    }
}
