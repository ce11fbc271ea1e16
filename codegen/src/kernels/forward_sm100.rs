//! `msa_forward_sm100`: the MSA forward for Blackwell (sm_100a), with the semantics and outputs
//! of [`super::forward_sm90`] (`out` bf16 `[T, 64, 128]`, `lse` f32 natural log, an empty row
//! `out = 0` / `lse = −∞`, a flagged schedule all empty), from the typed plans of
//! [`crate::plan`] as [`super::backward_sm100`] is.
//!
//! # Design
//! Q-parallel, the items of the Hopper forward: item `4·chunk + g` is 8 consecutive compact
//! query rows × the 16 heads of KV group `g`, 128 *folded rows* `slot·16 + head`, which here
//! are the 128 TMEM lanes; each CTA walks items `ctaid, ctaid + grid, …`, and per item the
//! union of its queries' blocks ([`super::forward_list`]), a slot's rows masked to −∞ on a
//! block it did not select.
//!
//! - **Warps** (512 threads, one CTA per SM; the backward's [`WarpPlan`]). Warpgroup 0 idles.
//!   Warps 4–7 *compute* the softmax, thread = TMEM lane = folded row; warp 4 allocates the
//!   512 TMEM columns and frees them after the dealloc barrier. Warps 8–11 are the *epilogue*
//!   (the plan's reduce role), thread = folded row. Warp 12 issues every MMA, warp 13 every TMA
//!   load, warp 14 builds the lists (the plan's scalar role); warp 15 idles.
//! - **TMEM**: two S stages (fp32, 128 columns each, S at 0 and S1 at 128) with P (packed
//!   bf16, 64 columns) over each; O (fp32, 128 columns) at 256. Block `i` of the CTA's walk
//!   uses S stage `i % 2`.
//! - **MMA warp** (one `elect.sync` lane issues every MMA and commit), per block `i` of an
//!   item: first `S_{i+1} = Q·Kᵀ` of the item's next block into the other stage (SS, M128
//!   N128 K128, both K-major; the item's first S is issued before its loop), so it overlaps
//!   the softmax of block `i`; then wait for `P_i`, at the item's first block wait until the
//!   epilogue has drained O, and `O (+)= P_i·V` (TS: P from TMEM, V MN-major; overwriting at
//!   the first block), committing the P and K/V releases. An S stage is refilled only after
//!   compute released it, which it does once the P·V that read its P completed (the ISA
//!   orders MMAs only on one accumulator, so this order is explicit, as the backward's
//!   `MmaOrder::Explicit`). After an item it commits O (also for an empty list, so the
//!   epilogue never waits for nothing) and releases Q.
//! - **Compute** per block: two passes over its S stage in 32-column chunks
//!   (`tcgen05.ld.32x32b.x32`): the row max of `S·scale·log2e` under the mask
//!   `selected(slot) ∧ qpos ≥ kblock·128 + key` (aligned coordinates: document-local
//!   causality, padding keys excluded); then it waits for the previous `P·V` (which overlapped
//!   pass 1), frees that block's S stage, rescales `O *= exp2(m_old − m_new)` in TMEM (not at an
//!   item's first block, whose MMA overwrites O) and writes `P = exp2(x − m_new)` packed to
//!   bf16 over S; a row whose max is still −∞ uses 0 as its reference, so an empty row never
//!   makes NaN. The row sum `l` and max `m` stay in registers; at an item's end they go to the
//!   stats stage.
//! - **Epilogue** per item: `out = O/l` (bf16, 256 contiguous bytes per thread) and
//!   `lse = ln2·(m + log2 l)`; `l = 0` gives `out = 0`, `lse = −∞` (O is not read when the list
//!   is empty). A −1 row (past `T`) stores nothing.
//! - **Pipelines** (typed, parity generated): `kv` and `q` (TMA, two stages, released by
//!   `tcgen05.commit`), `list` (two stages, 32 builder arrivals, one arrival per consumer
//!   thread: load, compute, MMA, epilogue), `s` (two stages: commit → compute, released by
//!   compute after the P·V that read it), `p` (compute → commit), `o` (commit → epilogue),
//!   `stats` (compute → epilogue).
//!
//! Still serial: the rescale of O and pass 2 wait for the previous P·V, and the epilogue's
//! drain of O delays an item's first P·V (a second O buffer would not fit next to two S
//! stages in 512 columns). It has never run on a B200 (no hardware); CI runs it on the
//! simulator (`runtime/sim/tests/forward.rs`), with planted bugs.

use super::common::{self, bump};
use super::forward_list as list;
use super::forward_sm90::{forward_params, items, ForwardParams, Items};
use super::sm100::{MmaA, MmaIssuer, Sm100Layout, Sm100Roles};
use super::KernelDesc;
use crate::plan::gemm::{AOperand, Gemm};
use crate::plan::pipeline::{Barriers, NamedBarrier, Pipe, Pipeline, PipelinePlan, TmaBox};
use crate::plan::roles::{Role, WarpPlan};
use crate::plan::smem::{Buf, BufKind, BufferSpec, Major, Placed, SmemPlan, PANEL_BYTES};
use crate::plan::smem::{TILE_BYTES, TILE_ROWS};
use crate::plan::tmem::{Region, TmemPlan, TmemRegion};
use crate::plan::{KernelPlan, PlanError};
use crate::ptx::tcgen05::TmemAddr;
use crate::ptx::*;
use crate::target::Target;

/// Threads per CTA: 16 warps.
pub const THREADS: u32 = crate::plan::roles::THREADS;
/// Columns of one `tcgen05.ld.32x32b.x32`.
const CHUNK: u32 = 32;
/// Slack above the plan's shared bytes for aligning the base to the 1024-B SW128 atom.
const ALIGN_SLACK: u32 = 1024;
const LN2: f32 = std::f32::consts::LN_2;

/// The Blackwell forward kernel.
pub const DESC: KernelDesc = KernelDesc {
    name: "msa_forward_sm100",
    about: "MSA forward for Blackwell: per item the union of its queries' blocks, TMA + mbarrier \
            pipelines, tcgen05 MMAs with TMEM accumulators, online softmax in exp2; out bf16 and \
            lse (natural log)",
    targets: &[Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe,
};

// ---- the plan ----------------------------------------------------------------------------

/// The forward's pipelines, in barrier-slot order.
pub fn pipelines() -> Vec<Pipeline> {
    use Role::*;
    let boxes = |dims: [u32; 3], n: usize| {
        vec![
            TmaBox {
                dims: dims.to_vec(),
                elem_bytes: 2,
            };
            n
        ]
    };
    vec![
        Pipeline {
            // K and V of one key block, two 64-d boxes each.
            tx: boxes([64, 1, 128], 4),
            declared_tx: Some(2 * TILE_BYTES),
            fills: vec![Buf::K, Buf::V],
            ..Pipeline::new("kv", 2, Load, &[Mma], 1, 1)
        },
        Pipeline {
            // 8 slots × 2 d-halves of 16 heads × 64 d.
            tx: boxes([64, 16, 1], 16),
            declared_tx: Some(TILE_BYTES),
            fills: vec![Buf::Q],
            ..Pipeline::new("q", 2, Load, &[Mma], 1, 1)
        },
        Pipeline::new("list", 2, Scalar, &[Load, Compute, Mma, Reduce], 32, 320),
        Pipeline::new("s", 2, Mma, &[Compute], 1, 128),
        Pipeline::new("p", 1, Compute, &[Mma], 128, 1),
        Pipeline::new("o", 1, Mma, &[Reduce], 1, 128),
        Pipeline::new("stats", 1, Compute, &[Reduce], 128, 128),
    ]
}

/// The forward's named barriers.
pub fn barriers() -> Vec<NamedBarrier> {
    use Role::*;
    let nb = |name, id, threads, roles: &[Role]| NamedBarrier {
        name,
        id,
        threads,
        roles: roles.to_vec(),
    };
    vec![
        nb("tmem_alloc", 1, 288, &[Compute, Reduce, Mma]),
        nb("list_warp", 2, 32, &[Scalar]),
        nb("tmem_dealloc", 3, 256, &[Compute, Reduce]),
    ]
}

/// The TMEM plan: two S stages (S at 0, S1 at 128) with P over each, O at 256; 512 columns.
pub fn tmem_plan() -> Result<TmemPlan, PlanError> {
    use TmemRegion::*;
    let r = |id, col, cols| Region { id, col, cols };
    TmemPlan::new(
        512,
        vec![
            r(S, 0, 128),
            r(P, 0, 64),
            r(S1, 128, 128),
            r(P1, 128, 64),
            r(O, 256, 128),
        ],
        vec![(P, S), (P1, S1)],
    )
}

/// The shared-memory plan: the forwards' common buffers ([`list::buffers`]: two stages each
/// of K, V and Q, the lists, the builder's scratch), the stats stage, `barrier_slots`
/// mbarriers and the TMEM address word.
pub fn smem_plan(barrier_slots: u32) -> Result<SmemPlan, PlanError> {
    let mut specs = list::buffers();
    specs.extend([
        BufferSpec::scalar(Buf::Stats, 2 * TILE_ROWS, 1),
        BufferSpec::barriers(barrier_slots),
        BufferSpec {
            id: Buf::TmemAddr,
            kind: BufKind::Scalar,
            stage_bytes: 4,
            stages: 1,
            align: 4,
        },
    ]);
    SmemPlan::layout(specs)
}

/// The GEMMs: `s` S = Q·Kᵀ (SS, both K-major) and `pv` O += P·V (TS, V MN-major) on the first
/// S stage, `s1` and `pv1` the same on the second (the kernel issues `s`/`pv` at the stage's
/// column offset; the second pair has the plan check the second stage's operands).
pub fn gemms(smem: &SmemPlan) -> Result<Vec<Gemm>, PlanError> {
    let g = |name, a, b, d| Gemm {
        name,
        a,
        b,
        d,
        m: TILE_ROWS,
        n: TILE_ROWS,
        k: TILE_ROWS,
    };
    Ok(vec![
        g(
            "s",
            AOperand::Smem(smem.view(Buf::Q, Major::K)?),
            smem.view(Buf::K, Major::K)?,
            TmemRegion::S,
        ),
        g(
            "pv",
            AOperand::Tmem(TmemRegion::P),
            smem.view(Buf::V, Major::MN)?,
            TmemRegion::O,
        ),
        g(
            "s1",
            AOperand::Smem(smem.view(Buf::Q, Major::K)?),
            smem.view(Buf::K, Major::K)?,
            TmemRegion::S1,
        ),
        g(
            "pv1",
            AOperand::Tmem(TmemRegion::P1),
            smem.view(Buf::V, Major::MN)?,
            TmemRegion::O,
        ),
    ])
}

/// The forward's whole plan, every part and every cross-part rule checked.
pub fn plan() -> Result<KernelPlan, PlanError> {
    let warps = WarpPlan::design()?;
    let pipes = PipelinePlan::new(pipelines(), &warps)?;
    let smem = smem_plan(pipes.barrier_slots())?;
    let gemms = gemms(&smem)?;
    KernelPlan::new(warps, tmem_plan()?, smem, pipes, barriers(), gemms)
}

/// The plan resolved for the roles, looked up and checked once.
struct Resolved<'a> {
    k: Placed,
    v: Placed,
    q: Placed,
    list: Placed,
    scratch: Placed,
    stats: Placed,
    barriers: u32,
    tmem_word: u32,
    alloc_cols: u32,
    col_s: u32,
    col_p: u32,
    col_o: u32,
    /// Columns from one S/P stage to the next.
    s_stride: u32,
    plan: &'a KernelPlan,
    g_s: &'a Gemm,
    g_pv: &'a Gemm,
    kv: Pipe<'a>,
    qp: Pipe<'a>,
    lst: Pipe<'a>,
    s: Pipe<'a>,
    p: Pipe<'a>,
    o: Pipe<'a>,
    st: Pipe<'a>,
    nb_alloc: &'a NamedBarrier,
    nb_list: &'a NamedBarrier,
    nb_dealloc: &'a NamedBarrier,
    layout: Sm100Layout,
}

/// Looks up everything [`Resolved`] holds; the error names what is missing or the rule broken.
fn resolve(plan: &KernelPlan) -> Result<Resolved<'_>, String> {
    let smem = plan.smem();
    let buf = |id| smem.buffer(id).copied().map_err(|e| e.to_string());
    let col = |id| {
        plan.tmem()
            .region(id)
            .map(|r| r.col)
            .map_err(|e| e.to_string())
    };
    let gemm = |name| {
        plan.gemm(name)
            .ok_or(format!("the plan has no GEMM `{name}`"))
    };
    let pipe = |name| plan.pipelines().get(name).map_err(|e| e.to_string());
    let nb = |name| {
        plan.barrier(name)
            .ok_or(format!("the plan has no named barrier `{name}`"))
    };
    // The compute warps read their S lanes, the epilogue's their O lanes (thread = lane).
    let layout = Sm100Layout::resolve(plan.warps(), plan.tmem(), &[Role::Compute, Role::Reduce])?;
    let (s0, s1) = (col(TmemRegion::S)?, col(TmemRegion::S1)?);
    let (p0, p1) = (col(TmemRegion::P)?, col(TmemRegion::P1)?);
    if s1 <= s0 || s1 - s0 != p1.wrapping_sub(p0) {
        return Err(format!(
            "the second S/P stage (S1 at {s1}, P1 at {p1}) must be the first (S at {s0}, P at \
             {p0}) shifted by one stride"
        ));
    }
    let stages = plan
        .pipelines()
        .get("s")
        .map_err(|e| e.to_string())?
        .pipeline
        .stages;
    if stages != 2 {
        return Err(format!(
            "pipeline `s` has {stages} stages; TMEM holds 2 S/P stages"
        ));
    }
    for (a, b) in [("s", "s1"), ("pv", "pv1")] {
        let (a, b) = (gemm(a)?, gemm(b)?);
        if a.instr_desc().map_err(|e| e.to_string())?
            != b.instr_desc().map_err(|e| e.to_string())?
        {
            return Err(format!(
                "GEMMs `{}` and `{}` differ in shape; one stage's code issues both",
                a.name, b.name
            ));
        }
    }
    let o = plan
        .tmem()
        .region(TmemRegion::O)
        .map_err(|e| e.to_string())?;
    if o.cols != TILE_ROWS {
        return Err(format!(
            "TMEM region O has {} columns; the epilogue reads 128 (the head dim)",
            o.cols
        ));
    }
    Ok(Resolved {
        k: buf(Buf::K)?,
        v: buf(Buf::V)?,
        q: buf(Buf::Q)?,
        list: buf(Buf::List)?,
        scratch: buf(Buf::ListScratch)?,
        stats: buf(Buf::Stats)?,
        barriers: buf(Buf::Barriers)?.offset,
        tmem_word: buf(Buf::TmemAddr)?.offset,
        alloc_cols: plan.tmem().alloc_cols(),
        col_s: col(TmemRegion::S)?,
        col_p: col(TmemRegion::P)?,
        col_o: col(TmemRegion::O)?,
        s_stride: s1 - s0,
        plan,
        g_s: gemm("s")?,
        g_pv: gemm("pv")?,
        kv: pipe("kv")?,
        qp: pipe("q")?,
        lst: pipe("list")?,
        s: pipe("s")?,
        p: pipe("p")?,
        o: pipe("o")?,
        st: pipe("stats")?,
        nb_alloc: nb("tmem_alloc")?,
        nb_list: nb("list_warp")?,
        nb_dealloc: nb("tmem_dealloc")?,
        layout,
    })
}

// ---- the kernel --------------------------------------------------------------------------

/// What every role reads.
struct Ctx<'a> {
    r: &'a Resolved<'a>,
    p: &'a ForwardParams,
    base: Reg<U32>,
    bars: Barriers,
    tid: Reg<U32>,
    warp: Reg<U32>,
    items: Items,
}

fn umma_commit(b: &mut KernelBuilder, bar: &SharedAddr) {
    b.tcgen05_commit(bar);
}

fn describe(b: &mut KernelBuilder) {
    describe_with(b, plan());
}

/// Describes the kernel on `plan`: a plan that breaks a rule, or lacks something a role
/// needs, is reported as a build error naming it.
pub fn describe_with(b: &mut KernelBuilder, plan: Result<KernelPlan, PlanError>) {
    b.grid("[min(4*ceil(T/8), num_sms), 1, 1]");
    // With `.maxntid 512` this fixes the entry register count at 128, so ptxas applies
    // `setmaxnreg`.
    b.min_ctas_per_sm(1);
    let p = forward_params(b);
    let plan = match plan {
        Ok(plan) => plan,
        Err(e) => return b.error(format!("SM100 forward plan: {e}")),
    };
    let r = match resolve(&plan) {
        Ok(r) => r,
        Err(e) => return b.error(format!("SM100 forward plan: {e}")),
    };
    let total = plan.smem().total();
    let bytes = total + ALIGN_SLACK;
    if bytes > MAX_SHARED_BYTES {
        return b.error(format!(
            "SM100 forward plan: {total} B of shared memory and {ALIGN_SLACK} B of alignment \
             slack exceed {MAX_SHARED_BYTES} B"
        ));
    }
    let smem = b.dynamic_shared("smem", bytes, 1024);
    let (_, base) = common::swizzle_aligned_base(b, &smem);
    let tid = b.sreg(SReg::TidX);
    let warp = b.shr(tid, 5u32);
    let bars = Barriers {
        base: b.add(base, r.barriers),
        umma_commit,
    };
    b.comment("thread 0 initialises every pipeline barrier");
    let leader = b.setp(Cmp::Eq, tid, 0u32);
    b.if_then(leader, "init", |b| plan.pipelines().emit_init(b, &bars));
    b.bar_sync(0, None);
    let items = items(b, &p);
    let ctx = Ctx {
        r: &r,
        p: &p,
        base,
        bars,
        tid,
        warp,
        items,
    };

    r.layout.dispatch(
        b,
        plan.warps(),
        warp,
        Sm100Roles {
            compute: |b: &mut KernelBuilder| compute(b, &ctx),
            reduce: ("epilogue", |b: &mut KernelBuilder| epilogue(b, &ctx)),
            mma: |b: &mut KernelBuilder| mma(b, &ctx),
            load: |b: &mut KernelBuilder| load(b, &ctx),
            scalar: ("list", |b: &mut KernelBuilder| list_builder(b, &ctx)),
        },
    );
}

/// Reads the TMEM base address after the allocation hand-off.
fn tmem_base(b: &mut KernelBuilder, ctx: &Ctx) -> Reg<U32> {
    ctx.r.nb_alloc.sync(b);
    b.tcgen05_fence_after_thread_sync();
    b.ld::<U32, _>(&shared(ctx.base, ctx.r.tmem_word as i64))
}

/// The TMEM address (lane in bits 16–31) of this warp's lane quadrant.
fn quadrant(b: &mut KernelBuilder, tbase: Reg<U32>, warp: Reg<U32>) -> Reg<U32> {
    let q = b.and(warp, 3u32);
    let q = b.shl(q, 21u32);
    b.add(tbase, q)
}

/// `base + stage·stride` columns, as a TMEM address.
fn staged(b: &mut KernelBuilder, base: Reg<U32>, stage: Reg<U32>, stride: u32) -> TmemAddr {
    let a = b.mad_lo(stage, stride, base);
    TmemAddr::new(b.bitcast::<B32, U32>(a))
}

/// The list of item `k` in stage `index`: `(address, entry count)`.
fn list_at(b: &mut KernelBuilder, ctx: &Ctx, index: Reg<U32>) -> (Reg<U32>, Reg<U32>) {
    let lb = ctx.r.list.emit_stage_addr(b, ctx.base, index);
    let count = b.ld::<U32, _>(&shared(lb, list::COUNT as i64));
    (lb, count)
}

// ---- list warp ---------------------------------------------------------------------------

fn list_builder(b: &mut KernelBuilder, ctx: &Ctx) {
    let r = ctx.r;
    list::warp(
        b,
        ctx.p,
        &ctx.items,
        &r.lst,
        &ctx.bars,
        (&r.list, &r.scratch),
        (ctx.base, ctx.tid),
        &|b| r.nb_list.sync(b),
    );
}

// ---- load warp ---------------------------------------------------------------------------

fn load(b: &mut KernelBuilder, ctx: &Ctx) {
    let r = ctx.r;
    let bars = &ctx.bars;
    let p = ctx.p;
    let lane = b.and(ctx.tid, 31u32);
    let lead = b.setp(Cmp::Eq, lane, 0u32);
    let tq = b.tensor_map_addr(&p.tmap_q);
    let tk = b.tensor_map_addr(&p.tmap_k);
    let tv = b.tensor_map_addr(&p.tmap_v);
    let it = b.mov::<U32>(0u32);
    b.for_range(0u32, ctx.items.count, 1, "load_item", |b, k| {
        let item = ctx.items.item(b, k);
        let g = b.and(item, 3u32);
        let lst = r.lst.consumer_wait(b, bars, k);
        let (lb, count) = list_at(b, ctx, lst.index);
        b.if_then(lead, "load_lane", |b| {
            let qst = r.qp.producer_acquire(b, bars, k);
            let q_tile = r.q.emit_stage_addr(b, ctx.base, qst.index);
            let head16 = b.shl(g, 4u32);
            let head16 = b.bitcast::<S32, U32>(head16);
            b.comment("Q: per slot 16 heads x 64 d per d-half; a -1 row is zero-filled");
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
            b.for_range(0u32, count, 1, "load_block", |b, e| {
                let e4 = b.shl(e, 2u32);
                let at = b.add(lb, e4);
                let gb = b.ld::<U32, _>(&shared(at, list::GB as i64));
                let st = r.kv.producer_acquire(b, bars, it);
                let k_tile = r.k.emit_stage_addr(b, ctx.base, st.index);
                let v_tile = r.v.emit_stage_addr(b, ctx.base, st.index);
                let tiles = [shared(k_tile, 0), shared(v_tile, 0)];
                common::load_kv_tiles(b, [tk, tv], tiles, &[g, g, gb, gb], &st.full, None);
                bump(b, it);
            });
        });
        r.lst.consumer_release(b, bars, &lst);
    });
}

// ---- MMA warp ----------------------------------------------------------------------------

fn mma(b: &mut KernelBuilder, ctx: &Ctx) {
    let r = ctx.r;
    let bars = &ctx.bars;
    let tbase = tmem_base(b, ctx);
    let tm = TmemAddr::new(b.bitcast::<B32, U32>(tbase));
    let mmas = MmaIssuer::new(b, r.plan);
    let elect = mmas.elect;
    let it = b.mov::<U32>(0u32);
    // S = Q·Kᵀ of block `at` (a CTA-wide block count) into its S stage: K/V loaded, the stage
    // released by compute (which waited for the P·V that read its P), then commit S.
    let issue_s = |b: &mut KernelBuilder, at: Reg<U32>, q_addr: Reg<U32>| {
        let kv = r.kv.consumer_wait(b, bars, at);
        let k_addr = r.k.emit_stage_addr(b, ctx.base, kv.index);
        let s_st = r.s.producer_acquire(b, bars, at);
        b.tcgen05_fence_after_thread_sync();
        let d_tm = staged(b, tbase, s_st.index, r.s_stride);
        b.comment("S = Q*K^T into the block's S stage");
        mmas.issue(b, r.g_s, (MmaA::Smem(q_addr), k_addr), d_tm, mmas.never);
        b.predicated(elect, false, |b| r.s.producer_commit(b, bars, &s_st));
    };
    b.for_range(0u32, ctx.items.count, 1, "mma_item", |b, k| {
        let lst = r.lst.consumer_wait(b, bars, k);
        let (_, count) = list_at(b, ctx, lst.index);
        r.lst.consumer_release(b, bars, &lst);
        let qst = r.qp.consumer_wait(b, bars, k);
        let q_addr = r.q.emit_stage_addr(b, ctx.base, qst.index);
        let some = b.setp(Cmp::Ne, count, 0u32);
        b.if_then(some, "s_first", |b| issue_s(b, it, q_addr));
        b.for_range(0u32, count, 1, "mma_block", |b, e| {
            b.comment("the next block's S overlaps this block's softmax");
            let e1 = b.add(e, 1u32);
            let more = b.setp(Cmp::Lt, e1, count);
            b.if_then(more, "s_next", |b| {
                let next = b.add(it, 1u32);
                issue_s(b, next, q_addr);
            });
            let p_st = r.p.consumer_wait(b, bars, it);
            let first = b.setp(Cmp::Eq, e, 0u32);
            b.if_then(first, "o_acquire", |b| {
                b.comment("the item's first P*V overwrites O: the epilogue has drained it");
                r.o.producer_acquire(b, bars, k);
            });
            b.tcgen05_fence_after_thread_sync();
            let kv = r.kv.locate(b, bars, it.into());
            let v_addr = r.v.emit_stage_addr(b, ctx.base, kv.index);
            let s_st = r.s.locate(b, bars, it.into());
            let a_tm = staged(b, tbase, s_st.index, r.s_stride);
            b.comment("O (+)= P*V, overwriting at the item's first block");
            let later = b.setp(Cmp::Ne, e, 0u32);
            mmas.issue(b, r.g_pv, (MmaA::Tmem(a_tm), v_addr), tm, later);
            b.predicated(elect, false, |b| {
                r.p.consumer_release(b, bars, &p_st);
                r.kv.consumer_release(b, bars, &kv);
            });
            bump(b, it);
        });
        let empty = b.setp(Cmp::Eq, count, 0u32);
        b.if_then(empty, "o_acquire_empty", |b| {
            r.o.producer_acquire(b, bars, k);
        });
        b.comment("O of the item (an empty list commits nothing pending: it arrives at once)");
        let ost = r.o.locate(b, bars, k.into());
        b.predicated(elect, false, |b| {
            r.o.producer_commit(b, bars, &ost);
            r.qp.consumer_release(b, bars, &qst);
        });
    });
}

// ---- compute warps -----------------------------------------------------------------------

fn compute(b: &mut KernelBuilder, ctx: &Ctx) {
    let r = ctx.r;
    let bars = &ctx.bars;
    b.comment("the first compute warp allocates TMEM and hands the address over");
    let tmem_word = shared(ctx.base, r.tmem_word as i64);
    let is_alloc = b.setp(Cmp::Eq, ctx.warp, 4 * r.layout.compute_wg);
    b.if_then(is_alloc, "tmem_alloc", |b| {
        b.tcgen05_alloc(&tmem_word, r.alloc_cols);
        b.tcgen05_relinquish_alloc_permit();
    });
    b.tcgen05_fence_before_thread_sync();
    let tbase = tmem_base(b, ctx);
    let qbase = quadrant(b, tbase, ctx.warp);
    let tm = TmemAddr::new(b.bitcast::<B32, U32>(qbase));
    let row = b.and(ctx.tid, 127u32);
    let slot = b.shr(row, 4u32);
    let slot4 = b.shl(slot, 2u32);
    let row4 = b.shl(row, 2u32);
    let neg_inf = f32::NEG_INFINITY;
    let m = b.reg::<F32>();
    let l = b.reg::<F32>();
    let it = b.mov::<U32>(0u32);

    b.for_range(0u32, ctx.items.count, 1, "compute_item", |b, k| {
        let lst = r.lst.consumer_wait(b, bars, k);
        let (lb, count) = list_at(b, ctx, lst.index);
        let sat = b.add(lb, slot4);
        let qpos = b.ld::<S32, _>(&shared(sat, list::QPOS as i64));
        b.set(m, neg_inf);
        b.set(l, 0.0f32);
        b.for_range(0u32, count, 1, "compute_block", |b, e| {
            let e4 = b.shl(e, 2u32);
            let at = b.add(lb, e4);
            let gb = b.ld::<U32, _>(&shared(at, list::GB as i64));
            let mask = b.ld::<U32, _>(&shared(at, list::MASK as i64));
            let bits = b.shr(mask, slot);
            let bits = b.and(bits, 1u32);
            let chose = b.setp(Cmp::Ne, bits, 0u32);
            let qpos_eff = b.selp(qpos, -1i32, chose);
            // Key n of the block is seen iff qpos_eff - 128·gb >= n.
            let key0 = b.shl(gb, 7u32);
            let key0 = b.bitcast::<S32, U32>(key0);
            let limit = b.sub(qpos_eff, key0);
            let masked = |b: &mut KernelBuilder, s: Reg<F32>, n: u32| {
                let seen = b.setp(Cmp::Ge, limit, n as i32);
                let x = b.fmul(s, common::SCALE_LOG2E);
                b.selp(x, neg_inf, seen)
            };
            let s_st = r.s.consumer_wait(b, bars, it);
            b.tcgen05_fence_after_thread_sync();
            let stm = staged(b, qbase, s_st.index, r.s_stride);
            b.comment("pass 1: the row max of the masked, scaled scores");
            let mut mx: Option<Reg<F32>> = None;
            for c in 0..TILE_ROWS / CHUNK {
                let s: [Reg<F32>; 32] = b.tcgen05_ld_32x32b(stm.col(r.col_s + CHUNK * c));
                b.tcgen05_wait_ld();
                for (i, &si) in s.iter().enumerate() {
                    let x = masked(b, si, CHUNK * c + i as u32);
                    mx = Some(match mx {
                        None => x,
                        Some(v) => b.max(v, x),
                    });
                }
            }
            let mx = mx.expect("128 scores");
            let m_new = b.max(m, mx);
            let empty = b.setp(Cmp::Eq, m_new, neg_inf);
            let mu = b.selp(0.0f32, m_new, empty);
            let diff = b.sub(m, mu);
            let alpha = b.ex2_approx(diff);

            let p_st = r.p.producer_acquire(b, bars, it);
            b.tcgen05_fence_after_thread_sync();
            let any = b.setp(Cmp::Ne, it, 0u32);
            b.if_then(any, "s_release", |b| {
                b.comment("the previous P*V completed: its S/P stage is free for the S after next");
                let prev = b.sub(it, 1u32);
                let st = r.s.locate(b, bars, prev.into());
                b.tcgen05_fence_before_thread_sync();
                r.s.consumer_release(b, bars, &st);
            });
            let later = b.setp(Cmp::Ne, e, 0u32);
            b.if_then(later, "rescale", |b| {
                b.comment("the previous P*V is complete: O *= exp2(m_old - m_new)");
                for c in 0..TILE_ROWS / CHUNK {
                    let o: [Reg<F32>; 32] = b.tcgen05_ld_32x32b(tm.col(r.col_o + CHUNK * c));
                    b.tcgen05_wait_ld();
                    let o: [Reg<F32>; 32] = std::array::from_fn(|i| b.fmul(o[i], alpha));
                    b.tcgen05_st_32x32b(tm.col(r.col_o + CHUNK * c), o);
                }
            });
            b.comment("pass 2: P = exp2(x - m) as packed bf16 over S (chunk c's S is read first)");
            let mut sum: Option<Reg<F32>> = None;
            for c in 0..TILE_ROWS / CHUNK {
                let s: [Reg<F32>; 32] = b.tcgen05_ld_32x32b(stm.col(r.col_s + CHUNK * c));
                b.tcgen05_wait_ld();
                let mut pv = Vec::with_capacity(32);
                for (i, &si) in s.iter().enumerate() {
                    let x = masked(b, si, CHUNK * c + i as u32);
                    let d = b.sub(x, mu);
                    let pe = b.ex2_approx(d);
                    sum = Some(match sum {
                        None => pe,
                        Some(v) => b.add(v, pe),
                    });
                    pv.push(pe);
                }
                // Key 2j in the low half, 2j+1 in the high half of packed word j.
                let packed: [Reg<Bf16x2>; 16] =
                    std::array::from_fn(|j| b.cvt_bf16x2(pv[2 * j + 1], pv[2 * j]));
                b.tcgen05_st_32x32b(stm.col(r.col_p + CHUNK / 2 * c), packed);
            }
            let sum = sum.expect("128 probabilities");
            b.tcgen05_wait_st();
            b.tcgen05_fence_before_thread_sync();
            r.p.producer_commit(b, bars, &p_st);
            let nl = b.fma(l, alpha, sum);
            b.set(l, nl);
            b.set(m, m_new);
            bump(b, it);
        });
        b.comment("the item's row max and sum to the epilogue");
        let st = r.st.producer_acquire(b, bars, k);
        let sa = r.stats.emit_stage_addr(b, ctx.base, st.index);
        let sa = b.add(sa, row4);
        b.st(&shared(sa, 0), m);
        b.st(&shared(sa, (4 * TILE_ROWS) as i64), l);
        r.st.producer_commit(b, bars, &st);
        r.lst.consumer_release(b, bars, &lst);
    });

    b.comment("every TMEM access of compute and the epilogue is done (the MMAs: the epilogue waited their commit)");
    b.tcgen05_fence_before_thread_sync();
    r.nb_dealloc.sync(b);
    b.if_then(is_alloc, "tmem_dealloc", |b| {
        b.tcgen05_fence_after_thread_sync();
        let t = b.bitcast::<B32, U32>(tbase);
        b.tcgen05_dealloc(t, r.alloc_cols);
    });
}

// ---- epilogue warps ----------------------------------------------------------------------

fn epilogue(b: &mut KernelBuilder, ctx: &Ctx) {
    let r = ctx.r;
    let bars = &ctx.bars;
    let p = ctx.p;
    let tbase = tmem_base(b, ctx);
    let qbase = quadrant(b, tbase, ctx.warp);
    let tm = TmemAddr::new(b.bitcast::<B32, U32>(qbase));
    let row = b.and(ctx.tid, 127u32);
    let slot = b.shr(row, 4u32);
    let slot4 = b.shl(slot, 2u32);
    let head = b.and(row, 15u32);
    let row4 = b.shl(row, 2u32);
    let neg_inf = f32::NEG_INFINITY;
    b.for_range(0u32, ctx.items.count, 1, "epilogue_item", |b, k| {
        let item = ctx.items.item(b, k);
        let g = b.and(item, 3u32);
        let lst = r.lst.consumer_wait(b, bars, k);
        let (lb, count) = list_at(b, ctx, lst.index);
        let sat = b.add(lb, slot4);
        let qrow = b.ld::<S32, _>(&shared(sat, list::QROW as i64));
        r.lst.consumer_release(b, bars, &lst);
        let st = r.st.consumer_wait(b, bars, k);
        let sa = r.stats.emit_stage_addr(b, ctx.base, st.index);
        let sa = b.add(sa, row4);
        let m = b.ld::<F32, _>(&shared(sa, 0));
        let l = b.ld::<F32, _>(&shared(sa, (4 * TILE_ROWS) as i64));
        r.st.consumer_release(b, bars, &st);

        let some = b.setp(Cmp::Gt, l, 0.0f32);
        let rl = b.rcp_rn(l);
        let inv = b.selp(rl, 0.0f32, some);
        let lg = b.lg2_approx(l);
        let lse2 = b.add(m, lg);
        let lse = b.fmul(lse2, LN2);
        let lse = b.selp(lse, neg_inf, some);
        let live = b.setp(Cmp::Ge, qrow, 0i32);
        let qrow_u = b.bitcast::<U32, S32>(qrow);
        let g16 = b.shl(g, 4u32);
        let h = b.add(head, g16);
        let orow = b.mad_lo(qrow_u, 64u32, h);
        let out = b.ld_param_ptr(&p.out);
        let off = b.mul_wide(orow, 256u32);
        let out_at = global(b.add(out, off), 0);

        let ost = r.o.consumer_wait(b, bars, k);
        b.tcgen05_fence_after_thread_sync();
        let has = b.setp(Cmp::Ne, count, 0u32);
        let l_o = b.label("epilogue_zero");
        let l_done = b.label("epilogue_stored");
        b.bra_unless(has, &l_o);
        b.comment("out = O/l as bf16: 256 contiguous bytes per row");
        for c in 0..TILE_ROWS / CHUNK {
            let o: [Reg<F32>; 32] = b.tcgen05_ld_32x32b(tm.col(r.col_o + CHUNK * c));
            b.tcgen05_wait_ld();
            let w: [Reg<Bf16x2>; 16] = std::array::from_fn(|j| {
                let lo = b.fmul(o[2 * j], inv);
                let hi = b.fmul(o[2 * j + 1], inv);
                let lo = b.selp(lo, 0.0f32, some);
                let hi = b.selp(hi, 0.0f32, some);
                b.cvt_bf16x2(hi, lo)
            });
            b.predicated(live, false, |b| {
                for q in 0..4usize {
                    let v = [0, 1, 2, 3].map(|i| w[4 * q + i]);
                    b.st_v(&out_at.offset((64 * c as usize + 16 * q) as i64), v);
                }
            });
        }
        b.bra(&l_done);
        b.place(&l_o);
        b.comment("an empty list: O was never written, out = 0");
        let z = b.mov::<U32>(0u32);
        b.predicated(live, false, |b| {
            for q in 0..16i64 {
                b.st_v(&out_at.offset(16 * q), [z, z, z, z]);
            }
        });
        b.place(&l_done);
        b.tcgen05_fence_before_thread_sync();
        r.o.consumer_release(b, bars, &ost);
        b.predicated(live, false, |b| {
            let lse_p = b.ld_param_ptr(&p.lse);
            let a = common::elem::<F32>(b, lse_p, orow);
            b.st(&a, lse);
        });
    });
    b.tcgen05_fence_before_thread_sync();
    r.nb_dealloc.sync(b);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(plan: Result<KernelPlan, PlanError>) -> Result<Kernel, String> {
        let mut b = KernelBuilder::new(DESC.name, Target::Sm100a, DESC.threads);
        describe_with(&mut b, plan);
        b.finish().map_err(|e| e.to_string())
    }

    /// The design plan with the TMEM `regions` (`(id, first column, columns)`) and `aliases`
    /// instead of the design's.
    fn plan_with_tmem(
        regions: &[(TmemRegion, u32, u32)],
        aliases: Vec<(TmemRegion, TmemRegion)>,
    ) -> Result<KernelPlan, PlanError> {
        let regions = regions
            .iter()
            .map(|&(id, col, cols)| Region { id, col, cols })
            .collect();
        let tmem = TmemPlan::new(512, regions, aliases).unwrap();
        let warps = WarpPlan::design().unwrap();
        let pipes = PipelinePlan::new(pipelines(), &warps).unwrap();
        let smem = smem_plan(pipes.barrier_slots()).unwrap();
        let g = gemms(&smem).unwrap();
        KernelPlan::new(warps, tmem, smem, pipes, barriers(), g)
    }

    #[test]
    fn the_design_plan_builds() {
        let plan = plan().unwrap();
        assert_eq!(
            plan.pipelines().barrier_slots(),
            2 * (2 + 2 + 2 + 2 + 1 + 1 + 1)
        );
        assert!(plan.smem().total() + ALIGN_SLACK <= MAX_SHARED_BYTES);
        build(Ok(plan)).unwrap();
    }

    #[test]
    fn an_o_region_narrower_than_pv_is_rejected() {
        use TmemRegion::*;
        let e = plan_with_tmem(
            &[
                (S, 0, 128),
                (P, 0, 64),
                (S1, 128, 128),
                (P1, 128, 64),
                (O, 256, 64),
            ],
            vec![(P, S), (P1, S1)],
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "GEMM `pv`: operand D needs 128 TMEM columns but region O has 64"
        );
        let e = build(Err(e)).unwrap_err();
        assert!(e.contains("SM100 forward plan: GEMM `pv`"), "{e}");
    }

    #[test]
    fn p1_over_o_is_rejected() {
        // The second stage's P placed over O: its TS MMA would read A from the accumulator it
        // writes.
        use TmemRegion::*;
        let e = plan_with_tmem(
            &[
                (S, 0, 128),
                (P, 0, 64),
                (S1, 128, 128),
                (O, 256, 128),
                (P1, 256, 64),
            ],
            vec![(P, S), (P1, O)],
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "GEMM `pv1` reads A from TMEM region P1, which shares columns with its D region O"
        );
    }

    #[test]
    fn a_plan_without_a_pipeline_a_role_needs_fails_the_build() {
        let warps = WarpPlan::design().unwrap();
        let mut ps = pipelines();
        ps.retain(|p| p.name != "stats");
        let pipes = PipelinePlan::new(ps, &warps).unwrap();
        let smem = smem_plan(pipes.barrier_slots()).unwrap();
        let g = gemms(&smem).unwrap();
        let plan = KernelPlan::new(warps, tmem_plan().unwrap(), smem, pipes, barriers(), g);
        let e = build(plan).unwrap_err();
        assert!(
            e.contains("SM100 forward plan: pipeline `stats` is not in the pipeline plan"),
            "{e}"
        );
    }

    #[test]
    fn a_second_stage_not_shifted_like_the_first_fails_the_build() {
        // S1 at 128 but P1 at 192: one stride cannot address both.
        use TmemRegion::*;
        let plan = plan_with_tmem(
            &[
                (S, 0, 128),
                (P, 0, 64),
                (S1, 128, 128),
                (P1, 192, 64),
                (O, 256, 128),
            ],
            vec![(P, S), (P1, S1)],
        );
        let e = build(plan).unwrap_err();
        assert!(
            e.contains("(S1 at 128, P1 at 192) must be the first"),
            "{e}"
        );
    }

    #[test]
    fn a_list_pipeline_counting_warps_of_other_roles_is_rejected() {
        // 288 consumer arrivals: neither one per consumer warp (10) nor one per thread (320).
        let warps = WarpPlan::design().unwrap();
        let mut ps = pipelines();
        for p in &mut ps {
            if p.name == "list" {
                p.consumer_arrivals = 288;
            }
        }
        let e = PipelinePlan::new(ps, &warps).unwrap_err();
        assert!(
            e.to_string()
                .contains("pipeline `list`: 288 consumer arrivals"),
            "{e}"
        );
    }
}
