//! The decoded instruction set: what the parser turns PTX text into, once, before execution.
//!
//! Every operand is resolved at decode time: registers are slots of the per-thread register
//! file, symbols are addresses (shared offsets or param-window addresses), labels are
//! instruction indices and immediates are raw bits of the instruction's type. Execution never
//! looks at a string.
//!
//! The Hopper asynchronous machinery decodes to [`Op::MbarrierInit`], [`Op::MbarrierArrive`],
//! [`Op::MbarrierExpectTx`], [`Op::MbarrierTryWait`], [`Op::CpAsyncBulkTensor`],
//! [`Op::Wgmma`], [`Op::WgmmaSync`], [`Op::SetMaxNReg`] and [`Op::Fence`]; the Blackwell
//! tensor-memory family to [`Op::Tcgen05`].

use std::fmt;

/// A register slot in the per-thread register file (`.pred` registers included).
pub type Reg = u32;

/// Base of the generic-address window that maps the kernel parameter buffer.
///
/// `mov.u64 %rd, param_name` yields `PARAM_WINDOW + offset`; `ld.param` accepts these.
pub const PARAM_WINDOW: u64 = 0x0000_7e00_0000_0000;

/// Base of the generic-address window that maps the CTA's shared memory (`cvta.shared`).
pub const SHARED_WINDOW: u64 = 0x0000_7d00_0000_0000;

/// The axis of a special register such as `%tid.x`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Axis {
    /// `.x`
    X,
    /// `.y`
    Y,
    /// `.z`
    Z,
}

impl Axis {
    /// 0, 1 or 2.
    pub fn index(self) -> usize {
        match self {
            Axis::X => 0,
            Axis::Y => 1,
            Axis::Z => 2,
        }
    }
}

/// A read-only special register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    /// `%tid.{x,y,z}`
    Tid(Axis),
    /// `%ntid.{x,y,z}`
    Ntid(Axis),
    /// `%ctaid.{x,y,z}`
    Ctaid(Axis),
    /// `%nctaid.{x,y,z}`
    Nctaid(Axis),
    /// `%laneid`
    LaneId,
    /// `%clock`: the model's reads are a hash of the CTA's progress and the thread, so
    /// latency probes see arbitrary times; the paired pool's copies, chosen by them, then
    /// mix within rows, and any choice is correct.
    Clock,
    /// `%warpid` (the warp's index in the CTA; hardware may differ, PTX says it is volatile)
    WarpId,
    /// `%lanemask_eq`
    LaneMaskEq,
    /// `%lanemask_lt`
    LaneMaskLt,
    /// `%lanemask_le`
    LaneMaskLe,
    /// `%lanemask_gt`
    LaneMaskGt,
    /// `%lanemask_ge`
    LaneMaskGe,
}

impl Special {
    /// Parses `%tid.x` etc.
    pub fn from_name(name: &str) -> Option<Special> {
        let axis = |s: &str| match s {
            "x" => Some(Axis::X),
            "y" => Some(Axis::Y),
            "z" => Some(Axis::Z),
            _ => None,
        };
        if let Some((base, ax)) = name.split_once('.') {
            let ax = axis(ax)?;
            return match base {
                "%tid" => Some(Special::Tid(ax)),
                "%ntid" => Some(Special::Ntid(ax)),
                "%ctaid" => Some(Special::Ctaid(ax)),
                "%nctaid" => Some(Special::Nctaid(ax)),
                _ => None,
            };
        }
        match name {
            "%laneid" => Some(Special::LaneId),
            "%clock" => Some(Special::Clock),
            "%warpid" => Some(Special::WarpId),
            "%lanemask_eq" => Some(Special::LaneMaskEq),
            "%lanemask_lt" => Some(Special::LaneMaskLt),
            "%lanemask_le" => Some(Special::LaneMaskLe),
            "%lanemask_gt" => Some(Special::LaneMaskGt),
            "%lanemask_ge" => Some(Special::LaneMaskGe),
            _ => None,
        }
    }
}

/// A source operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Src {
    /// A register (its low bits per the instruction type).
    Reg(Reg),
    /// Raw bits of an immediate, already converted to the instruction type.
    Imm(u64),
    /// A special register.
    Special(Special),
}

/// A destination operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dst {
    /// A register.
    Reg(Reg),
    /// `_`: the result is discarded.
    Sink,
}

/// A predicate guard `@%p` / `@!%p`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Guard {
    /// The predicate register.
    pub reg: Reg,
    /// `@!%p`.
    pub negate: bool,
}

/// A state space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    /// `.global`
    Global,
    /// `.shared` (`.shared::cta`)
    Shared,
    /// `.param` (kernel parameters)
    Param,
    /// No space qualifier: generic addressing, resolved through the windows.
    Generic,
}

impl fmt::Display for Space {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Space::Global => "global",
            Space::Shared => "shared",
            Space::Param => "param",
            Space::Generic => "generic",
        })
    }
}

/// The base of an address operand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AddrBase {
    /// `[%r]`: the register's value (all 64 bits for a 64-bit register).
    Reg(Reg),
    /// A resolved symbol or absolute address.
    Abs(u64),
}

/// `[base+offset]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addr {
    /// The base.
    pub base: AddrBase,
    /// The signed byte offset.
    pub offset: i64,
}

/// A tensor operand `[%rd, {%c0, %c1, ...}]` of `cp.async.bulk.tensor`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorRef {
    /// The tensor-map address.
    pub map: Addr,
    /// The coordinates, innermost first.
    pub coords: Vec<Src>,
}

/// A scalar type as named by an instruction suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    /// `.pred`
    Pred,
    /// `.b8`, `.b16`, `.b32`, `.b64`
    B(u8),
    /// `.u8` .. `.u64`
    U(u8),
    /// `.s8` .. `.s64`
    S(u8),
    /// `.f16`
    F16,
    /// `.bf16`
    Bf16,
    /// `.f32`
    F32,
    /// `.f64`
    F64,
    /// `.f16x2`
    F16x2,
    /// `.bf16x2`
    Bf16x2,
}

impl Ty {
    /// Parses a type suffix without the dot.
    pub fn from_suffix(s: &str) -> Option<Ty> {
        Some(match s {
            "pred" => Ty::Pred,
            "b8" => Ty::B(8),
            "b16" => Ty::B(16),
            "b32" => Ty::B(32),
            "b64" => Ty::B(64),
            "u8" => Ty::U(8),
            "u16" => Ty::U(16),
            "u32" => Ty::U(32),
            "u64" => Ty::U(64),
            "s8" => Ty::S(8),
            "s16" => Ty::S(16),
            "s32" => Ty::S(32),
            "s64" => Ty::S(64),
            "f16" => Ty::F16,
            "bf16" => Ty::Bf16,
            "f32" => Ty::F32,
            "f64" => Ty::F64,
            "f16x2" => Ty::F16x2,
            "bf16x2" => Ty::Bf16x2,
            _ => return None,
        })
    }

    /// Width in bits (1 for `.pred`).
    pub fn bits(self) -> u32 {
        match self {
            Ty::Pred => 1,
            Ty::B(n) | Ty::U(n) | Ty::S(n) => n as u32,
            Ty::F16 | Ty::Bf16 => 16,
            Ty::F32 | Ty::F16x2 | Ty::Bf16x2 => 32,
            Ty::F64 => 64,
        }
    }

    /// Width in bytes (`.pred` counts as 1).
    pub fn bytes(self) -> u32 {
        self.bits().div_ceil(8)
    }

    /// Whether the type is a floating-point type (packed included).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            Ty::F16 | Ty::Bf16 | Ty::F32 | Ty::F64 | Ty::F16x2 | Ty::Bf16x2
        )
    }

    /// Whether the type is a signed integer.
    pub fn is_signed(self) -> bool {
        matches!(self, Ty::S(_))
    }
}

/// An integer type of an arithmetic instruction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntTy {
    /// 16, 32 or 64.
    pub bits: u8,
    /// `.sNN` (arithmetic shifts, signed compares, signed division).
    pub signed: bool,
}

/// Binary integer and bit operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntOp {
    /// `add`
    Add,
    /// `sub`
    Sub,
    /// `mul.lo`
    MulLo,
    /// `mul.hi`
    MulHi,
    /// `div` (division by zero is a fault)
    Div,
    /// `rem` (division by zero is a fault)
    Rem,
    /// `min`
    Min,
    /// `max`
    Max,
    /// `and`
    And,
    /// `or`
    Or,
    /// `xor`
    Xor,
    /// `shl` (shift amounts past the width give 0)
    Shl,
    /// `shr` (logical for `.b`/`.u`, arithmetic for `.s`)
    Shr,
}

/// Unary integer operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntUnOp {
    /// `not`
    Not,
    /// `neg`
    Neg,
    /// `abs`
    Abs,
    /// `popc` (the destination is a `.u32`)
    Popc,
}

/// `mad` variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MadMode {
    /// `mad.lo`: low half of `a·b`, plus `c`.
    Lo,
    /// `mad.hi`: high half of `a·b`, plus `c`.
    Hi,
    /// `mad.wide`: the full product at twice the width, plus `c`.
    Wide,
}

/// Binary f32 operations (round to nearest even).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatOp {
    /// `add.f32`
    Add,
    /// `sub.f32`
    Sub,
    /// `mul.f32`
    Mul,
    /// `min.f32` (NaN-ignoring, `-0 < +0`)
    Min,
    /// `max.f32` (NaN-ignoring, `-0 < +0`)
    Max,
}

/// Unary f32 operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatUnOp {
    /// `ex2.approx.f32`: modelled as `exp2` computed in f64 and rounded to f32.
    Ex2,
    /// `lg2.approx.f32`: modelled as `log2` computed in f64 and rounded to f32.
    Lg2,
    /// `rcp.rn.f32`: the correctly rounded reciprocal.
    Rcp,
    /// `neg.f32`
    Neg,
    /// `abs.f32`
    Abs,
}

/// A comparison of `setp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    /// `eq`
    Eq,
    /// `ne`
    Ne,
    /// `lt` (`lo` for unsigned)
    Lt,
    /// `le` (`ls` for unsigned)
    Le,
    /// `gt` (`hi` for unsigned)
    Gt,
    /// `ge` (`hs` for unsigned)
    Ge,
    /// float `equ`
    Equ,
    /// float `neu`
    Neu,
    /// float `ltu`
    Ltu,
    /// float `leu`
    Leu,
    /// float `gtu`
    Gtu,
    /// float `geu`
    Geu,
    /// float `num` (neither is NaN)
    Num,
    /// float `nan` (either is NaN)
    Nan,
}

/// Predicate logic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PredOp {
    /// `and.pred`
    And,
    /// `or.pred`
    Or,
    /// `xor.pred`
    Xor,
}

/// A predicate source, possibly negated (`!%p`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PredSrc {
    /// The predicate (a register or an immediate 0/1).
    pub src: Src,
    /// `!`
    pub negate: bool,
}

/// A conversion of `cvt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conversion {
    /// Integer to integer: truncate to `to` bits, then sign- or zero-extend from `from` bits.
    Int {
        /// Source type.
        from: IntTy,
        /// Destination type.
        to: IntTy,
    },
    /// Integer to f32 with round to nearest even (`cvt.rn.f32.{u,s}NN`).
    IntToF32 {
        /// Source type.
        from: IntTy,
    },
    /// f32 to integer with the given rounding (`cvt.rzi.s32.f32` etc.), saturating; NaN gives 0.
    F32ToInt {
        /// Destination type.
        to: IntTy,
        /// Rounding.
        round: RoundInt,
    },
    /// `cvt.rXi.f32.f32`: round to an integral value.
    F32Round(RoundInt),
    /// `cvt.f32.bf16`: exact.
    Bf16ToF32,
    /// `cvt.rn.bf16.f32`: round to nearest even, NaN to the canonical `0x7fff`.
    F32ToBf16,
    /// `cvt.f32.f16`: exact.
    F16ToF32,
    /// `cvt.rn.f16.f32`: round to nearest even.
    F32ToF16,
}

/// Integer rounding of float-to-integer conversions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundInt {
    /// `.rni`: nearest, ties to even.
    Nearest,
    /// `.rzi`: towards zero.
    Zero,
    /// `.rmi`: towards −∞.
    Down,
    /// `.rpi`: towards +∞.
    Up,
}

/// `shfl.sync` mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShflMode {
    /// `.up`
    Up,
    /// `.down`
    Down,
    /// `.bfly`
    Bfly,
    /// `.idx`
    Idx,
}

/// Atomic / reduction operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomOp {
    /// `.add`
    Add,
    /// `.min`
    Min,
    /// `.max`
    Max,
    /// `.and`
    And,
    /// `.or`
    Or,
    /// `.xor`
    Xor,
    /// `.exch`
    Exch,
    /// `.cas` (compare `b`, swap in `c`)
    Cas,
    /// `.inc` (wraps to 0 past `b`)
    Inc,
    /// `.dec` (wraps to `b` at 0 or past `b`)
    Dec,
}

/// `bar` flavours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarKind {
    /// `bar.sync` / `barrier.sync`: arrive and wait.
    Sync,
    /// `bar.arrive` / `barrier.arrive`: arrive without waiting (needs a thread count).
    Arrive,
}

/// The A operand of `wgmma.mma_async`.
#[derive(Debug, Clone, PartialEq)]
pub enum WgmmaA {
    /// A 64-bit shared-memory matrix descriptor (the SS form).
    Desc(Src),
    /// Four `.b32` registers per thread holding the thread's A fragment (the RS form).
    Regs([Src; 4]),
}

/// The input element type of a `wgmma.mma_async` (the accumulator is always `.f32`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WgmmaInput {
    /// `.bf16.bf16`
    Bf16,
    /// `.f16.f16`
    F16,
}

/// `wgmma.mma_async.sync.aligned.m64nNk16.f32.{bf16,f16}.{bf16,f16}`.
#[derive(Debug, Clone, PartialEq)]
pub struct Wgmma {
    /// `N` of the shape (a multiple of 8 in 8..=256); `M` = 64 and `K` = 16.
    pub n: u32,
    /// Input element type.
    pub input: WgmmaInput,
    /// The accumulator: `N/2` `.f32` registers per thread.
    pub d: Vec<Reg>,
    /// The A operand.
    pub a: WgmmaA,
    /// The B descriptor.
    pub b: Src,
    /// `scale-d`: `D = A·B + D` when true, `D = A·B` when false.
    pub scale_d: PredSrc,
    /// `imm-scale-a` = −1.
    pub negate_a: bool,
    /// `imm-scale-b` = −1.
    pub negate_b: bool,
    /// `imm-trans-a` = 1: A is MN-major in shared memory (SS form only).
    pub trans_a: bool,
    /// `imm-trans-b` = 1: B is MN-major in shared memory.
    pub trans_b: bool,
}

/// The warpgroup-wide `wgmma` bookkeeping instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WgmmaSync {
    /// `wgmma.fence.sync.aligned`
    Fence,
    /// `wgmma.commit_group.sync.aligned`
    Commit,
    /// `wgmma.wait_group.sync.aligned N`
    Wait(u32),
}

/// A `fence` flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FenceKind {
    /// `fence.proxy.async[.shared::cta|.global]`: orders the thread's generic-proxy accesses
    /// before its later async-proxy ones (TMA, wgmma operand reads).
    ProxyAsync,
    /// `fence.mbarrier_init.release.cluster` (a no-op here: one CTA, sequentially consistent).
    MbarrierInit,
    /// `fence.{sc,acq_rel}.{cta,gpu,sys}` (a no-op here).
    Memory,
}

/// `cp.async.bulk.tensor.Nd.shared::cluster.global.tile.mbarrier::complete_tx::bytes`.
#[derive(Debug, Clone, PartialEq)]
pub struct TmaLoad {
    /// The shared-memory destination (`.shared::cluster`: the own CTA's shared window).
    pub dst: Addr,
    /// The tensor map (a generic address of the 128-byte map) and the box coordinates.
    pub tensor: TensorRef,
    /// The mbarrier that receives the box's bytes as `complete_tx`.
    pub mbar: Addr,
}

/// `cp.reduce.async.bulk.tensor.Nd.global.shared::cta.add.tile.bulk_group [map, coords], [src]`:
/// the shared box at `src` added elementwise into the tensor (2-byte elements as bf16).
#[derive(Debug, Clone, PartialEq)]
pub struct TmaReduce {
    /// The shared-memory source.
    pub src: Addr,
    /// The tensor map and the box coordinates.
    pub tensor: TensorRef,
}

/// `cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], bytes,
/// [mbar]`: `bytes` contiguous bytes of global memory at `src` into shared `dst`.
#[derive(Debug, Clone, PartialEq)]
pub struct BulkLoad {
    /// The shared-memory destination (`.shared::cluster`: the own CTA's shared window).
    pub dst: Addr,
    /// The global source.
    pub src: Addr,
    /// Bytes (a multiple of 16).
    pub bytes: u32,
    /// The mbarrier that receives the bytes as `complete_tx`.
    pub mbar: Addr,
}

/// `cp.reduce.async.bulk.global.shared::cta.bulk_group.add.noftz.f16 [dst], [src], bytes`:
/// `bytes` of f16 at shared `src` added elementwise into global `dst`.
#[derive(Debug, Clone, PartialEq)]
pub struct BulkReduce {
    /// The global destination.
    pub dst: Addr,
    /// The shared-memory source.
    pub src: Addr,
    /// Bytes (a multiple of 16).
    pub bytes: u32,
}

/// The A operand of `tcgen05.mma`.
#[derive(Debug, Clone, PartialEq)]
pub enum Tc05A {
    /// A 64-bit shared-memory matrix descriptor (the SS form).
    Desc(Src),
    /// A tensor-memory address `[taddr]` (the TS form): packed 16-bit pairs, K-major.
    Tmem(Addr),
}

/// The Blackwell `tcgen05` family (`cta_group::1` only).
#[derive(Debug, Clone, PartialEq)]
pub enum Tcgen05 {
    /// `tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [dst], ncols`: warp-collective;
    /// writes the base TMEM address to the shared word at `dst`.
    Alloc {
        /// Shared destination of the address.
        dst: Addr,
        /// Columns (power of two in 32..=512).
        ncols: Src,
    },
    /// `tcgen05.dealloc.cta_group::1.sync.aligned.b32 taddr, ncols`
    Dealloc {
        /// The address `alloc` returned.
        taddr: Src,
        /// Columns.
        ncols: Src,
    },
    /// `tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned`
    Relinquish,
    /// `tcgen05.mma.cta_group::1.kind::f16 [d], a, bdesc, idesc, enable_input_d`
    Mma {
        /// The TMEM accumulator address.
        d: Addr,
        /// The A operand.
        a: Tc05A,
        /// The B descriptor.
        b: Src,
        /// The 32-bit instruction descriptor.
        idesc: Src,
        /// `enable_input_d`: `D += A·B` when true, `D = A·B` when false.
        enable_d: PredSrc,
    },
    /// `tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [mbar]`
    Commit {
        /// The mbarrier.
        mbar: Addr,
    },
    /// `tcgen05.ld.sync.aligned.32x32b.xN.b32 {regs}, [taddr]`
    Ld {
        /// N destination registers.
        dst: Vec<Dst>,
        /// The warp-uniform TMEM address.
        taddr: Addr,
    },
    /// `tcgen05.st.sync.aligned.32x32b.xN.b32 [taddr], {regs}`
    St {
        /// The warp-uniform TMEM address.
        taddr: Addr,
        /// N values.
        src: Vec<Src>,
    },
    /// `tcgen05.wait::ld.sync.aligned`
    WaitLd,
    /// `tcgen05.wait::st.sync.aligned`
    WaitSt,
    /// `tcgen05.fence::before_thread_sync` (`before`) or `::after_thread_sync`.
    Fence {
        /// `before_thread_sync`.
        before: bool,
    },
}

/// One decoded operation.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Op {
    /// `ld[.space][.nc][.vN].type`
    Ld {
        /// State space.
        space: Space,
        /// Element type.
        ty: Ty,
        /// Destinations (1, 2 or 4).
        dst: Vec<Dst>,
        /// Bits of each destination register (for sign extension of sub-word loads).
        dst_bits: u8,
        /// Address.
        addr: Addr,
    },
    /// `st[.space][.vN].type`
    St {
        /// State space.
        space: Space,
        /// Element type.
        ty: Ty,
        /// Address.
        addr: Addr,
        /// Values (1, 2 or 4).
        src: Vec<Src>,
    },
    /// `mov.type d, a` (also `mov` of a symbol's address).
    Mov {
        /// Width in bits (1 for `.pred`).
        bits: u8,
        /// Destination.
        d: Reg,
        /// Source.
        a: Src,
    },
    /// `mov.bNN d, {a, b, ...}`: pack, first element in the low bits.
    Pack {
        /// Bits of each element.
        elem_bits: u8,
        /// Destination.
        d: Reg,
        /// Elements, low first.
        parts: Vec<Src>,
    },
    /// `mov.bNN {a, b, ...}, s`: unpack, first element from the low bits.
    Unpack {
        /// Bits of each element.
        elem_bits: u8,
        /// Destinations, low first.
        dst: Vec<Dst>,
        /// Source.
        a: Src,
    },
    /// `cvta[.to].space.uNN`
    Cvta {
        /// `.to`: generic to `space`; otherwise `space` to generic.
        to: bool,
        /// The non-generic space.
        space: Space,
        /// 32 or 64.
        bits: u8,
        /// Destination.
        d: Reg,
        /// Source.
        a: Src,
    },
    /// Binary integer or bit operation.
    Int {
        /// Operation.
        op: IntOp,
        /// Type.
        ty: IntTy,
        /// Destination.
        d: Reg,
        /// First operand.
        a: Src,
        /// Second operand.
        b: Src,
    },
    /// Unary integer or bit operation.
    IntUn {
        /// Operation.
        op: IntUnOp,
        /// Type.
        ty: IntTy,
        /// Destination.
        d: Reg,
        /// Operand.
        a: Src,
    },
    /// `mul.wide.{u,s}NN`: full product at twice the width.
    MulWide {
        /// Source type.
        ty: IntTy,
        /// Destination.
        d: Reg,
        /// First factor.
        a: Src,
        /// Second factor.
        b: Src,
    },
    /// `mad.{lo,hi,wide}.type d, a, b, c`
    Mad {
        /// Which half of the product.
        mode: MadMode,
        /// Type of `a` and `b`.
        ty: IntTy,
        /// Destination.
        d: Reg,
        /// First factor.
        a: Src,
        /// Second factor.
        b: Src,
        /// Addend.
        c: Src,
    },
    /// Binary f32 operation.
    Float {
        /// Operation.
        op: FloatOp,
        /// `.ftz`
        ftz: bool,
        /// Destination.
        d: Reg,
        /// First operand.
        a: Src,
        /// Second operand.
        b: Src,
    },
    /// `fma.rn[.ftz].f32` (single rounding).
    Fma {
        /// `.ftz`
        ftz: bool,
        /// Destination.
        d: Reg,
        /// First factor.
        a: Src,
        /// Second factor.
        b: Src,
        /// Addend.
        c: Src,
    },
    /// Unary f32 operation.
    FloatUn {
        /// Operation.
        op: FloatUnOp,
        /// `.ftz`
        ftz: bool,
        /// Destination.
        d: Reg,
        /// Operand.
        a: Src,
    },
    /// `setp.cmp.type d, a, b`
    Setp {
        /// Comparison.
        cmp: Cmp,
        /// Operand type.
        ty: Ty,
        /// Destination predicate.
        d: Reg,
        /// First operand.
        a: Src,
        /// Second operand.
        b: Src,
    },
    /// `selp.type d, a, b, p`: `p ? a : b`.
    Selp {
        /// Width in bits.
        bits: u8,
        /// Destination.
        d: Reg,
        /// Taken when `p`.
        a: Src,
        /// Taken when `!p`.
        b: Src,
        /// Selector.
        p: PredSrc,
    },
    /// `and/or/xor.pred d, a, b`
    Pred {
        /// Operation.
        op: PredOp,
        /// Destination.
        d: Reg,
        /// First operand.
        a: PredSrc,
        /// Second operand.
        b: PredSrc,
    },
    /// `not.pred d, a` (and `mov.pred d, !a`).
    PredNot {
        /// Destination.
        d: Reg,
        /// Operand.
        a: PredSrc,
    },
    /// `cvt`
    Cvt {
        /// Conversion.
        conv: Conversion,
        /// Destination.
        d: Reg,
        /// Source.
        a: Src,
    },
    /// `cvt.rn.bf16x2.f32 d, hi, lo` (or `.f16x2` with `f16`): `hi` lands in the upper half.
    CvtBf16x2 {
        /// Destination.
        d: Reg,
        /// f16 halves instead of bf16.
        f16: bool,
        /// Upper element (first operand).
        hi: Src,
        /// Lower element (second operand).
        lo: Src,
    },
    /// `prmt.b32 d, a, b, c` (default mode).
    Prmt {
        /// Destination.
        d: Reg,
        /// Bytes 0–3.
        a: Src,
        /// Bytes 4–7.
        b: Src,
        /// Selector.
        c: Src,
    },
    /// `shfl.sync.mode.b32 d[|p], a, b, c, membermask`
    Shfl {
        /// Mode.
        mode: ShflMode,
        /// Destination value.
        d: Dst,
        /// Destination predicate (source lane in range).
        p: Option<Reg>,
        /// Value.
        a: Src,
        /// Lane / delta / mask.
        b: Src,
        /// Clamp and segment mask.
        c: Src,
        /// Member mask.
        mask: Src,
    },
    /// `bar.sync a{, b}` / `bar.arrive a, b` / `barrier.sync`
    Bar {
        /// Sync or arrive.
        kind: BarKind,
        /// Barrier id 0..15.
        id: Src,
        /// Thread count (all threads of the CTA when absent).
        count: Option<Src>,
    },
    /// `atom` / `red` on global or shared memory.
    Atom {
        /// State space.
        space: Space,
        /// Operation.
        op: AtomOp,
        /// Element type.
        ty: Ty,
        /// Old value(s) (`atom`); `None` for `red`.
        d: Option<Vec<Dst>>,
        /// Address.
        addr: Addr,
        /// Operand(s) (a vector for `.v2`/`.v4`).
        b: Vec<Src>,
        /// Swap value of `.cas`.
        c: Option<Src>,
        /// `.noftz` (f16/bf16 only); `.f32` adds flush subnormals.
        noftz: bool,
    },
    /// `createpolicy...b64 d, ...`: an opaque cache policy value.
    CreatePolicy {
        /// Destination.
        d: Reg,
    },
    /// `mbarrier.init[.shared::cta].b64 [addr], count`
    MbarrierInit {
        /// `.shared` or generic.
        space: Space,
        /// The mbarrier (8 bytes, 8-aligned).
        addr: Addr,
        /// Expected arrivals per phase.
        count: Src,
    },
    /// `mbarrier.arrive[.expect_tx][.release.cta][.shared::cta].b64 state, [addr]{, n}`:
    /// one arrival per executing thread (or `count` with the count operand), after adding
    /// `tx` to the phase's expected transaction bytes.
    MbarrierArrive {
        /// `.shared` or generic.
        space: Space,
        /// The returned state token (`_` to discard).
        state: Dst,
        /// The mbarrier.
        addr: Addr,
        /// Arrivals (1 when absent).
        count: Option<Src>,
        /// `.expect_tx` bytes.
        tx: Option<Src>,
    },
    /// `mbarrier.expect_tx[.relaxed.cta][.shared::cta].b64 [addr], tx` (adds `tx` expected
    /// bytes) or `mbarrier.complete_tx ...` (completes `tx` bytes, as a copy would).
    MbarrierExpectTx {
        /// `.shared` or generic.
        space: Space,
        /// The mbarrier.
        addr: Addr,
        /// Bytes.
        tx: Src,
        /// `complete_tx` rather than `expect_tx`.
        complete: bool,
    },
    /// `mbarrier.{try,test}_wait.parity[.acquire.cta][.shared::cta].b64 p, [addr], parity{, hint}`.
    /// `try_wait` is modelled as blocking: a lane whose phase has not completed waits until it
    /// does. `test_wait` returns at once. Either first lands the TMA copies in flight to the
    /// mbarrier when the phase is not complete.
    MbarrierTryWait {
        /// `test_wait` (never blocks).
        test: bool,
        /// `.shared` or generic.
        space: Space,
        /// The result predicate.
        p: Reg,
        /// The mbarrier.
        addr: Addr,
        /// The parity of the phase waited for.
        parity: Src,
    },
    /// A TMA tile load.
    CpAsyncBulkTensor(Box<TmaLoad>),
    /// A bulk (non-tensor) load into shared memory ([`BulkLoad`]).
    CpAsyncBulk(Box<BulkLoad>),
    /// A TMA reduce-add from shared memory, tracked by the thread's bulk groups.
    TmaReduceAdd(Box<TmaReduce>),
    /// A bulk (non-tensor) f16 reduce-add ([`BulkReduce`]).
    BulkReduceAdd(Box<BulkReduce>),
    /// `cp.async.bulk.commit_group`
    BulkCommit,
    /// `cp.async.bulk.wait_group{.read} n`: at most `n` of the thread's committed bulk groups
    /// remain (reading their sources, with `.read`).
    BulkWait {
        /// Groups that may remain.
        n: u32,
    },
    /// `wgmma.mma_async`: a warpgroup-collective asynchronous MMA.
    Wgmma(Box<Wgmma>),
    /// `wgmma.fence` / `commit_group` / `wait_group`.
    WgmmaSync(WgmmaSync),
    /// `setmaxnreg.{inc,dec}.sync.aligned.u32 count`
    SetMaxNReg {
        /// `.inc` (otherwise `.dec`).
        inc: bool,
        /// The new per-thread register count.
        count: u32,
    },
    /// `fence.*`
    Fence(FenceKind),
    /// `elect.sync d|p, membermask`: `p` is true in the leader (the lowest lane of the
    /// membermask), `d` is the leader's lane id.
    Elect {
        /// The leader's lane id (`_` to discard).
        d: Dst,
        /// True in the leader.
        p: Option<Reg>,
        /// The member mask.
        mask: Src,
    },
    /// `vote.sync.ballot.b32 d, p, membermask`: bit `l` of `d` is `p` of lane `l`.
    Ballot {
        /// The ballot.
        d: Dst,
        /// The predicate each lane votes.
        a: PredSrc,
        /// The member mask.
        mask: Src,
    },
    /// `redux.sync.min.u32 d, a, membermask`: the least `a` of the member lanes, in each.
    ReduxMin {
        /// The minimum.
        d: Dst,
        /// Each lane's value.
        a: Src,
        /// The member mask.
        mask: Src,
    },
    /// `stmatrix.sync.aligned.m8n8.x{1,2,4}.shared.b16 [addr], {r..}`: the warp stores
    /// `src.len()` 8×8 b16 matrices held in the mma fragment layout; lane `8·i + row` gives
    /// the address of `row` of matrix `i`.
    Stmatrix {
        /// Each lane's row address (shared space).
        addr: Addr,
        /// One 32-bit register per matrix.
        src: Vec<Src>,
    },
    /// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {d×4}, {a×4}, {b×2}, {c×4}`:
    /// the warp's `D[16×8] = A[16×16]·B[16×8] + C` in the ISA's fragment layout
    /// (9.7.14.5.8).
    MmaBf16 {
        /// Each lane's four f32 results.
        d: Vec<Dst>,
        /// Each lane's four bf16x2 words of A.
        a: Vec<Src>,
        /// Each lane's two bf16x2 words of B.
        b: Vec<Src>,
        /// Each lane's four f32 addends.
        c: Vec<Src>,
    },
    /// `bar.warp.sync membermask`: the lanes of the mask meet.
    WarpSync {
        /// The member mask.
        mask: Src,
    },
    /// A `tcgen05` instruction.
    Tcgen05(Box<Tcgen05>),
    /// `trap`: aborts the launch.
    Trap,
    /// `bra target`
    Bra {
        /// Instruction index.
        target: u32,
    },
    /// `ret` / `exit`
    Exit,
}

impl Op {
    /// Every register the operation reads or writes (address bases included), in operand
    /// order, possibly with repeats.
    pub fn registers(&self, out: &mut Vec<Reg>) {
        fn src(out: &mut Vec<Reg>, s: &Src) {
            if let Src::Reg(r) = s {
                out.push(*r);
            }
        }
        fn dst(out: &mut Vec<Reg>, d: &Dst) {
            if let Dst::Reg(r) = d {
                out.push(*r);
            }
        }
        fn addr(out: &mut Vec<Reg>, a: &Addr) {
            if let AddrBase::Reg(r) = a.base {
                out.push(r);
            }
        }
        match self {
            Op::Ld {
                dst: d, addr: a, ..
            } => {
                d.iter().for_each(|x| dst(out, x));
                addr(out, a);
            }
            Op::St {
                addr: a, src: s, ..
            } => {
                addr(out, a);
                s.iter().for_each(|x| src(out, x));
            }
            Op::Mov { d, a, .. }
            | Op::Cvta { d, a, .. }
            | Op::IntUn { d, a, .. }
            | Op::FloatUn { d, a, .. }
            | Op::Cvt { d, a, .. } => {
                out.push(*d);
                src(out, a);
            }
            Op::Pack { d, parts, .. } => {
                out.push(*d);
                parts.iter().for_each(|x| src(out, x));
            }
            Op::Unpack { dst: d, a, .. } => {
                d.iter().for_each(|x| dst(out, x));
                src(out, a);
            }
            Op::Int { d, a, b, .. }
            | Op::MulWide { d, a, b, .. }
            | Op::Float { d, a, b, .. }
            | Op::Setp { d, a, b, .. } => {
                out.push(*d);
                src(out, a);
                src(out, b);
            }
            Op::CvtBf16x2 { d, hi, lo, .. } => {
                out.push(*d);
                src(out, hi);
                src(out, lo);
            }
            Op::Mad { d, a, b, c, .. } | Op::Fma { d, a, b, c, .. } | Op::Prmt { d, a, b, c } => {
                out.push(*d);
                src(out, a);
                src(out, b);
                src(out, c);
            }
            Op::Selp { d, a, b, p, .. } => {
                out.push(*d);
                src(out, a);
                src(out, b);
                src(out, &p.src);
            }
            Op::Pred { d, a, b, .. } => {
                out.push(*d);
                src(out, &a.src);
                src(out, &b.src);
            }
            Op::PredNot { d, a } => {
                out.push(*d);
                src(out, &a.src);
            }
            Op::Shfl {
                d,
                p,
                a,
                b,
                c,
                mask,
                ..
            } => {
                dst(out, d);
                out.extend(p.iter().copied());
                [a, b, c, mask].into_iter().for_each(|x| src(out, x));
            }
            Op::Bar { id, count, .. } => {
                src(out, id);
                count.iter().for_each(|x| src(out, x));
            }
            Op::Atom {
                d, addr: a, b, c, ..
            } => {
                d.iter().flatten().for_each(|x| dst(out, x));
                addr(out, a);
                b.iter().for_each(|x| src(out, x));
                c.iter().for_each(|x| src(out, x));
            }
            Op::CreatePolicy { d } => out.push(*d),
            Op::MbarrierInit { addr: a, count, .. } => {
                addr(out, a);
                src(out, count);
            }
            Op::MbarrierArrive {
                state,
                addr: a,
                count,
                tx,
                ..
            } => {
                dst(out, state);
                addr(out, a);
                count.iter().chain(tx.iter()).for_each(|x| src(out, x));
            }
            Op::MbarrierExpectTx { addr: a, tx, .. } => {
                addr(out, a);
                src(out, tx);
            }
            Op::MbarrierTryWait {
                p, addr: a, parity, ..
            } => {
                out.push(*p);
                addr(out, a);
                src(out, parity);
            }
            Op::TmaReduceAdd(t) => {
                addr(out, &t.src);
                addr(out, &t.tensor.map);
                t.tensor.coords.iter().for_each(|x| src(out, x));
            }
            Op::BulkReduceAdd(r) => {
                addr(out, &r.dst);
                addr(out, &r.src);
            }
            Op::BulkCommit | Op::BulkWait { .. } => {}
            Op::CpAsyncBulk(t) => {
                addr(out, &t.dst);
                addr(out, &t.src);
                addr(out, &t.mbar);
            }
            Op::CpAsyncBulkTensor(t) => {
                addr(out, &t.dst);
                addr(out, &t.tensor.map);
                t.tensor.coords.iter().for_each(|x| src(out, x));
                addr(out, &t.mbar);
            }
            Op::Wgmma(w) => {
                out.extend(w.d.iter().copied());
                match &w.a {
                    WgmmaA::Desc(s) => src(out, s),
                    WgmmaA::Regs(r) => r.iter().for_each(|x| src(out, x)),
                }
                src(out, &w.b);
                src(out, &w.scale_d.src);
            }
            Op::Elect { d, p, mask } => {
                dst(out, d);
                out.extend(p.iter().copied());
                src(out, mask);
            }
            Op::Ballot { d, a, mask } => {
                dst(out, d);
                src(out, &a.src);
                src(out, mask);
            }
            Op::ReduxMin { d, a, mask } => {
                dst(out, d);
                src(out, a);
                src(out, mask);
            }
            Op::Stmatrix { addr: a, src: v } => {
                addr(out, a);
                v.iter().for_each(|x| src(out, x));
            }
            Op::WarpSync { mask } => src(out, mask),
            Op::MmaBf16 { d, a, b, c } => {
                d.iter().for_each(|x| dst(out, x));
                a.iter().chain(b).chain(c).for_each(|x| src(out, x));
            }
            Op::Tcgen05(t) => match &**t {
                Tcgen05::Alloc { dst, ncols } => {
                    addr(out, dst);
                    src(out, ncols);
                }
                Tcgen05::Dealloc { taddr, ncols } => {
                    src(out, taddr);
                    src(out, ncols);
                }
                Tcgen05::Mma {
                    d,
                    a,
                    b,
                    idesc,
                    enable_d,
                } => {
                    addr(out, d);
                    match a {
                        Tc05A::Desc(s) => src(out, s),
                        Tc05A::Tmem(x) => addr(out, x),
                    }
                    src(out, b);
                    src(out, idesc);
                    src(out, &enable_d.src);
                }
                Tcgen05::Commit { mbar } => addr(out, mbar),
                Tcgen05::Ld { dst: d, taddr } => {
                    d.iter().for_each(|x| dst(out, x));
                    addr(out, taddr);
                }
                Tcgen05::St { taddr, src: s } => {
                    addr(out, taddr);
                    s.iter().for_each(|x| src(out, x));
                }
                Tcgen05::Relinquish | Tcgen05::WaitLd | Tcgen05::WaitSt | Tcgen05::Fence { .. } => {
                }
            },
            Op::WgmmaSync(_)
            | Op::Trap
            | Op::SetMaxNReg { .. }
            | Op::Fence(_)
            | Op::Bra { .. }
            | Op::Exit => {}
        }
    }
}

/// One instruction: an optional guard and the operation.
#[derive(Debug, Clone, PartialEq)]
pub struct Inst {
    /// `@p` / `@!p`.
    pub guard: Option<Guard>,
    /// The operation.
    pub op: Op,
}

/// Where an instruction came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceLoc {
    /// 1-based line in the PTX text.
    pub line: usize,
    /// The statement's text, trimmed.
    pub text: String,
}
