//! The shared-memory plan: buffers with deterministic offsets, and K-/MN-major views.
//!
//! Tiles are 128×128 bf16 (32 KiB) stored as two SW128 panels of `[128 rows][64 columns]`
//! (panel 1 at +16 KiB), 1024-B aligned so that descriptors need no base offset. A view is a
//! descriptor over one buffer's bytes — the same tile read K-major by one GEMM and MN-major
//! by another — never a copy.

use super::PlanError;
use crate::ptx::{shared, KernelBuilder, Reg, SharedAddr, U32};
use std::fmt;

/// Largest shared memory of a CTA on sm_100 (227 KiB).
pub const SMEM_LIMIT: u32 = crate::ptx::MAX_SHARED_BYTES;
/// Rows (and columns) of a tile.
pub const TILE_ROWS: u32 = 128;
/// Bytes of one 128×128 bf16 tile.
pub const TILE_BYTES: u32 = TILE_ROWS * TILE_ROWS * 2;
/// Bytes of one `[128 rows][64 bf16]` SW128 panel.
pub const PANEL_BYTES: u32 = TILE_ROWS * 128;
/// Alignment of tiles: one SW128 swizzle pattern (8 rows × 128 B).
pub const TILE_ALIGN: u32 = 1024;
/// Bytes of one mbarrier.
pub const BARRIER_BYTES: u32 = 8;

/// A shared buffer of the design.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Buf {
    /// K tile of the segment.
    K,
    /// V tile of the segment.
    V,
    /// Q tiles (folded rows × head dim), one per stage.
    Q,
    /// dO tiles, one per stage.
    DO,
    /// dS tile (key × folded), the B operand of dQ^T.
    PdS,
    /// `−LSE·log2e` per folded row, per stage.
    Lse,
    /// Delta per folded row, per stage.
    Delta,
    /// The 8 query rows of a task, per stage.
    QRows,
    /// The 8 query positions of a task, per stage.
    QPos,
    /// The deterministic mode's inverse dQ units of a task's 8 query slots, per stage.
    DqInv,
    /// The mbarrier array of every pipeline.
    Barriers,
    /// The word `tcgen05.alloc` writes the TMEM base address to.
    TmemAddr,
    /// The forward's per-item block list (the union of its queries' blocks), per stage.
    List,
    /// The forward list builder's scratch (candidates and the slots' first blocks).
    ListScratch,
    /// The forward's per-row running max and sum at an item's end (`[m; 128]`, `[l; 128]`).
    Stats,
    /// Rows staged as bf16 SW128 boxes for a TMA reduce-add (the KV forward's O, 4 KB a warp).
    OStage,
}

impl fmt::Display for Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Buf::K => "sK",
            Buf::V => "sV",
            Buf::Q => "sQ",
            Buf::DO => "sdO",
            Buf::PdS => "sPdS",
            Buf::Lse => "sLSE",
            Buf::Delta => "sDelta",
            Buf::QRows => "sQRows",
            Buf::QPos => "sQPos",
            Buf::DqInv => "sDqInv",
            Buf::Barriers => "mbarriers",
            Buf::TmemAddr => "tmem_addr",
            Buf::List => "sList",
            Buf::ListScratch => "sListScratch",
            Buf::Stats => "sStats",
            Buf::OStage => "sOStage",
        })
    }
}

/// What a buffer holds, which decides its alignment rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufKind {
    /// 128×128 bf16 SW128 tiles: 1024-B aligned offset and stage size.
    Tile,
    /// fp32/int32 vectors.
    Scalar,
    /// 8-byte mbarriers.
    Barrier,
}

impl fmt::Display for BufKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BufKind::Tile => "tile",
            BufKind::Scalar => "scalar",
            BufKind::Barrier => "barrier",
        })
    }
}

/// A buffer to place: `stages` consecutive stages of `stage_bytes` each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferSpec {
    /// Which buffer.
    pub id: Buf,
    /// What it holds.
    pub kind: BufKind,
    /// Bytes of one stage.
    pub stage_bytes: u32,
    /// Stages.
    pub stages: u32,
    /// Alignment of the buffer in bytes.
    pub align: u32,
}

impl BufferSpec {
    /// `stages` 128×128 bf16 tiles.
    pub fn tile(id: Buf, stages: u32) -> Self {
        BufferSpec {
            id,
            kind: BufKind::Tile,
            stage_bytes: TILE_BYTES,
            stages,
            align: TILE_ALIGN,
        }
    }

    /// `stages` vectors of `len` 4-byte elements, 16-B aligned for vector access.
    pub fn scalar(id: Buf, len: u32, stages: u32) -> Self {
        BufferSpec {
            id,
            kind: BufKind::Scalar,
            stage_bytes: 4 * len,
            stages,
            align: 16,
        }
    }

    /// `slots` mbarriers.
    pub fn barriers(slots: u32) -> Self {
        BufferSpec {
            id: Buf::Barriers,
            kind: BufKind::Barrier,
            stage_bytes: BARRIER_BYTES * slots,
            stages: 1,
            align: BARRIER_BYTES,
        }
    }

    /// Total bytes.
    pub fn bytes(&self) -> u32 {
        self.stage_bytes * self.stages
    }
}

/// A buffer at its offset from the dynamic shared array's base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    /// The buffer.
    pub spec: BufferSpec,
    /// Byte offset.
    pub offset: u32,
}

impl Placed {
    /// Offset of stage `stage`.
    pub fn stage_offset(&self, stage: u32) -> u32 {
        self.offset + stage * self.spec.stage_bytes
    }

    /// Emits the shared-window address of stage `stage` given the array's base address.
    pub fn emit_stage_addr(
        &self,
        b: &mut KernelBuilder,
        base: Reg<U32>,
        stage: Reg<U32>,
    ) -> Reg<U32> {
        let off = b.mad_lo(stage, self.spec.stage_bytes, self.offset);
        b.add(base, off)
    }

    /// `[base + offset + stage·stage_bytes]` for a stage known at codegen time.
    pub fn at(&self, base: Reg<U32>, stage: u32) -> SharedAddr {
        shared(base, self.stage_offset(stage) as i64)
    }

    /// Stage `index` at `base`: the fixed stage 0 when the buffer has one stage (no
    /// instruction), else [`Placed::emit_stage_addr`].
    pub fn stage_at(&self, b: &mut KernelBuilder, base: Reg<U32>, index: Reg<U32>) -> SharedAddr {
        if self.spec.stages == 1 {
            self.at(base, 0)
        } else {
            shared(self.emit_stage_addr(b, base, index), 0)
        }
    }
}

/// Operand majorness: which dimension is contiguous along a tile's 128-B rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Major {
    /// The reduction dimension K is contiguous.
    K,
    /// The M (or N) dimension is contiguous.
    MN,
}

/// A K- or MN-major view of one tile buffer: what a shared-memory descriptor reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct View {
    /// The buffer whose bytes are read.
    pub buffer: Buf,
    /// How they are read.
    pub major: Major,
}

/// Buffers at their offsets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SmemPlan {
    buffers: Vec<Placed>,
    total: u32,
}

impl SmemPlan {
    /// Places `specs` in order, each at the next offset its alignment allows, and checks the
    /// result (see [`Self::placed`]).
    pub fn layout(specs: Vec<BufferSpec>) -> Result<Self, PlanError> {
        let mut next = 0u32;
        let mut placed = Vec::new();
        for spec in specs {
            if !spec.align.is_power_of_two() {
                return Err(PlanError::SmemAlignValue {
                    buffer: spec.id,
                    align: spec.align,
                });
            }
            let offset = next.next_multiple_of(spec.align);
            next = offset + spec.bytes();
            placed.push(Placed { spec, offset });
        }
        SmemPlan::placed(placed)
    }

    /// Checks buffers at explicit offsets.
    ///
    /// Rejects: an alignment that is not a power of two; an offset that is not a multiple of
    /// the buffer's alignment; a tile whose alignment or stage size is not a multiple of
    /// 1024 B; a buffer declared twice; overlapping buffers; a total above 232,448 B.
    pub fn placed(buffers: Vec<Placed>) -> Result<Self, PlanError> {
        for (i, p) in buffers.iter().enumerate() {
            let s = &p.spec;
            if !s.align.is_power_of_two() {
                return Err(PlanError::SmemAlignValue {
                    buffer: s.id,
                    align: s.align,
                });
            }
            let mut rules = vec![("offset", p.offset, s.align)];
            if s.kind == BufKind::Tile {
                rules.extend([
                    ("alignment", s.align, TILE_ALIGN),
                    ("offset", p.offset, TILE_ALIGN),
                    ("stage size", s.stage_bytes, TILE_ALIGN),
                ]);
            }
            for (what, value, align) in rules {
                if value % align != 0 {
                    return Err(PlanError::SmemAlign {
                        buffer: s.id,
                        what,
                        value,
                        align,
                    });
                }
            }
            for q in &buffers[..i] {
                if q.spec.id == s.id {
                    return Err(PlanError::SmemBufferTwice { buffer: s.id });
                }
                let start = p.offset.max(q.offset);
                let end = (p.offset + s.bytes()).min(q.offset + q.spec.bytes());
                if start < end {
                    return Err(PlanError::SmemOverlap {
                        a: q.spec.id,
                        b: s.id,
                        start,
                        end,
                    });
                }
            }
        }
        let total = buffers
            .iter()
            .map(|p| p.offset + p.spec.bytes())
            .max()
            .unwrap_or(0);
        if total > SMEM_LIMIT {
            return Err(PlanError::SmemTotal {
                total,
                limit: SMEM_LIMIT,
            });
        }
        Ok(SmemPlan { buffers, total })
    }

    /// The design's buffers (`docs/design.md` §3.3): sK, sV, sQ×2, sdO×2, sPdS; sLSE and sDelta
    /// `[2][128]` fp32; sQRows and sQPos `[2][8]` int32; `barrier_slots` mbarriers; the TMEM
    /// address word.
    pub fn design(barrier_slots: u32) -> Result<Self, PlanError> {
        SmemPlan::layout(vec![
            BufferSpec::tile(Buf::K, 1),
            BufferSpec::tile(Buf::V, 1),
            BufferSpec::tile(Buf::Q, 2),
            BufferSpec::tile(Buf::DO, 2),
            BufferSpec::tile(Buf::PdS, 1),
            BufferSpec::scalar(Buf::Lse, TILE_ROWS, 2),
            BufferSpec::scalar(Buf::Delta, TILE_ROWS, 2),
            BufferSpec::scalar(Buf::QRows, 8, 2),
            BufferSpec::scalar(Buf::QPos, 8, 2),
            BufferSpec::barriers(barrier_slots),
            BufferSpec {
                id: Buf::TmemAddr,
                kind: BufKind::Scalar,
                stage_bytes: 4,
                stages: 1,
                align: 4,
            },
        ])
    }

    /// Bytes the plan needs (the dynamic shared size to launch with).
    pub fn total(&self) -> u32 {
        self.total
    }

    /// Every buffer, in placement order.
    pub fn buffers(&self) -> &[Placed] {
        &self.buffers
    }

    /// Buffer `id`.
    pub fn buffer(&self, id: Buf) -> Result<&Placed, PlanError> {
        self.buffers
            .iter()
            .find(|p| p.spec.id == id)
            .ok_or(PlanError::SmemBufferMissing { buffer: id })
    }

    /// Offset of buffer `id`.
    pub fn offset(&self, id: Buf) -> Result<u32, PlanError> {
        Ok(self.buffer(id)?.offset)
    }

    /// mbarrier slots of the barrier array.
    pub fn barrier_slots(&self) -> Result<u32, PlanError> {
        Ok(self.buffer(Buf::Barriers)?.spec.bytes() / BARRIER_BYTES)
    }

    /// A `major` view of tile buffer `id`; rejects buffers that are not tiles.
    pub fn view(&self, id: Buf, major: Major) -> Result<View, PlanError> {
        let kind = self.buffer(id)?.spec.kind;
        if kind != BufKind::Tile {
            return Err(PlanError::SmemView { buffer: id, kind });
        }
        Ok(View { buffer: id, major })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn design_plan_passes() {
        let s = SmemPlan::design(24).unwrap();
        let offsets: Vec<u32> = [Buf::K, Buf::V, Buf::Q, Buf::DO, Buf::PdS, Buf::Lse]
            .map(|b| s.offset(b).unwrap())
            .to_vec();
        assert_eq!(
            offsets,
            vec![0, 32768, 65536, 131072, 196608, 7 * TILE_BYTES]
        );
        // 7 tiles + 2·1 KiB + 2·64 B + 24 barriers + the TMEM word.
        assert_eq!(s.total(), 7 * TILE_BYTES + 2048 + 128 + 192 + 4);
        assert_eq!(s.barrier_slots().unwrap(), 24);
        assert_eq!(s.buffer(Buf::Q).unwrap().stage_offset(1), 98304);
        // Deterministic: the same inputs give the same layout.
        assert_eq!(s, SmemPlan::design(24).unwrap());
    }

    #[test]
    fn views_are_descriptors_over_one_buffer() {
        let s = SmemPlan::design(24).unwrap();
        let k = s.view(Buf::Q, Major::K).unwrap();
        let mn = s.view(Buf::Q, Major::MN).unwrap();
        assert_eq!(k.buffer, mn.buffer);
        assert_ne!(k, mn);
        let e = s.view(Buf::Lse, Major::K).unwrap_err();
        assert_eq!(
            e,
            PlanError::SmemView {
                buffer: Buf::Lse,
                kind: BufKind::Scalar
            }
        );
        assert!(e.to_string().contains("only 128×128 bf16 tiles"), "{e}");
        assert_eq!(
            SmemPlan::layout(vec![]).unwrap().view(Buf::K, Major::K),
            Err(PlanError::SmemBufferMissing { buffer: Buf::K })
        );
    }

    #[test]
    fn rejects_misaligned_tiles() {
        let tile = BufferSpec::tile(Buf::K, 1);
        let e = SmemPlan::placed(vec![Placed {
            spec: tile,
            offset: 512,
        }])
        .unwrap_err();
        assert_eq!(
            e,
            PlanError::SmemAlign {
                buffer: Buf::K,
                what: "offset",
                value: 512,
                align: 1024
            }
        );
        let weak = BufferSpec { align: 128, ..tile };
        let e = SmemPlan::layout(vec![weak]).unwrap_err();
        assert!(
            matches!(
                e,
                PlanError::SmemAlign {
                    what: "alignment",
                    value: 128,
                    ..
                }
            ),
            "{e}"
        );
        // A stage size off the 1 KiB grid would misalign stage 1.
        let odd = BufferSpec {
            stage_bytes: TILE_BYTES + 16,
            ..BufferSpec::tile(Buf::Q, 2)
        };
        let e = SmemPlan::layout(vec![odd]).unwrap_err();
        assert!(
            matches!(
                e,
                PlanError::SmemAlign {
                    what: "stage size",
                    ..
                }
            ),
            "{e}"
        );
        let bad = BufferSpec {
            align: 24,
            ..BufferSpec::scalar(Buf::Lse, 128, 2)
        };
        assert_eq!(
            SmemPlan::layout(vec![bad]).unwrap_err(),
            PlanError::SmemAlignValue {
                buffer: Buf::Lse,
                align: 24
            }
        );
    }

    #[test]
    fn rejects_a_plan_over_the_limit() {
        let mut specs: Vec<BufferSpec> = [Buf::K, Buf::V, Buf::PdS]
            .map(|b| BufferSpec::tile(b, 1))
            .to_vec();
        specs.extend([BufferSpec::tile(Buf::Q, 2), BufferSpec::tile(Buf::DO, 3)]);
        let e = SmemPlan::layout(specs).unwrap_err();
        assert_eq!(
            e,
            PlanError::SmemTotal {
                total: 8 * TILE_BYTES,
                limit: 232_448
            }
        );
        assert!(e.to_string().contains("262144 B"), "{e}");
        // The design with far more barriers than fit also fails.
        assert!(matches!(
            SmemPlan::design(200),
            Err(PlanError::SmemTotal { .. })
        ));
    }

    #[test]
    fn rejects_overlap_and_duplicates() {
        let e = SmemPlan::placed(vec![
            Placed {
                spec: BufferSpec::tile(Buf::Q, 2),
                offset: 0,
            },
            Placed {
                spec: BufferSpec::tile(Buf::DO, 1),
                offset: TILE_BYTES,
            },
        ])
        .unwrap_err();
        assert_eq!(
            e,
            PlanError::SmemOverlap {
                a: Buf::Q,
                b: Buf::DO,
                start: TILE_BYTES,
                end: 2 * TILE_BYTES
            }
        );
        let e = SmemPlan::layout(vec![
            BufferSpec::tile(Buf::K, 1),
            BufferSpec::tile(Buf::K, 1),
        ])
        .unwrap_err();
        assert_eq!(e, PlanError::SmemBufferTwice { buffer: Buf::K });
    }
}
