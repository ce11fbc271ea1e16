//! `msa_backward_sm100`: the main backward kernel for Blackwell (sm_100a).
//!
//! # Design
//! The same work as [`super::backward_sm90`] — the CTA walk over task rows from the
//! descriptor, buckets `(index_head, kblock)` and segments of consecutive rows of one bucket,
//! one 128×128 tile per task row (128 keys × 8 query slots · 16 heads, head dim 128) — with
//! the tensor-core work moved to `tcgen05` and tensor memory (`docs/design.md` §3.3–§3.5). Every
//! resource comes from the typed plans of [`crate::plan`]: warp roles and `setmaxnreg`
//! values, the TMEM regions, the shared-memory offsets, the mbarrier pipelines with their
//! generated parity bookkeeping, the named barriers, and the GEMM, instruction and
//! shared-memory descriptors.
//!
//! - **Warps** (512 threads, one CTA per SM). Warpgroup 0 idles. Warps 4–7 *compute*: thread
//!   = TMEM lane = key row; warp 4 allocates all 512 TMEM columns, relinquishes the permit and
//!   hands the address to compute, reduce and MMA over named barrier 1, and frees TMEM after
//!   named barrier 6. Warps 8–11 *reduce*. Warp 12 issues every MMA, warp 13 every TMA load,
//!   warp 14 gathers the per-row scalars; warp 15 idles.
//! - **Scalar warp**: per task, `sLSE = −lse·log2e` (−∞ for an invalid slot), `sDelta`,
//!   `sQRows`, `sQPos` into the row stage (lane = slot·4 + part fills 4 folded rows).
//! - **Load warp**: K/V (two 64-d boxes each) once per segment; per task 32 Q/dO boxes of one
//!   query row's 16 heads × 64 d; a −1 row is out of bounds and zero-filled.
//! - **MMA warp** (one lane picked by `elect.sync` issues every `tcgen05.mma` and every
//!   `tcgen05.commit`): per task `S^T = K·Q^T` (commit S), after reduce's `t2r_dQ_done`
//!   `dP^T = V·dO^T` (commit dP), then per chunk stage `dV += P^T·dO` and `dK += dS^T·Q` with
//!   A from TMEM (overwriting at a segment's first task), release Q/dO, wait for that
//!   release (see [`MmaOrder`]: the next MMA overwrites columns the previous ones read, and
//!   the ISA orders MMAs only on one accumulator), `dQ^T = K^T·dS^T` over the dP columns
//!   (commit dQ), release the chunk stages; at a segment's end release K/V and commit dK/dV.
//! - **Compute warps**: per 32-column chunk, `tcgen05.ld` S, `P = exp2(S·scale·log2e +
//!   sLSE)` under the causal predicate `qpos ≥ kb·128 + key` (workspace coordinates),
//!   `tcgen05.ld` dP, `dS = P·(dP − Delta)·scale`; P and dS go to TMEM as packed bf16 (P over
//!   S, dS over dP: the A operands of dV and dK) and dS to `sPdS` (the B operand of dQ^T),
//!   published per chunk stage after `tcgen05.wait::st` and `fence.proxy.async.shared::cta`.
//! - **Reduce warps**: per task, `tcgen05.ld` dQ^T (lane = head dim), pack head pairs to
//!   bf16x2, arrive `t2r_dQ_done` and release dQ, then `red.add.bf16x2` with an evict_last
//!   policy into the head-pair-interleaved pool. At a segment's end, dV then dK: a 4×4
//!   in-quad transpose gives each lane 4 consecutive head dims of one key row, flushed with
//!   `red.global.add.v4.f32` into the fp32 pools.
//!
//! Shared memory: the plan's layout needs 231,748 B. The kernel requests the per-CTA maximum
//! (232,448 B) and aligns the dynamic base up to 1024 B at run time; the 700 B of slack cover
//! any base offset up to 700 B, and a base needing more traps instead of corrupting memory
//! (the `.align 1024` declaration makes the offset 0 in practice).

use super::common::{self, bump, MainParams, Walk};
use super::fixed_point;
use super::sm100::{MmaA, MmaIssuer, Sm100Layout, Sm100Roles};
use super::KernelDesc;
use crate::plan::gemm::Gemm;
use crate::plan::pipeline::{Barriers, ChunkGroups, Cursor, NamedBarrier, Pipe, Stage};
use crate::plan::roles::Role;
use crate::plan::smem::{Buf, Placed, PANEL_BYTES};
use crate::plan::tmem::TmemRegion;
use crate::plan::KernelPlan;
use crate::ptx::tcgen05::TmemAddr;
use crate::ptx::*;
use crate::target::Target;

/// Threads per CTA: 16 warps.
pub const THREADS: u32 = crate::plan::roles::THREADS;
/// Dynamic shared memory requested: the per-CTA maximum, which leaves 700 B above the plan's
/// layout for aligning the base to 1024 B at run time.
pub const SMEM_BYTES: u32 = MAX_SHARED_BYTES;

/// Folded columns of one compute chunk (one `tcgen05.ld.32x32b.x32`).
const CHUNK_COLS: u32 = 32;
/// Heads per query slot: folded column `n = slot·16 + h`.
const HEADS_PER_SLOT: u32 = 16;

/// The Blackwell main kernel.
pub const DESC: KernelDesc = KernelDesc {
    name: "msa_backward_sm100",
    about: "MSA backward main kernel for Blackwell: warp-specialised tcgen05 GEMMs with TMEM \
            accumulators, TMA + mbarrier pipelines",
    targets: &[Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe,
};

/// The Blackwell main kernel of the deterministic mode: fixed-point integer reductions
/// (`fixed_point`, `docs/design.md` §3.8), otherwise the same kernel.
pub const DETERMINISTIC: KernelDesc = KernelDesc {
    name: "msa_backward_sm100_det",
    about: "msa_backward_sm100 with fixed-point integer reductions of dQ, dK and dV (bitwise reproducible)",
    targets: &[Target::Sm100a],
    threads: (THREADS, 1, 1),
    describe: describe_deterministic,
};

/// The plan resolved for the roles: every buffer, TMEM column, GEMM, pipeline, named barrier
/// and warp a role names, looked up and checked once by [`resolve`] instead of in every role.
struct Resolved<'a> {
    k: Placed,
    v: Placed,
    q: Placed,
    d_o: Placed,
    pds: Placed,
    lse: Placed,
    delta: Placed,
    qrows: Placed,
    qpos: Placed,
    barriers: u32,
    tmem_word: u32,
    alloc_cols: u32,
    col_s: u32,
    col_p: u32,
    col_dp: u32,
    col_ds: u32,
    col_dq: u32,
    col_dv: u32,
    col_dk: u32,
    plan: &'a KernelPlan,
    g_s: &'a Gemm,
    g_dp: &'a Gemm,
    g_dv: &'a Gemm,
    g_dk: &'a Gemm,
    g_dq: &'a Gemm,
    kv: Pipe<'a>,
    q_do: Pipe<'a>,
    rows: Pipe<'a>,
    s: Pipe<'a>,
    dp: Pipe<'a>,
    dq: Pipe<'a>,
    dkv: Pipe<'a>,
    chunk: Pipe<'a>,
    groups: ChunkGroups,
    nb_alloc: &'a NamedBarrier,
    nb_reduce: &'a NamedBarrier,
    nb_t2r: &'a NamedBarrier,
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
    let chunk = pipe("chunk")?;
    let groups = chunk
        .pipeline
        .chunk_groups
        .clone()
        .ok_or("the chunk pipeline has no chunk groups")?;
    if groups.chunks * CHUNK_COLS != crate::plan::smem::TILE_ROWS {
        return Err(format!(
            "{} chunks of {CHUNK_COLS} columns do not cover a 128-column tile",
            groups.chunks
        ));
    }
    // The compute warps read their S^T/dP^T lanes and write dS^T (thread = lane).
    let layout = Sm100Layout::resolve(plan.warps(), plan.tmem(), &[Role::Compute])?;
    Ok(Resolved {
        k: buf(Buf::K)?,
        v: buf(Buf::V)?,
        q: buf(Buf::Q)?,
        d_o: buf(Buf::DO)?,
        pds: buf(Buf::PdS)?,
        lse: buf(Buf::Lse)?,
        delta: buf(Buf::Delta)?,
        qrows: buf(Buf::QRows)?,
        qpos: buf(Buf::QPos)?,
        barriers: buf(Buf::Barriers)?.offset,
        tmem_word: buf(Buf::TmemAddr)?.offset,
        alloc_cols: plan.tmem().alloc_cols(),
        col_s: col(TmemRegion::S)?,
        col_p: col(TmemRegion::P)?,
        col_dp: col(TmemRegion::DP)?,
        col_ds: col(TmemRegion::DS)?,
        col_dq: col(TmemRegion::DQ)?,
        col_dv: col(TmemRegion::DV)?,
        col_dk: col(TmemRegion::DK)?,
        plan,
        g_s: gemm("s_t")?,
        g_dp: gemm("dp_t")?,
        g_dv: gemm("dv")?,
        g_dk: gemm("dk")?,
        g_dq: gemm("dq_t")?,
        kv: pipe("kv")?,
        q_do: pipe("q_do")?,
        rows: pipe("rows")?,
        s: pipe("s")?,
        dp: pipe("dp")?,
        dq: pipe("dq")?,
        dkv: pipe("dkv")?,
        chunk,
        groups,
        nb_alloc: nb("tmem_alloc")?,
        nb_reduce: nb("reduce_sync")?,
        nb_t2r: nb("t2r_dq_done")?,
        nb_dealloc: nb("tmem_dealloc")?,
        layout,
    })
}

/// How the MMA warp orders `tcgen05.mma`s on different accumulators whose TMEM columns
/// overlap.
///
/// G5 (`dQ^T` into the dP/dS columns 128–255) overwrites the `dS^T` columns that the G4
/// MMAs (`dK`, another accumulator) read as their A operand, and the next task's G1 (`S^T`,
/// columns 0–127) overwrites the `P^T` columns the G3 MMAs (`dV`) read. The PTX ISA orders
/// `tcgen05.mma`s only on the same accumulator, so neither pair is ordered by the
/// specification; FlashAttention-4 and CUTLASS example 77 rely on issue order there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MmaOrder {
    /// Before G5 the MMA warp waits for the commit that releases the Q/dO stage, which
    /// arrives once every earlier MMA of the task (all G3 and G4) has completed; that also
    /// orders G3 before the next G1. Safe under the specification; it costs one drain of the
    /// tensor pipe per task before G5, not measured (no B200).
    Explicit,
    /// Issue order assumed, as FA4 and CUTLASS do: no wait. Faster by that drain if the
    /// hardware completes in issue order; the simulator reports it as a TMEM hazard.
    IssueOrder,
}

/// The order the generated kernel uses: the specification's, until a B200 measurement
/// shows the drain is costly and that issue order holds.
pub const MMA_ORDER: MmaOrder = MmaOrder::Explicit;

/// What every role reads.
struct Ctx<'a> {
    resolved: &'a Resolved<'a>,
    p: &'a MainParams,
    base: Reg<U32>,
    bars: Barriers,
    tid: Reg<U32>,
    warp: Reg<U32>,
    walk: Walk,
}

fn umma_commit(b: &mut KernelBuilder, bar: &SharedAddr) {
    b.tcgen05_commit(bar);
}

fn describe(b: &mut KernelBuilder) {
    describe_mode(b, false);
}

fn describe_deterministic(b: &mut KernelBuilder) {
    describe_mode(b, true);
}

fn describe_mode(b: &mut KernelBuilder, deterministic: bool) {
    b.grid("[grid_launch_bound(capacity, num_sms), 1, 1]");
    // With `.maxntid 512` this fixes the entry register count at 128, so ptxas applies
    // `setmaxnreg` (sm100-ptx.md §8).
    b.min_ctas_per_sm(1);
    let p = common::main_params(b, deterministic);
    let plan = match KernelPlan::design() {
        Ok(plan) => plan,
        Err(e) => return b.error(format!("SM100 plan: {e}")),
    };
    let resolved = match resolve(&plan) {
        Ok(resolved) => resolved,
        Err(e) => return b.error(format!("SM100 plan: {e}")),
    };
    let Some(base) = common::guarded_smem_base(b, plan.smem().total(), SMEM_BYTES) else {
        return;
    };
    let tid = b.sreg(SReg::TidX);
    let warp = b.shr(tid, 5u32);
    let bars = Barriers {
        base: b.add(base, resolved.barriers),
        umma_commit,
    };

    let (_, walk) = common::init_and_walk(b, tid, plan.pipelines(), &bars, &p.desc);
    let ctx = Ctx {
        resolved: &resolved,
        p: &p,
        base,
        bars,
        tid,
        warp,
        walk,
    };

    resolved.layout.dispatch(
        b,
        plan.warps(),
        warp,
        Sm100Roles {
            compute: |b: &mut KernelBuilder| compute(b, &ctx),
            reduce: ("reduce", |b: &mut KernelBuilder| reduce(b, &ctx)),
            mma: |b: &mut KernelBuilder| mma(b, &ctx),
            load: |b: &mut KernelBuilder| load(b, &ctx),
            scalar: ("scalar", |b: &mut KernelBuilder| scalar(b, &ctx)),
        },
    );
}

/// The cursor of chunk stage `stage` in round `round`.
fn round(b: &mut KernelBuilder, pipe: &Pipe, stage: u32, round: Reg<U32>) -> Cursor {
    pipe.round(stage, round).unwrap_or_else(|e| {
        b.error(e.to_string());
        Cursor::iter(round)
    })
}

/// Reads the TMEM base address after the allocation hand-off (named barrier 1).
fn tmem_base(b: &mut KernelBuilder, ctx: &Ctx) -> Reg<U32> {
    ctx.resolved.nb_alloc.sync(b);
    b.tcgen05_fence_after_thread_sync();
    b.ld::<U32, _>(&shared(ctx.base, ctx.resolved.tmem_word as i64))
}

/// The TMEM address of this warp's lane quadrant: base + (32·(warp % 4)) << 16.
fn quadrant(b: &mut KernelBuilder, tbase: Reg<U32>, warp: Reg<U32>) -> TmemAddr {
    let q = b.and(warp, 3u32);
    let q = b.shl(q, 21u32);
    let a = b.add(tbase, q);
    TmemAddr::new(b.bitcast::<B32, U32>(a))
}

// ---- compute warps ---------------------------------------------------------------------

fn compute(b: &mut KernelBuilder, ctx: &Ctx) {
    let resolved = ctx.resolved;
    let bars = &ctx.bars;
    b.comment("warp 4 allocates TMEM and hands the address over named barrier 1");
    let tmem_word = shared(ctx.base, resolved.tmem_word as i64);
    let is_alloc = b.setp(Cmp::Eq, ctx.warp, 4 * resolved.layout.compute_wg);
    b.if_then(is_alloc, "tmem_alloc", |b| {
        b.tcgen05_alloc(&tmem_word, resolved.alloc_cols);
        b.tcgen05_relinquish_alloc_permit();
    });
    b.tcgen05_fence_before_thread_sync();
    let tbase = tmem_base(b, ctx);
    let tm = quadrant(b, tbase, ctx.warp);
    let key = b.and(ctx.tid, 127u32);
    // sPdS row of this key: [key][64 folded] SW128 panels.
    let key_row = b.shl(key, 7u32);
    let pds_row = b.add(ctx.base, key_row);
    let pds_row = b.add(pds_row, resolved.pds.offset);
    let key7 = b.and(key, 7u32);
    let scale_log2e = common::SCALE_LOG2E;
    let t = b.mov::<U32>(0u32);

    b.for_range(ctx.walk.lo, ctx.walk.hi, 1, "compute_task", |b, row| {
        let m = common::task_meta(b, ctx.p, row);
        let key_pos = b.shl(m[2], 7u32);
        let key_pos = b.add(key_pos, key);
        let key_pos = b.bitcast::<S32, U32>(key_pos);
        let rows_st = resolved.rows.consumer_wait(b, bars, t);
        let lse_a = resolved.lse.emit_stage_addr(b, ctx.base, rows_st.index);
        let delta_a = resolved.delta.emit_stage_addr(b, ctx.base, rows_st.index);
        let qpos_a = resolved.qpos.emit_stage_addr(b, ctx.base, rows_st.index);
        b.comment("own every chunk stage of this tile (the previous tile's MMAs are done)");
        let chunk_st: Vec<Stage> = (0..resolved.chunk.pipeline.stages)
            .map(|s| {
                let at = round(b, &resolved.chunk, s, t);
                resolved.chunk.producer_acquire(b, bars, at)
            })
            .collect();
        let s_st = resolved.s.consumer_wait(b, bars, t);
        b.tcgen05_fence_after_thread_sync();
        let mut dp_st = None;
        for c in 0..resolved.groups.chunks {
            b.comment(&format!(
                "chunk {c}: folded columns {}..{}",
                32 * c,
                32 * c + 32
            ));
            let s: [Reg<F32>; 32] = b.tcgen05_ld_32x32b(tm.col(resolved.col_s + CHUNK_COLS * c));
            b.tcgen05_wait_ld();
            let slot0 = CHUNK_COLS * c / HEADS_PER_SLOT;
            let seen: [Reg<Pred>; 2] = std::array::from_fn(|i| {
                let qp = b.ld::<S32, _>(&shared(qpos_a, 4 * (slot0 + i as u32) as i64));
                b.setp(Cmp::Ge, qp, key_pos)
            });
            let mut p = Vec::with_capacity(32);
            for g in 0..8u32 {
                let l: [Reg<F32>; 4] =
                    b.ld_v(&shared(lse_a, (4 * (CHUNK_COLS * c + 4 * g)) as i64));
                for (e, &le) in l.iter().enumerate() {
                    let i = 4 * g as usize + e;
                    let v = b.fma(s[i], scale_log2e, le);
                    let v = b.selp(v, f32::NEG_INFINITY, seen[i / HEADS_PER_SLOT as usize]);
                    p.push(b.ex2_approx(v));
                }
            }
            if c == 0 {
                // Deferred to here so G2 overlaps the first exp2 work.
                dp_st = Some(resolved.dp.consumer_wait(b, bars, t));
                b.tcgen05_fence_after_thread_sync();
            }
            let dp: [Reg<F32>; 32] = b.tcgen05_ld_32x32b(tm.col(resolved.col_dp + CHUNK_COLS * c));
            b.tcgen05_wait_ld();
            let mut ds = Vec::with_capacity(32);
            for g in 0..8u32 {
                let dl: [Reg<F32>; 4] =
                    b.ld_v(&shared(delta_a, (4 * (CHUNK_COLS * c + 4 * g)) as i64));
                for (e, &de) in dl.iter().enumerate() {
                    let i = 4 * g as usize + e;
                    let dd = b.sub(dp[i], de);
                    let x = b.fmul(p[i], dd);
                    ds.push(b.fmul(x, common::SCALE));
                }
            }
            // Folded column 2j in the low half, 2j+1 in the high half of packed word j.
            let p_pack: [Reg<Bf16x2>; 16] =
                std::array::from_fn(|j| b.cvt_bf16x2(p[2 * j + 1], p[2 * j]));
            let ds_pack: [Reg<Bf16x2>; 16] =
                std::array::from_fn(|j| b.cvt_bf16x2(ds[2 * j + 1], ds[2 * j]));
            b.comment("P^T over S and dS^T over dP (packed bf16: the TS-MMA A operands)");
            b.tcgen05_st_32x32b(tm.col(resolved.col_p + CHUNK_COLS / 2 * c), p_pack);
            b.tcgen05_st_32x32b(tm.col(resolved.col_ds + CHUNK_COLS / 2 * c), ds_pack);
            b.comment("dS^T to sPdS: SW128 panels [folded/64][key][64 folded]");
            for q in 0..4u32 {
                let j = 4 * (c % 2) + q;
                let x = b.xor(key7, j);
                let x = b.shl(x, 4u32);
                let a = b.add(pds_row, x);
                let v = [0, 1, 2, 3].map(|i| ds_pack[(4 * q + i) as usize]);
                b.st_v(&shared(a, ((c / 2) * PANEL_BYTES) as i64), v);
            }
            if let Some(stage) = resolved.groups.publishes_after(c) {
                b.comment(&format!("publish chunk stage {stage}"));
                b.tcgen05_wait_st();
                b.fence_proxy_async_shared();
                b.tcgen05_fence_before_thread_sync();
                resolved
                    .chunk
                    .producer_commit(b, bars, &chunk_st[stage as usize]);
            }
        }
        b.comment("S, dP and the row stage are read: release them");
        b.tcgen05_fence_before_thread_sync();
        resolved.s.consumer_release(b, bars, &s_st);
        if let Some(st) = dp_st {
            resolved.dp.consumer_release(b, bars, &st);
        }
        resolved.rows.consumer_release(b, bars, &rows_st);
        bump(b, t);
    });

    b.comment(
        "every TMEM access of compute and reduce is done (MMAs: reduce waited their commits)",
    );
    b.tcgen05_fence_before_thread_sync();
    resolved.nb_dealloc.sync(b);
    b.if_then(is_alloc, "tmem_dealloc", |b| {
        b.tcgen05_fence_after_thread_sync();
        let t = b.bitcast::<B32, U32>(tbase);
        b.tcgen05_dealloc(t, resolved.alloc_cols);
    });
}

// ---- MMA warp --------------------------------------------------------------------------

fn mma(b: &mut KernelBuilder, ctx: &Ctx) {
    let resolved = ctx.resolved;
    let bars = &ctx.bars;
    let tbase = tmem_base(b, ctx);
    let tm = TmemAddr::new(b.bitcast::<B32, U32>(tbase));
    let mmas = MmaIssuer::new(b, resolved.plan);
    let elect = mmas.elect;
    let prev = b.mov::<U32>(u32::MAX);
    let seg = b.mov::<U32>(0u32);
    let t = b.mov::<U32>(0u32);
    let k_addr = b.add(ctx.base, resolved.k.offset);
    let v_addr = b.add(ctx.base, resolved.v.offset);
    let pds_addr = b.add(ctx.base, resolved.pds.offset);

    b.for_range(ctx.walk.lo, ctx.walk.hi, 1, "mma_task", |b, row| {
        let m = common::task_meta(b, ctx.p, row);
        let cur = common::bucket(b, &m);
        // `same` is false at a segment's first task, whose dV/dK MMAs overwrite.
        let same = b.setp(Cmp::Eq, cur, prev);
        let seg_end = common::segment_ends(b, ctx.p, &ctx.walk, row, cur);
        b.unless(same, "kv_wait", |b| {
            resolved.kv.consumer_wait(b, bars, seg);
            b.set(prev, cur);
        });
        let qd = resolved.q_do.consumer_wait(b, bars, t);
        let q_addr = resolved.q.emit_stage_addr(b, ctx.base, qd.index);
        let do_addr = resolved.d_o.emit_stage_addr(b, ctx.base, qd.index);
        let s_st = resolved.s.producer_acquire(b, bars, t);
        b.tcgen05_fence_after_thread_sync();
        b.comment("G1: S^T = K*Q^T");
        mmas.issue(
            b,
            resolved.g_s,
            (MmaA::Smem(k_addr), q_addr),
            tm,
            mmas.never,
        );
        b.predicated(elect, false, |b| resolved.s.producer_commit(b, bars, &s_st));

        b.comment("G2 overwrites dQ^T of the previous tile: wait until reduce has read it");
        let first = b.setp(Cmp::Eq, t, 0u32);
        b.unless(first, "t2r_wait", |b| {
            resolved.nb_t2r.sync(b);
            b.tcgen05_fence_after_thread_sync();
        });
        let dp_st = resolved.dp.locate(b, bars, t.into());
        b.comment("G2: dP^T = V*dO^T");
        mmas.issue(
            b,
            resolved.g_dp,
            (MmaA::Smem(v_addr), do_addr),
            tm,
            mmas.never,
        );
        b.predicated(elect, false, |b| {
            resolved.dp.producer_commit(b, bars, &dp_st)
        });

        b.unless(same, "dkv_acquire", |b| {
            resolved.dkv.producer_acquire(b, bars, seg);
            b.tcgen05_fence_after_thread_sync();
        });
        let mut chunk_st = Vec::new();
        for s in 0..resolved.chunk.pipeline.stages {
            let at = round(b, &resolved.chunk, s, t);
            chunk_st.push(resolved.chunk.consumer_wait(b, bars, at));
            b.tcgen05_fence_after_thread_sync();
            for c in resolved.groups.chunks_of(s) {
                let ks = 2 * c..2 * c + 2;
                b.comment(&format!("chunk {c}: G3 dV += P^T*dO, G4 dK += dS^T*Q"));
                mmas.issue_steps(
                    b,
                    resolved.g_dv,
                    (MmaA::Tmem(tm), do_addr),
                    tm,
                    ks.clone(),
                    same,
                );
                mmas.issue_steps(b, resolved.g_dk, (MmaA::Tmem(tm), q_addr), tm, ks, same);
            }
        }
        b.predicated(elect, false, |b| {
            resolved.q_do.consumer_release(b, bars, &qd)
        });
        if MMA_ORDER == MmaOrder::Explicit {
            // The fence after the waits below also covers this one.
            b.comment("G5 overwrites the dS^T that G4 reads: wait until the release commit lands");
            b.mbarrier_wait(&qd.empty, qd.parity);
        }

        b.comment("G5 overwrites dP^T/dS^T: compute has read dP, reduce has read the last dQ");
        let t1 = b.add(t, 1u32);
        resolved.dp.producer_acquire(b, bars, t1);
        let dq_st = resolved.dq.producer_acquire(b, bars, t);
        b.tcgen05_fence_after_thread_sync();
        b.comment("G5: dQ^T = K^T*dS^T");
        mmas.issue(
            b,
            resolved.g_dq,
            (MmaA::Smem(k_addr), pds_addr),
            tm,
            mmas.never,
        );
        b.predicated(elect, false, |b| {
            resolved.dq.producer_commit(b, bars, &dq_st);
            for st in &chunk_st {
                resolved.chunk.consumer_release(b, bars, st);
            }
        });

        b.if_then(seg_end, "segment_end", |b| {
            let kv_st = resolved.kv.locate(b, bars, seg.into());
            let dkv_st = resolved.dkv.locate(b, bars, seg.into());
            b.predicated(elect, false, |b| {
                resolved.kv.consumer_release(b, bars, &kv_st);
                resolved.dkv.producer_commit(b, bars, &dkv_st);
            });
            bump(b, seg);
        });
        bump(b, t);
    });
    b.comment("the last tile's t2r_dQ_done");
    let any = b.setp(Cmp::Ne, t, 0u32);
    b.if_then(any, "t2r_last", |b| resolved.nb_t2r.sync(b));
}

// ---- load warp -------------------------------------------------------------------------

fn load(b: &mut KernelBuilder, ctx: &Ctx) {
    let resolved = ctx.resolved;
    let bars = &ctx.bars;
    let p = ctx.p;
    let lane = b.and(ctx.tid, 31u32);
    let lead = b.setp(Cmp::Eq, lane, 0u32);
    b.if_then(lead, "load_lane", |b| {
        let tq = b.tensor_map_addr(&p.tmap_q);
        let tdo = b.tensor_map_addr(&p.tmap_do);
        let tk = b.tensor_map_addr(&p.tmap_k);
        let tv = b.tensor_map_addr(&p.tmap_v);
        let prev = b.mov::<U32>(u32::MAX);
        let seg = b.mov::<U32>(0u32);
        let t = b.mov::<U32>(0u32);
        b.for_range(ctx.walk.lo, ctx.walk.hi, 1, "load_task", |b, row| {
            let m = common::task_meta(b, p, row);
            let tiles = [(&resolved.k, ctx.base), (&resolved.v, ctx.base)];
            let maps = [tk, tv];
            common::load_kv_if_new_segment(
                b,
                &resolved.kv,
                bars,
                (prev, seg),
                maps,
                tiles,
                &m,
                None,
            );
            let st = resolved.q_do.producer_acquire(b, bars, t);
            let q_tile = resolved.q.emit_stage_addr(b, ctx.base, st.index);
            let do_tile = resolved.d_o.emit_stage_addr(b, ctx.base, st.index);
            let qrows = b.ld_param_ptr(&p.qrows);
            let tiles = [shared(q_tile, 0), shared(do_tile, 0)];
            common::load_qdo_tiles(b, [tq, tdo], tiles, qrows, row, &m, &st.full);
            bump(b, t);
        });
    });
}

// ---- scalar-gather warp ----------------------------------------------------------------

fn scalar(b: &mut KernelBuilder, ctx: &Ctx) {
    let resolved = ctx.resolved;
    let bars = &ctx.bars;
    let p = ctx.p;
    let g = common::gather_lane(b, ctx.tid);
    let t = b.mov::<U32>(0u32);
    b.for_range(ctx.walk.lo, ctx.walk.hi, 1, "scalar_task", |b, row| {
        let st = resolved.rows.producer_acquire(b, bars, t);
        let m = common::task_meta(b, p, row);
        let (l4, d4) = common::gather_row_scalars(b, p, row, m[1], &g);
        let row8 = b.shl(row, 3u32);
        let lse_a = resolved.lse.emit_stage_addr(b, ctx.base, st.index);
        let lse_a = b.add(lse_a, g.lane16);
        b.st_v(&shared(lse_a, 0), l4);
        let delta_a = resolved.delta.emit_stage_addr(b, ctx.base, st.index);
        let delta_a = b.add(delta_a, g.lane16);
        b.st_v(&shared(delta_a, 0), d4);
        b.if_then(g.word_lane, "slot_words", |b| {
            let idx = b.add(row8, g.lane);
            let lane4 = b.shl(g.lane, 2u32);
            for (table, buf) in [(&p.qrows, resolved.qrows), (&p.qpos, resolved.qpos)] {
                let ptr = b.ld_param_ptr(table);
                let a = common::elem::<S32>(b, ptr, idx);
                let v = b.ld::<S32, _>(&a);
                let s = buf.emit_stage_addr(b, ctx.base, st.index);
                let s = b.add(s, lane4);
                b.st(&shared(s, 0), v);
            }
        });
        resolved.rows.producer_commit(b, bars, &st);
        bump(b, t);
    });
}

// ---- reduce warps ----------------------------------------------------------------------

/// In-place 4×4 transpose of four 4-float blocks across the 4 lanes of a quad: lane `i`
/// holds (row i, block k) in `v[4k..4k+4]` before and (row k, block i) after. Two butterfly
/// stages; in the stage over lane bit `m`, each lane trades the block whose bit `m` differs
/// from its own.
fn quad_transpose(b: &mut KernelBuilder, v: &mut [Reg<F32>; 16], bits: [Reg<Pred>; 2]) {
    for (mask, hi) in [(1u32, bits[0]), (2u32, bits[1])] {
        for k0 in (0..4u32).filter(|k| k & mask == 0) {
            let k1 = k0 | mask;
            for e in 0..4usize {
                let (i0, i1) = (4 * k0 as usize + e, 4 * k1 as usize + e);
                let send = b.selp(v[i0], v[i1], hi);
                let got = b.shfl(Shfl::Bfly, send, mask, 0x1f);
                let n0 = b.selp(got, v[i0], hi);
                let n1 = b.selp(v[i1], got, hi);
                v[i0] = n0;
                v[i1] = n1;
            }
        }
    }
}

fn reduce(b: &mut KernelBuilder, ctx: &Ctx) {
    let resolved = ctx.resolved;
    let bars = &ctx.bars;
    let p = ctx.p;
    let tbase = tmem_base(b, ctx);
    let tm = quadrant(b, tbase, ctx.warp);
    // Lane of TMEM: head dim for dQ^T, key row for dK/dV.
    let lane128 = b.and(ctx.tid, 127u32);
    let lane = b.and(ctx.tid, 31u32);
    let quad_bits: [Reg<Pred>; 2] = [1u32, 2u32].map(|m| {
        let x = b.and(lane, m);
        b.setp(Cmp::Ne, x, 0u32)
    });
    let policy = b.policy_evict_last(1.0);
    let prev = b.mov::<U32>(u32::MAX);
    let seg = b.mov::<U32>(0u32);
    let t = b.mov::<U32>(0u32);

    b.for_range(ctx.walk.lo, ctx.walk.hi, 1, "reduce_task", |b, row| {
        let m = common::task_meta(b, p, row);
        let head = m[1];
        let kb = m[2];
        let cur = common::bucket(b, &m);
        let same = b.setp(Cmp::Eq, cur, prev);
        let seg_end = common::segment_ends(b, ctx.p, &ctx.walk, row, cur);
        b.unless(same, "new_segment", |b| b.set(prev, cur));
        let st = resolved.rows.consumer_wait(b, bars, t);
        let qr_a = resolved.qrows.emit_stage_addr(b, ctx.base, st.index);
        let lo4: [Reg<S32>; 4] = b.ld_v(&shared(qr_a, 0));
        let hi4: [Reg<S32>; 4] = b.ld_v(&shared(qr_a, 16));
        resolved.rows.consumer_release(b, bars, &st);

        let head_d = b.mad_lo(head, 1024u32, lane128);
        if let Some(f) = &p.fixed {
            dq_fixed_point(b, ctx, &tm, f, [lo4, hi4], head, lane128, t);
        } else {
            dq_bf16x2(b, ctx, &tm, [lo4, hi4], head_d, t, policy);
        }

        b.if_then(seg_end, "flush", |b| {
            b.comment("segment end: dV and dK to the fp32 pools [W][4][128]");
            let st = resolved.dkv.consumer_wait(b, bars, seg);
            b.tcgen05_fence_after_thread_sync();
            // Key row of quad lane 0: kb·128 + 32·(warp % 4) + 4·(lane / 4).
            let w3 = b.and(ctx.warp, 3u32);
            let quad = b.shr(lane, 2u32);
            let r = b.shl(kb, 7u32);
            let r = b.mad_lo(w3, 32u32, r);
            let r = b.mad_lo(quad, 4u32, r);
            let col4 = b.and(lane, 3u32);
            let col4 = b.shl(col4, 2u32);
            let idx = b.mad_lo(r, 512u32, col4);
            let idx = b.mad_lo(head, 128u32, idx);
            let regions = [(resolved.col_dv, &p.dv), (resolved.col_dk, &p.dk)];
            // Deterministic: the inverse units of this group's dV and dK.
            let invs = p
                .fixed
                .as_ref()
                .map(|f| fixed_point::flush_inv_units(b, f, head));
            for (which, (col, pool_p)) in regions.into_iter().enumerate() {
                let pool = b.ld_param_ptr(pool_p);
                let a = common::elem::<F32>(b, pool, idx);
                // The deterministic pools' 8-byte elements (only that variant addresses them).
                let a64 = invs.map(|_| common::elem_bytes(b, pool, idx, 8));
                for pass in 0..4u32 {
                    let v: [Reg<F32>; 32] = b.tcgen05_ld_32x32b(tm.col(col + CHUNK_COLS * pass));
                    b.tcgen05_wait_ld();
                    if which == 1 && pass == 3 {
                        b.comment(
                            "the last TMEM read of dK/dV: release the slot before the atomics",
                        );
                        b.tcgen05_fence_before_thread_sync();
                        resolved.dkv.consumer_release(b, bars, &st);
                    }
                    for blk in 0..2usize {
                        let mut x: [Reg<F32>; 16] = std::array::from_fn(|e| v[16 * blk + e]);
                        quad_transpose(b, &mut x, quad_bits);
                        for k in 0..4usize {
                            let off =
                                2048 * k + 4 * (CHUNK_COLS as usize * pass as usize + 16 * blk);
                            let vals = [x[4 * k], x[4 * k + 1], x[4 * k + 2], x[4 * k + 3]];
                            match (invs, &a64) {
                                (Some(inv), Some(a64)) => {
                                    for (e, v) in vals.into_iter().enumerate() {
                                        let q = fixed_point::to_fixed64(b, v, inv[which]);
                                        let at = a64.offset(2 * off as i64 + 8 * e as i64);
                                        b.red::<U64, _>(AtomOp::Add, &at, q);
                                    }
                                }
                                _ => b.red_add_v4_f32(&a.offset(off as i64), vals, None),
                            }
                        }
                    }
                }
            }
            resolved.nb_reduce.sync(b);
            bump(b, seg);
        });
        bump(b, t);
    });

    b.tcgen05_fence_before_thread_sync();
    resolved.nb_dealloc.sync(b);
}

/// The reduce warps' dQ drain of the default mode: dQ^T from TMEM (lane = head dim, column =
/// folded `(slot, head)`), heads `2m`/`2m+1` of a slot packed to bf16x2, then reduced into the
/// pool `[T][32][128][2]`.
#[allow(clippy::too_many_arguments)]
fn dq_bf16x2(
    b: &mut KernelBuilder,
    ctx: &Ctx,
    tm: &TmemAddr,
    qrows: [[Reg<S32>; 4]; 2],
    head_d: Reg<U32>,
    t: Reg<U32>,
    policy: Reg<B64>,
) {
    let (p, resolved, bars) = (ctx.p, ctx.resolved, &ctx.bars);
    b.comment("dQ^T to registers: lane = head dim, column = folded (slot, head)");
    let dq_st = resolved.dq.consumer_wait(b, bars, t);
    b.tcgen05_fence_after_thread_sync();
    let mut words = Vec::with_capacity(64);
    for pass in 0..4u32 {
        let v: [Reg<F32>; 32] = b.tcgen05_ld_32x32b(tm.col(resolved.col_dq + CHUNK_COLS * pass));
        b.tcgen05_wait_ld();
        // Heads 2m (low half) and 2m+1 (high half) of one slot.
        for j in 0..16 {
            words.push(b.cvt_bf16x2(v[2 * j + 1], v[2 * j]));
        }
    }
    b.tcgen05_fence_before_thread_sync();
    resolved.nb_t2r.arrive(b);
    resolved.dq.consumer_release(b, bars, &dq_st);

    b.comment("dQ: head pairs into the bf16x2 pool [T][32][128][2]");
    let [lo4, hi4] = qrows;
    for (slot, qrow) in lo4.into_iter().chain(hi4).enumerate() {
        let live = b.setp(Cmp::Ge, qrow, 0i32);
        let r = b.bitcast::<U32, S32>(qrow);
        let word = b.mad_lo(r, 4096u32, head_d);
        let pool = b.ld_param_ptr(&p.dq);
        let a = common::elem::<U32>(b, pool, word);
        b.predicated(live, false, |b| {
            for m in 0..8 {
                b.red_add_bf16x2(&a.offset(512 * m as i64), words[8 * slot + m], Some(policy));
            }
        });
    }
}

/// The deterministic dQ drain: each slot's unit from `a[t, g]` first (while the MMA runs),
/// then per TMEM pass its 16 heads at this lane's `d` as four integer-valued head quads,
/// reduced with one `red.add.v4.f32` each into the pool `[T][4][4][128][4]`
/// (`fixed_point::dq_word`; issued per pass, as holding all 128 values would take 128
/// registers). The slot is released after the last pass, as in [`dq_bf16x2`].
#[allow(clippy::too_many_arguments)]
fn dq_fixed_point(
    b: &mut KernelBuilder,
    ctx: &Ctx,
    tm: &TmemAddr,
    f: &common::FixedParams,
    qrows: [[Reg<S32>; 4]; 2],
    head: Reg<U32>,
    d: Reg<U32>,
    t: Reg<U32>,
) {
    let (p, resolved, bars) = (ctx.p, ctx.resolved, &ctx.bars);
    let bounds = b.ld_param_ptr(&f.bounds);
    let factor = fixed_point::dq_factor(b, bounds, head);
    let [lo4, hi4] = qrows;
    let slots: Vec<(Reg<Pred>, Reg<U32>, Reg<F32>)> = lo4
        .into_iter()
        .chain(hi4)
        .map(|qrow| {
            let live = b.setp(Cmp::Ge, qrow, 0i32);
            let rc = b.max(qrow, 0i32);
            let r = b.bitcast::<U32, S32>(rc);
            let inv = fixed_point::dq_row_inv_unit(b, f, r, head, factor);
            (live, r, inv)
        })
        .collect();
    b.comment("dQ^T to fixed-point head quads in the f32 pool [T][4][4][128][4]");
    let dq_st = resolved.dq.consumer_wait(b, bars, t);
    b.tcgen05_fence_after_thread_sync();
    for pass in 0..4u32 {
        let v: [Reg<F32>; 32] = b.tcgen05_ld_32x32b(tm.col(resolved.col_dq + CHUNK_COLS * pass));
        b.tcgen05_wait_ld();
        // Column 32·pass + 16·s + h: slot 2·pass + s, group-local head h.
        for s in 0..2u32 {
            let (live, r, inv) = slots[(2 * pass + s) as usize];
            for quad in 0..4u32 {
                let vals: [Reg<F32>; 4] = std::array::from_fn(|e| {
                    v[(16 * s + fixed_point::dq_quad_head(quad, e as u32)) as usize]
                })
                .map(|x| fixed_point::to_fixed_f32(b, x, inv));
                let word = fixed_point::dq_word(b, r, head, quad, d);
                let pool = b.ld_param_ptr(&p.dq);
                let a = common::elem::<F32>(b, pool, word);
                b.predicated(live, false, |b| b.red_add_v4_f32(&a, vals, None));
            }
        }
    }
    b.tcgen05_fence_before_thread_sync();
    resolved.nb_t2r.arrive(b);
    resolved.dq.consumer_release(b, bars, &dq_st);
}
