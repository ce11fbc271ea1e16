//! The tensor-memory plan: 128 lanes × up to 512 32-bit columns, split into named regions
//! (`docs/design.md` §3.3).
//!
//! Regions span all 128 lanes (lane = key row or head dim, the MMA's M). Overlapping regions
//! must be declared aliases: they share columns by design (P over S, dS over dP, dQ over
//! dP), and the kernel's pipelines order their uses. Aliasing is transitive: regions aliased
//! to one base may overlap each other (dQ and dS both lie over dP).

use super::PlanError;
use std::fmt;
use std::ops::Range;

/// TMEM lanes (rows).
pub const LANES: u32 = 128;
/// Lanes one warp may access: those of its quadrant.
pub const QUADRANT_LANES: u32 = 32;
/// Smallest allocation in columns.
pub const MIN_ALLOC_COLS: u32 = 32;
/// Largest allocation in columns.
pub const MAX_ALLOC_COLS: u32 = 512;

/// A named TMEM region of the design.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TmemRegion {
    /// S^T accumulator (fp32, lane = key, column = folded row).
    S,
    /// P^T as packed bf16 pairs over S (the A operand of dV).
    P,
    /// dP^T accumulator.
    DP,
    /// dS^T as packed bf16 pairs over dP (the A operand of dK).
    DS,
    /// dQ^T accumulator over dP (lane = head dim).
    DQ,
    /// dV accumulator, kept across a segment.
    DV,
    /// dK accumulator, kept across a segment.
    DK,
    /// O accumulator of the forward (fp32, lane = folded query row, column = head dim).
    O,
    /// The forward's second S stage (S itself is the first).
    S1,
    /// P over [`TmemRegion::S1`].
    P1,
}

impl fmt::Display for TmemRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TmemRegion::S => "S",
            TmemRegion::P => "P",
            TmemRegion::DP => "dP",
            TmemRegion::DS => "dS",
            TmemRegion::DQ => "dQ",
            TmemRegion::DV => "dV",
            TmemRegion::DK => "dK",
            TmemRegion::O => "O",
            TmemRegion::S1 => "S1",
            TmemRegion::P1 => "P1",
        })
    }
}

/// A region: columns `col .. col + cols` of every lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Which region.
    pub id: TmemRegion,
    /// First column.
    pub col: u32,
    /// Columns.
    pub cols: u32,
}

impl Region {
    fn columns(&self) -> Range<u32> {
        self.col..self.col + self.cols
    }
}

/// A TMEM address: lane in bits 16–31, column in bits 0–15.
pub fn addr(lane: u32, col: u32) -> u32 {
    (lane << 16) | col
}

/// The allocation and its regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TmemPlan {
    alloc_cols: u32,
    regions: Vec<Region>,
    aliases: Vec<(TmemRegion, TmemRegion)>,
}

impl TmemPlan {
    /// Checks and returns a plan. `aliases` lists pairs (region, the region it lies over).
    ///
    /// Rejects: an allocation that is not a power of two in 32..=512; an empty region or one
    /// outside the allocation; a region declared twice; overlapping regions that are not
    /// (transitively) declared aliases.
    pub fn new(
        alloc_cols: u32,
        regions: Vec<Region>,
        aliases: Vec<(TmemRegion, TmemRegion)>,
    ) -> Result<Self, PlanError> {
        if !alloc_cols.is_power_of_two() || !(MIN_ALLOC_COLS..=MAX_ALLOC_COLS).contains(&alloc_cols)
        {
            return Err(PlanError::TmemAllocCols { cols: alloc_cols });
        }
        for (i, r) in regions.iter().enumerate() {
            if r.cols == 0 || r.col.checked_add(r.cols).is_none_or(|end| end > alloc_cols) {
                return Err(PlanError::TmemRegionBounds {
                    region: r.id,
                    start: r.col,
                    end: r.col.saturating_add(r.cols),
                    alloc: alloc_cols,
                });
            }
            if regions[..i].iter().any(|q| q.id == r.id) {
                return Err(PlanError::TmemRegionTwice { region: r.id });
            }
        }
        let plan = TmemPlan {
            alloc_cols,
            regions,
            aliases,
        };
        for (i, a) in plan.regions.iter().enumerate() {
            for b in &plan.regions[i + 1..] {
                let start = a.col.max(b.col);
                let end = (a.col + a.cols).min(b.col + b.cols);
                if start < end && plan.group(a.id) != plan.group(b.id) {
                    return Err(PlanError::TmemOverlap {
                        a: a.id,
                        b: b.id,
                        start,
                        end,
                    });
                }
            }
        }
        Ok(plan)
    }

    /// The design: 512 columns; S at 0 with P^T (128 bf16 per lane = 64 columns) over it;
    /// dP at 128 with dS^T (64 columns) and dQ^T (128 columns) over it; dV at 256; dK at 384.
    pub fn design() -> Result<Self, PlanError> {
        use TmemRegion::*;
        let r = |id, col, cols| Region { id, col, cols };
        TmemPlan::new(
            512,
            vec![
                r(S, 0, 128),
                r(P, 0, 64),
                r(DP, 128, 128),
                r(DS, 128, 64),
                r(DQ, 128, 128),
                r(DV, 256, 128),
                r(DK, 384, 128),
            ],
            vec![(P, S), (DS, DP), (DQ, DP)],
        )
    }

    /// The alias group of `id`: the smallest region id reachable through declared aliases.
    fn group(&self, id: TmemRegion) -> TmemRegion {
        let mut group = vec![id];
        loop {
            let before = group.len();
            for &(a, b) in &self.aliases {
                for (x, y) in [(a, b), (b, a)] {
                    if group.contains(&x) && !group.contains(&y) {
                        group.push(y);
                    }
                }
            }
            if group.len() == before {
                return group.into_iter().min().unwrap_or(id);
            }
        }
    }

    /// Columns to allocate (the `tcgen05.alloc` operand).
    pub fn alloc_cols(&self) -> u32 {
        self.alloc_cols
    }

    /// Every region.
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// Region `id`.
    pub fn region(&self, id: TmemRegion) -> Result<Region, PlanError> {
        self.regions
            .iter()
            .copied()
            .find(|r| r.id == id)
            .ok_or(PlanError::TmemRegionMissing { region: id })
    }

    /// Whether regions `a` and `b` share a column.
    pub fn overlaps(&self, a: TmemRegion, b: TmemRegion) -> Result<bool, PlanError> {
        let (a, b) = (self.region(a)?.columns(), self.region(b)?.columns());
        Ok(a.start.max(b.start) < a.end.min(b.end))
    }

    /// Checks that `warp` accesses only lanes of its quadrant, `32·(warp % 4) .. +32`
    /// (`tcgen05.ld`/`st` fault otherwise).
    pub fn check_access(&self, warp: u32, lanes: Range<u32>) -> Result<(), PlanError> {
        let allowed_start = QUADRANT_LANES * (warp % 4);
        let allowed_end = allowed_start + QUADRANT_LANES;
        if lanes.is_empty() || lanes.start < allowed_start || lanes.end > allowed_end {
            return Err(PlanError::TmemLanes {
                warp,
                start: lanes.start,
                end: lanes.end,
                allowed_start,
                allowed_end,
            });
        }
        Ok(())
    }

    /// Offset of `warp`'s quadrant of region `id` from the allocation's base address (the
    /// `tcgen05.alloc` result is lane 0, so the offset is added to it).
    pub fn warp_offset(&self, warp: u32, id: TmemRegion) -> Result<u32, PlanError> {
        Ok(addr(QUADRANT_LANES * (warp % 4), self.region(id)?.col))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TmemRegion::*;

    fn design_regions() -> Vec<Region> {
        TmemPlan::design().unwrap().regions().to_vec()
    }

    fn design_aliases() -> Vec<(TmemRegion, TmemRegion)> {
        vec![(P, S), (DS, DP), (DQ, DP)]
    }

    #[test]
    fn design_plan_passes() {
        let t = TmemPlan::design().unwrap();
        assert_eq!(t.alloc_cols(), 512);
        let cols: Vec<u32> = [S, DP, DV, DK].map(|r| t.region(r).unwrap().col).to_vec();
        assert_eq!(cols, vec![0, 128, 256, 384]);
        assert!(t.overlaps(DQ, DS).unwrap()); // allowed through dP
        assert!(!t.overlaps(DV, DK).unwrap());
    }

    #[test]
    fn rejects_allocation_sizes() {
        for cols in [0, 16, 48, 384, 1024] {
            let e = TmemPlan::new(cols, vec![], vec![]).unwrap_err();
            assert_eq!(e, PlanError::TmemAllocCols { cols });
        }
        for cols in [32, 64, 128, 256, 512] {
            assert!(TmemPlan::new(cols, vec![], vec![]).is_ok());
        }
    }

    #[test]
    fn rejects_regions_outside_the_allocation() {
        let e = TmemPlan::new(256, design_regions(), design_aliases()).unwrap_err();
        assert_eq!(
            e,
            PlanError::TmemRegionBounds {
                region: DV,
                start: 256,
                end: 384,
                alloc: 256
            }
        );
        assert!(e.to_string().contains("256-column allocation"), "{e}");
        let empty = vec![Region {
            id: S,
            col: 0,
            cols: 0,
        }];
        assert!(matches!(
            TmemPlan::new(512, empty, vec![]),
            Err(PlanError::TmemRegionBounds { .. })
        ));
    }

    #[test]
    fn rejects_undeclared_overlap() {
        let mut regions = design_regions();
        regions.iter_mut().find(|r| r.id == DV).unwrap().col = 192;
        let e = TmemPlan::new(512, regions, design_aliases()).unwrap_err();
        assert_eq!(
            e,
            PlanError::TmemOverlap {
                a: DP,
                b: DV,
                start: 192,
                end: 256
            }
        );
        // Dropping the dQ-over-dP alias makes dQ's overlap with dP and dS undeclared.
        let e = TmemPlan::new(512, design_regions(), vec![(P, S), (DS, DP)]).unwrap_err();
        assert!(
            matches!(e, PlanError::TmemOverlap { a: DP, b: DQ, .. }),
            "{e}"
        );
    }

    #[test]
    fn rejects_a_region_declared_twice_and_a_missing_one() {
        let mut regions = design_regions();
        regions.push(regions[0]);
        let e = TmemPlan::new(512, regions, design_aliases()).unwrap_err();
        assert_eq!(e, PlanError::TmemRegionTwice { region: S });
        let t = TmemPlan::new(512, vec![], vec![]).unwrap();
        assert_eq!(
            t.region(DK).unwrap_err(),
            PlanError::TmemRegionMissing { region: DK }
        );
    }

    #[test]
    fn rejects_cross_quadrant_access() {
        let t = TmemPlan::design().unwrap();
        assert!(t.check_access(4, 0..32).is_ok());
        assert!(t.check_access(9, 40..48).is_ok());
        assert!(t.check_access(11, 96..128).is_ok());
        let e = t.check_access(5, 0..32).unwrap_err();
        assert_eq!(
            e,
            PlanError::TmemLanes {
                warp: 5,
                start: 0,
                end: 32,
                allowed_start: 32,
                allowed_end: 64
            }
        );
        assert!(e.to_string().contains("lanes 32..64"), "{e}");
        assert!(t.check_access(6, 60..70).is_err());
        assert!(t.check_access(12, 0..0).is_err());
    }

    #[test]
    fn addresses_put_the_lane_above_the_column() {
        assert_eq!(addr(0, 0), 0);
        assert_eq!(addr(32, 384), 0x0020_0180);
        assert_eq!(addr(127, 511), 0x007F_01FF);
        let t = TmemPlan::design().unwrap();
        assert_eq!(t.warp_offset(7, DV).unwrap(), (96 << 16) | 256);
        assert_eq!(t.warp_offset(8, DQ).unwrap(), 128);
    }
}
