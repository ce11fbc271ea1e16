//! The simulator's tensor map: what `cp.async.bulk.tensor` reads through its map operand.
//!
//! A real `CUtensorMap` is 128 opaque bytes written by `cuTensorMapEncodeTiled`; the simulator
//! cannot decode them. [`SimTensorMap`] holds the same parameters and serialises them into a
//! 128-byte blob of its own format ([`SimTensorMap::to_bytes`]) that is passed exactly where
//! the driver's map would go: as the bytes of a `.param .align 64 .b8 tmap[128]` kernel
//! parameter ([`SimTensorMap::arg`]), or in global memory. The TMA instruction resolves its
//! generic map address (typically `mov.u64 %rd, tmap; cvta.param.u64 %rd, %rd`) to those
//! bytes and decodes them with [`SimTensorMap::from_bytes`]; anything else there (a driver
//! map, garbage) fails with a message saying so.
//!
//! # Blob layout (little-endian)
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `MSASIMTM` |
//! | 8 | format version, 1 |
//! | 9 | rank, 1..=5 |
//! | 10 | element size in bytes: 1, 2, 4 or 8 |
//! | 11 | swizzle: 0 none, 1 32B, 2 64B, 3 128B (`CUtensorMapSwizzle` values) |
//! | 12 | OOB fill: 0 zeros (`FLOAT_OOB_FILL_NONE`), 1 NaN (`NAN_REQUEST_ZERO_FMA`) |
//! | 13 | 16-bit float kind: 0 bf16 (or not a 16-bit float map), 1 f16 |
//! | 14..16 | zero |
//! | 16..24 | global base address |
//! | 24..64 | globalDim\[0..5\] (u64, innermost first; unused dimensions 1) |
//! | 64..96 | globalStrides\[0..4\]: byte strides of dimensions 1..rank (u64) |
//! | 96..116 | boxDim\[0..5\] (u32) |
//! | 116..121 | elementStrides\[0..5\] (u8) |
//! | 121..128 | zero |

use crate::launch::Arg;
use crate::memory::DevPtr;
pub use crate::smem_layout::Swizzle;

/// Bytes of a tensor map.
pub const TENSOR_MAP_BYTES: usize = 128;

const MAGIC: &[u8; 8] = b"MSASIMTM";
const VERSION: u8 = 1;

/// What out-of-bounds box elements read as (`CUtensorMapFloatOOBfill`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OobFill {
    /// `CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE`: zeros.
    Zero,
    /// `CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA`: a NaN, see [`OobFill::nan_bits`].
    Nan,
}

impl OobFill {
    /// The little-endian bytes of one NaN-filled element of `elem_bytes` bytes: `0x7ff7` for
    /// 16-bit elements (what an H200 writes for a bf16 map); all-ones bits for other sizes
    /// (not measured).
    pub fn nan_bits(elem_bytes: usize) -> [u8; 8] {
        if elem_bytes == 2 {
            [0xf7, 0x7f, 0, 0, 0, 0, 0, 0]
        } else {
            [0xff; 8]
        }
    }
}

/// A tiled tensor map: the parameters of `cuTensorMapEncodeTiled` (no interleave; the L2
/// promotion does not change results and is not kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimTensorMap {
    /// Global base address (16-byte aligned).
    pub base: u64,
    /// Dimensions used, 1..=5.
    pub rank: u8,
    /// Bytes per element.
    pub elem_bytes: u8,
    /// Elements per dimension, innermost first.
    pub global_dim: [u64; 5],
    /// Byte strides of dimensions 1..rank (dimension 0 is contiguous).
    pub global_strides: [u64; 4],
    /// The box one copy moves, innermost first.
    pub box_dim: [u32; 5],
    /// Element strides inside the box, 1..=8.
    pub element_strides: [u32; 5],
    /// Shared-memory swizzle.
    pub swizzle: Swizzle,
    /// Out-of-bounds fill.
    pub oob_fill: OobFill,
    /// 2-byte elements are f16, not bf16 (what a TMA reduce-add adds; loads move bits).
    pub f16: bool,
}

impl SimTensorMap {
    /// A tiled map, checked against the rules of `cuTensorMapEncodeTiled`: rank 1..=5, a
    /// non-null 16-byte aligned base, each `globalDim` in 1..=2^32, strides multiples of 16
    /// below 2^40, each `boxDim` in 1..=256, element strides in 1..=8, and with a swizzle the
    /// inner box row (`boxDim[0]·elem_bytes`) a multiple of 16 bytes no wider than the span.
    ///
    /// `global_strides` has `rank − 1` entries (the byte strides of dimensions 1..rank); the
    /// other slices have `rank` entries.
    ///
    /// # Errors
    /// A message naming the first violated rule.
    #[allow(clippy::too_many_arguments)]
    pub fn tiled(
        base: DevPtr,
        elem_bytes: u8,
        global_dim: &[u64],
        global_strides: &[u64],
        box_dim: &[u32],
        element_strides: &[u32],
        swizzle: Swizzle,
        oob_fill: OobFill,
    ) -> Result<SimTensorMap, String> {
        let rank = global_dim.len();
        if !(1..=5).contains(&rank) {
            return Err(format!("rank {rank} is not in 1..=5"));
        }
        if global_strides.len() != rank - 1
            || box_dim.len() != rank
            || element_strides.len() != rank
        {
            return Err(format!(
                "rank {rank} needs {} strides and {rank} box dims and element strides \
                 (got {}, {}, {})",
                rank - 1,
                global_strides.len(),
                box_dim.len(),
                element_strides.len()
            ));
        }
        let mut m = SimTensorMap {
            base: base.0,
            rank: rank as u8,
            elem_bytes,
            global_dim: [1; 5],
            global_strides: [0; 4],
            box_dim: [1; 5],
            element_strides: [1; 5],
            swizzle,
            oob_fill,
            f16: false,
        };
        m.global_dim[..rank].copy_from_slice(global_dim);
        m.global_strides[..rank - 1].copy_from_slice(global_strides);
        m.box_dim[..rank].copy_from_slice(box_dim);
        m.element_strides[..rank].copy_from_slice(element_strides);
        m.validate()?;
        Ok(m)
    }

    /// The maps the runtime encodes (`msa_runtime::backward::TileMapSpec::encode`): rank 3,
    /// bf16, swizzle 128B, OOB fill none, over `base` with the same four arrays it passes to
    /// `cuTensorMapEncodeTiled`.
    ///
    /// # Errors
    /// As [`SimTensorMap::tiled`].
    pub fn bf16_sw128(
        base: DevPtr,
        global_dim: [u64; 3],
        global_strides: [u64; 2],
        box_dim: [u32; 3],
        element_strides: [u32; 3],
    ) -> Result<SimTensorMap, String> {
        SimTensorMap::tiled(
            base,
            2,
            &global_dim,
            &global_strides,
            &box_dim,
            &element_strides,
            Swizzle::B128,
            OobFill::Zero,
        )
    }

    /// The map `spec.encode(base)` asks the driver for, after the runtime's own
    /// `TileMapSpec::validate`.
    ///
    /// # Errors
    /// The runtime's validation error, or one of [`SimTensorMap::tiled`].
    #[cfg(feature = "runtime")]
    pub fn from_spec(
        spec: &msa_runtime::backward::TileMapSpec,
        base: DevPtr,
    ) -> Result<SimTensorMap, String> {
        spec.validate(base.0).map_err(|e| e.to_string())?;
        let mut m = SimTensorMap::tiled(
            base,
            spec.elem.bytes() as u8,
            &spec.global_dim,
            &spec.global_strides,
            &spec.box_dim,
            &spec.element_strides,
            Swizzle::B128,
            OobFill::Zero,
        )
        .map_err(|e| format!("tensor map `{}`: {e}", spec.map))?;
        m.f16 = spec.elem == msa_runtime::backward::MapElem::F16;
        Ok(m)
    }

    fn validate(&self) -> Result<(), String> {
        let r = self.rank as usize;
        if !(1..=5).contains(&r) {
            return Err(format!("rank {r} is not in 1..=5"));
        }
        if ![1, 2, 4, 8].contains(&self.elem_bytes) {
            return Err(format!(
                "element size {} is not 1, 2, 4 or 8",
                self.elem_bytes
            ));
        }
        if self.base == 0 || !self.base.is_multiple_of(16) {
            return Err(format!(
                "base address {:#x} is not a non-null 16-byte aligned address",
                self.base
            ));
        }
        if let Some(d) = self.global_dim[..r]
            .iter()
            .find(|&&d| d == 0 || d > 1 << 32)
        {
            return Err(format!("globalDim {d} is not in 1..=2^32"));
        }
        if let Some(s) = self.global_strides[..r - 1]
            .iter()
            .find(|&&s| !s.is_multiple_of(16) || s >= 1 << 40)
        {
            return Err(format!(
                "globalStride {s} is not a multiple of 16 below 2^40"
            ));
        }
        if let Some(b) = self.box_dim[..r].iter().find(|&&b| b == 0 || b > 256) {
            return Err(format!("boxDim {b} is not in 1..=256"));
        }
        if let Some(e) = self.element_strides[..r].iter().find(|&&e| e == 0 || e > 8) {
            return Err(format!("elementStride {e} is not in 1..=8"));
        }
        let inner = self.box_dim[0] as usize * self.elem_bytes as usize;
        if !inner.is_multiple_of(16) {
            return Err(format!(
                "the inner box row is {inner} bytes, not a multiple of 16"
            ));
        }
        let span = self.swizzle.span();
        if span != 0 && inner > span {
            return Err(format!(
                "the inner box row is {inner} bytes, wider than the {span}-byte swizzle"
            ));
        }
        Ok(())
    }

    /// Elements the box moves along each dimension: `ceil(boxDim / elementStride)`.
    pub fn box_elements(&self) -> [u32; 5] {
        std::array::from_fn(|d| self.box_dim[d].div_ceil(self.element_strides[d]))
    }

    /// Bytes one copy completes on its mbarrier: the whole box, out-of-bounds elements
    /// included.
    pub fn box_bytes(&self) -> u64 {
        self.box_elements()
            .iter()
            .map(|&n| n as u64)
            .product::<u64>()
            * self.elem_bytes as u64
    }

    /// Bytes between consecutive box rows in shared memory: the inner row, or the swizzle
    /// span when the row is narrower (an H200 leaves the rest of each span untouched).
    pub fn row_pitch(&self) -> u64 {
        let row = self.box_elements()[0] as u64 * self.elem_bytes as u64;
        row.max(self.swizzle.span() as u64)
    }

    /// The global coordinate of box element `i` along dimension `d`, for a box at `coords`.
    pub fn coord(&self, coords: &[i64; 5], d: usize, i: u32) -> i64 {
        coords[d] + i as i64 * self.element_strides[d] as i64
    }

    /// Whether global coordinate `g` lies inside dimension `d`.
    pub fn in_dim(&self, d: usize, g: i64) -> bool {
        g >= 0 && (g as u64) < self.global_dim[d]
    }

    /// The box's rows at `coords`, in shared-memory order (row `i` at `i · row_pitch`): whether
    /// every outer coordinate of the row is in bounds, and the global byte address of its
    /// inner coordinate 0.
    pub fn box_rows(&self, coords: &[i64; 5]) -> Vec<(bool, i128)> {
        let n = self.box_elements();
        let rank = self.rank as usize;
        let mut rows = Vec::new();
        for i4 in 0..n[4] {
            for i3 in 0..n[3] {
                for i2 in 0..n[2] {
                    for i1 in 0..n[1] {
                        let outer = [0, i1, i2, i3, i4];
                        let mut ok = true;
                        let mut base = self.base as i128;
                        for (d, &i) in outer.iter().enumerate().take(rank).skip(1) {
                            let g = self.coord(coords, d, i);
                            ok &= self.in_dim(d, g);
                            base += g as i128 * self.global_strides[d - 1] as i128;
                        }
                        rows.push((ok, base));
                    }
                }
            }
        }
        rows
    }

    /// Bytes of shared memory a copy spans: the box's rows at [`SimTensorMap::row_pitch`].
    pub fn shared_bytes(&self) -> u64 {
        let rows: u64 = self.box_elements()[1..].iter().map(|&n| n as u64).product();
        rows * self.row_pitch()
    }

    /// The 128-byte blob (see the module documentation).
    pub fn to_bytes(&self) -> [u8; TENSOR_MAP_BYTES] {
        let mut b = [0u8; TENSOR_MAP_BYTES];
        b[..8].copy_from_slice(MAGIC);
        b[8] = VERSION;
        b[9] = self.rank;
        b[10] = self.elem_bytes;
        b[11] = self.swizzle.code();
        b[12] = match self.oob_fill {
            OobFill::Zero => 0,
            OobFill::Nan => 1,
        };
        b[13] = u8::from(self.f16);
        b[16..24].copy_from_slice(&self.base.to_le_bytes());
        for (i, d) in self.global_dim.iter().enumerate() {
            b[24 + 8 * i..32 + 8 * i].copy_from_slice(&d.to_le_bytes());
        }
        for (i, s) in self.global_strides.iter().enumerate() {
            b[64 + 8 * i..72 + 8 * i].copy_from_slice(&s.to_le_bytes());
        }
        for (i, d) in self.box_dim.iter().enumerate() {
            b[96 + 4 * i..100 + 4 * i].copy_from_slice(&d.to_le_bytes());
        }
        for (i, e) in self.element_strides.iter().enumerate() {
            b[116 + i] = *e as u8;
        }
        b
    }

    /// The kernel argument for a `.param .align 64 .b8 tmap[128]` parameter.
    pub fn arg(&self) -> Arg {
        Arg::Bytes(self.to_bytes().to_vec())
    }

    /// Decodes and re-validates a blob.
    ///
    /// # Errors
    /// A message when `b` is not a simulator tensor map (wrong size or magic, e.g. a driver
    /// `CUtensorMap`) or holds invalid parameters.
    pub fn from_bytes(b: &[u8]) -> Result<SimTensorMap, String> {
        if b.len() != TENSOR_MAP_BYTES {
            return Err(format!("a tensor map is 128 bytes, got {}", b.len()));
        }
        if &b[..8] != MAGIC {
            return Err(format!(
                "the 128 bytes at the map address are not a simulator tensor map (magic {:02x?}; \
                 pass msa_sim::SimTensorMap bytes: the simulator cannot decode a driver CUtensorMap)",
                &b[..8]
            ));
        }
        if b[8] != VERSION {
            return Err(format!(
                "tensor map format version {} is not {VERSION}",
                b[8]
            ));
        }
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let m = SimTensorMap {
            base: u64_at(16),
            rank: b[9],
            elem_bytes: b[10],
            global_dim: std::array::from_fn(|i| u64_at(24 + 8 * i)),
            global_strides: std::array::from_fn(|i| u64_at(64 + 8 * i)),
            box_dim: std::array::from_fn(|i| u32_at(96 + 4 * i)),
            element_strides: std::array::from_fn(|i| b[116 + i] as u32),
            swizzle: Swizzle::from_code(b[11])
                .ok_or_else(|| format!("swizzle code {} is not 0..=3", b[11]))?,
            oob_fill: match b[12] {
                0 => OobFill::Zero,
                1 => OobFill::Nan,
                c => return Err(format!("OOB fill code {c} is not 0 or 1")),
            },
            f16: match b[13] {
                0 => false,
                1 => true,
                c => return Err(format!("16-bit float kind {c} is not 0 or 1")),
            },
        };
        m.validate()?;
        Ok(m)
    }
}
