//! Micro-kernels of the sm_90a asynchronous machinery (TMA, mbarrier, wgmma, elect) as data:
//! PTX text, inputs, tensor maps, outputs. `async_micro.rs` runs them on the simulator and
//! checks them against host models written from the PTX ISA; `h200_compare.rs` runs the same
//! PTX on a GPU and compares the bytes with the simulator's.

#![allow(dead_code)]

pub mod probe;
pub mod recorded;
pub mod warp;

use half::bf16;
use msa_sim::tensor_map::{OobFill, Swizzle};
use msa_sim::{Arg, Gpu, LaunchConfig, Module, SimError, SimTensorMap};

/// A bf16 rank-3 tiled tensor map over input `input`.
#[derive(Debug, Clone, Copy)]
pub struct MapSpec {
    pub input: usize,
    pub global_dim: [u64; 3],
    pub global_strides: [u64; 2],
    pub box_dim: [u32; 3],
    pub swizzle: Swizzle,
    pub oob_fill: OobFill,
}

impl MapSpec {
    /// The runtime's maps: swizzle 128B, OOB fill none.
    pub fn sw128(
        input: usize,
        global_dim: [u64; 3],
        global_strides: [u64; 2],
        box_dim: [u32; 3],
    ) -> Self {
        MapSpec {
            input,
            global_dim,
            global_strides,
            box_dim,
            swizzle: Swizzle::B128,
            oob_fill: OobFill::Zero,
        }
    }
}

/// A kernel argument.
#[derive(Debug, Clone)]
pub enum ArgSpec {
    /// A `.b8 [128]` tensor-map parameter.
    Map(MapSpec),
    /// The device address of input `i`.
    In(usize),
    /// The device address of output `i` (zero-filled).
    Out(usize),
    U32(u32),
}

/// One launch of one micro-kernel.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: &'static str,
    pub ptx: String,
    pub kernel: &'static str,
    /// CTAs (a 1-D grid).
    pub grid: u32,
    pub threads: u32,
    pub dynamic_smem: u32,
    pub inputs: Vec<Vec<u8>>,
    /// Output sizes in bytes.
    pub outputs: Vec<usize>,
    pub args: Vec<ArgSpec>,
}

pub const HEADER: &str = ".version 8.1\n.target sm_90a\n.address_size 64\n";

/// splitmix64.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A bf16 of random sign and significand with exponent in `2^[-6, 6)`.
    pub fn bf16(&mut self) -> bf16 {
        let r = self.next();
        let sign = (r & 1) as u16;
        let exp = 127 - 6 + ((r >> 1) % 12) as u16;
        let man = ((r >> 8) & 0x7f) as u16;
        bf16::from_bits(sign << 15 | exp << 7 | man)
    }

    /// A bf16 with exponent in `2^[-20, 20]`, zero one time in eight.
    pub fn bf16_wide(&mut self) -> bf16 {
        let r = self.next();
        if r.is_multiple_of(8) {
            return bf16::from_bits(((r >> 8) as u16 & 1) << 15);
        }
        let sign = ((r >> 3) & 1) as u16;
        let exp = 127 - 20 + ((r >> 4) % 41) as u16;
        let man = ((r >> 16) & 0x7f) as u16;
        bf16::from_bits(sign << 15 | exp << 7 | man)
    }
}

pub fn bytes_of_bf16(v: &[bf16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect()
}

pub fn bytes_of_u32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn bytes_of_i32(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

pub fn f32s(b: &[u8]) -> Vec<f32> {
    u32s(b).into_iter().map(f32::from_bits).collect()
}

/// Runs a scenario on the simulator; returns the outputs.
pub fn run_sim(s: &Scenario) -> Result<Vec<Vec<u8>>, SimError> {
    let m = Module::parse(&s.ptx)?;
    let k = m.kernel(s.kernel).expect("the scenario's entry");
    let mut gpu = Gpu::new();
    let ins: Vec<_> = s
        .inputs
        .iter()
        .enumerate()
        .map(|(i, b)| gpu.upload(&format!("input {i}"), b))
        .collect();
    let outs: Vec<_> = s
        .outputs
        .iter()
        .enumerate()
        .map(|(i, &n)| gpu.alloc(&format!("output {i}"), n))
        .collect();
    let args: Vec<Arg> = s
        .args
        .iter()
        .map(|a| match a {
            ArgSpec::Map(m) => SimTensorMap::tiled(
                ins[m.input],
                2,
                &m.global_dim,
                &m.global_strides,
                &m.box_dim,
                &[1, 1, 1],
                m.swizzle,
                m.oob_fill,
            )
            .expect("valid map")
            .arg(),
            ArgSpec::In(i) => Arg::Ptr(ins[*i]),
            ArgSpec::Out(i) => Arg::Ptr(outs[*i]),
            ArgSpec::U32(v) => Arg::U32(*v),
        })
        .collect();
    let cfg =
        LaunchConfig::new((s.grid, 1, 1), (s.threads, 1, 1)).with_dynamic_shared(s.dynamic_smem);
    gpu.launch(k, &cfg, &args)?;
    outs.iter()
        .zip(&s.outputs)
        .map(|(p, &n)| gpu.read::<u8>(*p, n))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// TMA
// ---------------------------------------------------------------------------------------------

/// `tma_box`: the CTA zeroes its 64 KiB box area; then for each row `(c0, c1, c2, dst)` of
/// `coords`, thread 0 arms the mbarrier with `box_bytes` and loads the box at `[c0, c1, c2]`
/// to shared `base + dst` (base 1024-aligned); every thread waits (bounded: `flags[i]` = 1
/// if the phase completed), then the CTA copies the `copy_bytes` from `base + dst` (the
/// box's shared footprint) to `out[i]`.
pub fn tma_box_ptx() -> String {
    HEADER.to_string()
        + r#"
.extern .shared .align 1024 .b8 smem[];

.visible .entry tma_box(
	.param .align 64 .b8 tmap[128],
	.param .u64 .ptr .align 16 coords,
	.param .u64 .ptr .align 16 out,
	.param .u64 .ptr .align 16 flags,
	.param .u32 n,
	.param .u32 box_bytes,
	.param .u32 copy_bytes
)
.maxntid 128, 1, 1
{
	.reg .pred %p<4>;
	.reg .b32 %r<24>;
	.reg .s32 %s<4>;
	.reg .b64 %rd<12>;

	mov.u32 %r0, smem;
	add.u32 %r1, %r0, 1023;
	and.b32 %r1, %r1, 4294966272;
	add.u32 %r2, %r1, 65536;
	mov.u32 %r3, %tid.x;
	shl.b32 %r11, %r3, 4;
	mov.u32 %r13, 0;
$L_zero:
	add.u32 %r12, %r1, %r11;
	st.shared.v4.b32 [%r12], {%r13, %r13, %r13, %r13};
	add.u32 %r11, %r11, 2048;
	setp.lt.u32 %p1, %r11, 65536;
	@%p1 bra $L_zero;
	fence.proxy.async.shared::cta;
	setp.eq.u32 %p0, %r3, 0;
	@%p0 mbarrier.init.shared::cta.b64 [%r2], 1;
	@%p0 fence.mbarrier_init.release.cluster;
	bar.sync 0;
	mov.u64 %rd0, tmap;
	cvta.param.u64 %rd1, %rd0;
	ld.param.u64 %rd2, [coords];
	cvta.to.global.u64 %rd2, %rd2;
	ld.param.u64 %rd3, [out];
	cvta.to.global.u64 %rd3, %rd3;
	ld.param.u64 %rd4, [flags];
	cvta.to.global.u64 %rd4, %rd4;
	ld.param.u32 %r4, [n];
	ld.param.u32 %r5, [box_bytes];
	ld.param.u32 %r17, [copy_bytes];
	mov.u32 %r6, 0;
$L_box:
	setp.ge.u32 %p1, %r6, %r4;
	@%p1 bra $L_done;
	mul.wide.u32 %rd5, %r6, 16;
	add.u64 %rd5, %rd2, %rd5;
	ld.global.v4.s32 {%s0, %s1, %s2, %s3}, [%rd5];
	mov.b32 %r7, %s3;
	add.u32 %r7, %r1, %r7;
	@%p0 mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r2], %r5;
	@%p0 cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%r7], [%rd1, {%s0, %s1, %s2}], [%r2];
	and.b32 %r8, %r6, 1;
	mov.u32 %r9, 0;
$L_wait:
	mbarrier.try_wait.parity.shared::cta.b64 %p2, [%r2], %r8;
	@%p2 bra $L_ready;
	add.u32 %r9, %r9, 1;
	setp.lt.u32 %p3, %r9, 1000000;
	@%p3 bra $L_wait;
$L_ready:
	selp.u32 %r10, 1, 0, %p2;
	mul.wide.u32 %rd6, %r6, 4;
	add.u64 %rd6, %rd4, %rd6;
	@%p0 st.global.u32 [%rd6], %r10;
	mul.wide.u32 %rd7, %r6, %r17;
	add.u64 %rd7, %rd3, %rd7;
	shl.b32 %r11, %r3, 4;
$L_copy:
	setp.ge.u32 %p1, %r11, %r17;
	@%p1 bra $L_copied;
	add.u32 %r12, %r7, %r11;
	ld.shared.v4.b32 {%r13, %r14, %r15, %r16}, [%r12];
	cvt.u64.u32 %rd8, %r11;
	add.u64 %rd8, %rd7, %rd8;
	st.global.v4.b32 [%rd8], {%r13, %r14, %r15, %r16};
	add.u32 %r11, %r11, 2048;
	bra $L_copy;
$L_copied:
	fence.proxy.async.shared::cta;
	bar.sync 0;
	add.u32 %r6, %r6, 1;
	bra $L_box;
$L_done:
	ret;
}
"#
}

/// Dynamic shared memory of `tma_box`: 1 KiB of alignment slack, 64 KiB of boxes, the mbarrier.
pub const TMA_BOX_SMEM: u32 = 1024 + 65536 + 64;

/// A bf16 tensor of `n` elements whose bits are all distinct and never zero.
pub fn distinct_bf16(n: usize, salt: u16) -> Vec<bf16> {
    (0..n)
        .map(|i| bf16::from_bits(((i as u16).wrapping_mul(3).wrapping_add(salt)) | 0x0100))
        .collect()
}

/// A `tma_box` scenario over a `[d2][d1][d0]` bf16 tensor with a box `[b0, b1, b2]`, swizzle
/// 128B and zero fill (the runtime's maps).
pub fn tma_scenario(
    name: &'static str,
    dims: [u64; 3],
    box_dim: [u32; 3],
    boxes: &[[i32; 4]],
) -> Scenario {
    tma_scenario_with(name, dims, box_dim, Swizzle::B128, OobFill::Zero, boxes)
}

/// Shared bytes a bf16 box spans: its rows `max(row bytes, swizzle span)` apart.
pub fn tma_footprint(box_dim: [u32; 3], swizzle: Swizzle) -> usize {
    let pitch = (box_dim[0] as usize * 2).max(swizzle.span());
    pitch * (box_dim[1] * box_dim[2]) as usize
}

/// A `tma_box` scenario with any swizzle and out-of-bounds fill; each row of `boxes` is
/// `[c0, c1, c2, destination offset]`.
pub fn tma_scenario_with(
    name: &'static str,
    dims: [u64; 3],
    box_dim: [u32; 3],
    swizzle: Swizzle,
    oob_fill: OobFill,
    boxes: &[[i32; 4]],
) -> Scenario {
    let n = (dims[0] * dims[1] * dims[2]) as usize;
    let tensor = distinct_bf16(n, 0x1234);
    let box_bytes = box_dim.iter().product::<u32>() * 2;
    let copy_bytes = tma_footprint(box_dim, swizzle) as u32;
    let coords: Vec<i32> = boxes.iter().flatten().copied().collect();
    Scenario {
        name,
        ptx: tma_box_ptx(),
        kernel: "tma_box",
        grid: 1,
        threads: 128,
        dynamic_smem: TMA_BOX_SMEM,
        inputs: vec![bytes_of_bf16(&tensor), bytes_of_i32(&coords)],
        outputs: vec![boxes.len() * copy_bytes as usize, 4 * boxes.len()],
        args: vec![
            ArgSpec::Map(MapSpec {
                input: 0,
                global_dim: dims,
                global_strides: [dims[0] * 2, dims[0] * dims[1] * 2],
                box_dim,
                swizzle,
                oob_fill,
            }),
            ArgSpec::In(1),
            ArgSpec::Out(0),
            ArgSpec::Out(1),
            ArgSpec::U32(boxes.len() as u32),
            ArgSpec::U32(box_bytes),
            ArgSpec::U32(copy_bytes),
        ],
    }
}

/// Query-row maps as the runtime encodes them, shrunk to 3 tokens: `[128, 64, 3]`, box
/// `[64, 16, 1]`; in-range, partially and fully out-of-range boxes (negative coordinates
/// included), all to 1024-aligned destinations.
pub fn tma_query_rows() -> Scenario {
    tma_scenario(
        "tma query rows [64,16,1]",
        [128, 64, 3],
        [64, 16, 1],
        &[
            [0, 0, 0, 0],
            [64, 16, 1, 2048],
            [0, 48, 2, 4096],
            [64, 56, 0, 6144],
            [-16, 0, 1, 8192],
            [96, 32, 2, 10240],
            [0, -4, 1, 12288],
            [0, 0, -1, 14336],
            [64, 0, 3, 16384],
            [-64, -16, 0, 18432],
        ],
    )
}

/// Key-row maps as the runtime encodes them, shrunk to W = 256: `[128, 4, 256]`, box
/// `[64, 1, 128]`.
pub fn tma_key_rows() -> Scenario {
    tma_scenario(
        "tma key rows [64,1,128]",
        [128, 4, 256],
        [64, 1, 128],
        &[
            [0, 0, 0, 0],
            [64, 3, 128, 16384],
            [0, 1, -64, 32768],
            [64, 2, 200, 49152],
            [0, 4, 0, 0],
        ],
    )
}

/// Destinations that are 128-byte but not 1024-byte aligned: the swizzle phase comes from
/// the absolute address bits (as an H200 does it).
pub fn tma_dst_128_aligned() -> Scenario {
    tma_scenario(
        "tma destinations 128-byte aligned [64,16,1]",
        [128, 64, 3],
        [64, 16, 1],
        &[[0, 0, 0, 128], [64, 8, 1, 384], [0, 0, 2, 2048 + 640]],
    )
}

/// Inner coordinates that are not a multiple of 16 bytes (3 and −3 elements), 1024-aligned
/// destinations: an H200 raises an illegal instruction.
pub fn tma_inner_unaligned() -> Scenario {
    tma_scenario(
        "tma inner coordinate 3 [64,16,1]",
        [128, 64, 3],
        [64, 16, 1],
        &[[3, 5, 1, 0], [-3, 0, 0, 2048]],
    )
}

/// A `[3][40][96]` bf16 tensor (192-byte rows) and boxes of two planes that are in range,
/// cut by each face (negative and past-the-end coordinates in every dimension) or wholly
/// outside; `inner` elements per box row, inner coordinates multiples of 16 bytes,
/// destinations 1024-aligned.
fn tma_faces(name: &'static str, inner: u32, swizzle: Swizzle, oob_fill: OobFill) -> Scenario {
    let i = inner as i32;
    // Half a row, in whole 16-byte units.
    let h = (i / 2 / 8 * 8).max(8);
    let bytes = 2 * inner * 8 * 2;
    let step = bytes.div_ceil(1024) as i32 * 1024;
    let boxes: Vec<[i32; 4]> = [
        [0, 0, 0],
        [96 - i, 32, 1],
        [h, 11, 0],
        [-h, 3, 1],
        [96 - h, 20, 0],
        [8, -5, 1],
        [16, 36, 0],
        [0, 0, -1],
        [24, 16, 2],
        [96, 0, 0],
        [-200, 8, 1],
        [0, 40, 0],
        [0, 0, 3],
        [-h, -3, -1],
    ]
    .iter()
    .enumerate()
    .map(|(k, c)| [c[0], c[1], c[2], k as i32 * step])
    .filter(|b| b[3] + step <= 65536)
    .collect();
    tma_scenario_with(name, [96, 40, 3], [inner, 8, 2], swizzle, oob_fill, &boxes)
}

/// One scenario per swizzle mode (rows as wide as the span; 48- and 16-byte rows without a
/// swizzle) with zero fill, and the 128B and none modes with the NaN fill.
pub fn tma_swizzle_scenarios() -> Vec<Scenario> {
    use OobFill::*;
    vec![
        tma_faces("tma no swizzle, 48-byte rows", 24, Swizzle::None, Zero),
        tma_faces("tma no swizzle, 16-byte rows", 8, Swizzle::None, Zero),
        tma_faces("tma swizzle 32B", 16, Swizzle::B32, Zero),
        tma_faces("tma swizzle 64B", 32, Swizzle::B64, Zero),
        tma_faces("tma swizzle 128B", 64, Swizzle::B128, Zero),
        tma_faces("tma swizzle 128B, NaN fill", 64, Swizzle::B128, Nan),
        tma_faces("tma no swizzle, NaN fill", 24, Swizzle::None, Nan),
    ]
}

/// Boxes whose inner row is narrower than the swizzle span (64 bytes under 128B, 32 under
/// 64B): how the hardware lays them out, or whether it refuses them.
pub fn tma_narrow_rows(swizzle: Swizzle) -> Scenario {
    let (name, inner) = match swizzle {
        Swizzle::B128 => ("tma swizzle 128B, 64-byte rows", 32),
        _ => ("tma swizzle 64B, 32-byte rows", 16),
    };
    tma_scenario_with(
        name,
        [96, 40, 3],
        [inner, 8, 2],
        swizzle,
        OobFill::Zero,
        &[[0, 0, 0, 0], [8, 3, 1, 2048], [-8, 36, 0, 4096]],
    )
}

/// Destinations aligned to 128 but not to the swizzle pattern (256 bytes for 32B), and to 16
/// but not 128 bytes without a swizzle.
pub fn tma_dst_misaligned(swizzle: Swizzle) -> Scenario {
    match swizzle {
        Swizzle::None => tma_scenario_with(
            "tma no swizzle, destinations 16-byte aligned",
            [96, 40, 3],
            [24, 8, 2],
            Swizzle::None,
            OobFill::Zero,
            &[[0, 0, 0, 16], [24, 8, 1, 2048 + 48]],
        ),
        _ => tma_scenario_with(
            "tma swizzle 32B, destinations 128-byte aligned",
            [96, 40, 3],
            [16, 8, 2],
            Swizzle::B32,
            OobFill::Zero,
            &[[0, 0, 0, 128], [16, 8, 1, 2048 + 384]],
        ),
    }
}

/// One box at inner coordinate `c0` elements without a swizzle (`[24, 8, 2]` box: 4 is in
/// range, −4 cut by the face).
pub fn tma_inner_coordinate(name: &'static str, c0: i32) -> Scenario {
    tma_scenario_with(
        name,
        [96, 40, 3],
        [24, 8, 2],
        Swizzle::None,
        OobFill::Zero,
        &[[c0, 5, 0, 0]],
    )
}

/// Every `tma_box` scenario an H200 runs (compared byte for byte): the runtime's maps, each
/// swizzle mode and fill, destinations aligned to 128 bytes only, narrow swizzled rows.
pub fn tma_accepted_scenarios() -> Vec<Scenario> {
    let mut v = vec![
        tma_query_rows(),
        tma_key_rows(),
        tma_dst_128_aligned(),
        tma_dst_misaligned(Swizzle::B32),
        tma_narrow_rows(Swizzle::B128),
        tma_narrow_rows(Swizzle::B64),
    ];
    v.extend(tma_swizzle_scenarios());
    v
}

/// An inner coordinate of 3 elements (6 bytes) without a swizzle.
pub fn tma_inner_unaligned_plain() -> Scenario {
    tma_scenario_with(
        "tma no swizzle, inner coordinate 3",
        [96, 40, 3],
        [24, 8, 2],
        Swizzle::None,
        OobFill::Zero,
        &[[3, 5, 1, 0], [-3, 0, 0, 2048]],
    )
}

/// The shared bytes the model predicts for `tma_box` row `[c0, c1, c2, dst]` of a copy
/// through `map`: box rows `max(row, span)` bytes apart (a narrow row leaves the rest of its
/// span untouched, zero here), out-of-range elements filled (zeros, or `0x7ff7` for the NaN
/// fill), every 16-byte chunk at `a ^ (((a >> 7) & m) << 4)` of its absolute address `a`
/// with `m` = span/16 − 1 (CUTLASS `Swizzle<B,4,3>`, base 1024-aligned), read back from
/// `base + dst` over the box's footprint (what the kernel copies out).
pub fn tma_expected(tensor: &[u8], map: &MapSpec, row: [i32; 4]) -> Vec<u8> {
    let (dims, box_dim) = (map.global_dim, map.box_dim);
    let esize = 2usize;
    let bytes = tma_footprint(box_dim, map.swizzle);
    let dst = row[3] as usize;
    // The NaN fill of a bf16 map is 0x7ff7 on an H200.
    let fill = match map.oob_fill {
        OobFill::Zero => [0u8, 0],
        OobFill::Nan => [0xf7, 0x7f],
    };
    let m = (map.swizzle.span() / 16).max(1) - 1;
    let pitch = (box_dim[0] as usize * esize).max(map.swizzle.span());
    let mut smem = vec![0u8; dst + bytes + 1024];
    let mut r = 0usize;
    for i2 in 0..box_dim[2] as i64 {
        for i1 in 0..box_dim[1] as i64 {
            for i0 in 0..box_dim[0] as i64 {
                let g = [row[0] as i64 + i0, row[1] as i64 + i1, row[2] as i64 + i2];
                let inside = (0..3).all(|d| g[d] >= 0 && (g[d] as u64) < dims[d]);
                let a = dst + r * pitch + i0 as usize * esize;
                let swz = a ^ (((a >> 7) & m) << 4);
                if inside {
                    let idx = ((g[2] as u64 * dims[1] + g[1] as u64) * dims[0] + g[0] as u64)
                        as usize
                        * esize;
                    smem[swz..swz + esize].copy_from_slice(&tensor[idx..idx + esize]);
                } else {
                    smem[swz..swz + esize].copy_from_slice(&fill);
                }
            }
            r += 1;
        }
    }
    smem[dst..dst + bytes].to_vec()
}

// ---------------------------------------------------------------------------------------------
// mbarrier and elect
// ---------------------------------------------------------------------------------------------

/// `mbarrier_phases`: one thread walks an mbarrier (2 arrivals per phase) through its phases
/// with `test_wait`/`try_wait` and records each result in `out[i]` (see `MBARRIER_EXPECTED`).
pub fn mbarrier_ptx() -> String {
    let mut body = String::new();
    let mut slot = 0;
    let mut record = |body: &mut String, op: &str, parity: u32| {
        body.push_str(&format!(
            "\tmbarrier.{op}.parity.shared::cta.b64 %p1, [%r1], {parity};\n\
             \tselp.u32 %r2, 1, 0, %p1;\n\
             \tst.global.u32 [%rd0+{}], %r2;\n",
            4 * slot
        ));
        slot += 1;
    };
    let arrive = "\tmbarrier.arrive.shared::cta.b64 _, [%r1];\n";
    record(&mut body, "test_wait", 0); // 0: phase 0 in progress
    record(&mut body, "test_wait", 1); // 1: the phase before it counts as complete
    body.push_str(arrive);
    record(&mut body, "test_wait", 0); // 2: one of two arrivals
    body.push_str(arrive);
    record(&mut body, "test_wait", 0); // 3: phase 0 complete
    record(&mut body, "test_wait", 1); // 4: phase 1 in progress
    body.push_str("\tmbarrier.expect_tx.shared::cta.b64 [%r1], 64;\n");
    body.push_str(arrive);
    body.push_str(arrive);
    record(&mut body, "test_wait", 1); // 5: arrivals in, 64 bytes outstanding
    body.push_str("\tmbarrier.complete_tx.shared::cta.b64 [%r1], 64;\n");
    record(&mut body, "test_wait", 1); // 6: phase 1 complete
    record(&mut body, "test_wait", 0); // 7: phase 2 in progress
    body.push_str("\tmbarrier.arrive.shared::cta.b64 _, [%r1], 2;\n");
    record(&mut body, "test_wait", 0); // 8: one arrive of count 2 completes phase 2
    record(&mut body, "try_wait", 0); // 9: try_wait of a completed phase
    body.push_str("\tmbarrier.arrive.expect_tx.shared::cta.b64 _, [%r1], 32;\n");
    body.push_str("\tmbarrier.complete_tx.shared::cta.b64 [%r1], 32;\n");
    record(&mut body, "test_wait", 1); // 10: bytes in, one arrival missing
    body.push_str(arrive);
    record(&mut body, "test_wait", 1); // 11: phase 3 complete
    body.push_str("\tmbarrier.complete_tx.shared::cta.b64 [%r1], 16;\n");
    body.push_str("\tmbarrier.arrive.expect_tx.shared::cta.b64 _, [%r1], 16;\n");
    record(&mut body, "test_wait", 0); // 12: bytes completed before they were expected
    body.push_str(arrive);
    record(&mut body, "test_wait", 0); // 13: phase 4 complete
    format!(
        "{HEADER}
.visible .entry mbarrier_phases(
	.param .u64 .ptr .align 16 out
)
.maxntid 32, 1, 1
{{
	.reg .pred %p<2>;
	.reg .b32 %r<4>;
	.reg .b64 %rd<2>;
	.shared .align 8 .b64 mbar0;
	mov.u32 %r0, %tid.x;
	setp.ne.u32 %p0, %r0, 0;
	@%p0 bra $L_end;
	ld.param.u64 %rd0, [out];
	cvta.to.global.u64 %rd0, %rd0;
	mov.u32 %r1, mbar0;
	mbarrier.init.shared::cta.b64 [%r1], 2;
	fence.mbarrier_init.release.cluster;
{body}$L_end:
	ret;
}}
"
    )
}

/// What `mbarrier_phases` records, from the PTX ISA's phase rules.
pub const MBARRIER_EXPECTED: [u32; 14] = [0, 1, 0, 1, 0, 0, 1, 0, 1, 1, 0, 1, 0, 1];

pub fn mbarrier_scenario() -> Scenario {
    Scenario {
        name: "mbarrier phases",
        ptx: mbarrier_ptx(),
        kernel: "mbarrier_phases",
        grid: 1,
        threads: 32,
        dynamic_smem: 0,
        inputs: vec![],
        outputs: vec![4 * MBARRIER_EXPECTED.len()],
        args: vec![ArgSpec::Out(0)],
    }
}

/// `elect_leader`: lanes 0–4 leave; lanes 5–31 run `elect.sync` with membermask 0xffffffe0
/// and store the leader's lane id (`out[lane]`) and their predicate (`out[32 + lane]`).
pub fn elect_scenario() -> Scenario {
    let ptx = HEADER.to_string()
        + r#"
.visible .entry elect_leader(
	.param .u64 .ptr .align 16 out
)
.maxntid 32, 1, 1
{
	.reg .pred %p<2>;
	.reg .b32 %r<4>;
	.reg .b64 %rd<3>;
	mov.u32 %r0, %laneid;
	ld.param.u64 %rd0, [out];
	cvta.to.global.u64 %rd0, %rd0;
	setp.lt.u32 %p0, %r0, 5;
	@%p0 bra $L_end;
	elect.sync %r1|%p1, 0xffffffe0;
	selp.u32 %r2, 1, 0, %p1;
	mul.wide.u32 %rd1, %r0, 4;
	add.u64 %rd2, %rd0, %rd1;
	st.global.u32 [%rd2], %r1;
	st.global.u32 [%rd2+128], %r2;
$L_end:
	ret;
}
"#;
    Scenario {
        name: "elect.sync",
        ptx,
        kernel: "elect_leader",
        grid: 1,
        threads: 32,
        dynamic_smem: 0,
        inputs: vec![],
        outputs: vec![4 * 64],
        args: vec![ArgSpec::Out(0)],
    }
}

// ---------------------------------------------------------------------------------------------
// wgmma
// ---------------------------------------------------------------------------------------------

/// How a wgmma scenario lays out its operands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WgmmaForm {
    /// `S^T = K·Qᵀ`: A `[64 m][128 k]` and B `[64 n][128 k]`, both K-major (two 64-k panels of
    /// 8 KiB each), m64n64k16 × 8 in two commit groups.
    SsKK,
    /// `dV = Pᵀ·dO`: A from registers (`afrag`), B `[64 k][128 n]` MN-major (two 64-n panels,
    /// LBO 8 KiB), m64n128k16 × 4.
    RsMn,
    /// `dQᵀ = Kᵀ·dSᵀ`: A `[128 k][64 m]` and B `[128 k][64 n]`, both MN-major, m64n64k16 × 8,
    /// with `imm-scale-a` = −1 on k-steps 5 and 6.
    SsMnMn,
}

/// A wgmma scenario: logical `a [64][K]`, `b [K][N]` and what the kernel gets.
pub struct WgmmaCase {
    pub form: WgmmaForm,
    pub n: usize,
    pub k: usize,
    pub a: Vec<bf16>,
    pub b: Vec<bf16>,
    /// K-steps whose A is negated.
    pub negated_steps: Vec<usize>,
    pub scenario: Scenario,
}

/// Element (row, col) of accumulator register `i` of thread `t` of the warpgroup.
pub fn acc_pos(t: usize, i: usize) -> (usize, usize) {
    let (q, lane) = (t / 32, t % 32);
    (
        16 * q + lane / 4 + 8 * ((i % 4) / 2),
        8 * (i / 4) + 2 * (lane % 4) + i % 2,
    )
}

/// `(m, k)` of half `h` of A-fragment register `j` of thread `t` (one k16 step).
pub fn afrag_pos(t: usize, j: usize, h: usize) -> (usize, usize) {
    let (q, lane) = (t / 32, t % 32);
    (
        16 * q + lane / 4 + 8 * (j % 2),
        8 * (j / 2) + 2 * (lane % 4) + h,
    )
}

fn desc_lo(addr: &str, lbo: u32) -> String {
    format!(
        "\tshr.u32 %r20, {addr}, 4;\n\tand.b32 %r20, %r20, 16383;\n\tor.b32 %r20, %r20, {};\n",
        (lbo >> 4) << 16
    )
}

pub fn wgmma_case(form: WgmmaForm, seed: u64) -> WgmmaCase {
    wgmma_case_with(form, seed, false)
}

/// A wgmma scenario; `wide`: exponents in `2^[-20, 20]` with zeros, and in every k-step the
/// first two products of each output cancel exactly (`a[m][k+1] = −a[m][k]`,
/// `b[k+1][n] = b[k][n]`), so the sums lose their leading bits.
pub fn wgmma_case_with(form: WgmmaForm, seed: u64, wide: bool) -> WgmmaCase {
    let mut rng = Rng(seed);
    let (n, k) = match form {
        WgmmaForm::SsKK | WgmmaForm::SsMnMn => (64, 128),
        WgmmaForm::RsMn => (128, 64),
    };
    let mut draw = |_| if wide { rng.bf16_wide() } else { rng.bf16() };
    let mut a: Vec<bf16> = (0..64 * k).map(&mut draw).collect();
    let mut b: Vec<bf16> = (0..k * n).map(&mut draw).collect();
    if wide {
        for k0 in (0..k).step_by(16) {
            for m in 0..64 {
                a[m * k + k0 + 1] = -a[m * k + k0];
            }
            for j in 0..n {
                b[(k0 + 1) * n + j] = b[k0 * n + j];
            }
        }
    }
    let steps = k / 16;
    let negated_steps = if form == WgmmaForm::SsMnMn {
        vec![5, 6]
    } else {
        vec![]
    };
    // Tensors as the kernel loads them, and their maps.
    let (ta, tb, map_a, map_b): (Vec<bf16>, Vec<bf16>, Option<MapSpec>, MapSpec) = match form {
        WgmmaForm::SsKK => {
            let tb: Vec<bf16> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
            let kmajor = |input| MapSpec::sw128(input, [128, 64, 1], [256, 16384], [64, 64, 1]);
            (a.clone(), tb, Some(kmajor(0)), kmajor(1))
        }
        WgmmaForm::RsMn => {
            let mut frag = vec![0u32; steps * 128 * 4];
            for s in 0..steps {
                for t in 0..128 {
                    for j in 0..4 {
                        let mut word = 0u32;
                        for h in 0..2 {
                            let (m, kk) = afrag_pos(t, j, h);
                            word |= (a[m * k + 16 * s + kk].to_bits() as u32) << (16 * h);
                        }
                        frag[(s * 128 + t) * 4 + j] = word;
                    }
                }
            }
            let fb: Vec<bf16> = frag
                .iter()
                .flat_map(|w| {
                    [
                        bf16::from_bits(*w as u16),
                        bf16::from_bits((*w >> 16) as u16),
                    ]
                })
                .collect();
            let map_b = MapSpec::sw128(1, [128, 64, 1], [256, 16384], [64, 64, 1]);
            (fb, b.clone(), None, map_b)
        }
        WgmmaForm::SsMnMn => {
            let ta: Vec<bf16> = (0..k * 64).map(|i| a[(i % 64) * k + i / 64]).collect();
            let mn = |input| MapSpec::sw128(input, [64, 128, 1], [128, 16384], [64, 128, 1]);
            (ta, b.clone(), Some(mn(0)), mn(1))
        }
    };
    let regs = n / 2;
    let loads: Vec<(u32, &str, i32)> = match form {
        // (shared offset, map, c0)
        WgmmaForm::SsKK => vec![
            (0, "%rd1", 0),
            (8192, "%rd1", 64),
            (16384, "%rd2", 0),
            (24576, "%rd2", 64),
        ],
        WgmmaForm::RsMn => vec![(16384, "%rd2", 0), (24576, "%rd2", 64)],
        WgmmaForm::SsMnMn => vec![(0, "%rd1", 0), (16384, "%rd2", 0)],
    };
    let tx = match form {
        WgmmaForm::SsKK | WgmmaForm::SsMnMn => 32768,
        WgmmaForm::RsMn => 16384,
    };
    let mut body = String::new();
    body.push_str(&format!(
        "\t@%p0 mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r2], {tx};\n"
    ));
    for (off, map, c0) in &loads {
        body.push_str(&format!(
            "\tadd.u32 %r4, %r1, {off};\n\tmov.s32 %s0, {c0};\n\
             \t@%p0 cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%r4], [{map}, {{%s0, %s1, %s1}}], [%r2];\n"
        ));
    }
    body.push_str(
        "$L_wait:\n\tmbarrier.try_wait.parity.shared::cta.b64 %p1, [%r2], 0;\n\t@!%p1 bra $L_wait;\n",
    );
    if form == WgmmaForm::RsMn {
        // This thread's 4 fragment registers per k-step.
        body.push_str("\tmul.wide.u32 %rd5, %r3, 16;\n\tadd.u64 %rd5, %rd3, %rd5;\n");
        for s in 0..steps {
            body.push_str(&format!(
                "\tld.global.v4.b32 {{%q{}, %q{}, %q{}, %q{}}}, [%rd5+{}];\n",
                4 * s,
                4 * s + 1,
                4 * s + 2,
                4 * s + 3,
                s * 128 * 16
            ));
        }
    }
    let acc: Vec<String> = (0..regs).map(|i| format!("%f{i}")).collect();
    let acc = acc.join(", ");
    body.push_str("\twgmma.fence.sync.aligned;\n");
    for s in 0..steps {
        let scale_d = if s == 0 { "%p2" } else { "%p3" };
        match form {
            WgmmaForm::SsKK => {
                let off = (s / 4) * 8192 + (s % 4) * 32;
                body.push_str(&format!("\tadd.u32 %r21, %r1, {off};\n"));
                body.push_str(&desc_lo("%r21", 16));
                body.push_str("\tmov.b64 %bd0, {%r20, %r22};\n");
                body.push_str(&format!("\tadd.u32 %r21, %r1, {};\n", 16384 + off));
                body.push_str(&desc_lo("%r21", 16));
                body.push_str("\tmov.b64 %bd1, {%r20, %r22};\n");
                body.push_str(&format!(
                    "\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{{acc}}}, %bd0, %bd1, {scale_d}, 1, 1, 0, 0;\n"
                ));
                if s == 3 {
                    body.push_str("\twgmma.commit_group.sync.aligned;\n");
                }
            }
            WgmmaForm::RsMn => {
                body.push_str(&format!("\tadd.u32 %r21, %r1, {};\n", 16384 + 2048 * s));
                body.push_str(&desc_lo("%r21", 8192));
                body.push_str("\tmov.b64 %bd1, {%r20, %r22};\n");
                body.push_str(&format!(
                    "\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {{{acc}}}, {{%q{}, %q{}, %q{}, %q{}}}, %bd1, {scale_d}, 1, 1, 1;\n",
                    4 * s,
                    4 * s + 1,
                    4 * s + 2,
                    4 * s + 3
                ));
            }
            WgmmaForm::SsMnMn => {
                body.push_str(&format!("\tadd.u32 %r21, %r1, {};\n", 2048 * s));
                body.push_str(&desc_lo("%r21", 16384));
                body.push_str("\tmov.b64 %bd0, {%r20, %r22};\n");
                body.push_str(&format!("\tadd.u32 %r21, %r1, {};\n", 16384 + 2048 * s));
                body.push_str(&desc_lo("%r21", 16384));
                body.push_str("\tmov.b64 %bd1, {%r20, %r22};\n");
                let sa = if negated_steps.contains(&s) { -1 } else { 1 };
                body.push_str(&format!(
                    "\twgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {{{acc}}}, %bd0, %bd1, {scale_d}, {sa}, 1, 1, 1;\n"
                ));
            }
        }
    }
    body.push_str("\twgmma.commit_group.sync.aligned;\n");
    if form == WgmmaForm::SsKK {
        body.push_str("\twgmma.wait_group.sync.aligned 1;\n");
    }
    body.push_str("\twgmma.wait_group.sync.aligned 0;\n");
    body.push_str(&format!(
        "\tmul.wide.u32 %rd6, %r3, {};\n\tadd.u64 %rd6, %rd4, %rd6;\n",
        regs * 4
    ));
    for i in 0..regs {
        body.push_str(&format!("\tst.global.f32 [%rd6+{}], %f{i};\n", 4 * i));
    }
    let ptx = format!(
        "{HEADER}
.extern .shared .align 1024 .b8 smem[];

.visible .entry wgmma_case(
	.param .align 64 .b8 tmap_a[128],
	.param .align 64 .b8 tmap_b[128],
	.param .u64 .ptr .align 16 afrag,
	.param .u64 .ptr .align 16 out
)
.maxntid 128, 1, 1
{{
	.reg .pred %p<4>;
	.reg .b32 %r<24>;
	.reg .b32 %q<16>;
	.reg .s32 %s<2>;
	.reg .f32 %f<64>;
	.reg .b64 %bd<2>;
	.reg .b64 %rd<8>;

	mov.u32 %r0, smem;
	add.u32 %r1, %r0, 1023;
	and.b32 %r1, %r1, 4294966272;
	add.u32 %r2, %r1, 32768;
	mov.u32 %r3, %tid.x;
	setp.eq.u32 %p0, %r3, 0;
	mov.u32 %r22, 1073741888;
	mov.u32 %r23, 0;
	setp.ne.u32 %p2, %r23, 0;
	setp.eq.u32 %p3, %r23, 0;
	mov.s32 %s1, 0;
	@%p0 mbarrier.init.shared::cta.b64 [%r2], 1;
	@%p0 fence.mbarrier_init.release.cluster;
	bar.sync 0;
	mov.u64 %rd0, tmap_a;
	cvta.param.u64 %rd1, %rd0;
	mov.u64 %rd0, tmap_b;
	cvta.param.u64 %rd2, %rd0;
	ld.param.u64 %rd3, [afrag];
	cvta.to.global.u64 %rd3, %rd3;
	ld.param.u64 %rd4, [out];
	cvta.to.global.u64 %rd4, %rd4;
{body}	ret;
}}
"
    );
    // The unused map of the RS form points at the fragment buffer (never read through).
    let dummy = MapSpec::sw128(0, [128, 64, 1], [256, 16384], [64, 64, 1]);
    let scenario = Scenario {
        name: match (form, wide) {
            (WgmmaForm::SsKK, false) => "wgmma SS K-major m64n64k16 x8",
            (WgmmaForm::RsMn, false) => "wgmma RS, B MN-major m64n128k16 x4",
            (WgmmaForm::SsMnMn, false) => "wgmma SS MN-major m64n64k16 x8, scale-a -1",
            (WgmmaForm::SsKK, true) => "wgmma SS K-major m64n64k16 x8, wide exponents",
            (WgmmaForm::RsMn, true) => "wgmma RS, B MN-major m64n128k16 x4, wide exponents",
            (WgmmaForm::SsMnMn, true) => {
                "wgmma SS MN-major m64n64k16 x8, scale-a -1, wide exponents"
            }
        },
        ptx,
        kernel: "wgmma_case",
        grid: 1,
        threads: 128,
        dynamic_smem: 1024 + 32768 + 64,
        inputs: vec![bytes_of_bf16(&ta), bytes_of_bf16(&tb)],
        outputs: vec![128 * regs * 4],
        args: vec![
            ArgSpec::Map(map_a.unwrap_or(dummy)),
            ArgSpec::Map(map_b),
            ArgSpec::In(0),
            ArgSpec::Out(0),
        ],
    };
    WgmmaCase {
        form,
        n,
        k,
        a,
        b,
        negated_steps,
        scenario,
    }
}

impl WgmmaCase {
    /// `D[m][n]` from the kernel's per-thread output.
    pub fn unpack(&self, out: &[u8]) -> Vec<f32> {
        let v = f32s(out);
        let regs = self.n / 2;
        let mut d = vec![0f32; 64 * self.n];
        for t in 0..128 {
            for i in 0..regs {
                let (r, c) = acc_pos(t, i);
                d[r * self.n + c] = v[t * regs + i];
            }
        }
        d
    }

    fn a_at(&self, m: usize, kk: usize) -> f32 {
        let x = self.a[m * self.k + kk].to_f32();
        if self.negated_steps.contains(&(kk / 16)) {
            -x
        } else {
            x
        }
    }

    /// `Σ_k a·b` in f64 and `Σ_k |a·b|`.
    pub fn reference(&self) -> (Vec<f64>, Vec<f64>) {
        let mut d = vec![0f64; 64 * self.n];
        let mut mag = vec![0f64; 64 * self.n];
        for m in 0..64 {
            for j in 0..self.n {
                for kk in 0..self.k {
                    let p = self.a_at(m, kk) as f64 * self.b[kk * self.n + j].to_f32() as f64;
                    d[m * self.n + j] += p;
                    mag[m * self.n + j] += p.abs();
                }
            }
        }
        (d, mag)
    }
}
