//! Typed mbarrier pipelines and named barriers (`docs/design.md` §3.4).
//!
//! A pipeline of `stages` stages owns `2·stages` consecutive mbarriers in the barrier array:
//! `full[0..stages]` (producer → consumer) then `empty[0..stages]` (consumer → producer).
//! Phase bookkeeping is generated from an iteration counter held in a register:
//! `stage = iter % stages`, `parity = (iter / stages) & 1`; the consumer waits on `full`
//! with `parity`, the producer on `empty` with `parity ^ 1` (the first wait passes on the
//! freshly initialised barrier).
//!
//! How a side signals follows from its role: a stage with TMA boxes is completed by one
//! `mbarrier.arrive.expect_tx` plus the copies' bytes; the MMA warp signals with
//! `tcgen05.commit` (one arrival once its MMAs finish); other roles `mbarrier.arrive`, from
//! every thread or from one elected lane per warp.
//!
//! Three types, from description to code:
//! - [`Pipeline`] is the description of one ring: its name, stages, producer and consumer
//!   roles, arrival counts and TMA boxes. It is plain data that knows nothing of barrier
//!   addresses; [`design_pipelines`] lists the kernel's.
//! - [`PipelinePlan`] is the checked set of a kernel's `Pipeline`s: [`PipelinePlan::new`]
//!   validates each against the warp plan and gives it its slots in the barrier array.
//!   It owns the `Pipeline`s and is part of the [`KernelPlan`](super::KernelPlan).
//! - [`Pipe`] is a borrowed view of one `Pipeline` inside a `PipelinePlan` together with
//!   its first slot, handed out by [`PipelinePlan::get`]. It is what kernel code holds: it
//!   emits the `mbarrier` instructions (`producer_acquire` … `consumer_release`).

use super::roles::{Role, RoleThreads};
use super::smem::{Buf, SmemPlan, BARRIER_BYTES};
use super::PlanError;
use crate::ptx::{shared, KernelBuilder, Reg, SharedAddr, U32};
use std::fmt;
use std::ops::Range;

/// Largest transaction count one mbarrier phase can expect (20-bit tx-count).
pub const TX_LIMIT: u32 = (1 << 20) - 1;
/// Largest inner box extent with 128-B swizzling, in bytes.
pub const SW128_INNER_BYTES: u32 = 128;

/// One TMA box: extents innermost first, and the element size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TmaBox {
    /// Extents in elements, innermost first.
    pub dims: Vec<u32>,
    /// Bytes per element.
    pub elem_bytes: u32,
}

impl TmaBox {
    /// Bytes the box delivers.
    pub fn bytes(&self) -> u32 {
        self.dims.iter().product::<u32>() * self.elem_bytes
    }
}

/// Which side of a pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Fills stages, arrives on `full`.
    Producer,
    /// Drains stages, arrives on `empty`.
    Consumer,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Producer => "producer",
            Side::Consumer => "consumer",
        })
    }
}

/// How one side arrives on its barrier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// One thread's `mbarrier.arrive.expect_tx` with the stage's bytes; the TMA copies'
    /// `complete_tx` finishes the phase.
    Tma,
    /// `tcgen05.commit` by the MMA-issuing thread: one arrival when its MMAs complete.
    UmmaCommit,
    /// `mbarrier.arrive` from every thread, or from one elected lane per warp.
    Arrive,
}

/// The compute → MMA hand-off's split of a tile's column chunks into stages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkGroups {
    /// First chunk of each stage (`chunk_stage_starts`).
    pub starts: Vec<u32>,
    /// Chunks per tile.
    pub chunks: u32,
}

impl ChunkGroups {
    /// Chunks of stage `stage`.
    pub fn chunks_of(&self, stage: u32) -> Range<u32> {
        let s = stage as usize;
        let end = self.starts.get(s + 1).copied().unwrap_or(self.chunks);
        self.starts[s]..end
    }

    /// The stage chunk `chunk` belongs to.
    pub fn stage_of(&self, chunk: u32) -> u32 {
        self.starts.iter().rposition(|&s| s <= chunk).unwrap_or(0) as u32
    }

    /// The stage to publish once chunk `chunk` is done, if it is its stage's last chunk.
    pub fn publishes_after(&self, chunk: u32) -> Option<u32> {
        let stage = self.stage_of(chunk);
        (self.chunks_of(stage).end == chunk + 1).then_some(stage)
    }
}

/// The description of a producer → consumer ring of `stages` stages: who produces and
/// consumes, how many arrivals complete a phase, what TMA delivers per stage.
///
/// Plain data with no barrier slots; a [`PipelinePlan`] checks it and places its barriers,
/// and a [`Pipe`] emits the code for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pipeline {
    /// Name (unique in a plan).
    pub name: &'static str,
    /// Stages.
    pub stages: u32,
    /// The producing role.
    pub producer: Role,
    /// The consuming roles (the rows pipeline has two).
    pub consumers: Vec<Role>,
    /// Arrivals that complete a `full` phase (the `mbarrier.init` count).
    pub producer_arrivals: u32,
    /// Arrivals that complete an `empty` phase.
    pub consumer_arrivals: u32,
    /// TMA boxes one stage receives (empty: no TMA).
    pub tx: Vec<TmaBox>,
    /// The tx bytes per stage the description states, checked against the boxes.
    pub declared_tx: Option<u32>,
    /// Shared buffers one stage's TMA fills; their stage bytes must equal the tx bytes.
    pub fills: Vec<Buf>,
    /// Chunk groups of a hand-off whose stages split one tile.
    pub chunk_groups: Option<ChunkGroups>,
}

impl Pipeline {
    /// A pipeline without TMA, fills or chunk groups.
    pub fn new(
        name: &'static str,
        stages: u32,
        producer: Role,
        consumers: &[Role],
        producer_arrivals: u32,
        consumer_arrivals: u32,
    ) -> Self {
        Pipeline {
            name,
            stages,
            producer,
            consumers: consumers.to_vec(),
            producer_arrivals,
            consumer_arrivals,
            tx: Vec::new(),
            declared_tx: None,
            fills: Vec::new(),
            chunk_groups: None,
        }
    }

    /// Bytes one stage receives through TMA.
    pub fn tx_bytes(&self) -> u32 {
        self.tx.iter().map(TmaBox::bytes).sum()
    }

    /// How `side` signals.
    pub fn signal(&self, side: Side) -> Signal {
        match side {
            Side::Producer if !self.tx.is_empty() => Signal::Tma,
            Side::Producer if self.producer == Role::Mma => Signal::UmmaCommit,
            Side::Consumer if self.consumers == [Role::Mma] => Signal::UmmaCommit,
            _ => Signal::Arrive,
        }
    }

    fn roles(&self, side: Side) -> &[Role] {
        match side {
            Side::Producer => std::slice::from_ref(&self.producer),
            Side::Consumer => &self.consumers,
        }
    }

    fn check(&self, warps: &impl RoleThreads) -> Result<(), PlanError> {
        let pipeline = self.name;
        if self.stages == 0 {
            return Err(PlanError::Stages {
                pipeline,
                stages: self.stages,
            });
        }
        for side in [Side::Producer, Side::Consumer] {
            for &role in self.roles(side) {
                if role == Role::Idle || warps.threads(role) == 0 {
                    return Err(PlanError::PipelineRole {
                        pipeline,
                        side,
                        role,
                    });
                }
            }
        }
        for (index, tbox) in self.tx.iter().enumerate() {
            if !(1..=5).contains(&tbox.dims.len()) {
                return Err(PlanError::TmaBoxRank {
                    pipeline,
                    index,
                    rank: tbox.dims.len(),
                });
            }
            if let Some((dim, &extent)) = tbox
                .dims
                .iter()
                .enumerate()
                .find(|(_, &e)| !(1..=256).contains(&e))
            {
                return Err(PlanError::TmaBoxExtent {
                    pipeline,
                    index,
                    dim,
                    extent,
                });
            }
            let bytes = tbox.dims[0] * tbox.elem_bytes;
            if bytes > SW128_INNER_BYTES {
                return Err(PlanError::TmaBoxInner {
                    pipeline,
                    index,
                    bytes,
                    limit: SW128_INNER_BYTES,
                });
            }
        }
        let boxes = self.tx_bytes();
        if let Some(declared) = self.declared_tx {
            if declared != boxes {
                return Err(PlanError::TxMismatch {
                    pipeline,
                    declared,
                    boxes,
                });
            }
        }
        if boxes > TX_LIMIT {
            return Err(PlanError::TxLimit {
                pipeline,
                bytes: boxes,
                limit: TX_LIMIT,
            });
        }
        for (side, arrivals) in [
            (Side::Producer, self.producer_arrivals),
            (Side::Consumer, self.consumer_arrivals),
        ] {
            let (signal, allowed) = match self.signal(side) {
                Signal::Tma => ("with TMA (one arrive.expect_tx)", vec![1]),
                Signal::UmmaCommit => ("with tcgen05.commit", vec![1]),
                // Each role arrives in one of its granules: one elected thread per warpgroup
                // after a warpgroup barrier, one elected lane per warp, or every thread; the
                // count is the sum over the roles.
                Signal::Arrive => {
                    let threads = self.roles(side).iter().map(|&r| warps.threads(r));
                    let granules = |t: u32| {
                        let mut g = vec![t / 32, t];
                        if t >= 128 && t.is_multiple_of(128) {
                            g.insert(0, t / 128);
                        }
                        g
                    };
                    let mut sums = vec![0];
                    let mut whole_warpgroups = true;
                    for t in threads {
                        whole_warpgroups &= t >= 128 && t.is_multiple_of(128);
                        sums = sums
                            .iter()
                            .flat_map(|s| granules(t).into_iter().map(move |g| s + g))
                            .collect();
                    }
                    sums.sort_unstable();
                    sums.dedup();
                    let signal = if whole_warpgroups {
                        "arriving per warpgroup, per warp or per thread,"
                    } else {
                        "arriving per warp or per thread (per warpgroup where a role fills whole warpgroups),"
                    };
                    (signal, sums)
                }
            };
            if !allowed.contains(&arrivals) {
                return Err(PlanError::Arrivals {
                    pipeline,
                    side,
                    arrivals,
                    signal,
                    allowed,
                });
            }
        }
        if let Some(groups) = &self.chunk_groups {
            let s = &groups.starts;
            let ok = s.len() == self.stages as usize
                && s.first() == Some(&0)
                && s.windows(2).all(|w| w[0] < w[1])
                && s.last().is_some_and(|&l| l < groups.chunks);
            if !ok {
                return Err(PlanError::ChunkGroups {
                    pipeline,
                    starts: s.clone(),
                    chunks: groups.chunks,
                    stages: self.stages,
                });
            }
        }
        Ok(())
    }
}

/// A kernel's validated [`Pipeline`]s, each with its slots in the barrier array.
///
/// Built once by [`PipelinePlan::new`]; kernel code reaches one pipeline through
/// [`PipelinePlan::get`], which returns a [`Pipe`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipelinePlan {
    pipes: Vec<(Pipeline, u32)>,
    slots: u32,
}

impl PipelinePlan {
    /// Checks every pipeline against `warps` and assigns barrier slots in order.
    ///
    /// Rejects: zero stages; a role without warps; a TMA box with 0 or more than 5
    /// dimensions, an extent outside 1..=256 or an inner extent above 128 B; a declared tx
    /// that differs from the boxes' bytes; tx above the mbarrier's limit; arrival counts
    /// inconsistent with the side's signal and threads; chunk groups that do not split the
    /// chunks into the stages; a name used twice.
    pub fn new(pipelines: Vec<Pipeline>, warps: &impl RoleThreads) -> Result<Self, PlanError> {
        let mut pipes = Vec::new();
        let mut slots = 0;
        for p in pipelines {
            p.check(warps)?;
            if pipes
                .iter()
                .any(|(q, _): &(Pipeline, u32)| q.name == p.name)
            {
                return Err(PlanError::PipelineTwice { pipeline: p.name });
            }
            let n = 2 * p.stages;
            pipes.push((p, slots));
            slots += n;
        }
        Ok(PipelinePlan { pipes, slots })
    }

    /// mbarriers of all pipelines.
    pub fn barrier_slots(&self) -> u32 {
        self.slots
    }

    /// Every pipeline with its first slot.
    pub fn pipes(&self) -> impl Iterator<Item = Pipe<'_>> {
        self.pipes.iter().map(|(p, slot)| Pipe {
            pipeline: p,
            slot: *slot,
        })
    }

    /// The pipeline called `name`.
    pub fn get(&self, name: &str) -> Result<Pipe<'_>, PlanError> {
        self.pipes()
            .find(|p| p.pipeline.name == name)
            .ok_or_else(|| PlanError::PipelineMissing {
                pipeline: name.to_string(),
            })
    }

    /// Checks that each TMA stage fills exactly its buffers' stages: the buffers exist,
    /// have the pipeline's stage count, and hold the tx bytes per stage.
    pub fn check_fills(&self, smem: &SmemPlan) -> Result<(), PlanError> {
        for p in self.pipes() {
            let p = p.pipeline;
            if p.fills.is_empty() && p.tx.is_empty() {
                continue;
            }
            let mut fills = 0;
            for &buf in &p.fills {
                let spec = smem.buffer(buf)?.spec;
                if spec.stages != p.stages {
                    return Err(PlanError::FillStages {
                        pipeline: p.name,
                        buffer: buf,
                        buffer_stages: spec.stages,
                        stages: p.stages,
                    });
                }
                fills += spec.stage_bytes;
            }
            if fills != p.tx_bytes() {
                return Err(PlanError::TxFill {
                    pipeline: p.name,
                    tx: p.tx_bytes(),
                    buffers: p.fills.clone(),
                    fills,
                });
            }
        }
        Ok(())
    }

    /// Emits every `mbarrier.init` (full: producer arrivals, empty: consumer arrivals) and
    /// the init fence. One thread runs it; a CTA barrier must follow before any use.
    pub fn emit_init(&self, b: &mut KernelBuilder, bars: &Barriers) {
        for p in self.pipes() {
            p.emit_init(b, bars);
        }
        b.fence_mbarrier_init();
    }
}

/// The barrier array at run time.
#[derive(Debug, Clone, Copy)]
pub struct Barriers {
    /// Shared-window address of slot 0.
    pub base: Reg<U32>,
    /// Emits `tcgen05.commit` arriving on a barrier (the MMA warp's signal).
    pub umma_commit: fn(&mut KernelBuilder, &SharedAddr),
}

/// Where in a pipeline an iteration is, computed into registers.
#[derive(Debug, Clone)]
pub struct Stage {
    /// Stage index.
    pub index: Reg<U32>,
    /// Phase parity the consumer waits for (the producer waits for its complement).
    pub parity: Reg<U32>,
    /// The stage's full barrier.
    pub full: SharedAddr,
    /// The stage's empty barrier.
    pub empty: SharedAddr,
}

/// Which iteration to locate.
#[derive(Debug, Clone, Copy)]
pub struct Cursor(CursorKind);

#[derive(Debug, Clone, Copy)]
enum CursorKind {
    Iter(Reg<U32>),
    Round { stage: u32, round: Reg<U32> },
}

impl Cursor {
    /// The `iter`-th use of the ring: stage `iter % stages`.
    pub fn iter(iter: Reg<U32>) -> Self {
        Cursor(CursorKind::Iter(iter))
    }
}

impl From<Reg<U32>> for Cursor {
    fn from(iter: Reg<U32>) -> Self {
        Cursor::iter(iter)
    }
}

/// One [`Pipeline`] of a [`PipelinePlan`], with its first barrier slot: the handle kernel
/// code emits a pipeline's barrier operations and phase bookkeeping through.
///
/// It borrows from the plan and is `Copy`, so roles keep their pipes by value.
#[derive(Debug, Clone, Copy)]
pub struct Pipe<'a> {
    /// The description.
    pub pipeline: &'a Pipeline,
    /// Its first barrier slot.
    pub slot: u32,
}

impl Pipe<'_> {
    fn full_at(&self, bars: &Barriers, stage: u32) -> SharedAddr {
        shared(bars.base, (BARRIER_BYTES * (self.slot + stage)) as i64)
    }

    fn empty_at(&self, bars: &Barriers, stage: u32) -> SharedAddr {
        let stages = self.pipeline.stages;
        shared(
            bars.base,
            (BARRIER_BYTES * (self.slot + stages + stage)) as i64,
        )
    }

    /// Emits this pipeline's `mbarrier.init`s (full: producer arrivals, empty: consumer
    /// arrivals), without the init fence.
    pub fn emit_init(&self, b: &mut KernelBuilder, bars: &Barriers) {
        for s in 0..self.pipeline.stages {
            b.mbarrier_init(&self.full_at(bars, s), self.pipeline.producer_arrivals);
            b.mbarrier_init(&self.empty_at(bars, s), self.pipeline.consumer_arrivals);
        }
    }

    /// The cursor of stage `stage` in round `round`, for pipelines whose every stage is used
    /// once per round (the chunk hand-off): the same as iteration `round·stages + stage`.
    pub fn round(&self, stage: u32, round: Reg<U32>) -> Result<Cursor, PlanError> {
        if stage >= self.pipeline.stages {
            return Err(PlanError::StageIndex {
                pipeline: self.pipeline.name,
                stage,
                stages: self.pipeline.stages,
            });
        }
        Ok(Cursor(CursorKind::Round { stage, round }))
    }

    /// Emits `stage = iter % stages`, `parity = (iter / stages) & 1` and the barriers'
    /// addresses.
    pub fn locate(&self, b: &mut KernelBuilder, bars: &Barriers, at: Cursor) -> Stage {
        let stages = self.pipeline.stages;
        match at.0 {
            CursorKind::Round { stage, round } => Stage {
                index: b.mov::<U32>(stage),
                parity: b.and(round, 1u32),
                full: self.full_at(bars, stage),
                empty: self.empty_at(bars, stage),
            },
            CursorKind::Iter(iter) if stages == 1 => Stage {
                index: b.mov::<U32>(0u32),
                parity: b.and(iter, 1u32),
                full: self.full_at(bars, 0),
                empty: self.empty_at(bars, 0),
            },
            CursorKind::Iter(iter) => {
                let (index, phase) = if stages.is_power_of_two() {
                    (
                        b.and(iter, stages - 1),
                        b.shr(iter, stages.trailing_zeros()),
                    )
                } else {
                    (b.rem(iter, stages), b.div(iter, stages))
                };
                let parity = b.and(phase, 1u32);
                let off = b.shl(index, BARRIER_BYTES.trailing_zeros());
                let at = b.add(bars.base, off);
                let slot = |s: u32| (BARRIER_BYTES * (self.slot + s)) as i64;
                Stage {
                    index,
                    parity,
                    full: shared(at, slot(0)),
                    empty: shared(at, slot(stages)),
                }
            }
        }
    }

    /// Producer: waits until the stage is free (`empty`, parity ^ 1); for a TMA stage also
    /// arrives on `full` expecting the stage's bytes, before the copies are issued.
    pub fn producer_acquire(
        &self,
        b: &mut KernelBuilder,
        bars: &Barriers,
        at: impl Into<Cursor>,
    ) -> Stage {
        let st = self.locate(b, bars, at.into());
        let parity = b.xor(st.parity, 1u32);
        b.mbarrier_wait(&st.empty, parity);
        if self.pipeline.signal(Side::Producer) == Signal::Tma {
            b.mbarrier_arrive_expect_tx(&st.full, self.pipeline.tx_bytes());
        }
        st
    }

    /// Producer: publishes the stage (nothing for TMA, whose bytes complete the phase).
    pub fn producer_commit(&self, b: &mut KernelBuilder, bars: &Barriers, st: &Stage) {
        match self.pipeline.signal(Side::Producer) {
            Signal::Tma => {}
            Signal::UmmaCommit => (bars.umma_commit)(b, &st.full),
            Signal::Arrive => b.mbarrier_arrive(&st.full),
        }
    }

    /// Consumer: waits until the stage is full (`full`, parity).
    pub fn consumer_wait(
        &self,
        b: &mut KernelBuilder,
        bars: &Barriers,
        at: impl Into<Cursor>,
    ) -> Stage {
        let st = self.locate(b, bars, at.into());
        b.mbarrier_wait(&st.full, st.parity);
        st
    }

    /// Consumer: hands the stage back to the producer.
    pub fn consumer_release(&self, b: &mut KernelBuilder, bars: &Barriers, st: &Stage) {
        match self.pipeline.signal(Side::Consumer) {
            Signal::UmmaCommit => (bars.umma_commit)(b, &st.empty),
            Signal::Tma | Signal::Arrive => b.mbarrier_arrive(&st.empty),
        }
    }
}

/// A `bar.sync`/`bar.arrive` barrier shared by some roles.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedBarrier {
    /// Name.
    pub name: &'static str,
    /// Hardware barrier id, 1..=15.
    pub id: u32,
    /// Threads that take part.
    pub threads: u32,
    /// The roles whose threads take part.
    pub roles: Vec<Role>,
}

impl NamedBarrier {
    /// `bar.sync id, threads`.
    pub fn sync(&self, b: &mut KernelBuilder) {
        b.bar_sync(self.id, Some(self.threads));
    }

    /// `bar.arrive id, threads`.
    pub fn arrive(&self, b: &mut KernelBuilder) {
        b.bar_arrive(self.id, self.threads);
    }
}

/// Checks named barriers: ids in 1..=15 and unique; thread counts equal to their roles'
/// threads in `warps`.
pub fn check_named_barriers(
    barriers: &[NamedBarrier],
    warps: &impl RoleThreads,
) -> Result<(), PlanError> {
    for (i, nb) in barriers.iter().enumerate() {
        if !(1..=15).contains(&nb.id) {
            return Err(PlanError::BarrierId {
                barrier: nb.name,
                id: nb.id,
            });
        }
        if let Some(first) = barriers[..i].iter().find(|o| o.id == nb.id) {
            return Err(PlanError::BarrierIdReused {
                id: nb.id,
                first: first.name,
                second: nb.name,
            });
        }
        let roles_threads = nb.roles.iter().map(|&r| warps.threads(r)).sum();
        if nb.threads != roles_threads {
            return Err(PlanError::BarrierThreads {
                barrier: nb.name,
                threads: nb.threads,
                roles: nb.roles.clone(),
                roles_threads,
            });
        }
    }
    Ok(())
}

/// One K or V box: 64 d (one d-half) × 1 head × 128 keys of a key block.
pub(crate) const KV_BOX: [u32; 3] = [64, 1, 128];
/// One query row's 16 heads × 64 d (one d-half) of Q or dO.
pub(crate) const QDO_BOX: [u32; 3] = [64, 16, 1];

/// The design's pipelines (`docs/design.md` §3.4), in barrier-slot order.
pub fn design_pipelines() -> Vec<Pipeline> {
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
            // K and V, two d-halves each: 2 × (128×128 bf16).
            tx: boxes(KV_BOX, 4),
            declared_tx: Some(2 * 128 * 128 * 2),
            fills: vec![Buf::K, Buf::V],
            ..Pipeline::new("kv", 1, Load, &[Mma], 1, 1)
        },
        Pipeline {
            // 8 slots × 2 d-halves × {Q, dO}.
            tx: boxes(QDO_BOX, 32),
            declared_tx: Some(65_536),
            fills: vec![Buf::Q, Buf::DO],
            ..Pipeline::new("q_do", 2, Load, &[Mma], 1, 1)
        },
        Pipeline::new("rows", 2, Scalar, &[Compute, Reduce], 32, 256),
        Pipeline::new("s", 1, Mma, &[Compute], 1, 128),
        Pipeline::new("dp", 1, Mma, &[Compute], 1, 128),
        Pipeline::new("dq", 1, Mma, &[Reduce], 1, 128),
        Pipeline::new("dkv", 1, Mma, &[Reduce], 1, 128),
        Pipeline {
            chunk_groups: Some(ChunkGroups {
                starts: vec![0, 2, 3],
                chunks: 4,
            }),
            ..Pipeline::new("chunk", 3, Compute, &[Mma], 128, 1)
        },
    ]
}

/// The design's named barriers (`docs/design.md` §3.4).
pub fn design_barriers() -> Vec<NamedBarrier> {
    use Role::*;
    let nb = |name, id, threads, roles: &[Role]| NamedBarrier {
        name,
        id,
        threads,
        roles: roles.to_vec(),
    };
    vec![
        nb("tmem_alloc", 1, 288, &[Compute, Reduce, Mma]),
        nb("reduce_sync", 4, 128, &[Reduce]),
        nb("t2r_dq_done", 5, 160, &[Reduce, Mma]),
        nb("tmem_dealloc", 6, 256, &[Compute, Reduce]),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::roles::WarpPlan;
    use crate::plan::smem::SmemPlan;
    use crate::ptx::print;
    use crate::target::Target;

    fn warps() -> WarpPlan {
        WarpPlan::design().unwrap()
    }

    fn plan() -> PipelinePlan {
        PipelinePlan::new(design_pipelines(), &warps()).unwrap()
    }

    fn with(name: &str, edit: impl FnOnce(&mut Pipeline)) -> Result<PipelinePlan, PlanError> {
        let mut ps = design_pipelines();
        edit(ps.iter_mut().find(|p| p.name == name).unwrap());
        PipelinePlan::new(ps, &warps())
    }

    fn commit_marker(b: &mut KernelBuilder, _bar: &SharedAddr) {
        b.comment("tcgen05.commit");
    }

    fn emit(body: impl FnOnce(&mut KernelBuilder, &Barriers, Reg<U32>)) -> String {
        let mut b = KernelBuilder::new("t", Target::Sm100a, (512, 1, 1));
        let bars = Barriers {
            base: b.mov::<U32>(0u32),
            umma_commit: commit_marker,
        };
        let iter = b.mov::<U32>(0u32);
        body(&mut b, &bars, iter);
        print::body(&b.finish().unwrap())
    }

    #[test]
    fn design_pipelines_pass() {
        let p = plan();
        assert_eq!(p.barrier_slots(), 24);
        let kv = p.get("kv").unwrap();
        assert_eq!(kv.pipeline.tx_bytes(), 65_536);
        assert_eq!(p.get("q_do").unwrap().pipeline.tx_bytes(), 65_536);
        assert_eq!(p.get("q_do").unwrap().slot, 2);
        assert_eq!(p.get("chunk").unwrap().slot, 18);
        assert_eq!(kv.pipeline.signal(Side::Producer), Signal::Tma);
        assert_eq!(kv.pipeline.signal(Side::Consumer), Signal::UmmaCommit);
        let rows = p.get("rows").unwrap().pipeline;
        assert_eq!(rows.signal(Side::Consumer), Signal::Arrive);
        p.check_fills(&SmemPlan::design(24).unwrap()).unwrap();
        assert!(matches!(
            p.get("nope"),
            Err(PlanError::PipelineMissing { .. })
        ));
        check_named_barriers(&design_barriers(), &warps()).unwrap();
    }

    #[test]
    fn chunk_groups_map_chunks_to_stages() {
        let p = plan();
        let g = p
            .get("chunk")
            .unwrap()
            .pipeline
            .chunk_groups
            .clone()
            .unwrap();
        assert_eq!(
            (0..3).map(|s| g.chunks_of(s)).collect::<Vec<_>>(),
            vec![0..2, 2..3, 3..4]
        );
        assert_eq!(
            (0..4).map(|c| g.stage_of(c)).collect::<Vec<_>>(),
            [0, 0, 1, 2]
        );
        let published: Vec<_> = (0..4).map(|c| g.publishes_after(c)).collect();
        assert_eq!(published, [None, Some(0), Some(1), Some(2)]);
    }

    #[test]
    fn rejects_zero_stages() {
        let e = with("s", |p| p.stages = 0).unwrap_err();
        assert_eq!(
            e,
            PlanError::Stages {
                pipeline: "s",
                stages: 0
            }
        );
    }

    #[test]
    fn rejects_a_declared_tx_that_differs_from_the_boxes() {
        // Forgetting the second d-half: 16 boxes would be 32 KiB, not the declared 64 KiB.
        let e = with("q_do", |p| p.tx.truncate(16)).unwrap_err();
        assert_eq!(
            e,
            PlanError::TxMismatch {
                pipeline: "q_do",
                declared: 65_536,
                boxes: 32_768
            }
        );
        assert!(e.to_string().contains("declares 65536 tx bytes"), "{e}");
    }

    #[test]
    fn rejects_illegal_tma_boxes_and_tx_over_the_limit() {
        let e = with("kv", |p| p.tx[1].dims = vec![64, 1, 512]).unwrap_err();
        assert_eq!(
            e,
            PlanError::TmaBoxExtent {
                pipeline: "kv",
                index: 1,
                dim: 2,
                extent: 512
            }
        );
        let e = with("kv", |p| p.tx[0].dims = vec![128, 1, 64]).unwrap_err();
        assert_eq!(
            e,
            PlanError::TmaBoxInner {
                pipeline: "kv",
                index: 0,
                bytes: 256,
                limit: 128
            }
        );
        let e = with("kv", |p| p.tx[0].dims = vec![]).unwrap_err();
        assert!(matches!(e, PlanError::TmaBoxRank { rank: 0, .. }), "{e}");
        let e = with("kv", |p| {
            p.tx = vec![
                TmaBox {
                    dims: vec![64, 64, 128],
                    elem_bytes: 2
                };
                2
            ];
            p.declared_tx = None;
        })
        .unwrap_err();
        assert_eq!(
            e,
            PlanError::TxLimit {
                pipeline: "kv",
                bytes: 2 * 64 * 64 * 128 * 2,
                limit: TX_LIMIT
            }
        );
    }

    #[test]
    fn rejects_arrival_counts_inconsistent_with_the_roles() {
        // rows: the scalar warp's 32 threads (or 1 per warp) produce; 256 threads consume.
        let e = with("rows", |p| p.consumer_arrivals = 128).unwrap_err();
        assert_eq!(
            e,
            PlanError::Arrivals {
                pipeline: "rows",
                side: Side::Consumer,
                arrivals: 128,
                signal: "arriving per warpgroup, per warp or per thread,",
                // Compute's 128 threads and Reduce's 128, each per warpgroup, warp or thread.
                allowed: vec![2, 5, 8, 129, 132, 256]
            }
        );
        assert!(
            e.to_string()
                .contains("arrives 2 or 5 or 8 or 129 or 132 or 256 times"),
            "{e}"
        );
        assert!(with("rows", |p| p.consumer_arrivals = 8).is_ok());
        assert!(with("rows", |p| p.producer_arrivals = 1).is_ok());
        let e = with("rows", |p| p.producer_arrivals = 16).unwrap_err();
        assert!(matches!(
            e,
            PlanError::Arrivals {
                side: Side::Producer,
                ..
            }
        ));
        // A side of several roles: each role in its own granule (the SM90 forward's list:
        // one TMA lane of the load warp and every consumer thread).
        let warps = WarpPlan::design().unwrap();
        let mixed = Pipeline::new(
            "mixed",
            1,
            Role::Scalar,
            &[Role::Load, Role::Compute],
            32,
            129,
        );
        assert!(PipelinePlan::new(vec![mixed.clone()], &warps).is_ok());
        let e = PipelinePlan::new(
            vec![Pipeline {
                consumer_arrivals: 130,
                ..mixed
            }],
            &warps,
        )
        .unwrap_err();
        assert!(
            matches!(&e, PlanError::Arrivals { allowed, .. } if allowed == &[2, 5, 33, 36, 129, 160]),
            "{e}"
        );
        // TMA and tcgen05.commit signal with exactly one arrival.
        let e = with("kv", |p| p.producer_arrivals = 32).unwrap_err();
        assert!(matches!(e, PlanError::Arrivals { allowed, .. } if allowed == [1]));
        let e = with("s", |p| p.producer_arrivals = 32).unwrap_err();
        assert!(e.to_string().contains("tcgen05.commit"), "{e}");
    }

    #[test]
    fn rejects_idle_roles_and_duplicate_names() {
        let e = with("s", |p| p.consumers = vec![Role::Idle, Role::Compute]).unwrap_err();
        assert_eq!(
            e,
            PlanError::PipelineRole {
                pipeline: "s",
                side: Side::Consumer,
                role: Role::Idle
            }
        );
        assert!(e.to_string().contains("role idle has no work"), "{e}");
        let mut ps = design_pipelines();
        ps.push(Pipeline::new(
            "rows",
            1,
            Role::Scalar,
            &[Role::Compute],
            32,
            128,
        ));
        let e = PipelinePlan::new(ps, &warps()).unwrap_err();
        assert_eq!(e, PlanError::PipelineTwice { pipeline: "rows" });
    }

    #[test]
    fn rejects_bad_chunk_groups() {
        for starts in [vec![0, 2], vec![1, 2, 3], vec![0, 2, 2], vec![0, 2, 4]] {
            let e = with("chunk", |p| {
                p.chunk_groups.as_mut().unwrap().starts = starts.clone();
            })
            .unwrap_err();
            assert_eq!(
                e,
                PlanError::ChunkGroups {
                    pipeline: "chunk",
                    starts,
                    chunks: 4,
                    stages: 3
                }
            );
        }
    }

    #[test]
    fn rejects_fills_that_differ_from_the_tx() {
        let smem = SmemPlan::design(24).unwrap();
        let p = with("kv", |p| p.fills = vec![Buf::K]).unwrap();
        assert_eq!(
            p.check_fills(&smem).unwrap_err(),
            PlanError::TxFill {
                pipeline: "kv",
                tx: 65_536,
                buffers: vec![Buf::K],
                fills: 32_768
            }
        );
        let p = with("kv", |p| p.fills = vec![Buf::K, Buf::Q]).unwrap();
        assert_eq!(
            p.check_fills(&smem).unwrap_err(),
            PlanError::FillStages {
                pipeline: "kv",
                buffer: Buf::Q,
                buffer_stages: 2,
                stages: 1
            }
        );
    }

    #[test]
    fn rejects_named_barrier_ids_and_thread_counts() {
        let w = warps();
        let mut bs = design_barriers();
        bs[1].id = 0;
        assert_eq!(
            check_named_barriers(&bs, &w).unwrap_err(),
            PlanError::BarrierId {
                barrier: "reduce_sync",
                id: 0
            }
        );
        bs[1].id = 16;
        assert!(matches!(
            check_named_barriers(&bs, &w),
            Err(PlanError::BarrierId { id: 16, .. })
        ));
        let mut bs = design_barriers();
        bs[3].id = 5;
        assert_eq!(
            check_named_barriers(&bs, &w).unwrap_err(),
            PlanError::BarrierIdReused {
                id: 5,
                first: "t2r_dq_done",
                second: "tmem_dealloc"
            }
        );
        let mut bs = design_barriers();
        bs[2].threads = 128; // t2r_dQ_done is reduce (128) + MMA (32)
        let e = check_named_barriers(&bs, &w).unwrap_err();
        assert_eq!(
            e,
            PlanError::BarrierThreads {
                barrier: "t2r_dq_done",
                threads: 128,
                roles: vec![Role::Reduce, Role::Mma],
                roles_threads: 160
            }
        );
        assert!(e.to_string().contains("(reduce, mma) have 160"), "{e}");
    }

    #[test]
    fn rejects_a_round_stage_past_the_ring() {
        let p = plan();
        let mut b = KernelBuilder::new("t", Target::Sm100a, (512, 1, 1));
        let r = b.mov::<U32>(0u32);
        let chunk = p.get("chunk").unwrap();
        assert!(chunk.round(2, r).is_ok());
        assert_eq!(
            chunk.round(3, r).unwrap_err(),
            PlanError::StageIndex {
                pipeline: "chunk",
                stage: 3,
                stages: 3
            }
        );
    }

    #[test]
    fn two_stage_tma_pipeline_emits_parity_bookkeeping() {
        let p = plan();
        let q = p.get("q_do").unwrap();
        let text = emit(|b, bars, iter| {
            let st = q.producer_acquire(b, bars, iter);
            q.producer_commit(b, bars, &st);
            let st = q.consumer_wait(b, bars, iter);
            q.consumer_release(b, bars, &st);
        });
        // Slots: q_do is 2..6, so full = base + 16 + 8·stage, empty = base + 32 + 8·stage.
        let expected = "\
\tmov.u32 %r0, 0;
\tmov.u32 %r1, 0;
\tand.b32 %r2, %r1, 1;
\tshr.u32 %r3, %r1, 1;
\tand.b32 %r4, %r3, 1;
\tshl.b32 %r5, %r2, 3;
\tadd.u32 %r6, %r0, %r5;
\txor.b32 %r7, %r4, 1;
$L_0_mbar_wait:
\tmbarrier.try_wait.parity.shared::cta.b64 %p0, [%r6+32], %r7;
\t@!%p0 bra $L_0_mbar_wait;
\tmbarrier.arrive.expect_tx.shared::cta.b64 _, [%r6+16], 65536;
\tand.b32 %r8, %r1, 1;
\tshr.u32 %r9, %r1, 1;
\tand.b32 %r10, %r9, 1;
\tshl.b32 %r11, %r8, 3;
\tadd.u32 %r12, %r0, %r11;
$L_1_mbar_wait:
\tmbarrier.try_wait.parity.shared::cta.b64 %p1, [%r12+16], %r10;
\t@!%p1 bra $L_1_mbar_wait;
\t// tcgen05.commit
";
        assert_eq!(text, expected);
    }

    #[test]
    fn thread_and_commit_signals_and_rounds() {
        let p = plan();
        let rows = p.get("rows").unwrap();
        let chunk = p.get("chunk").unwrap();
        let s = p.get("s").unwrap();
        let text = emit(|b, bars, iter| {
            let st = rows.producer_acquire(b, bars, iter);
            rows.producer_commit(b, bars, &st); // scalar warp: mbarrier.arrive on full
            let at = chunk.round(1, iter).unwrap();
            let st = chunk.producer_acquire(b, bars, at);
            chunk.producer_commit(b, bars, &st);
            let st = s.producer_acquire(b, bars, iter);
            s.producer_commit(b, bars, &st); // MMA warp: tcgen05.commit
            let st = s.consumer_wait(b, bars, iter);
            s.consumer_release(b, bars, &st);
        });
        // chunk (slots 18..24) stage 1 in a round: full at 8·19, empty at 8·22, parity = round & 1.
        assert!(text.contains("[%r0+176], %r"), "{text}");
        assert!(
            text.contains("mbarrier.arrive.shared::cta.b64 _, [%r0+152];"),
            "{text}"
        );
        // s (slots 10..12) has one stage: parity = iter & 1, no stage arithmetic.
        assert!(text.contains("[%r0+88], %r"), "{text}");
        assert!(
            text.contains("mbarrier.arrive.shared::cta.b64 _, [%r0+88];"),
            "{text}"
        );
        assert_eq!(text.matches("// tcgen05.commit").count(), 1, "{text}");
        assert_eq!(text.matches("mbarrier.try_wait").count(), 4, "{text}");
        assert!(!text.contains("expect_tx"), "{text}");
    }

    #[test]
    fn three_stage_ring_divides_and_init_counts_follow_the_plan() {
        let ps = vec![Pipeline::new(
            "r3",
            3,
            Role::Compute,
            &[Role::Reduce],
            4,
            128,
        )];
        let p = PipelinePlan::new(ps, &warps()).unwrap();
        let r3 = p.get("r3").unwrap();
        let text = emit(|b, bars, iter| {
            r3.consumer_wait(b, bars, iter);
        });
        assert!(text.contains("rem.u32 %r2, %r1, 3;"), "{text}");
        assert!(text.contains("div.u32 %r3, %r1, 3;"), "{text}");

        let p = plan();
        let text = emit(|b, bars, _| p.emit_init(b, bars));
        assert_eq!(text.matches("mbarrier.init").count(), 24);
        assert!(
            text.contains("mbarrier.init.shared::cta.b64 [%r0+64], 256;"),
            "{text}"
        );
        assert!(
            text.contains("mbarrier.init.shared::cta.b64 [%r0+8], 1;"),
            "{text}"
        );
        assert!(
            text.ends_with("\tfence.mbarrier_init.release.cluster;\n"),
            "{text}"
        );
    }
}
