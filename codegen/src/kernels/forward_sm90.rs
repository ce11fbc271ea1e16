//! `msa_forward_sm90`: the MSA forward for Hopper (sm_90a): `out` and `lse` from Q, the aligned
//! K/V and the selection `q2k`, with the semantics of `docs/design.md` §1.4.
//!
//! # Design
//! Q-parallel. An *item* is 8 consecutive compact query rows × the 16 heads of one KV group
//! `g`: 128 folded rows (`slot·16 + head`), the same fold as the backward's tasks. Items are
//! numbered `4·chunk + g`, so the CTAs resident at one time work on neighbouring queries of all
//! four groups and share their key blocks in L2; each CTA walks items `ctaid, ctaid + grid, …`.
//!
//! - **Block list.** The 8 queries of an item select up to 8·16 blocks; neighbouring queries
//!   of one document mostly select the same ones. The CTA walks the *union* once: one entry
//!   per distinct global key block (`document_workspace_starts[d]/128 + id`), with an 8-bit
//!   mask of the slots that selected it. A slot's rows are masked to −∞ on a block it did
//!   not select, so each query attends exactly its own selection; a consumer warpgroup skips
//!   (computes nothing for) a block none of its 4 slots selected.
//! - **Warpgroups.** 384 threads. Warpgroup 0 produces (`setmaxnreg.dec`): warp 1 builds each
//!   item's list in shared memory (the slots' documents by binary search over `cu_seqlens`,
//!   their aligned positions, then the union: every lane compares its 4 of the 128 candidates
//!   with all of them, and a warp scan compacts the first occurrences in slot-major order, so
//!   the walk order is deterministic; [`forward_list::build`](super::forward_list::build),
//!   shared with the SM100 forward); thread 0 issues the TMA loads (Q as 16-head × 64-d
//!   boxes, a −1 row out of bounds and zero-filled; per list entry K and V as 128-key × 64-d
//!   boxes). Warpgroups 1 and 2 consume (`setmaxnreg.inc`); consumer `c` owns slots
//!   `4c .. 4c+4`, i.e. folded rows `64c .. 64c+64`, and its warp `w` exactly the 16 heads
//!   of slot `4c + w`.
//! - **Plan.** Every resource comes from the typed [`Sm90Plan`] of [`plan`], checked at codegen
//!   time as the backward's is: the `setmaxnreg` budgets, the shared-memory offsets
//!   ([`SmemPlan`]), the pipelines with their barrier slots ([`PipelinePlan`]: arrival counts
//!   against the roles, TMA boxes against the tiles they fill) and the list warp's named
//!   barrier.
//! - **Pipelines** (stage/parity from [`Pipe`] over running counters): the list, two stages
//!   (full: the 32 list lanes; empty: the TMA thread and every consumer thread after its own
//!   last read); Q, two stages (16 boxes); K/V, two stages (4 boxes; empty: one arrival per
//!   consumer warp after its last `wgmma.wait_group`). A consumer warpgroup that skips a block
//!   still waits for its stage before releasing it, so its arrivals cannot run ahead into the
//!   stage's next phase.
//! - **Per block** (consumer `c`, wgmma m64, bf16 in, f32 accumulators in registers):
//!   `S = Q_c·Kᵀ` (m64n128k16 × 8, both operands K-major SW128), the mask
//!   `selected(slot) ∧ qpos ≥ kblock·128 + key` in aligned coordinates (document-local
//!   causality; padding keys excluded, `docs/design.md` §3.5), online softmax in the log2
//!   domain (`exp2(S·scale·log2e − m)`; a row whose running max is still −∞ uses 0 as its
//!   reference, so an empty row never produces NaN), then `O += P·V` with P rounded to bf16 in
//!   registers as the A fragment (the accumulator layout of S is the wgmma A layout) and V as
//!   an MN-major SW128 descriptor.
//! - **Epilogue.** The row sum is reduced over the quad; `out = O/l` as bf16 and
//!   `lse = ln2·(m + log2 l)` (natural log, as `run_backward` reads it); a row with no key
//!   gets `out = 0`, `lse = −∞`. A flagged schedule (status word 0 non-zero) makes every
//!   selection empty, so its `out` is 0 and `lse` −∞, never a wrong value.
//!
//! # Performance, and the design that should replace this one
//! On the H200 (`bench/results/h200-2026-12-01-forward-baselines.md`) this kernel runs at 236 /
//! 261 / 141 useful TFLOP/s (packed64k / doc8k / doc32k): 2.4× / 2.6× / 1.4× fla's
//! `parallel_nsa_fwd`, 3.2-3.7× FlexAttention, short of the 3× and 450 TFLOP/s and not
//! flat with document length. ncu (packed64k): tensor pipe busy 53 % of cycles, L2 at 38 % of
//! its peak, no spills. The limit is wasted tensor work: an m64 tile holds 4 queries, so a
//! consumer executes a tile for every block any of its 4 queries chose, while with random
//! selections about one of them wants it (packed64k: 7.4 TFLOP executed for 3.6 useful; doc32k
//! 6.3 for 2.1, the union growing with the document).
//!
//! Forcing the two consumers to alternate their GEMM issues (FlashAttention-3's ping-pong,
//! named barriers around each GEMM batch) was measured 2.5-5.6 % slower
//! (`bench/results/h200-2026-12-01-s6-forward-pingpong.md`): the consumers already overlap on
//! their own, so the overlap the softmax lacks is inside a consumer (a second S accumulator,
//! which the 232-register budget does not hold next to O and P). Three K/V stages (Q in one,
//! to fit) were 3-4 % slower (`bench/results/h200-2026-12-02-s7-backward-dq.md`): the
//! consumers' wait on K/V fills fell from 13.6 % to 9.8 % of their stall samples, but the
//! single Q stage stalls each item's start, and since the consumers skip different blocks the
//! shared ring couples them at any depth.
//!
//! `bench/forward_model.py` bounds the alternatives (L2 bytes, executed FLOP, shared-memory
//! operand bytes). A smaller item or a cluster alone keep the waste. Executing only selected
//! (query, block) pairs needs the transposed orientation, `Sᵀ = K·Qᵀ` with M = 128 keys and
//! N = 16 heads per query and `Oᵀ += Vᵀ·Pᵀ` (Vᵀ an MN-major A operand, Pᵀ staged in shared
//! memory as a K-major B, the column softmax reduced across the warpgroup's warps), with:
//! 16 queries per CTA (two consumers × 8, `Oᵀ` of 8 queries = 128 f32 registers per thread),
//! which halves the L2 bytes; the Q rows of a block's selecting queries gathered into one
//! N = 16·n staging tile, so K is read from shared memory once per block and consumer; and PV
//! per fixed pair of queries (their `Oᵀ` is one static register list; a run-time-gathered
//! PV would need registers named at run time). Its bound at packed64k is 546 useful TFLOP/s,
//! ~330 at this kernel's 60 % of bound; doc32k stays L2-bound (386) unless a 2-CTA cluster
//! multicasts each block to both CTAs (32-query union), which `msa-sim` does not model yet.
//!
//! A KV-parallel forward on the backward's task tables, which hold only selected (query,
//! block) pairs, so no tile is wasted, is built as [`forward_kv_sm90`](super::forward_kv_sm90)
//! (sessions 13-15). It needs no online maximum: a max pass gives every row's exact maximum,
//! and the sum pass adds each task's rows against it into f16 pools in L2. At packed64k /
//! doc32k / doc8k it takes 14.2 / 8.1 / 1.83 ms, flat at 254-258 useful TFLOP/s, against this
//! kernel's 15.2 / 14.3 / 1.81 in the same run; since session 18 (no max pass) 8.9 / 5.1 /
//! 1.16 ms. `MsaAttention` takes it from a mean document of 4096 tokens.

use super::common::{self, k_major, mn_major};
use super::forward_list as list;
use super::KernelDesc;
use crate::plan::pipeline::{Barriers, NamedBarrier, Pipe, Pipeline, PipelinePlan, TmaBox};
use crate::plan::roles::Role;
use crate::plan::sm90::{Sm90Plan, Sm90Warps};
use crate::plan::smem::{Buf, BufferSpec, Major, Placed, SmemPlan, PANEL_BYTES, TILE_BYTES};
use crate::plan::PlanError;
use crate::ptx::*;
use crate::target::Target;

/// Threads per CTA: one producer warpgroup and two consumer warpgroups.
pub const THREADS: u32 = 384;
/// Registers of the producer warpgroup after `setmaxnreg.dec`.
pub const PRODUCER_REGS: u32 = 40;
/// Registers of each consumer warpgroup after `setmaxnreg.inc` (40·128 + 232·256 ≤ 64 Ki).
pub const CONSUMER_REGS: u32 = 232;
/// Query rows per item.
pub const ITEM_QUERIES: u32 = 8;

/// The K/V pipeline: two stages of two 128-key × 64-d boxes each of K and V; one arrival per
/// consumer warp releases a stage.
pub fn kv_pipeline() -> Pipeline {
    Pipeline {
        tx: vec![
            TmaBox {
                dims: vec![64, 1, 128],
                elem_bytes: 2
            };
            4
        ],
        declared_tx: Some(2 * TILE_BYTES),
        fills: vec![Buf::K, Buf::V],
        ..Pipeline::new("kv", 2, Role::Load, &[Role::Compute], 1, 8)
    }
}

/// The Q pipeline: two stages of 8 slots × 2 d-halves of 16 heads × 64 d.
pub fn q_pipeline() -> Pipeline {
    Pipeline {
        tx: vec![
            TmaBox {
                dims: vec![64, 16, 1],
                elem_bytes: 2
            };
            16
        ],
        declared_tx: Some(TILE_BYTES),
        fills: vec![Buf::Q],
        ..Pipeline::new("q", 2, Role::Load, &[Role::Compute], 1, 8)
    }
}

/// The list pipeline: filled by the list warp's 32 lanes, released by the TMA thread (the
/// load warp's one active lane) and each of the 256 consumer threads after its own last read.
pub fn list_pipeline() -> Pipeline {
    Pipeline::new(
        "list",
        2,
        Role::Scalar,
        &[Role::Load, Role::Compute],
        32,
        1 + 256,
    )
}

/// The forward's warps: warp 0's lane 0 issues the TMA loads ([`Role::Load`]), warp 1 builds
/// the lists ([`Role::Scalar`]), warps 2-3 exit, warpgroups 1 and 2 consume.
pub fn warps() -> Result<Sm90Warps, PlanError> {
    Sm90Warps::new(PRODUCER_REGS, CONSUMER_REGS)
}

/// The shared layout: the forwards' common buffers ([`list::buffers`]: K, V, Q, the item
/// lists, the list builder's scratch), then the barrier array.
pub fn smem_plan(barrier_slots: u32) -> Result<SmemPlan, PlanError> {
    let mut specs = list::buffers();
    specs.push(BufferSpec::barriers(barrier_slots));
    SmemPlan::layout(specs)
}

/// The named barrier of the list warp alone (it orders the lanes' scratch stores and loads).
pub fn barriers() -> Vec<NamedBarrier> {
    vec![NamedBarrier {
        name: "list_warp",
        id: 1,
        threads: 32,
        roles: vec![Role::Scalar],
    }]
}

/// The forward's whole plan, checked: the register budgets, the pipelines against the roles,
/// the layout against the TMA fills, the named barrier against its role.
pub fn plan() -> Result<Sm90Plan, PlanError> {
    let warps = warps()?;
    let pipelines = PipelinePlan::new(vec![kv_pipeline(), q_pipeline(), list_pipeline()], &warps)?;
    let smem = smem_plan(pipelines.barrier_slots())?;
    Sm90Plan::new(warps, smem, pipelines, barriers(), Vec::new())
}

/// Dynamic shared memory requested: the plan's layout and 1 KiB of slack, enough to align
/// the base to the 1024-B swizzle atom at run time whatever the base (so no guard is needed).
pub fn smem_bytes(plan: &Sm90Plan) -> u32 {
    plan.smem().total() + 1024
}

/// The plan resolved for the roles, looked up once.
struct Resolved<'a> {
    k: Placed,
    v: Placed,
    q: Placed,
    list: Placed,
    scratch: Placed,
    barriers: u32,
    kv: Pipe<'a>,
    q_pipe: Pipe<'a>,
    list_pipe: Pipe<'a>,
    list_warp: u32,
}

/// Looks up everything [`Resolved`] holds; the error names what the plan lacks.
fn resolve(plan: &Sm90Plan) -> Result<Resolved<'_>, String> {
    let smem = plan.smem();
    let buf = |id| smem.buffer(id).copied().map_err(|e| e.to_string());
    let pipe = |name| plan.pipelines().get(name).map_err(|e| e.to_string());
    let list_warp = plan
        .barrier("list_warp")
        .ok_or("the plan has no named barrier `list_warp`")?
        .id;
    Ok(Resolved {
        k: buf(Buf::K)?,
        v: buf(Buf::V)?,
        q: buf(Buf::Q)?,
        list: buf(Buf::List)?,
        scratch: buf(Buf::ListScratch)?,
        barriers: buf(Buf::Barriers)?.offset,
        kv: pipe("kv")?,
        q_pipe: pipe("q")?,
        list_pipe: pipe("list")?,
        list_warp,
    })
}

impl Resolved<'_> {
    fn bars(&self, b: &mut KernelBuilder, base: Reg<U32>) -> Barriers {
        common::sm90_barriers(b, base, self.barriers)
    }
}

const LN2: f32 = std::f32::consts::LN_2;

/// The Hopper forward kernel.
pub const DESC: KernelDesc = KernelDesc {
    name: "msa_forward_sm90",
    about: "MSA forward for Hopper: per item the union of its queries' blocks, TMA + mbarrier \
            pipelines, wgmma, online softmax in exp2; out bf16 and lse (natural log)",
    targets: &[Target::Sm90a],
    threads: (THREADS, 1, 1),
    describe,
};

/// The forward kernels' parameters.
pub struct ForwardParams {
    /// Q `[T, 64, 128]` bf16, boxes of 16 heads × 64 d.
    pub tmap_q: TensorMapRef,
    /// K `[W, 4, 128]` bf16 (aligned), boxes of 128 keys × 64 d.
    pub tmap_k: TensorMapRef,
    /// V, as K.
    pub tmap_v: TensorMapRef,
    /// `q2k [4, T, 16]` int32.
    pub q2k: ParamRef<U64>,
    /// `cu_seqlens [D+1]` int32.
    pub cu: ParamRef<U64>,
    /// `document_workspace_starts [D]` int32.
    pub ws: ParamRef<U64>,
    /// The schedule build's status block (word 0: the flags).
    pub status: ParamRef<U64>,
    /// `out [T, 64, 128]` bf16.
    pub out: ParamRef<U64>,
    /// `lse [T, 64]` f32.
    pub lse: ParamRef<U64>,
    /// T.
    pub num_tokens: ParamRef<U32>,
    /// D.
    pub num_docs: ParamRef<U32>,
    /// The packed sequence's token of local row 0: the document search runs on
    /// `first_token + t`, while `q`, `q2k`, `out` and `lse` are indexed by the local row `t`
    /// (0 on one device; a context-parallel rank's first token otherwise).
    pub first_token: ParamRef<U32>,
}

/// Declares the forward kernels' parameters.
pub fn forward_params(b: &mut KernelBuilder) -> ForwardParams {
    ForwardParams {
        tmap_q: b.param_tensor_map("tmap_q"),
        tmap_k: b.param_tensor_map("tmap_k"),
        tmap_v: b.param_tensor_map("tmap_v"),
        q2k: b.param_ptr("q2k", HostElem::I32, false),
        cu: b.param_ptr("cu_seqlens", HostElem::I32, false),
        ws: b.param_ptr("document_workspace_starts", HostElem::I32, false),
        status: b.param_ptr("status", HostElem::I32, false),
        out: b.param_ptr("out", HostElem::Bf16, true),
        lse: b.param_ptr("lse", HostElem::F32, true),
        num_tokens: b.param_u32("num_tokens"),
        num_docs: b.param_u32("num_docs"),
        first_token: b.param_u32("first_token"),
    }
}

/// This CTA's items: `ctaid + k·grid` for `k < count`.
pub struct Items {
    /// How many items this CTA walks.
    pub count: Reg<U32>,
    /// The CTA index.
    pub cta: Reg<U32>,
    /// The grid size.
    pub grid: Reg<U32>,
}

impl Items {
    /// Item `k` of this CTA.
    pub fn item(&self, b: &mut KernelBuilder, k: Reg<U32>) -> Reg<U32> {
        b.mad_lo(k, self.grid, self.cta)
    }
}

/// `4·ceil(T/8)` items, walked with a grid stride.
pub fn items(b: &mut KernelBuilder, p: &ForwardParams) -> Items {
    let t = b.ld_param(&p.num_tokens);
    let chunks = common::div_ceil(b, t, ITEM_QUERIES);
    let n = b.shl(chunks, 2u32);
    let cta = b.sreg(SReg::CtaidX);
    let grid = b.sreg(SReg::NctaidX);
    let left = b.sub(n, cta);
    let some = b.setp(Cmp::Lt, cta, n);
    let left = b.selp(left, 0u32, some);
    let count = common::div_ceil(b, left, grid);
    Items { count, cta, grid }
}

fn describe(b: &mut KernelBuilder) {
    b.grid("[min(4*ceil(T/8), num_sms), 1, 1]");
    b.min_ctas_per_sm(1);
    let p = forward_params(b);
    let plan = match plan() {
        Ok(plan) => plan,
        Err(e) => return b.error(format!("SM90 forward plan: {e}")),
    };
    let r = match resolve(&plan) {
        Ok(r) => r,
        Err(e) => return b.error(format!("SM90 forward plan: {e}")),
    };
    let smem = b.dynamic_shared("smem", smem_bytes(&plan), 1024);
    let (_, base) = common::swizzle_aligned_base(b, &smem);
    let tid = b.sreg(SReg::TidX);
    b.comment("thread 0 initialises every pipeline barrier");
    let leader = b.setp(Cmp::Eq, tid, 0u32);
    let bars = r.bars(b, base);
    b.if_then(leader, "init", |b| plan.pipelines().emit_init(b, &bars));
    b.bar_sync(0, None);
    let walk = items(b, &p);

    let wg = b.shr(tid, 7u32);
    let is_producer = b.setp(Cmp::Eq, wg, 0u32);
    let consumers = b.label("consumers");
    b.bra_unless(is_producer, &consumers);
    plan.warps().emit_producer_setmaxnreg(b);
    let warp = b.shr(tid, 5u32);
    let is_list = b.setp(Cmp::Eq, warp, 1u32);
    b.if_then(is_list, "list", |b| list_warp(b, &r, &p, base, tid, &walk));
    b.if_then(leader, "tma", |b| tma_thread(b, &r, &p, base, &walk));
    b.ret();

    b.place(&consumers);
    plan.warps().emit_consumer_setmaxnreg(b);
    consumer(b, &r, &p, base, tid, &walk);
    b.ret();
}

/// The list warp: per item, the slots' rows and positions and the union of their blocks.
fn list_warp(
    b: &mut KernelBuilder,
    r: &Resolved,
    p: &ForwardParams,
    base: Reg<U32>,
    tid: Reg<U32>,
    w: &Items,
) {
    let bars = r.bars(b, base);
    let id = r.list_warp;
    list::warp(
        b,
        p,
        w,
        &r.list_pipe,
        &bars,
        (&r.list, &r.scratch),
        (base, tid),
        &|b| b.bar_sync(id, Some(32)),
    );
}

/// The TMA thread: per item its Q rows, then K and V of every list entry.
fn tma_thread(b: &mut KernelBuilder, r: &Resolved, p: &ForwardParams, base: Reg<U32>, w: &Items) {
    let (list, q, kv) = (&r.list_pipe, &r.q_pipe, &r.kv);
    let bars = r.bars(b, base);
    let tq = b.tensor_map_addr(&p.tmap_q);
    let tk = b.tensor_map_addr(&p.tmap_k);
    let tv = b.tensor_map_addr(&p.tmap_v);
    let kv_iter = b.mov::<U32>(0u32);
    b.for_range(0u32, w.count, 1, "tma_item", |b, k| {
        let item = w.item(b, k);
        let g = b.and(item, 3u32);
        let lst = list.consumer_wait(b, &bars, k);
        let lb = r.list.emit_stage_addr(b, base, lst.index);
        let count = b.ld::<U32, _>(&shared(lb, list::COUNT as i64));

        let qst = q.producer_acquire(b, &bars, k);
        let q_tile = r.q.emit_stage_addr(b, base, qst.index);
        let head16 = b.shl(g, 4u32);
        let head16 = b.bitcast::<S32, U32>(head16);
        for slot in 0..8u32 {
            let qrow = b.ld::<S32, _>(&shared(lb, (list::QROW + 4 * slot) as i64));
            for panel in 0..2u32 {
                let d0 = b.mov::<S32>(panel as i32 * 64);
                let off = panel * PANEL_BYTES + slot * 2048;
                b.tma_load_3d(
                    &shared(q_tile, off as i64),
                    tq,
                    [d0, head16, qrow],
                    &qst.full,
                );
            }
        }

        b.for_range(0u32, count, 1, "tma_block", |b, e| {
            let e4 = b.shl(e, 2u32);
            let at = b.add(lb, e4);
            let gb = b.ld::<U32, _>(&shared(at, list::GB as i64));
            let st = kv.producer_acquire(b, &bars, kv_iter);
            let k_tile = r.k.emit_stage_addr(b, base, st.index);
            let v_tile = r.v.emit_stage_addr(b, base, st.index);
            let tiles = [shared(k_tile, 0), shared(v_tile, 0)];
            common::load_kv_tiles(b, [tk, tv], tiles, &[g, g, gb, gb], &st.full, None);
            let next = b.add(kv_iter, 1u32);
            b.set(kv_iter, next);
        });
        list.consumer_release(b, &bars, &lst);
    });
}

#[allow(clippy::too_many_lines)]
fn consumer(
    b: &mut KernelBuilder,
    r: &Resolved,
    p: &ForwardParams,
    base: Reg<U32>,
    tid: Reg<U32>,
    w: &Items,
) {
    let t = b.sub(tid, 128u32);
    let c = b.shr(t, 7u32); // consumer 0/1: slots 4c..4c+4
    let tw = b.and(t, 127u32);
    let warp = b.shr(tw, 5u32);
    let lane = b.and(tw, 31u32);
    let quad = b.shr(lane, 2u32);
    let pair = b.and(lane, 3u32);
    let col0 = b.shl(pair, 1u32);
    let slot = b.mad_lo(c, 4u32, warp);
    let slot4 = b.shl(slot, 2u32);
    let c4 = b.shl(c, 2u32);
    let lane0 = b.setp(Cmp::Eq, lane, 0u32);
    let zero = b.mov::<U32>(0u32);
    let always = b.setp(Cmp::Eq, zero, 0u32);
    let never = b.setp(Cmp::Ne, zero, 0u32);
    let neg_inf = f32::NEG_INFINITY;
    let scale_log2e = common::SCALE_LOG2E;
    let c_rows = b.mul_lo(c, 64 * 128);

    let (list, q, kv) = (&r.list_pipe, &r.q_pipe, &r.kv);
    let bars = r.bars(b, base);
    let kv_iter = b.mov::<U32>(0u32);
    let o_acc: Vec<Reg<F32>> = (0..64).map(|_| b.reg()).collect();
    let m_row: [Reg<F32>; 2] = std::array::from_fn(|_| b.reg());
    let l_row: [Reg<F32>; 2] = std::array::from_fn(|_| b.reg());

    b.for_range(0u32, w.count, 1, "item", |b, k| {
        let item = w.item(b, k);
        let g = b.and(item, 3u32);
        let lst = list.consumer_wait(b, &bars, k);
        let lb = r.list.emit_stage_addr(b, base, lst.index);
        let count = b.ld::<U32, _>(&shared(lb, list::COUNT as i64));
        let sat = b.add(lb, slot4);
        let qpos = b.ld::<S32, _>(&shared(sat, list::QPOS as i64));
        let qrow = b.ld::<S32, _>(&shared(sat, list::QROW as i64));
        let qst = q.consumer_wait(b, &bars, k);
        let q_tile = r.q.emit_stage_addr(b, base, qst.index);
        let a_base = b.add(q_tile, c_rows);
        for r in &o_acc {
            b.set(*r, 0.0f32);
        }
        for rr in 0..2 {
            b.set(m_row[rr], neg_inf);
            b.set(l_row[rr], 0.0f32);
        }

        b.for_range(0u32, count, 1, "block", |b, e| {
            let e4 = b.shl(e, 2u32);
            let at = b.add(lb, e4);
            let gb = b.ld::<U32, _>(&shared(at, list::GB as i64));
            let mask = b.ld::<U32, _>(&shared(at, list::MASK as i64));
            let st = kv.consumer_wait(b, &bars, kv_iter);
            let k_addr = r.k.emit_stage_addr(b, base, st.index);
            let v_addr = r.v.emit_stage_addr(b, base, st.index);
            let wg_bits = b.shr(mask, c4);
            let wg_bits = b.and(wg_bits, 15u32);
            let active = b.setp(Cmp::Ne, wg_bits, 0u32);
            b.if_then(active, "active", |b| {
                b.comment("S = Q_c*K^T");
                let s_acc: Vec<Reg<F32>> = (0..64).map(|_| b.reg()).collect();
                b.wgmma_fence();
                let a0 = k_major().emit(b, a_base);
                let b0 = k_major().emit(b, k_addr);
                common::wgmma_ss_k128(b, &s_acc, Major::K, (a0, b0), (never, always));
                b.wgmma_commit();
                b.wgmma_wait(0);

                b.comment("mask: the slot selected this block, and qpos >= key position");
                let bits = b.shr(mask, slot);
                let bits = b.and(bits, 1u32);
                let chose = b.setp(Cmp::Ne, bits, 0u32);
                let qpos_eff = b.selp(qpos, -1i32, chose);
                let key0 = b.shl(gb, 7u32);
                let key0 = b.add(key0, col0);
                let key0 = b.bitcast::<S32, U32>(key0);
                let mut v = Vec::with_capacity(64);
                for (i, s) in s_acc.iter().enumerate() {
                    let (jj, e) = (i / 4, i % 2);
                    let n = (8 * jj + e) as i32;
                    let kp = b.add(key0, n);
                    let seen = b.setp(Cmp::Ge, qpos_eff, kp);
                    let x = b.fmul(*s, scale_log2e);
                    v.push(b.selp(x, neg_inf, seen));
                }

                b.comment("online softmax per row (rows r and r+8 of the warp's 16 heads)");
                let mut alpha = Vec::new();
                let mut m_use = Vec::new();
                for (rr, &m_old) in m_row.iter().enumerate() {
                    let mx = common::thread_row_max(b, &v, rr);
                    let mx = common::quad_max(b, mx);
                    let m_new = b.max(m_old, mx);
                    let empty = b.setp(Cmp::Eq, m_new, neg_inf);
                    let mu = b.selp(0.0f32, m_new, empty);
                    let diff = b.sub(m_old, mu);
                    alpha.push(b.ex2_approx(diff));
                    m_use.push(mu);
                    b.set(m_old, m_new);
                }
                let mut pv = Vec::with_capacity(64);
                let mut sums = [None, None];
                for (i, x) in v.iter().enumerate() {
                    let rr = (i / 2) % 2;
                    let d = b.sub(*x, m_use[rr]);
                    let pe = b.ex2_approx(d);
                    sums[rr] = Some(match sums[rr] {
                        None => pe,
                        Some(s) => b.add(s, pe),
                    });
                    pv.push(pe);
                }
                for rr in 0..2usize {
                    let sum = sums[rr].expect("64 values");
                    let l = b.fma(l_row[rr], alpha[rr], sum);
                    b.set(l_row[rr], l);
                }
                for (i, o) in o_acc.iter().enumerate() {
                    let rr = (i / 2) % 2;
                    let x = b.fmul(*o, alpha[rr]);
                    b.set(*o, x);
                }
                let frags = common::bf16_a_frags(b, &pv);

                b.comment("O += P*V (A from registers, V MN-major)");
                b.wgmma_fence();
                let b0 = mn_major().emit(b, v_addr);
                common::wgmma_rs_k128(b, &o_acc, &frags, b0, (always, always));
                b.wgmma_commit();
                b.wgmma_wait(0);
            });
            b.predicated(lane0, false, |b| kv.consumer_release(b, &bars, &st));
            let next = b.add(kv_iter, 1u32);
            b.set(kv_iter, next);
        });
        b.comment("this warp's wgmma reads of Q are complete: release the stage");
        b.predicated(lane0, false, |b| q.consumer_release(b, &bars, &qst));
        b.comment("this thread's last read of the list is done");
        list.consumer_release(b, &bars, &lst);

        b.comment("epilogue: out = O/l (bf16), lse = ln2*(m + log2 l); empty rows 0 and -inf");
        let live = b.setp(Cmp::Ge, qrow, 0i32);
        let qrow_u = b.bitcast::<U32, S32>(qrow);
        let g16 = b.shl(g, 4u32);
        for rr in 0..2usize {
            let mut l = l_row[rr];
            for d in [1u32, 2] {
                let o = b.shfl(Shfl::Bfly, l, d, 0x1f);
                l = b.add(l, o);
            }
            let some = b.setp(Cmp::Gt, l, 0.0f32);
            let r = b.rcp_rn(l);
            let inv = b.selp(r, 0.0f32, some);
            let lg = b.lg2_approx(l);
            let lse2 = b.add(m_row[rr], lg);
            let lse = b.fmul(lse2, LN2);
            let lse = b.selp(lse, neg_inf, some);
            let head = b.add(quad, 8 * rr as u32);
            let head = b.add(head, g16);
            let row = b.mad_lo(qrow_u, 64u32, head);
            b.if_then(live, "store", |b| {
                let out = b.ld_param_ptr(&p.out);
                let off = b.mul_wide(row, 256u32);
                let cb = b.mul_wide(col0, 2u32);
                let at = b.add(out, off);
                let at = b.add(at, cb);
                let row_at = global(at, 0);
                for jj in 0..16usize {
                    let i = 4 * jj + 2 * rr;
                    let lo = b.fmul(o_acc[i], inv);
                    let hi = b.fmul(o_acc[i + 1], inv);
                    let pk = b.cvt_bf16x2(hi, lo);
                    b.st(&row_at.offset(16 * jj as i64), pk);
                }
                let head_lane = b.setp(Cmp::Eq, pair, 0u32);
                b.if_then(head_lane, "store_lse", |b| {
                    let lse_p = b.ld_param_ptr(&p.lse);
                    let a = common::elem::<F32>(b, lse_p, row);
                    b.st(&a, lse);
                });
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::pipeline::Side;

    #[test]
    fn the_forward_plan_passes_and_places_every_buffer() {
        let plan = plan().unwrap();
        let smem = plan.smem();
        let at = |id| smem.offset(id).unwrap();
        assert_eq!(
            [at(Buf::K), at(Buf::V), at(Buf::Q)],
            [0, 2 * TILE_BYTES, 4 * TILE_BYTES]
        );
        assert_eq!(at(Buf::List), 6 * TILE_BYTES);
        assert_eq!(at(Buf::ListScratch), 6 * TILE_BYTES + 2 * list::BYTES);
        // kv, q and list: two stages of a full and an empty barrier each.
        assert_eq!(plan.pipelines().barrier_slots(), 12);
        let slots: Vec<u32> = ["kv", "q", "list"]
            .map(|n| plan.pipelines().get(n).unwrap().slot)
            .to_vec();
        assert_eq!(slots, [0, 4, 8]);
        assert_eq!(smem_bytes(&plan), smem.total() + 1024);
        assert!(smem_bytes(&plan) <= MAX_SHARED_BYTES);
        assert_eq!(plan.barrier("list_warp").unwrap().id, 1);
    }

    #[test]
    fn the_forward_plan_rejects_what_the_kernel_would_get_wrong() {
        let warps = warps().unwrap();
        // The list's consumers without the TMA thread's arrival.
        let list = Pipeline {
            consumer_arrivals: 256,
            ..list_pipeline()
        };
        let e = PipelinePlan::new(vec![kv_pipeline(), q_pipeline(), list], &warps).unwrap_err();
        assert!(
            matches!(&e, PlanError::Arrivals { side: Side::Consumer, allowed, .. }
                if allowed.contains(&257) && !allowed.contains(&256)),
            "{e}"
        );
        // A third Q stage that the two Q tiles of the layout do not have.
        let q = Pipeline {
            stages: 3,
            ..q_pipeline()
        };
        let pipes = PipelinePlan::new(vec![kv_pipeline(), q, list_pipeline()], &warps).unwrap();
        let smem = smem_plan(pipes.barrier_slots()).unwrap();
        let e = Sm90Plan::new(warps.clone(), smem, pipes, barriers(), Vec::new()).unwrap_err();
        assert!(
            matches!(e, PlanError::FillStages { pipeline: "q", .. }),
            "{e}"
        );
        // Consumer budgets that overflow an SMSP's register file with the producer's 40.
        assert!(Sm90Warps::new(PRODUCER_REGS, 240).is_err());
    }
}
