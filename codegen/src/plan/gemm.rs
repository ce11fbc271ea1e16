//! tcgen05 instruction descriptors, shared-memory matrix descriptors and the five GEMMs
//! (`docs/design.md` §3.3; sm100-ptx.md §5.4–§5.5).
//!
//! Every GEMM is 128×128×128, bf16 in, fp32 accumulated in TMEM, `cta_group::1`, issued as
//! eight K=16 MMAs. Shared operands are 128×128 bf16 tiles in two SW128 panels; a K-major
//! and an MN-major descriptor over the same tile differ only in LBO and in the K-step.

use super::smem::{Buf, Major, SmemPlan, View, PANEL_BYTES, TILE_ROWS};
use super::tmem::{TmemPlan, TmemRegion};
use super::PlanError;
use crate::ptx::{KernelBuilder, Reg, B64, U32, U64};
use crate::target::Target;

/// K of one tcgen05.mma kind::f16.
pub const MMA_K: u32 = 16;
/// TMEM columns one K=16 step of a TMEM A operand spans (two bf16 per 32-bit column).
pub const TMEM_A_COLS_PER_STEP: u32 = MMA_K / 2;
/// Bytes of one 8-row group of a SW128 tile (the stride-dimension byte offset).
pub const SW128_ATOM_BYTES: u32 = 8 * 128;

/// Accumulator (D) format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccFormat {
    /// fp16 (code 0).
    F16 = 0,
    /// fp32 (code 1).
    F32 = 1,
}

/// Input (A/B) format of kind::f16.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InFormat {
    /// fp16 (code 0).
    F16 = 0,
    /// bf16 (code 1).
    Bf16 = 1,
}

/// The 32-bit instruction descriptor of `tcgen05.mma.kind::f16` (dense, no negation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InstrDesc {
    /// D format (bits 4–5).
    pub d: AccFormat,
    /// A format (bits 7–9).
    pub a: InFormat,
    /// B format (bits 10–12).
    pub b: InFormat,
    /// A major (bit 15: 1 = MN-major).
    pub a_major: Major,
    /// B major (bit 16: 1 = MN-major).
    pub b_major: Major,
    /// M (bits 24–28 hold M >> 4).
    pub m: u32,
    /// N (bits 17–22 hold N >> 3).
    pub n: u32,
}

fn check_shape(gemm: &'static str, m: u32, n: u32, k: u32) -> Result<(), PlanError> {
    let n_ok = match m {
        64 => n.is_multiple_of(8) && (8..=256).contains(&n),
        128 => n.is_multiple_of(16) && (16..=256).contains(&n),
        _ => false,
    };
    if !n_ok || k == 0 || !k.is_multiple_of(MMA_K) {
        return Err(PlanError::MmaShape { gemm, m, n, k });
    }
    Ok(())
}

impl InstrDesc {
    /// bf16 × bf16 → fp32 with the given majors and M×N (K = 16 per instruction); rejects
    /// shapes `cta_group::1` does not have.
    pub fn bf16(m: u32, n: u32, a_major: Major, b_major: Major) -> Result<Self, PlanError> {
        check_shape("(instruction descriptor)", m, n, MMA_K)?;
        Ok(InstrDesc {
            d: AccFormat::F32,
            a: InFormat::Bf16,
            b: InFormat::Bf16,
            a_major,
            b_major,
            m,
            n,
        })
    }

    /// The descriptor word.
    pub fn bits(&self) -> u32 {
        let mn = |m: Major| (m == Major::MN) as u32;
        (self.d as u32) << 4
            | (self.a as u32) << 7
            | (self.b as u32) << 10
            | mn(self.a_major) << 15
            | mn(self.b_major) << 16
            | (self.n >> 3) << 17
            | (self.m >> 4) << 24
    }
}

/// A 64-bit shared-memory matrix descriptor for a 128-B-swizzled operand, in the SM100
/// (`tcgen05`) or Hopper (`wgmma`) encoding. The start address is supplied per use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SmemDesc {
    target: Target,
    major: Major,
    lbo: u32,
    sbo: u32,
    panel_bytes: u32,
}

impl SmemDesc {
    /// Exclusive bound of LBO and SBO: 14-bit fields in 16-B units.
    pub const FIELD_LIMIT: u32 = 1 << 18;

    /// A descriptor with leading/stride byte offsets `lbo`/`sbo`; `panel_bytes` is the
    /// stride between 64-element panels that K-major K-steps jump by. Rejects offsets that
    /// are not multiples of 16 below 2^18.
    pub fn new(
        target: Target,
        major: Major,
        lbo: u32,
        sbo: u32,
        panel_bytes: u32,
    ) -> Result<Self, PlanError> {
        for (field, value) in [("LBO", lbo), ("SBO", sbo), ("panel stride", panel_bytes)] {
            if value % 16 != 0 || value >= Self::FIELD_LIMIT {
                return Err(PlanError::DescField {
                    field,
                    value,
                    limit: Self::FIELD_LIMIT,
                });
            }
        }
        Ok(SmemDesc {
            target,
            major,
            lbo,
            sbo,
            panel_bytes,
        })
    }

    /// The descriptor of a `major` view of a 128×128 bf16 tile in two `[128][64]` SW128
    /// panels: SBO = 1024 B (8 rows of 128 B); LBO = 16 B (ignored) K-major, the panel
    /// stride MN-major.
    pub fn sw128_tile(target: Target, major: Major) -> Self {
        SmemDesc {
            target,
            major,
            lbo: match major {
                Major::K => 16,
                Major::MN => PANEL_BYTES,
            },
            sbo: SW128_ATOM_BYTES,
            panel_bytes: PANEL_BYTES,
        }
    }

    /// The upper word: SBO >> 4 in bits 32–45; SM100 adds the fixed version bit 46 and the
    /// 3-bit swizzle code 2 (128 B) at bits 61–63, Hopper the 2-bit layout type 1 (128 B) at
    /// bits 62–63 — the same pattern, written as different fields.
    pub fn hi(&self) -> u32 {
        let sbo = self.sbo >> 4;
        match self.target {
            Target::Sm100a => sbo | 1 << (46 - 32) | 2 << (61 - 32),
            Target::Sm90a => sbo | 1 << (62 - 32),
        }
    }

    /// The lower word for a start address: `(addr >> 4)` in bits 0–13, LBO >> 4 in 16–29.
    pub fn lo(&self, addr: u32) -> u32 {
        ((addr >> 4) & 0x3FFF) | (self.lbo >> 4) << 16
    }

    /// The whole descriptor for a start address.
    pub fn word(&self, addr: u32) -> u64 {
        (self.hi() as u64) << 32 | self.lo(addr) as u64
    }

    /// Bytes the start address advances for K step `k` (K = 16 elements per step). K-major:
    /// 32 B inside the 128-B row for `k % 4`, then a panel per 4 steps (SW128 applies to
    /// absolute address bits, so moving the start inside an atom is exact). MN-major: 16 rows
    /// of 128 B per step.
    pub fn k_step_bytes(&self, k: u32) -> u32 {
        match self.major {
            Major::K => (k / 4) * self.panel_bytes + (k % 4) * 32,
            Major::MN => k * MMA_K * 128,
        }
    }

    /// Emits the descriptor of the operand at shared-window address `addr`.
    pub fn emit(&self, b: &mut KernelBuilder, addr: Reg<U32>) -> Reg<B64> {
        let lo = b.shr(addr, 4u32);
        let lo = b.and(lo, 0x3FFFu32);
        let lo = b.or(lo, (self.lbo >> 4) << 16);
        b.pack_b64(lo, self.hi())
    }

    /// Emits `desc` advanced to K step `k` (adds to the start-address field, which stays
    /// below 2^14 for shared addresses, so nothing carries into LBO).
    pub fn emit_step(&self, b: &mut KernelBuilder, desc: Reg<B64>, k: u32) -> Reg<B64> {
        let bytes = self.k_step_bytes(k);
        if bytes == 0 {
            return desc;
        }
        let d = b.bitcast::<U64, B64>(desc);
        let d = b.add(d, (bytes >> 4) as u64);
        b.bitcast::<B64, U64>(d)
    }
}

/// The A operand of a GEMM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AOperand {
    /// A tile in shared memory (SS MMA).
    Smem(View),
    /// Packed bf16 in a TMEM region, always K-major (TS MMA).
    Tmem(TmemRegion),
}

/// One GEMM `D (+)= A·B` of the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gemm {
    /// Name.
    pub name: &'static str,
    /// A (M×K).
    pub a: AOperand,
    /// B (K×N), a shared-memory view.
    pub b: View,
    /// The TMEM accumulator.
    pub d: TmemRegion,
    /// M (TMEM lanes).
    pub m: u32,
    /// N (accumulator columns).
    pub n: u32,
    /// K (reduction).
    pub k: u32,
}

impl Gemm {
    /// Whether A comes from TMEM.
    pub fn is_ts(&self) -> bool {
        matches!(self.a, AOperand::Tmem(_))
    }

    /// A's major (TMEM operands are K-major).
    pub fn a_major(&self) -> Major {
        match self.a {
            AOperand::Smem(v) => v.major,
            AOperand::Tmem(_) => Major::K,
        }
    }

    /// The instruction descriptor.
    pub fn instr_desc(&self) -> Result<InstrDesc, PlanError> {
        check_shape(self.name, self.m, self.n, self.k)?;
        InstrDesc::bf16(self.m, self.n, self.a_major(), self.b.major)
    }

    /// K=16 MMAs per GEMM.
    pub fn k_steps(&self) -> u32 {
        self.k / MMA_K
    }

    /// A's descriptor, when A is in shared memory.
    pub fn a_desc(&self, target: Target) -> Option<SmemDesc> {
        match self.a {
            AOperand::Smem(v) => Some(SmemDesc::sw128_tile(target, v.major)),
            AOperand::Tmem(_) => None,
        }
    }

    /// B's descriptor.
    pub fn b_desc(&self, target: Target) -> SmemDesc {
        SmemDesc::sw128_tile(target, self.b.major)
    }

    /// TMEM column of A for K step `k`, when A is in TMEM.
    pub fn a_tmem_col(&self, tmem: &TmemPlan, k: u32) -> Result<Option<u32>, PlanError> {
        match self.a {
            AOperand::Tmem(r) => Ok(Some(tmem.region(r)?.col + k * TMEM_A_COLS_PER_STEP)),
            AOperand::Smem(_) => Ok(None),
        }
    }

    fn check_smem(
        &self,
        smem: &SmemPlan,
        operand: &'static str,
        view: View,
        rows: u32,
    ) -> Result<(), PlanError> {
        smem.view(view.buffer, view.major)?;
        let capacity = smem.buffer(view.buffer)?.spec.stage_bytes;
        let bytes = rows * self.k * 2;
        if bytes > capacity {
            return Err(PlanError::GemmOperandBytes {
                gemm: self.name,
                operand,
                buffer: view.buffer,
                bytes,
                capacity,
            });
        }
        Ok(())
    }

    fn check_cols(
        &self,
        tmem: &TmemPlan,
        operand: &'static str,
        region: TmemRegion,
        needed: u32,
    ) -> Result<(), PlanError> {
        let cols = tmem.region(region)?.cols;
        if needed > cols {
            return Err(PlanError::GemmTmemCols {
                gemm: self.name,
                operand,
                region,
                needed,
                cols,
            });
        }
        Ok(())
    }

    /// Checks the shape; that shared operands are tile views whose stage holds them; that
    /// TMEM regions exist and are wide enough (D: N fp32 columns, A: K/2 packed columns);
    /// and that a TMEM A does not share columns with D.
    pub fn validate(&self, smem: &SmemPlan, tmem: &TmemPlan) -> Result<(), PlanError> {
        self.instr_desc()?;
        if let AOperand::Smem(v) = self.a {
            self.check_smem(smem, "A", v, self.m)?;
        }
        self.check_smem(smem, "B", self.b, self.n)?;
        self.check_cols(tmem, "D", self.d, self.n)?;
        if let AOperand::Tmem(r) = self.a {
            self.check_cols(tmem, "A", r, self.k / 2)?;
            if tmem.overlaps(r, self.d)? {
                return Err(PlanError::GemmAliased {
                    gemm: self.name,
                    a: r,
                    d: self.d,
                });
            }
        }
        Ok(())
    }
}

/// The design's five GEMMs, all transposed (keys on TMEM lanes), in issue order:
/// - `s_t`  S^T = K·Q^T: SS, K and Q K-major, into S;
/// - `dp_t` dP^T = V·dO^T: SS, V and dO K-major, into dP;
/// - `dv`   dV += P^T·dO: TS, P^T from TMEM, dO MN-major (same bytes as G2's B);
/// - `dk`   dK += dS^T·Q: TS, dS^T from TMEM, Q MN-major (same bytes as G1's B);
/// - `dq_t` dQ^T = K^T·dS^T: SS, K MN-major (same bytes as G1's A), sPdS MN-major, into dQ
///   over dP after G4 has read dS^T.
pub fn design_gemms(smem: &SmemPlan) -> Result<Vec<Gemm>, PlanError> {
    let v = |buf: Buf, major: Major| smem.view(buf, major);
    let g = |name, a, b, d| Gemm {
        name,
        a,
        b,
        d,
        m: TILE_ROWS,
        n: TILE_ROWS,
        k: TILE_ROWS,
    };
    use AOperand::{Smem, Tmem};
    Ok(vec![
        g(
            "s_t",
            Smem(v(Buf::K, Major::K)?),
            v(Buf::Q, Major::K)?,
            TmemRegion::S,
        ),
        g(
            "dp_t",
            Smem(v(Buf::V, Major::K)?),
            v(Buf::DO, Major::K)?,
            TmemRegion::DP,
        ),
        g(
            "dv",
            Tmem(TmemRegion::P),
            v(Buf::DO, Major::MN)?,
            TmemRegion::DV,
        ),
        g(
            "dk",
            Tmem(TmemRegion::DS),
            v(Buf::Q, Major::MN)?,
            TmemRegion::DK,
        ),
        g(
            "dq_t",
            Smem(v(Buf::K, Major::MN)?),
            v(Buf::PdS, Major::MN)?,
            TmemRegion::DQ,
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tmem::Region;
    use crate::ptx::print;

    fn smem() -> SmemPlan {
        SmemPlan::design(24).unwrap()
    }

    fn gemms() -> Vec<Gemm> {
        design_gemms(&smem()).unwrap()
    }

    fn gemm(name: &str) -> Gemm {
        gemms().into_iter().find(|g| g.name == name).unwrap()
    }

    #[test]
    fn design_gemms_pass_and_have_the_documented_descriptors() {
        let (s, t) = (smem(), TmemPlan::design().unwrap());
        let got: Vec<(&str, bool, u32, u32)> = gemms()
            .iter()
            .map(|g| {
                g.validate(&s, &t).unwrap();
                (
                    g.name,
                    g.is_ts(),
                    g.instr_desc().unwrap().bits(),
                    g.k_steps(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                ("s_t", false, 0x0820_0490, 8),
                ("dp_t", false, 0x0820_0490, 8),
                ("dv", true, 0x0821_0490, 8),
                ("dk", true, 0x0821_0490, 8),
                ("dq_t", false, 0x0821_8490, 8),
            ]
        );
        // Views of one buffer: G1 reads sQ K-major, G4 the same bytes MN-major.
        assert_eq!(gemm("s_t").b.buffer, gemm("dk").b.buffer);
        assert_eq!(gemm("dv").a_tmem_col(&t, 3).unwrap(), Some(24));
        assert_eq!(gemm("dk").a_tmem_col(&t, 7).unwrap(), Some(128 + 56));
        assert_eq!(gemm("s_t").a_tmem_col(&t, 0).unwrap(), None);
    }

    #[test]
    fn instruction_descriptor_fields() {
        use Major::*;
        let bits = |m, n, a, b| InstrDesc::bf16(m, n, a, b).unwrap().bits();
        assert_eq!(bits(128, 128, K, K), 0x0820_0490);
        assert_eq!(bits(128, 128, K, MN), 0x0821_0490);
        assert_eq!(bits(128, 128, MN, MN), 0x0821_8490);
        assert_eq!(bits(128, 256, K, K), 0x0840_0490);
        assert_eq!(bits(64, 8, K, K), 0x0400_0000 | 1 << 17 | 0x490);
        let fp16 = InstrDesc {
            d: AccFormat::F16,
            a: InFormat::F16,
            b: InFormat::F16,
            ..InstrDesc::bf16(128, 128, K, K).unwrap()
        };
        assert_eq!(fp16.bits(), 0x0820_0000);
    }

    #[test]
    fn rejects_mma_shapes_cta_group_1_lacks() {
        for (m, n) in [
            (256, 128),
            (128, 8),
            (128, 136),
            (128, 272),
            (64, 12),
            (32, 64),
        ] {
            let e = InstrDesc::bf16(m, n, Major::K, Major::K).unwrap_err();
            assert!(
                matches!(e, PlanError::MmaShape { m: em, n: en, k: 16, .. } if em == m && en == n),
                "{e}"
            );
        }
        let mut g = gemm("s_t");
        g.k = 120;
        let e = g.instr_desc().unwrap_err();
        assert_eq!(
            e,
            PlanError::MmaShape {
                gemm: "s_t",
                m: 128,
                n: 128,
                k: 120
            }
        );
        assert!(e.to_string().contains("M128 N128 K120"), "{e}");
    }

    #[test]
    fn sm100_descriptors_match_the_reference_table() {
        let k = SmemDesc::sw128_tile(Target::Sm100a, Major::K);
        let mn = SmemDesc::sw128_tile(Target::Sm100a, Major::MN);
        assert_eq!(k.hi(), 0x4000_4040);
        assert_eq!(mn.hi(), 0x4000_4040);
        let addr = 3 * 32768 + 1024;
        assert_eq!(k.lo(addr), (addr >> 4) | 0x0001_0000);
        assert_eq!(mn.lo(addr), (addr >> 4) | 0x0400_0000);
        assert_eq!(k.word(0) >> 46 & 1, 1, "version bit 46");
        assert_eq!(k.word(0) >> 61, 2, "swizzle code 2 = 128 B");
        // Per-K16 advance of the low word: K-major 2·(k%4) + 1024·(k/4), MN-major 128·k.
        let lo_steps = |d: SmemDesc| (0..8).map(|s| d.k_step_bytes(s) >> 4).collect::<Vec<_>>();
        assert_eq!(lo_steps(k), [0, 2, 4, 6, 1024, 1026, 1028, 1030]);
        assert_eq!(lo_steps(mn), [0, 128, 256, 384, 512, 640, 768, 896]);
    }

    #[test]
    fn hopper_descriptors_lack_the_version_bit() {
        let k = SmemDesc::sw128_tile(Target::Sm90a, Major::K);
        let mn = SmemDesc::sw128_tile(Target::Sm90a, Major::MN);
        // The constant the sm_90a kernel packs; layout type 1 at bits 62-63.
        assert_eq!(k.hi(), 0x4000_0040);
        assert_eq!(k.word(0) >> 46 & 1, 0);
        assert_eq!(k.word(0) >> 62, 1);
        assert_eq!(mn.lo(2048), 128 | 0x0400_0000);
        assert_eq!(k.k_step_bytes(5), PANEL_BYTES + 32);
        assert_eq!(mn.k_step_bytes(5), 5 * 2048);
    }

    #[test]
    fn rejects_unencodable_descriptor_offsets() {
        let e = SmemDesc::new(Target::Sm100a, Major::MN, 8, 1024, PANEL_BYTES).unwrap_err();
        assert_eq!(
            e,
            PlanError::DescField {
                field: "LBO",
                value: 8,
                limit: 1 << 18
            }
        );
        let e = SmemDesc::new(Target::Sm100a, Major::K, 16, 1 << 18, PANEL_BYTES).unwrap_err();
        assert!(
            matches!(e, PlanError::DescField { field: "SBO", .. }),
            "{e}"
        );
        assert_eq!(
            SmemDesc::new(Target::Sm100a, Major::MN, PANEL_BYTES, 1024, PANEL_BYTES).unwrap(),
            SmemDesc::sw128_tile(Target::Sm100a, Major::MN)
        );
    }

    #[test]
    fn descriptor_emission() {
        let mut b = KernelBuilder::new("t", Target::Sm100a, (512, 1, 1));
        let addr = b.mov::<U32>(0u32);
        let d = SmemDesc::sw128_tile(Target::Sm100a, Major::K);
        let desc = d.emit(&mut b, addr);
        let same = d.emit_step(&mut b, desc, 0);
        assert_eq!(same, desc);
        d.emit_step(&mut b, desc, 5);
        let text = print::body(&b.finish().unwrap());
        assert!(text.contains("or.b32 %r3, %r2, 65536;"), "{text}");
        assert!(
            text.contains(&format!("mov.u32 %r4, {};", 0x4000_4040u32)),
            "{text}"
        );
        assert!(
            text.contains(&format!("add.u64 %rd1, %rd0, {};", 1024 + 2)),
            "{text}"
        );
    }

    #[test]
    fn rejects_operands_larger_than_their_buffer() {
        let (s, t) = (smem(), TmemPlan::design().unwrap());
        let mut g = gemm("dq_t");
        g.n = 256;
        assert_eq!(
            g.validate(&s, &t).unwrap_err(),
            PlanError::GemmOperandBytes {
                gemm: "dq_t",
                operand: "B",
                buffer: Buf::PdS,
                bytes: 65_536,
                capacity: 32_768
            }
        );
        let mut g = gemm("s_t");
        g.b = View {
            buffer: Buf::Lse,
            major: Major::K,
        };
        assert!(matches!(
            g.validate(&s, &t),
            Err(PlanError::SmemView {
                buffer: Buf::Lse,
                ..
            })
        ));
    }

    #[test]
    fn rejects_narrow_or_missing_tmem_regions() {
        let s = smem();
        let t = TmemPlan::design().unwrap();
        let mut g = gemm("dk");
        g.d = TmemRegion::P;
        assert_eq!(
            g.validate(&s, &t).unwrap_err(),
            PlanError::GemmTmemCols {
                gemm: "dk",
                operand: "D",
                region: TmemRegion::P,
                needed: 128,
                cols: 64
            }
        );
        let r = |id, col, cols| Region { id, col, cols };
        let narrow = TmemPlan::new(
            512,
            vec![r(TmemRegion::P, 0, 32), r(TmemRegion::DV, 256, 128)],
            vec![],
        )
        .unwrap();
        assert_eq!(
            gemm("dv").validate(&s, &narrow).unwrap_err(),
            PlanError::GemmTmemCols {
                gemm: "dv",
                operand: "A",
                region: TmemRegion::P,
                needed: 64,
                cols: 32
            }
        );
        assert_eq!(
            gemm("dk").validate(&s, &narrow).unwrap_err(),
            PlanError::TmemRegionMissing {
                region: TmemRegion::DK
            }
        );
    }

    #[test]
    fn rejects_a_ts_gemm_writing_over_its_a_operand() {
        let mut g = gemm("dv");
        g.d = TmemRegion::S; // P^T lies over S
        let e = g
            .validate(&smem(), &TmemPlan::design().unwrap())
            .unwrap_err();
        assert_eq!(
            e,
            PlanError::GemmAliased {
                gemm: "dv",
                a: TmemRegion::P,
                d: TmemRegion::S
            }
        );
    }
}
