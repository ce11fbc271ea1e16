//! The typed instruction builder. Kernel descriptions call its methods; each method checks
//! operand types through the trait bounds of [`super::types`] and records one IR instruction.

use super::ir::{
    AddrBase, HostElem, Inst, Kernel, Label, Operand, Param, ParamKind, SharedDecl, Stmt,
};
use super::types::*;
use crate::error::CodegenError;
use crate::target::{PtxVersion, Target};
use std::collections::BTreeMap;

/// Largest shared memory a CTA may use on sm_90/sm_100 (227 KiB), checked at codegen time.
pub const MAX_SHARED_BYTES: u32 = 232_448;

/// A value an instruction can read: a register of type `T` or an immediate of that type.
pub trait Src<T: Ty> {
    /// The operand.
    fn operand(self) -> Operand;
}

impl<T: Ty> Src<T> for Reg<T> {
    fn operand(self) -> Operand {
        Operand::Reg(self.name())
    }
}

macro_rules! imm_src {
    ($($rust:ty => $($T:ident),*);*) => {
        $($(impl Src<$T> for $rust {
            fn operand(self) -> Operand { Operand::Int(self as i64) }
        })*)*
    };
}
imm_src!(u32 => U32, B32; i32 => S32; u64 => U64, B64; i64 => S64);

impl Src<F32> for f32 {
    fn operand(self) -> Operand {
        Operand::F32(self)
    }
}

/// A global-memory address: a 64-bit register plus a byte offset.
#[derive(Debug, Clone, Copy)]
pub struct GlobalAddr {
    base: Reg<U64>,
    offset: i64,
}

impl GlobalAddr {
    /// The same base, `bytes` further.
    pub fn offset(&self, bytes: i64) -> GlobalAddr {
        GlobalAddr {
            base: self.base,
            offset: self.offset + bytes,
        }
    }
}

/// `[base + offset]` in the global space.
pub fn global(base: Reg<U64>, offset: i64) -> GlobalAddr {
    GlobalAddr { base, offset }
}

/// A shared-memory address: a 32-bit shared-window register or a symbol, plus an offset.
#[derive(Debug, Clone)]
pub struct SharedAddr {
    base: AddrBase,
    offset: i64,
}

/// A declared shared-memory array.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedVar {
    name: String,
    bytes: u32,
}

impl SharedVar {
    /// `[var + offset]`.
    pub fn at(&self, offset: i64) -> SharedAddr {
        SharedAddr {
            base: AddrBase::Symbol(self.name.clone()),
            offset,
        }
    }

    /// Declared size in bytes (0 for the dynamic array).
    pub fn bytes(&self) -> u32 {
        self.bytes
    }
}

impl SharedAddr {
    /// The same base, `bytes` further.
    pub fn offset(&self, bytes: i64) -> SharedAddr {
        SharedAddr {
            base: self.base.clone(),
            offset: self.offset + bytes,
        }
    }
}

/// `[base + offset]` in the shared space, base a 32-bit shared-window address.
pub fn shared(base: Reg<U32>, offset: i64) -> SharedAddr {
    SharedAddr {
        base: AddrBase::Reg(base.name()),
        offset,
    }
}

/// A memory operand in some state space.
pub trait Address {
    /// The state space suffix (`global`, `shared`).
    const SPACE: &'static str;
    /// The `[...]` operand.
    fn operand(&self) -> Operand;
}

impl Address for GlobalAddr {
    const SPACE: &'static str = "global";
    fn operand(&self) -> Operand {
        Operand::Addr(AddrBase::Reg(self.base.name()), self.offset)
    }
}

impl Address for SharedAddr {
    const SPACE: &'static str = "shared";
    fn operand(&self) -> Operand {
        Operand::Addr(self.base.clone(), self.offset)
    }
}

/// A declared scalar or pointer parameter whose value has type `T` on the device.
#[derive(Debug, Clone)]
pub struct ParamRef<T: Ty> {
    name: String,
    _t: std::marker::PhantomData<T>,
}

/// A declared CUtensorMap parameter.
#[derive(Debug, Clone)]
pub struct TensorMapRef {
    name: String,
}

impl TensorMapRef {
    /// The parameter's symbol.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Special registers read with `mov.u32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SReg {
    /// `%tid.x`
    TidX,
    /// `%tid.y`
    TidY,
    /// `%ntid.x`
    NtidX,
    /// `%ctaid.x`
    CtaidX,
    /// `%ctaid.y`
    CtaidY,
    /// `%nctaid.x`
    NctaidX,
    /// `%laneid`
    LaneId,
}

impl SReg {
    fn name(self) -> &'static str {
        match self {
            SReg::TidX => "%tid.x",
            SReg::TidY => "%tid.y",
            SReg::NtidX => "%ntid.x",
            SReg::CtaidX => "%ctaid.x",
            SReg::CtaidY => "%ctaid.y",
            SReg::NctaidX => "%nctaid.x",
            SReg::LaneId => "%laneid",
        }
    }
}

/// Comparison operators of `setp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
}

impl Cmp {
    fn name(self) -> &'static str {
        match self {
            Cmp::Eq => "eq",
            Cmp::Ne => "ne",
            Cmp::Lt => "lt",
            Cmp::Le => "le",
            Cmp::Gt => "gt",
            Cmp::Ge => "ge",
        }
    }
}

/// `shfl.sync` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shfl {
    /// Butterfly (xor of the lane id).
    Bfly,
    /// From a lane index.
    Idx,
    /// From a lower lane.
    Up,
    /// From a higher lane.
    Down,
}

/// Integer atomic operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomOp {
    /// Add.
    Add,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Bitwise or.
    Or,
    /// Exchange.
    Exch,
}

/// Conversions `cvt` performs, with the rounding each pair needs.
pub trait CvtFrom<S: Ty>: Ty {
    /// Modifiers between `cvt` and the types (`.rn`, `.rzi`, or empty).
    const ROUND: &'static str;
    /// PTX ISA the pair needs.
    const MIN_VERSION: PtxVersion = PtxVersion(0, 0);
}

macro_rules! cvt_pairs {
    ($($D:ident <- $S:ident : $round:literal $(, $v:expr)?;)*) => {
        $(impl CvtFrom<$S> for $D {
            const ROUND: &'static str = $round;
            $(const MIN_VERSION: PtxVersion = $v;)?
        })*
    };
}
cvt_pairs! {
    U64 <- U32: "";
    S64 <- S32: "";
    U32 <- U64: "";
    U64 <- S32: "";
    F32 <- U32: ".rn";
    F32 <- S32: ".rn";
    U32 <- F32: ".rzi";
    S32 <- F32: ".rzi";
    F32 <- Bf16: "", PtxVersion(7, 8);
    Bf16 <- F32: ".rn", PtxVersion(7, 0);
}

/// Integer types whose `mul.wide` result is `Self::Wide`.
pub trait Widen: Int {
    /// The double-width result type.
    type Wide: Int;
}
impl Widen for U32 {
    type Wide = U64;
}
impl Widen for S32 {
    type Wide = S64;
}

/// Records a kernel body for one target.
pub struct KernelBuilder {
    name: String,
    target: Target,
    threads: (u32, u32, u32),
    min_ctas_per_sm: Option<u32>,
    max_regs: Option<u32>,
    params: Vec<Param>,
    shared: Vec<SharedDecl>,
    counters: BTreeMap<&'static str, u32>,
    labels: u32,
    placed: Vec<bool>,
    used: Vec<bool>,
    guard: Option<(RegName, bool)>,
    body: Vec<Stmt>,
    errors: Vec<String>,
    grid: String,
    dynamic_shared_bytes: u32,
}

impl KernelBuilder {
    /// Starts a kernel `name` for `target` launched with `threads` per CTA.
    pub fn new(name: &str, target: Target, threads: (u32, u32, u32)) -> Self {
        KernelBuilder {
            name: name.to_string(),
            target,
            threads,
            min_ctas_per_sm: None,
            max_regs: None,
            params: Vec::new(),
            shared: Vec::new(),
            counters: BTreeMap::new(),
            labels: 0,
            placed: Vec::new(),
            used: Vec::new(),
            guard: None,
            body: Vec::new(),
            errors: Vec::new(),
            grid: String::new(),
            dynamic_shared_bytes: 0,
        }
    }

    /// The target being built.
    pub fn target(&self) -> Target {
        self.target
    }

    /// Describes how the host sizes the grid (goes into the manifest).
    pub fn grid(&mut self, text: &str) {
        self.grid = text.to_string();
    }

    /// Adds `.minnctapersm n`.
    pub fn min_ctas_per_sm(&mut self, n: u32) {
        self.min_ctas_per_sm = Some(n);
    }

    /// Adds `.maxnreg n`.
    pub fn max_regs(&mut self, n: u32) {
        self.max_regs = Some(n);
    }

    pub(crate) fn error(&mut self, msg: String) {
        self.errors.push(msg);
    }

    pub(crate) fn fresh<T: Ty>(&mut self) -> Reg<T> {
        let c = self.counters.entry(T::PREFIX).or_insert(0);
        let r = Reg::new(*c);
        *c += 1;
        r
    }

    /// A fresh register of type `T`, not yet written (loop variables, outputs of `set`).
    pub fn reg<T: Ty>(&mut self) -> Reg<T> {
        self.fresh()
    }

    pub(crate) fn push(&mut self, opcode: String, operands: Vec<Operand>, min_version: PtxVersion) {
        self.body.push(Stmt::Inst(Inst {
            guard: self.guard,
            opcode,
            operands,
            min_version,
        }));
    }

    pub(crate) fn inst(&mut self, opcode: String, operands: Vec<Operand>) {
        self.push(opcode, operands, PtxVersion(0, 0));
    }

    /// A comment line in the body, to mark sections for a reviewer.
    ///
    /// PTX must be ASCII (the driver's JIT rejects anything else), so other text is an error.
    pub fn comment(&mut self, text: &str) {
        if !text.is_ascii() {
            self.error(format!(
                "comment {text:?} is not ASCII; the driver's PTX JIT rejects it"
            ));
        }
        self.body.push(Stmt::Comment(text.to_string()));
    }

    // ---- parameters and declarations -------------------------------------------------

    fn add_param(&mut self, name: &str, kind: ParamKind) {
        if self.params.iter().any(|p| p.name == name) {
            self.error(format!("parameter `{name}` declared twice"));
        }
        self.params.push(Param {
            name: name.to_string(),
            kind,
        });
    }

    /// Declares a device-pointer parameter.
    pub fn param_ptr(&mut self, name: &str, elem: HostElem, mutable: bool) -> ParamRef<U64> {
        self.add_param(name, ParamKind::Ptr { elem, mutable });
        ParamRef {
            name: name.to_string(),
            _t: Default::default(),
        }
    }

    /// Declares a `u32` parameter.
    pub fn param_u32(&mut self, name: &str) -> ParamRef<U32> {
        self.add_param(name, ParamKind::U32);
        ParamRef {
            name: name.to_string(),
            _t: Default::default(),
        }
    }

    /// Declares an `s32` parameter.
    pub fn param_s32(&mut self, name: &str) -> ParamRef<S32> {
        self.add_param(name, ParamKind::I32);
        ParamRef {
            name: name.to_string(),
            _t: Default::default(),
        }
    }

    /// Declares a 128-byte, 64-aligned CUtensorMap parameter.
    pub fn param_tensor_map(&mut self, name: &str) -> TensorMapRef {
        self.add_param(name, ParamKind::TensorMap);
        TensorMapRef {
            name: name.to_string(),
        }
    }

    /// Declares a static shared array of `bytes` bytes aligned to `align`.
    pub fn shared_array(&mut self, name: &str, bytes: u32, align: u32) -> SharedVar {
        if !align.is_power_of_two() {
            self.error(format!(
                "shared `{name}`: alignment {align} is not a power of two"
            ));
        }
        self.shared.push(SharedDecl {
            name: name.to_string(),
            bytes,
            align,
            dynamic: false,
        });
        SharedVar {
            name: name.to_string(),
            bytes,
        }
    }

    /// Declares the dynamic shared array; the launch must request `bytes`.
    pub fn dynamic_shared(&mut self, name: &str, bytes: u32, align: u32) -> SharedVar {
        self.dynamic_shared_bytes = bytes;
        self.shared.push(SharedDecl {
            name: name.to_string(),
            bytes: 0,
            align,
            dynamic: true,
        });
        SharedVar {
            name: name.to_string(),
            bytes,
        }
    }

    /// Loads a scalar parameter.
    pub fn ld_param<T: Ty>(&mut self, p: &ParamRef<T>) -> Reg<T> {
        let d = self.fresh::<T>();
        self.inst(
            format!("ld.param.{}", T::NAME),
            vec![
                Operand::Reg(d.name()),
                Operand::Addr(AddrBase::Symbol(p.name.clone()), 0),
            ],
        );
        d
    }

    /// Loads a pointer parameter and converts it to a global address.
    pub fn ld_param_ptr(&mut self, p: &ParamRef<U64>) -> Reg<U64> {
        let generic = self.ld_param(p);
        let d = self.fresh::<U64>();
        self.inst(
            "cvta.to.global.u64".into(),
            vec![Operand::Reg(d.name()), Operand::Reg(generic.name())],
        );
        d
    }

    /// The generic address of a tensor-map parameter (the TMA descriptor operand): the
    /// parameter's address converted from the param window (`cvta.param`, PTX 7.7).
    pub fn tensor_map_addr(&mut self, p: &TensorMapRef) -> Reg<U64> {
        let param = self.fresh::<U64>();
        self.inst(
            "mov.u64".into(),
            vec![Operand::Reg(param.name()), Operand::Symbol(p.name.clone())],
        );
        let d = self.fresh::<U64>();
        self.push(
            "cvta.param.u64".into(),
            vec![Operand::Reg(d.name()), Operand::Reg(param.name())],
            PtxVersion(7, 7),
        );
        d
    }

    /// The 32-bit shared-window address of a shared array.
    pub fn shared_base(&mut self, v: &SharedVar) -> Reg<U32> {
        let d = self.fresh::<U32>();
        self.inst(
            "mov.u32".into(),
            vec![Operand::Reg(d.name()), Operand::Symbol(v.name.clone())],
        );
        d
    }

    // ---- moves, special registers --------------------------------------------------

    /// Reads a special register.
    pub fn sreg(&mut self, s: SReg) -> Reg<U32> {
        let d = self.fresh::<U32>();
        self.inst(
            "mov.u32".into(),
            vec![Operand::Reg(d.name()), Operand::Special(s.name())],
        );
        d
    }

    /// `d = src` into a fresh register.
    pub fn mov<T: Ty>(&mut self, src: impl Src<T>) -> Reg<T> {
        let d = self.fresh::<T>();
        self.set(d, src);
        d
    }

    /// `dst = src` (re-assigns an existing register; loop-carried values).
    pub fn set<T: Ty>(&mut self, dst: Reg<T>, src: impl Src<T>) {
        self.inst(
            format!("mov.{}", T::NAME),
            vec![Operand::Reg(dst.name()), src.operand()],
        );
    }

    /// Reinterprets the bits of `src` as another type of the same width.
    pub fn bitcast<D: Bits, S: Bits>(&mut self, src: Reg<S>) -> Reg<D> {
        const {
            assert!(
                D::BYTES == S::BYTES,
                "bitcast between types of different width"
            )
        };
        let d = self.fresh::<D>();
        self.inst(
            format!("mov.{}", D::BITS_NAME),
            vec![Operand::Reg(d.name()), Operand::Reg(src.name())],
        );
        d
    }

    // ---- arithmetic ----------------------------------------------------------------

    /// `op d, srcs...` into a fresh `d`.
    fn compute<T: Ty>(&mut self, op: &str, srcs: Vec<Operand>) -> Reg<T> {
        let d = self.fresh::<T>();
        let mut operands = vec![Operand::Reg(d.name())];
        operands.extend(srcs);
        self.inst(op.to_string(), operands);
        d
    }

    fn binary<T: Ty>(&mut self, op: &str, a: Operand, b: Operand) -> Reg<T> {
        self.compute(op, vec![a, b])
    }

    /// `a + b`.
    pub fn add<T: Arith>(&mut self, a: Reg<T>, b: impl Src<T>) -> Reg<T> {
        self.binary(&format!("add.{}", T::NAME), a.operand(), b.operand())
    }

    /// `a - b`.
    pub fn sub<T: Arith>(&mut self, a: Reg<T>, b: impl Src<T>) -> Reg<T> {
        self.binary(&format!("sub.{}", T::NAME), a.operand(), b.operand())
    }

    /// `min(a, b)`.
    pub fn min<T: Arith>(&mut self, a: Reg<T>, b: impl Src<T>) -> Reg<T> {
        self.binary(&format!("min.{}", T::NAME), a.operand(), b.operand())
    }

    /// `max(a, b)`.
    pub fn max<T: Arith>(&mut self, a: Reg<T>, b: impl Src<T>) -> Reg<T> {
        self.binary(&format!("max.{}", T::NAME), a.operand(), b.operand())
    }

    /// Low half of `a * b`.
    pub fn mul_lo<T: Int>(&mut self, a: Reg<T>, b: impl Src<T>) -> Reg<T> {
        self.binary(&format!("mul.lo.{}", T::NAME), a.operand(), b.operand())
    }

    /// Full-width product of two 32-bit integers.
    pub fn mul_wide<T: Widen>(&mut self, a: Reg<T>, b: impl Src<T>) -> Reg<T::Wide> {
        self.binary(&format!("mul.wide.{}", T::NAME), a.operand(), b.operand())
    }

    /// `a * b + c` (low half).
    pub fn mad_lo<T: Int>(&mut self, a: Reg<T>, b: impl Src<T>, c: impl Src<T>) -> Reg<T> {
        let op = format!("mad.lo.{}", T::NAME);
        self.compute(&op, vec![a.operand(), b.operand(), c.operand()])
    }

    /// `a / b` (integer, truncating).
    pub fn div<T: Int>(&mut self, a: Reg<T>, b: impl Src<T>) -> Reg<T> {
        self.binary(&format!("div.{}", T::NAME), a.operand(), b.operand())
    }

    /// `a % b` (integer).
    pub fn rem<T: Int>(&mut self, a: Reg<T>, b: impl Src<T>) -> Reg<T> {
        self.binary(&format!("rem.{}", T::NAME), a.operand(), b.operand())
    }

    /// `a * b` in f32, round to nearest even.
    pub fn fmul(&mut self, a: Reg<F32>, b: impl Src<F32>) -> Reg<F32> {
        self.binary("mul.rn.f32", a.operand(), b.operand())
    }

    /// Fused `a * b + c` in f32, one rounding.
    pub fn fma(&mut self, a: Reg<F32>, b: impl Src<F32>, c: impl Src<F32>) -> Reg<F32> {
        self.compute("fma.rn.f32", vec![a.operand(), b.operand(), c.operand()])
    }

    /// `2^a`, approximate (flush-to-zero), as the MUFU unit computes it.
    pub fn ex2_approx(&mut self, a: Reg<F32>) -> Reg<F32> {
        self.compute("ex2.approx.ftz.f32", vec![a.operand()])
    }

    /// `a << n`.
    pub fn shl<T: Bits>(&mut self, a: Reg<T>, n: impl Src<U32>) -> Reg<T> {
        self.binary(&format!("shl.{}", T::BITS_NAME), a.operand(), n.operand())
    }

    /// `a >> n` (arithmetic for signed types).
    pub fn shr<T: Int>(&mut self, a: Reg<T>, n: impl Src<U32>) -> Reg<T> {
        self.binary(&format!("shr.{}", T::NAME), a.operand(), n.operand())
    }

    /// Bitwise and.
    pub fn and<T: Bits>(&mut self, a: Reg<T>, b: impl Src<T>) -> Reg<T> {
        self.binary(&format!("and.{}", T::BITS_NAME), a.operand(), b.operand())
    }

    /// Bitwise or.
    pub fn or<T: Bits>(&mut self, a: Reg<T>, b: impl Src<T>) -> Reg<T> {
        self.binary(&format!("or.{}", T::BITS_NAME), a.operand(), b.operand())
    }

    /// Bitwise xor.
    pub fn xor<T: Bits>(&mut self, a: Reg<T>, b: impl Src<T>) -> Reg<T> {
        self.binary(&format!("xor.{}", T::BITS_NAME), a.operand(), b.operand())
    }

    /// Predicate and.
    pub fn and_pred(&mut self, a: Reg<Pred>, b: Reg<Pred>) -> Reg<Pred> {
        self.binary("and.pred", a.operand(), b.operand())
    }

    /// Predicate or.
    pub fn or_pred(&mut self, a: Reg<Pred>, b: Reg<Pred>) -> Reg<Pred> {
        self.binary("or.pred", a.operand(), b.operand())
    }

    /// `p = a <cmp> b`.
    pub fn setp<T: Arith>(&mut self, cmp: Cmp, a: Reg<T>, b: impl Src<T>) -> Reg<Pred> {
        self.binary(
            &format!("setp.{}.{}", cmp.name(), T::NAME),
            a.operand(),
            b.operand(),
        )
    }

    /// `p ? a : b`.
    pub fn selp<T: Ty>(&mut self, a: impl Src<T>, b: impl Src<T>, p: Reg<Pred>) -> Reg<T> {
        let d = self.fresh::<T>();
        let name = if T::BYTES == 0 { "pred" } else { T::DECL };
        self.inst(
            format!("selp.{name}"),
            vec![
                Operand::Reg(d.name()),
                a.operand(),
                b.operand(),
                p.operand(),
            ],
        );
        d
    }

    // ---- conversions ---------------------------------------------------------------

    /// `cvt` between numeric types, with the rounding the pair requires.
    pub fn cvt<D: CvtFrom<S>, S: Ty>(&mut self, src: Reg<S>) -> Reg<D> {
        let d = self.fresh::<D>();
        self.push(
            format!("cvt{}.{}.{}", D::ROUND, D::NAME, S::NAME),
            vec![Operand::Reg(d.name()), src.operand()],
            D::MIN_VERSION,
        );
        d
    }

    /// Packs two f32 values into bf16x2 with round-to-nearest-even: `hi` lands in the upper
    /// half, `lo` in the lower (the operand order of `cvt.rn.bf16x2.f32`).
    pub fn cvt_bf16x2(&mut self, hi: Reg<F32>, lo: Reg<F32>) -> Reg<Bf16x2> {
        let d = self.fresh::<Bf16x2>();
        self.push(
            "cvt.rn.bf16x2.f32".into(),
            vec![Operand::Reg(d.name()), hi.operand(), lo.operand()],
            PtxVersion(7, 0),
        );
        d
    }

    /// Splits bf16x2 into its (lower, upper) halves.
    pub fn unpack_bf16x2(&mut self, v: Reg<Bf16x2>) -> (Reg<Bf16>, Reg<Bf16>) {
        let lo = self.fresh::<Bf16>();
        let hi = self.fresh::<Bf16>();
        self.inst(
            "mov.b32".into(),
            vec![Operand::Vector(vec![lo.name(), hi.name()]), v.operand()],
        );
        (lo, hi)
    }

    /// Widens bf16x2 to two f32 values (lower, upper): the exact reverse of `cvt_bf16x2`.
    pub fn bf16x2_to_f32(&mut self, v: Reg<Bf16x2>) -> (Reg<F32>, Reg<F32>) {
        let (lo, hi) = self.unpack_bf16x2(v);
        (self.cvt::<F32, Bf16>(lo), self.cvt::<F32, Bf16>(hi))
    }

    /// Byte permute: each selector nibble picks one byte of `{b, a}` (`prmt.b32`).
    pub fn prmt<T: Word>(&mut self, a: Reg<T>, b: Reg<T>, selector: u32) -> Reg<T> {
        let d = self.fresh::<T>();
        self.inst(
            "prmt.b32".into(),
            vec![
                Operand::Reg(d.name()),
                a.operand(),
                b.operand(),
                Operand::Hex(selector as u64),
            ],
        );
        d
    }

    // ---- memory --------------------------------------------------------------------

    fn check_vector<T: Ty>(&mut self, n: usize) {
        if !matches!(n, 2 | 4) || T::BYTES as usize * n > 16 {
            self.error(format!(
                "vector access of {n} x {} is not a legal PTX vector (2 or 4 lanes, <= 16 bytes)",
                T::NAME
            ));
        }
    }

    fn mem_name<T: Ty>() -> &'static str {
        // bf16 values move as untyped bits.
        if T::NAME.starts_with("bf16") {
            T::DECL
        } else {
            T::NAME
        }
    }

    /// Scalar load.
    pub fn ld<T: Mem, A: Address>(&mut self, addr: &A) -> Reg<T> {
        let d = self.fresh::<T>();
        self.inst(
            format!("ld.{}.{}", A::SPACE, Self::mem_name::<T>()),
            vec![Operand::Reg(d.name()), addr.operand()],
        );
        d
    }

    /// Vector load of `N` (2 or 4) elements.
    pub fn ld_v<T: Mem, A: Address, const N: usize>(&mut self, addr: &A) -> [Reg<T>; N] {
        self.ld_vec::<T, A, N>(addr, "")
    }

    /// Vector load through the read-only (non-coherent) path, for data the kernel never writes.
    pub fn ld_global_nc_v<T: Mem, const N: usize>(&mut self, addr: &GlobalAddr) -> [Reg<T>; N] {
        self.ld_vec::<T, GlobalAddr, N>(addr, ".nc")
    }

    fn ld_vec<T: Mem, A: Address, const N: usize>(&mut self, addr: &A, cache: &str) -> [Reg<T>; N] {
        self.check_vector::<T>(N);
        let regs: [Reg<T>; N] = std::array::from_fn(|_| self.fresh::<T>());
        self.inst(
            format!("ld.{}{cache}.v{N}.{}", A::SPACE, Self::mem_name::<T>()),
            vec![
                Operand::Vector(regs.iter().map(|r| r.name()).collect()),
                addr.operand(),
            ],
        );
        regs
    }

    /// Scalar store.
    pub fn st<T: Mem, A: Address>(&mut self, addr: &A, v: impl Src<T>) {
        self.inst(
            format!("st.{}.{}", A::SPACE, Self::mem_name::<T>()),
            vec![addr.operand(), v.operand()],
        );
    }

    /// Vector store of `N` (2 or 4) elements.
    pub fn st_v<T: Mem, A: Address, const N: usize>(&mut self, addr: &A, v: [Reg<T>; N]) {
        self.check_vector::<T>(N);
        self.inst(
            format!("st.{}.v{N}.{}", A::SPACE, Self::mem_name::<T>()),
            vec![
                addr.operand(),
                Operand::Vector(v.iter().map(|r| r.name()).collect()),
            ],
        );
    }

    // ---- atomics and reductions ----------------------------------------------------

    fn atom_type<T: AtomBits>(op: AtomOp) -> &'static str {
        match op {
            AtomOp::Or | AtomOp::Exch => T::BITS_NAME_OF,
            _ => T::NAME,
        }
    }

    /// `atom.<space>.<op>`: returns the old value.
    pub fn atom<T: Int + AtomBits, A: Address>(
        &mut self,
        op: AtomOp,
        addr: &A,
        v: impl Src<T>,
    ) -> Reg<T> {
        let d = self.fresh::<T>();
        self.inst(
            format!(
                "atom.{}.{}.{}",
                A::SPACE,
                op.name(),
                Self::atom_type::<T>(op)
            ),
            vec![Operand::Reg(d.name()), addr.operand(), v.operand()],
        );
        d
    }

    /// `red.<space>.<op>` on an integer: no result.
    pub fn red<T: Int + AtomBits, A: Address>(&mut self, op: AtomOp, addr: &A, v: impl Src<T>) {
        self.inst(
            format!(
                "red.{}.{}.{}",
                A::SPACE,
                op.name(),
                Self::atom_type::<T>(op)
            ),
            vec![addr.operand(), v.operand()],
        );
    }

    /// `red.global.add.f32`.
    pub fn red_add_f32(&mut self, addr: &GlobalAddr, v: Reg<F32>) {
        self.inst(
            "red.global.add.f32".into(),
            vec![addr.operand(), v.operand()],
        );
    }

    /// `red.global.add.v4.f32`: four consecutive floats in one 16-byte reduction.
    pub fn red_add_v4_f32(
        &mut self,
        addr: &GlobalAddr,
        v: [Reg<F32>; 4],
        policy: Option<Reg<B64>>,
    ) {
        let (hint, mut extra) = Self::policy(policy);
        let mut ops = vec![
            addr.operand(),
            Operand::Vector(v.iter().map(|r| r.name()).collect()),
        ];
        ops.append(&mut extra);
        self.push(
            format!("red.global.add{hint}.v4.f32"),
            ops,
            PtxVersion(8, 1),
        );
    }

    /// `red.global.add.noftz.bf16x2`: two packed bf16 additions in one 4-byte reduction.
    pub fn red_add_bf16x2(&mut self, addr: &GlobalAddr, v: Reg<Bf16x2>, policy: Option<Reg<B64>>) {
        let (hint, mut extra) = Self::policy(policy);
        let mut ops = vec![addr.operand(), v.operand()];
        ops.append(&mut extra);
        self.push(
            format!("red.global.add.noftz{hint}.bf16x2"),
            ops,
            PtxVersion(7, 8),
        );
    }

    fn policy(policy: Option<Reg<B64>>) -> (&'static str, Vec<Operand>) {
        match policy {
            Some(p) => (".L2::cache_hint", vec![p.operand()]),
            None => ("", vec![]),
        }
    }

    /// An L2 policy that keeps the lines it touches (`evict_last`) for `fraction` of them.
    pub fn policy_evict_last(&mut self, fraction: f32) -> Reg<B64> {
        let d = self.fresh::<B64>();
        self.inst(
            "createpolicy.fractional.L2::evict_last.L2::evict_unchanged.b64".into(),
            vec![Operand::Reg(d.name()), Operand::F32(fraction)],
        );
        d
    }

    // ---- warp and CTA collectives --------------------------------------------------

    /// `shfl.sync.<mode>.b32` over the full warp.
    pub fn shfl<T: Word>(
        &mut self,
        mode: Shfl,
        v: Reg<T>,
        lane: impl Src<U32>,
        clamp: u32,
    ) -> Reg<T> {
        let d = self.fresh::<T>();
        let m = match mode {
            Shfl::Bfly => "bfly",
            Shfl::Idx => "idx",
            Shfl::Up => "up",
            Shfl::Down => "down",
        };
        self.inst(
            format!("shfl.sync.{m}.b32"),
            vec![
                Operand::Reg(d.name()),
                v.operand(),
                lane.operand(),
                Operand::Hex(clamp as u64),
                Operand::Hex(0xffff_ffff),
            ],
        );
        d
    }

    fn check_barrier(&mut self, id: u32, threads: Option<u32>) {
        if id > 15 {
            self.error(format!("named barrier {id} out of range 0..=15"));
        }
        let total = self.threads.0 * self.threads.1 * self.threads.2;
        if let Some(n) = threads {
            if n == 0 || n % 32 != 0 || n > total {
                self.error(format!(
                    "barrier {id}: thread count {n} must be a positive multiple of 32 and at most the CTA's {total}"
                ));
            }
        }
    }

    /// `bar.sync id[, threads]`: waits until `threads` (default: all) have arrived.
    pub fn bar_sync(&mut self, id: u32, threads: Option<u32>) {
        self.check_barrier(id, threads);
        let mut ops = vec![Operand::Int(id as i64)];
        ops.extend(threads.map(|n| Operand::Int(n as i64)));
        self.inst("bar.sync".into(), ops);
    }

    /// `bar.sync id, threads` with the barrier id in a register (a role-dependent barrier).
    pub fn bar_sync_reg(&mut self, id: Reg<U32>, threads: u32) {
        self.check_barrier(0, Some(threads));
        self.inst(
            "bar.sync".into(),
            vec![id.operand(), Operand::Int(threads as i64)],
        );
    }

    /// `bar.arrive id, threads`: signals without waiting.
    pub fn bar_arrive(&mut self, id: u32, threads: u32) {
        self.check_barrier(id, Some(threads));
        self.inst(
            "bar.arrive".into(),
            vec![Operand::Int(id as i64), Operand::Int(threads as i64)],
        );
    }

    // ---- control flow --------------------------------------------------------------

    /// A new label (placed later with [`Self::place`]).
    pub fn label(&mut self, hint: &'static str) -> Label {
        let l = Label {
            idx: self.labels,
            hint,
        };
        self.labels += 1;
        self.placed.push(false);
        self.used.push(false);
        l
    }

    /// Places `label` at the current position.
    pub fn place(&mut self, label: &Label) {
        if self.guard.is_some() {
            self.error(format!("label {label} placed inside a predicated region"));
        }
        if std::mem::replace(&mut self.placed[label.idx as usize], true) {
            self.error(format!("label {label} placed twice"));
        }
        self.body.push(Stmt::Label(label.clone()));
    }

    fn branch(&mut self, guard: Option<(RegName, bool)>, label: &Label) {
        self.used[label.idx as usize] = true;
        let saved = self.guard;
        if saved.is_some() && guard.is_some() {
            self.error(format!(
                "conditional branch to {label} inside a predicated region"
            ));
        }
        self.guard = guard.or(saved);
        self.inst("bra".into(), vec![Operand::Label(label.clone())]);
        self.guard = saved;
    }

    /// Unconditional branch.
    pub fn bra(&mut self, label: &Label) {
        self.branch(None, label);
    }

    /// Branch if `p`.
    pub fn bra_if(&mut self, p: Reg<Pred>, label: &Label) {
        self.branch(Some((p.name(), false)), label);
    }

    /// Branch unless `p`.
    pub fn bra_unless(&mut self, p: Reg<Pred>, label: &Label) {
        self.branch(Some((p.name(), true)), label);
    }

    /// Runs `body` only in threads where `p` holds (a branch around it).
    pub fn if_then(&mut self, p: Reg<Pred>, hint: &'static str, body: impl FnOnce(&mut Self)) {
        let skip = self.label(hint);
        self.bra_unless(p, &skip);
        body(self);
        self.place(&skip);
    }

    /// Runs `body` only in threads where `p` does not hold.
    pub fn unless(&mut self, p: Reg<Pred>, hint: &'static str, body: impl FnOnce(&mut Self)) {
        let skip = self.label(hint);
        self.bra_if(p, &skip);
        body(self);
        self.place(&skip);
    }

    /// Predicates every instruction `body` emits with `p` (or `!p` when `negate`).
    pub fn predicated(&mut self, p: Reg<Pred>, negate: bool, body: impl FnOnce(&mut Self)) {
        if self.guard.is_some() {
            self.error("nested predicated regions".into());
        }
        let saved = self.guard.replace((p.name(), negate));
        body(self);
        self.guard = saved;
    }

    /// A counted loop: `for i in (start..end).step_by(step)`, with `i` a `u32` register.
    pub fn for_range(
        &mut self,
        start: impl Src<U32>,
        end: impl Src<U32> + Copy,
        step: u32,
        hint: &'static str,
        body: impl FnOnce(&mut Self, Reg<U32>),
    ) {
        let i = self.mov::<U32>(start);
        let top = self.label(hint);
        let done = self.label(hint);
        self.place(&top);
        let out = self.setp(Cmp::Ge, i, end);
        self.bra_if(out, &done);
        body(self, i);
        let next = self.add(i, step);
        self.set(i, next);
        self.bra(&top);
        self.place(&done);
    }

    /// `ret`.
    pub fn ret(&mut self) {
        self.inst("ret".into(), vec![]);
    }

    // ---- async machinery: mbarriers, TMA, proxies -----------------------------------

    /// `mbarrier.init` with the arrival count of one phase.
    pub fn mbarrier_init(&mut self, bar: &SharedAddr, count: u32) {
        self.inst(
            "mbarrier.init.shared::cta.b64".into(),
            vec![bar.operand(), Operand::Int(count as i64)],
        );
    }

    /// Makes barrier initialisation visible to the async proxy and other threads.
    pub fn fence_mbarrier_init(&mut self) {
        self.inst("fence.mbarrier_init.release.cluster".into(), vec![]);
    }

    /// One arrival on `bar`.
    pub fn mbarrier_arrive(&mut self, bar: &SharedAddr) {
        self.inst(
            "mbarrier.arrive.shared::cta.b64".into(),
            vec![Operand::Symbol("_".into()), bar.operand()],
        );
    }

    /// One arrival on `bar` that also expects `bytes` of transactions in this phase.
    pub fn mbarrier_arrive_expect_tx(&mut self, bar: &SharedAddr, bytes: u32) {
        self.inst(
            "mbarrier.arrive.expect_tx.shared::cta.b64".into(),
            vec![
                Operand::Symbol("_".into()),
                bar.operand(),
                Operand::Int(bytes as i64),
            ],
        );
    }

    /// Waits until the phase of `bar` with parity `parity` has completed.
    pub fn mbarrier_wait(&mut self, bar: &SharedAddr, parity: impl Src<U32>) {
        let top = self.label("mbar_wait");
        self.place(&top);
        let done = self.fresh::<Pred>();
        self.inst(
            "mbarrier.try_wait.parity.shared::cta.b64".into(),
            vec![Operand::Reg(done.name()), bar.operand(), parity.operand()],
        );
        self.bra_unless(done, &top);
    }

    /// A 3-D TMA tile load of the box at `coords` (innermost first) into `dst`, completing
    /// its bytes on `bar`.
    pub fn tma_load_3d(
        &mut self,
        dst: &SharedAddr,
        tensor_map: Reg<U64>,
        coords: [Reg<S32>; 3],
        bar: &SharedAddr,
    ) {
        self.inst(
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                .into(),
            vec![
                dst.operand(),
                Operand::TensorCoords(tensor_map.name(), coords.iter().map(|c| c.name()).collect()),
                bar.operand(),
            ],
        );
    }

    /// Orders this thread's generic-proxy shared-memory writes before later async-proxy
    /// (TMA, wgmma, tcgen05) accesses.
    pub fn fence_proxy_async_shared(&mut self) {
        self.inst("fence.proxy.async.shared::cta".into(), vec![]);
    }

    /// `setmaxnreg`: every warp of a warpgroup must execute the same value.
    pub fn setmaxnreg(&mut self, increase: bool, regs: u32) {
        if !(24..=256).contains(&regs) || !regs.is_multiple_of(8) {
            self.error(format!(
                "setmaxnreg {regs}: must be a multiple of 8 in 24..=256"
            ));
        }
        let dir = if increase { "inc" } else { "dec" };
        self.inst(
            format!("setmaxnreg.{dir}.sync.aligned.u32"),
            vec![Operand::Int(regs as i64)],
        );
    }

    /// `{lo, hi}` as one 64-bit value.
    pub fn pack_b64(&mut self, lo: Reg<U32>, hi: impl Src<U32>) -> Reg<B64> {
        let hi = match hi.operand() {
            Operand::Reg(r) => r,
            imm => {
                let r = self.fresh::<U32>();
                self.inst("mov.u32".into(), vec![Operand::Reg(r.name()), imm]);
                r.name()
            }
        };
        let d = self.fresh::<B64>();
        self.inst(
            "mov.b64".into(),
            vec![Operand::Reg(d.name()), Operand::Vector(vec![lo.name(), hi])],
        );
        d
    }

    // ---- Hopper warpgroup MMA -------------------------------------------------------

    pub(crate) fn require(&mut self, what: &str, target: Target) {
        if self.target != target {
            self.error(format!(
                "{what} is only available on {target}, not {}",
                self.target
            ));
        }
    }

    /// `wgmma.fence`: orders register accesses of the accumulators and A fragments before
    /// the following wgmma.
    pub fn wgmma_fence(&mut self) {
        self.require("wgmma", Target::Sm90a);
        self.inst("wgmma.fence.sync.aligned".into(), vec![]);
    }

    /// Closes the current group of wgmma operations.
    pub fn wgmma_commit(&mut self) {
        self.require("wgmma", Target::Sm90a);
        self.inst("wgmma.commit_group.sync.aligned".into(), vec![]);
    }

    /// Waits until at most `pending` wgmma groups are in flight.
    pub fn wgmma_wait(&mut self, pending: u32) {
        self.require("wgmma", Target::Sm90a);
        self.inst(
            "wgmma.wait_group.sync.aligned".into(),
            vec![Operand::Int(pending as i64)],
        );
    }

    fn wgmma_shape(&mut self, acc: &[Reg<F32>]) -> u32 {
        let n = acc.len() as u32 * 2;
        if !(8..=256).contains(&n) || !n.is_multiple_of(8) {
            self.error(format!(
                "wgmma m64: {} accumulators per thread is not a legal N",
                acc.len()
            ));
        }
        n
    }

    /// `D (+)= A·B` with A and B in shared memory (descriptors), bf16 inputs, f32
    /// accumulators `acc` (N/2 registers per thread). `accumulate` false overwrites D.
    pub fn wgmma_ss(
        &mut self,
        acc: &[Reg<F32>],
        a_desc: Reg<B64>,
        b_desc: Reg<B64>,
        accumulate: Reg<Pred>,
        transpose_a: bool,
        transpose_b: bool,
    ) {
        self.require("wgmma", Target::Sm90a);
        let n = self.wgmma_shape(acc);
        self.inst(
            format!("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16"),
            vec![
                Operand::Vector(acc.iter().map(|r| r.name()).collect()),
                a_desc.operand(),
                b_desc.operand(),
                accumulate.operand(),
                Operand::Int(1),
                Operand::Int(1),
                Operand::Int(transpose_a as i64),
                Operand::Int(transpose_b as i64),
            ],
        );
    }

    /// `D (+)= A·B` with A from registers (four bf16x2 per thread, the m64k16 fragment) and B
    /// in shared memory.
    pub fn wgmma_rs(
        &mut self,
        acc: &[Reg<F32>],
        a: [Reg<Bf16x2>; 4],
        b_desc: Reg<B64>,
        accumulate: Reg<Pred>,
        transpose_b: bool,
    ) {
        self.require("wgmma", Target::Sm90a);
        let n = self.wgmma_shape(acc);
        self.inst(
            format!("wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16"),
            vec![
                Operand::Vector(acc.iter().map(|r| r.name()).collect()),
                Operand::Vector(a.iter().map(|r| r.name()).collect()),
                b_desc.operand(),
                accumulate.operand(),
                Operand::Int(1),
                Operand::Int(1),
                Operand::Int(transpose_b as i64),
            ],
        );
    }

    // ---- finishing -----------------------------------------------------------------

    /// Checks the recorded kernel and returns it.
    pub fn finish(mut self) -> Result<Kernel, CodegenError> {
        for (i, (placed, used)) in self.placed.iter().zip(&self.used).enumerate() {
            if *used && !placed {
                self.errors
                    .push(format!("label #{i} is a branch target but never placed"));
            }
        }
        let threads = self.threads.0 * self.threads.1 * self.threads.2;
        if threads == 0 || threads > 1024 {
            self.errors
                .push(format!("{threads} threads per CTA; expected 1..=1024"));
        }
        let kernel = Kernel {
            name: self.name,
            target: self.target,
            threads: self.threads,
            min_ctas_per_sm: self.min_ctas_per_sm,
            max_regs: self.max_regs,
            params: self.params,
            shared: self.shared,
            regs: ALL_PREFIXES
                .iter()
                .filter_map(|&(prefix, decl)| self.counters.get(prefix).map(|&n| (decl, prefix, n)))
                .collect(),
            body: self.body,
            grid: self.grid,
            dynamic_shared_bytes: self.dynamic_shared_bytes,
        };
        let smem = kernel.static_shared_bytes() + kernel.dynamic_shared_bytes;
        if smem > MAX_SHARED_BYTES {
            self.errors.push(format!(
                "shared memory {smem} B exceeds the per-CTA limit of {MAX_SHARED_BYTES} B"
            ));
        }
        let version = kernel.version();
        if version > crate::target::MAX_DRIVER_VERSION {
            self.errors.push(format!(
                "needs PTX ISA {version}, above the {} the target driver accepts",
                crate::target::MAX_DRIVER_VERSION
            ));
        }
        if self.errors.is_empty() {
            Ok(kernel)
        } else {
            Err(CodegenError::Kernel {
                kernel: kernel.name,
                target: kernel.target,
                errors: self.errors,
            })
        }
    }
}

impl AtomOp {
    fn name(self) -> &'static str {
        match self {
            AtomOp::Add => "add",
            AtomOp::Min => "min",
            AtomOp::Max => "max",
            AtomOp::Or => "or",
            AtomOp::Exch => "exch",
        }
    }
}

/// Integer types atomics accept, with the untyped name bitwise atomics use.
pub trait AtomBits: Int {
    /// `b32`/`b64`.
    const BITS_NAME_OF: &'static str;
}
impl AtomBits for U32 {
    const BITS_NAME_OF: &'static str = "b32";
}
impl AtomBits for S32 {
    const BITS_NAME_OF: &'static str = "b32";
}
impl AtomBits for U64 {
    const BITS_NAME_OF: &'static str = "b64";
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builder() -> KernelBuilder {
        KernelBuilder::new("t", Target::Sm90a, (128, 1, 1))
    }

    fn errors(b: KernelBuilder) -> Vec<String> {
        match b.finish() {
            Err(CodegenError::Kernel { errors, .. }) => errors,
            other => panic!("expected a codegen error, got {other:?}"),
        }
    }

    #[test]
    fn rejects_illegal_vector_width() {
        let mut b = builder();
        let p = b.param_ptr("p", HostElem::F32, false);
        let a = b.ld_param_ptr(&p);
        let _: [Reg<U64>; 4] = b.ld_v(&global(a, 0));
        let e = errors(b);
        assert!(e[0].contains("4 x u64 is not a legal PTX vector"), "{e:?}");
    }

    #[test]
    fn rejects_bad_barrier_thread_counts_and_ids() {
        let mut b = builder();
        b.bar_sync(1, Some(48));
        b.bar_arrive(2, 256);
        b.bar_sync(16, None);
        let e = errors(b);
        assert_eq!(e.len(), 3, "{e:?}");
        assert!(e[0].contains("thread count 48"), "{e:?}");
        assert!(
            e[1].contains("thread count 256") && e[1].contains("128"),
            "{e:?}"
        );
        assert!(e[2].contains("named barrier 16"), "{e:?}");
    }

    #[test]
    fn rejects_unplaced_and_doubly_placed_labels() {
        let mut b = builder();
        let l = b.label("x");
        b.bra(&l);
        let e = errors(b);
        assert!(e[0].contains("never placed"), "{e:?}");

        let mut b = builder();
        let l = b.label("x");
        b.place(&l);
        b.place(&l);
        assert!(errors(b)[0].contains("placed twice"));
    }

    #[test]
    fn rejects_shared_memory_over_the_limit() {
        let mut b = builder();
        b.shared_array("a", 200_000, 1024);
        b.dynamic_shared("dyn", 40_000, 1024);
        let e = errors(b);
        assert!(
            e[0].contains("240000 B exceeds") && e[0].contains("232448"),
            "{e:?}"
        );

        let mut b = builder();
        b.shared_array("a", 232_448, 16);
        assert!(b.finish().is_ok());
    }

    #[test]
    fn rejects_bad_alignment_duplicate_params_and_nested_guards() {
        let mut b = builder();
        b.shared_array("a", 64, 24);
        b.param_u32("n");
        b.param_u32("n");
        let p = b.mov::<Pred>(Reg::<Pred>::new(0));
        b.predicated(p, false, |b| {
            b.predicated(p, true, |_| {});
            let l = b.label("inner");
            b.place(&l);
        });
        let e = errors(b);
        assert!(e.iter().any(|m| m.contains("alignment 24")), "{e:?}");
        assert!(e.iter().any(|m| m.contains("`n` declared twice")), "{e:?}");
        assert!(e.iter().any(|m| m.contains("nested predicated")), "{e:?}");
        assert!(
            e.iter().any(|m| m.contains("inside a predicated region")),
            "{e:?}"
        );
    }

    #[test]
    fn rejects_cta_shapes_out_of_range() {
        let b = KernelBuilder::new("t", Target::Sm100a, (2048, 1, 1));
        assert!(errors(b)[0].contains("2048 threads"));
    }

    #[test]
    fn registers_are_numbered_per_type_in_creation_order() {
        let mut b = builder();
        let a = b.mov::<U32>(1u32);
        let f = b.mov::<F32>(1.5f32);
        let c = b.add(a, 2u32);
        assert_eq!(
            (a.to_string(), c.to_string(), f.to_string()),
            ("%r0".into(), "%r1".into(), "%f0".into())
        );
        let k = b.finish().unwrap();
        let body = crate::ptx::print::body(&k);
        assert_eq!(
            body,
            "\tmov.u32 %r0, 1;\n\tmov.f32 %f0, 0f3FC00000;\n\tadd.u32 %r1, %r0, 2;\n"
        );
    }

    #[test]
    fn version_is_the_highest_any_instruction_needs() {
        let build = |vector_red: bool| {
            let mut b = builder();
            let p = b.param_ptr("p", HostElem::F32, true);
            let a = b.ld_param_ptr(&p);
            let v = [b.mov::<F32>(0.0f32); 4];
            if vector_red {
                b.red_add_v4_f32(&global(a, 0), v, None);
            } else {
                b.red_add_f32(&global(a, 0), v[0]);
            }
            b.finish().unwrap().version()
        };
        assert_eq!(build(false), PtxVersion(8, 0));
        assert_eq!(build(true), PtxVersion(8, 1));
    }
}
