//! Syntax to semantics: one [`InstAst`] to one [`Op`], resolving every name once.
//!
//! A modifier the decoder does not consume makes the instruction *unsupported* (never silently
//! ignored), so the coverage test sees exactly what the executor models.

use std::collections::HashMap;

use crate::ir::*;
use crate::parse::{AddrAst, AddrBaseAst, InstAst, Operand};

/// Why an instruction could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum DecodeError {
    /// Well-formed but not modelled.
    Unsupported(String),
    /// Ill-formed (bad operands, unknown names).
    Malformed(String),
}

type Result<T> = std::result::Result<T, DecodeError>;

fn unsupported<T>(why: impl Into<String>) -> Result<T> {
    Err(DecodeError::Unsupported(why.into()))
}

fn malformed<T>(why: impl Into<String>) -> Result<T> {
    Err(DecodeError::Malformed(why.into()))
}

/// What a non-register name denotes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Symbol {
    /// A shared variable at this shared-space offset.
    Shared(u32),
    /// A kernel parameter at this address in the param window.
    Param(u64),
}

/// Names visible to the decoder.
pub(crate) struct Ctx<'a> {
    pub regs: &'a HashMap<String, (Reg, Ty)>,
    pub symbols: &'a HashMap<String, Symbol>,
    pub labels: &'a HashMap<String, u32>,
}

/// The modifiers of an opcode, consumed as they are understood.
struct Mods<'a> {
    list: Vec<&'a str>,
}

impl<'a> Mods<'a> {
    fn take(&mut self, m: &str) -> bool {
        if let Some(i) = self.list.iter().position(|&x| x == m) {
            self.list.remove(i);
            true
        } else {
            false
        }
    }

    fn take_any(&mut self, ms: &[&str]) -> Option<&'a str> {
        let i = self.list.iter().position(|x| ms.contains(x))?;
        Some(self.list.remove(i))
    }

    fn ignore(&mut self, ms: &[&str]) {
        self.list.retain(|x| !ms.contains(x));
    }

    /// Removes and returns every type modifier, in order.
    fn types(&mut self) -> Vec<Ty> {
        let mut out = Vec::new();
        self.list.retain(|x| match Ty::from_suffix(x) {
            Some(t) => {
                out.push(t);
                false
            }
            None => true,
        });
        out
    }

    fn one_type(&mut self) -> Result<Ty> {
        match self.types().as_slice() {
            [t] => Ok(*t),
            [] => malformed("missing type"),
            _ => malformed("more than one type"),
        }
    }

    fn vector(&mut self) -> usize {
        match self.take_any(&["v2", "v4", "v8"]) {
            Some("v2") => 2,
            Some("v4") => 4,
            Some(_) => 8,
            None => 1,
        }
    }

    fn finish(self) -> Result<()> {
        match self.list.first() {
            None => Ok(()),
            Some(m) => unsupported(format!("modifier `.{m}`")),
        }
    }
}

/// Cache and ordering qualifiers that do not change functional results here.
const CACHE_QUALIFIERS: &[&str] = &[
    "nc",
    "ca",
    "cg",
    "cs",
    "lu",
    "cv",
    "wb",
    "wt",
    "volatile",
    "weak",
    "relaxed",
    "acquire",
    "release",
    "acq_rel",
    "cta",
    "gpu",
    "sys",
    "L1::no_allocate",
    "L1::evict_normal",
    "L1::evict_unchanged",
    "L1::evict_first",
    "L1::evict_last",
    "L2::evict_normal",
    "L2::evict_first",
    "L2::evict_last",
    "L2::64B",
    "L2::128B",
    "L2::256B",
];

fn int_ty(t: Ty) -> Result<IntTy> {
    match t {
        Ty::B(n) | Ty::U(n) if n >= 16 => Ok(IntTy {
            bits: n,
            signed: false,
        }),
        Ty::S(n) if n >= 16 => Ok(IntTy {
            bits: n,
            signed: true,
        }),
        _ => unsupported(format!("type `{t:?}` for an integer operation")),
    }
}

fn mask(bits: u32, v: u64) -> u64 {
    if bits >= 64 {
        v
    } else {
        v & ((1u64 << bits) - 1)
    }
}

impl Ctx<'_> {
    fn reg(&self, op: &Operand) -> Result<Reg> {
        match op {
            Operand::Name(n) => match self.regs.get(n) {
                Some(&(r, _)) => Ok(r),
                None => malformed(format!("`{n}` is not a declared register")),
            },
            _ => malformed(format!("expected a register, found {op:?}")),
        }
    }

    fn reg_ty(&self, op: &Operand) -> Option<Ty> {
        match op {
            Operand::Name(n) => self.regs.get(n).map(|&(_, t)| t),
            _ => None,
        }
    }

    fn pred_reg(&self, op: &Operand) -> Result<Reg> {
        let r = self.reg(op)?;
        if self.reg_ty(op) != Some(Ty::Pred) {
            return malformed(format!("{op:?} is not a predicate register"));
        }
        Ok(r)
    }

    fn dst(&self, op: &Operand) -> Result<Dst> {
        match op {
            Operand::Name(n) if n == "_" => Ok(Dst::Sink),
            _ => Ok(Dst::Reg(self.reg(op)?)),
        }
    }

    fn imm(&self, op: &Operand, ty: Ty) -> Result<u64> {
        let bits = ty.bits();
        Ok(match (op, ty) {
            (Operand::Int(v), Ty::Pred) => (*v != 0) as u64,
            (Operand::Int(v), Ty::F32) => (*v as f32).to_bits() as u64,
            (Operand::Int(v), Ty::F64) => (*v as f64).to_bits(),
            (Operand::Int(v), Ty::Bf16) => half::bf16::from_f32(*v as f32).to_bits() as u64,
            (Operand::Int(v), Ty::F16) => half::f16::from_f32(*v as f32).to_bits() as u64,
            (Operand::Int(v), _) => mask(bits, *v as u64),
            (Operand::F32(b), Ty::F32) => *b as u64,
            (Operand::F32(b), Ty::F64) => (f32::from_bits(*b) as f64).to_bits(),
            (Operand::F64(b), Ty::F32) => (f64::from_bits(*b) as f32).to_bits() as u64,
            (Operand::F64(b), Ty::F64) => *b,
            (Operand::F32(_) | Operand::F64(_), _) => {
                return malformed(format!("floating literal for type {ty:?}"))
            }
            _ => return malformed(format!("expected an immediate, found {op:?}")),
        })
    }

    fn src(&self, op: &Operand, ty: Ty) -> Result<Src> {
        match op {
            Operand::Name(n) => {
                if let Some(&(r, rty)) = self.regs.get(n) {
                    if (rty == Ty::Pred) != (ty == Ty::Pred) {
                        return malformed(format!("register `{n}` of type {rty:?} used as {ty:?}"));
                    }
                    return Ok(Src::Reg(r));
                }
                if let Some(s) = Special::from_name(n) {
                    return Ok(Src::Special(s));
                }
                match self.symbols.get(n) {
                    Some(Symbol::Shared(off)) => Ok(Src::Imm(*off as u64)),
                    Some(Symbol::Param(a)) => Ok(Src::Imm(*a)),
                    None if n.starts_with('%') => {
                        malformed(format!("`{n}` is not a declared register"))
                    }
                    None => malformed(format!("unknown name `{n}`")),
                }
            }
            Operand::Int(_) | Operand::F32(_) | Operand::F64(_) => Ok(Src::Imm(self.imm(op, ty)?)),
            _ => malformed(format!("expected a value, found {op:?}")),
        }
    }

    fn pred_src(&self, op: &Operand) -> Result<PredSrc> {
        match op {
            Operand::Not(n) => Ok(PredSrc {
                src: Src::Reg(self.pred_reg(&Operand::Name(n.clone()))?),
                negate: true,
            }),
            Operand::Name(_) => Ok(PredSrc {
                src: Src::Reg(self.pred_reg(op)?),
                negate: false,
            }),
            Operand::Int(v) => Ok(PredSrc {
                src: Src::Imm((*v != 0) as u64),
                negate: false,
            }),
            _ => malformed(format!("expected a predicate, found {op:?}")),
        }
    }

    fn addr_of(&self, a: &AddrAst) -> Result<Addr> {
        let base = match &a.base {
            AddrBaseAst::Abs(v) => AddrBase::Abs(*v),
            AddrBaseAst::Name(n) => {
                if let Some(&(r, _)) = self.regs.get(n) {
                    AddrBase::Reg(r)
                } else {
                    match self.symbols.get(n) {
                        Some(Symbol::Shared(off)) => AddrBase::Abs(*off as u64),
                        Some(Symbol::Param(p)) => AddrBase::Abs(*p),
                        None => return malformed(format!("unknown address base `{n}`")),
                    }
                }
            }
        };
        Ok(Addr {
            base,
            offset: a.offset,
        })
    }

    fn addr(&self, op: &Operand) -> Result<Addr> {
        match op {
            Operand::Address(a) => self.addr_of(a),
            _ => malformed(format!("expected an address, found {op:?}")),
        }
    }

    fn dsts(&self, op: &Operand, n: usize) -> Result<Vec<Dst>> {
        let v = match op {
            Operand::Vector(items) => items.iter().map(|x| self.dst(x)).collect::<Result<_>>()?,
            _ => vec![self.dst(op)?],
        };
        if v.len() != n {
            return malformed(format!("expected {n} destinations, found {}", v.len()));
        }
        Ok(v)
    }

    fn srcs(&self, op: &Operand, n: usize, ty: Ty) -> Result<Vec<Src>> {
        let v = match op {
            Operand::Vector(items) => items
                .iter()
                .map(|x| self.src(x, ty))
                .collect::<Result<_>>()?,
            _ => vec![self.src(op, ty)?],
        };
        if v.len() != n {
            return malformed(format!("expected {n} values, found {}", v.len()));
        }
        Ok(v)
    }
}

fn arity(ops: &[Operand], n: usize) -> Result<()> {
    if ops.len() == n {
        Ok(())
    } else {
        malformed(format!("expected {n} operands, found {}", ops.len()))
    }
}

fn take_space(m: &mut Mods<'_>) -> Result<Space> {
    if m.take("global") {
        Ok(Space::Global)
    } else if m.take("shared") || m.take("shared::cta") {
        Ok(Space::Shared)
    } else if m.take("param") || m.take("param::entry") {
        Ok(Space::Param)
    } else if let Some(s) = m.take_any(&["local", "const", "shared::cluster", "param::func"]) {
        unsupported(format!("state space `.{s}`"))
    } else {
        Ok(Space::Generic)
    }
}

fn cmp_of(s: &str) -> Option<Cmp> {
    Some(match s {
        "eq" => Cmp::Eq,
        "ne" => Cmp::Ne,
        "lt" | "lo" => Cmp::Lt,
        "le" | "ls" => Cmp::Le,
        "gt" | "hi" => Cmp::Gt,
        "ge" | "hs" => Cmp::Ge,
        "equ" => Cmp::Equ,
        "neu" => Cmp::Neu,
        "ltu" => Cmp::Ltu,
        "leu" => Cmp::Leu,
        "gtu" => Cmp::Gtu,
        "geu" => Cmp::Geu,
        "num" => Cmp::Num,
        "nan" => Cmp::Nan,
        _ => return None,
    })
}

/// Decodes one instruction.
pub(crate) fn decode(inst: &InstAst, ctx: &Ctx<'_>) -> Result<Op> {
    let mut parts = inst.opcode.split('.');
    let name = parts.next().unwrap_or_default();
    let mut m = Mods {
        list: parts.collect(),
    };
    let ops = inst.operands.as_slice();
    let op = match name {
        "ld" => {
            let space = take_space(&mut m)?;
            m.ignore(CACHE_QUALIFIERS);
            let hint = m.take("L2::cache_hint");
            let n = m.vector();
            let ty = m.one_type()?;
            m.finish()?;
            arity(ops, 2 + hint as usize)?;
            let dst = ctx.dsts(&ops[0], n)?;
            let dst_bits = ctx.reg_ty(match &ops[0] {
                Operand::Vector(v) => &v[0],
                o => o,
            });
            Op::Ld {
                space,
                ty,
                dst,
                dst_bits: dst_bits.map_or(64, |t| t.bits().max(8) as u8),
                addr: ctx.addr(&ops[1])?,
            }
        }
        "st" => {
            let space = take_space(&mut m)?;
            m.ignore(CACHE_QUALIFIERS);
            let hint = m.take("L2::cache_hint");
            let n = m.vector();
            let ty = m.one_type()?;
            m.finish()?;
            arity(ops, 2 + hint as usize)?;
            Op::St {
                space,
                ty,
                addr: ctx.addr(&ops[0])?,
                src: ctx.srcs(&ops[1], n, ty)?,
            }
        }
        "mov" => {
            let ty = m.one_type()?;
            m.finish()?;
            arity(ops, 2)?;
            match (&ops[0], &ops[1]) {
                (Operand::Vector(ds), a) => {
                    let elem_bits = ty.bits() / ds.len() as u32;
                    Op::Unpack {
                        elem_bits: elem_bits as u8,
                        dst: ctx.dsts(&ops[0], ds.len())?,
                        a: ctx.src(a, ty)?,
                    }
                }
                (d, Operand::Vector(parts)) => {
                    let elem_bits = ty.bits() / parts.len() as u32;
                    let ety = Ty::B(elem_bits as u8);
                    Op::Pack {
                        elem_bits: elem_bits as u8,
                        d: ctx.reg(d)?,
                        parts: parts
                            .iter()
                            .map(|p| ctx.src(p, ety))
                            .collect::<Result<_>>()?,
                    }
                }
                (d, a @ Operand::Not(_)) if ty == Ty::Pred => Op::PredNot {
                    d: ctx.pred_reg(d)?,
                    a: ctx.pred_src(a)?,
                },
                (d, a) => Op::Mov {
                    bits: ty.bits() as u8,
                    d: ctx.reg(d)?,
                    a: ctx.src(a, ty)?,
                },
            }
        }
        "cvta" => {
            let to = m.take("to");
            let space = take_space(&mut m)?;
            let ty = m.one_type()?;
            m.finish()?;
            if space == Space::Generic || !matches!(ty, Ty::U(32) | Ty::U(64)) {
                return malformed("cvta needs a space and .u32/.u64");
            }
            arity(ops, 2)?;
            Op::Cvta {
                to,
                space,
                bits: ty.bits() as u8,
                d: ctx.reg(&ops[0])?,
                a: ctx.src(&ops[1], ty)?,
            }
        }
        "add" | "sub" | "mul" | "div" | "rem" | "min" | "max" | "and" | "or" | "xor" | "shl"
        | "shr" => {
            let ty = m.one_type()?;
            if ty == Ty::Pred {
                m.finish()?;
                arity(ops, 3)?;
                let op = match name {
                    "and" => PredOp::And,
                    "or" => PredOp::Or,
                    "xor" => PredOp::Xor,
                    _ => return malformed(format!("`{name}` on .pred")),
                };
                return Ok(Op::Pred {
                    op,
                    d: ctx.pred_reg(&ops[0])?,
                    a: ctx.pred_src(&ops[1])?,
                    b: ctx.pred_src(&ops[2])?,
                });
            }
            if ty == Ty::F32 {
                let op = match name {
                    "add" => FloatOp::Add,
                    "sub" => FloatOp::Sub,
                    "mul" => FloatOp::Mul,
                    "min" => FloatOp::Min,
                    "max" => FloatOp::Max,
                    _ => return unsupported(format!("`{name}.f32`")),
                };
                if matches!(op, FloatOp::Add | FloatOp::Sub | FloatOp::Mul) {
                    m.take("rn");
                }
                let ftz = m.take("ftz");
                m.finish()?;
                arity(ops, 3)?;
                return Ok(Op::Float {
                    op,
                    ftz,
                    d: ctx.reg(&ops[0])?,
                    a: ctx.src(&ops[1], ty)?,
                    b: ctx.src(&ops[2], ty)?,
                });
            }
            if ty.is_float() {
                return unsupported(format!(
                    "type `.{}`",
                    inst.opcode.rsplit('.').next().unwrap_or("")
                ));
            }
            let ity = int_ty(ty)?;
            let mut wide = false;
            let op = match name {
                "add" => IntOp::Add,
                "sub" => IntOp::Sub,
                "mul" => {
                    if m.take("lo") {
                        IntOp::MulLo
                    } else if m.take("hi") {
                        IntOp::MulHi
                    } else if m.take("wide") {
                        wide = true;
                        IntOp::MulLo
                    } else {
                        return malformed("integer mul needs .lo, .hi or .wide");
                    }
                }
                "div" => IntOp::Div,
                "rem" => IntOp::Rem,
                "min" => IntOp::Min,
                "max" => IntOp::Max,
                "and" => IntOp::And,
                "or" => IntOp::Or,
                "xor" => IntOp::Xor,
                "shl" => IntOp::Shl,
                _ => IntOp::Shr,
            };
            m.finish()?;
            arity(ops, 3)?;
            let d = ctx.reg(&ops[0])?;
            let a = ctx.src(&ops[1], ty)?;
            // Shift amounts are .u32 whatever the operation's width.
            let bty = if matches!(op, IntOp::Shl | IntOp::Shr) {
                Ty::U(32)
            } else {
                ty
            };
            let b = ctx.src(&ops[2], bty)?;
            if wide {
                if ity.bits == 64 {
                    return malformed("mul.wide of 64-bit operands");
                }
                Op::MulWide { ty: ity, d, a, b }
            } else {
                Op::Int {
                    op,
                    ty: ity,
                    d,
                    a,
                    b,
                }
            }
        }
        "popc" => {
            let ty = m.one_type()?;
            if !matches!(ty, Ty::B(32) | Ty::B(64)) {
                return unsupported(format!("popc on {ty:?}"));
            }
            m.finish()?;
            arity(ops, 2)?;
            Op::IntUn {
                op: IntUnOp::Popc,
                ty: int_ty(ty)?,
                d: ctx.reg(&ops[0])?,
                a: ctx.src(&ops[1], ty)?,
            }
        }
        "not" | "neg" | "abs" => {
            let ty = m.one_type()?;
            if ty == Ty::Pred && name == "not" {
                m.finish()?;
                arity(ops, 2)?;
                return Ok(Op::PredNot {
                    d: ctx.pred_reg(&ops[0])?,
                    a: ctx.pred_src(&ops[1])?,
                });
            }
            if ty == Ty::F32 && name != "not" {
                let ftz = m.take("ftz");
                m.finish()?;
                arity(ops, 2)?;
                return Ok(Op::FloatUn {
                    op: if name == "neg" {
                        FloatUnOp::Neg
                    } else {
                        FloatUnOp::Abs
                    },
                    ftz,
                    d: ctx.reg(&ops[0])?,
                    a: ctx.src(&ops[1], ty)?,
                });
            }
            let ity = int_ty(ty)?;
            m.finish()?;
            arity(ops, 2)?;
            Op::IntUn {
                op: match name {
                    "not" => IntUnOp::Not,
                    "neg" => IntUnOp::Neg,
                    _ => IntUnOp::Abs,
                },
                ty: ity,
                d: ctx.reg(&ops[0])?,
                a: ctx.src(&ops[1], ty)?,
            }
        }
        "mad" => {
            let ty = m.one_type()?;
            if ty == Ty::F32 {
                if !m.take("rn") {
                    return unsupported("mad.f32 without .rn");
                }
                let ftz = m.take("ftz");
                m.finish()?;
                arity(ops, 4)?;
                return Ok(Op::Fma {
                    ftz,
                    d: ctx.reg(&ops[0])?,
                    a: ctx.src(&ops[1], ty)?,
                    b: ctx.src(&ops[2], ty)?,
                    c: ctx.src(&ops[3], ty)?,
                });
            }
            let ity = int_ty(ty)?;
            let mode = if m.take("lo") {
                MadMode::Lo
            } else if m.take("hi") {
                MadMode::Hi
            } else if m.take("wide") {
                MadMode::Wide
            } else {
                return malformed("integer mad needs .lo, .hi or .wide");
            };
            m.finish()?;
            arity(ops, 4)?;
            let cty = if mode == MadMode::Wide {
                if ity.bits == 64 {
                    return malformed("mad.wide of 64-bit operands");
                }
                Ty::U(ity.bits * 2)
            } else {
                ty
            };
            Op::Mad {
                mode,
                ty: ity,
                d: ctx.reg(&ops[0])?,
                a: ctx.src(&ops[1], ty)?,
                b: ctx.src(&ops[2], ty)?,
                c: ctx.src(&ops[3], cty)?,
            }
        }
        "fma" => {
            let ty = m.one_type()?;
            if ty != Ty::F32 {
                return unsupported(format!("fma of type {ty:?}"));
            }
            if !m.take("rn") {
                return unsupported("fma without .rn");
            }
            let ftz = m.take("ftz");
            m.finish()?;
            arity(ops, 4)?;
            Op::Fma {
                ftz,
                d: ctx.reg(&ops[0])?,
                a: ctx.src(&ops[1], ty)?,
                b: ctx.src(&ops[2], ty)?,
                c: ctx.src(&ops[3], ty)?,
            }
        }
        "ex2" | "lg2" | "rcp" => {
            // The approximations the kernels use, and the reciprocal's round to nearest.
            let (op, rounding) = match name {
                "ex2" => (FloatUnOp::Ex2, "approx"),
                "lg2" => (FloatUnOp::Lg2, "approx"),
                _ => (FloatUnOp::Rcp, "rn"),
            };
            let ty = m.one_type()?;
            if ty != Ty::F32 || !m.take(rounding) {
                return unsupported(format!("only {name}.{rounding}[.ftz].f32 is modelled"));
            }
            let ftz = m.take("ftz");
            m.finish()?;
            arity(ops, 2)?;
            Op::FloatUn {
                op,
                ftz,
                d: ctx.reg(&ops[0])?,
                a: ctx.src(&ops[1], ty)?,
            }
        }
        "setp" => {
            let first = m.list.first().copied().unwrap_or_default();
            let Some(cmp) = cmp_of(first) else {
                return malformed("setp needs a comparison");
            };
            m.list.remove(0);
            if m.take_any(&["and", "or", "xor"]).is_some() {
                return unsupported("setp with a boolean combination");
            }
            let ty = m.one_type()?;
            m.finish()?;
            if ty == Ty::Pred || (ty.is_float() && ty != Ty::F32) {
                return unsupported(format!("setp of type {ty:?}"));
            }
            if !ty.is_float() && cmp as u8 > Cmp::Ge as u8 {
                return malformed("unordered comparison on integers");
            }
            arity(ops, 3)?;
            if let Operand::Pair(..) = ops[0] {
                return unsupported("setp with two destinations");
            }
            Op::Setp {
                cmp,
                ty,
                d: ctx.pred_reg(&ops[0])?,
                a: ctx.src(&ops[1], ty)?,
                b: ctx.src(&ops[2], ty)?,
            }
        }
        "selp" => {
            let ty = m.one_type()?;
            m.finish()?;
            arity(ops, 4)?;
            Op::Selp {
                bits: ty.bits() as u8,
                d: ctx.reg(&ops[0])?,
                a: ctx.src(&ops[1], ty)?,
                b: ctx.src(&ops[2], ty)?,
                p: ctx.pred_src(&ops[3])?,
            }
        }
        "cvt" => decode_cvt(&mut m, ops, ctx)?,
        "prmt" => {
            let ty = m.one_type()?;
            m.finish()?;
            if ty != Ty::B(32) {
                return malformed("prmt is .b32");
            }
            arity(ops, 4)?;
            Op::Prmt {
                d: ctx.reg(&ops[0])?,
                a: ctx.src(&ops[1], ty)?,
                b: ctx.src(&ops[2], ty)?,
                c: ctx.src(&ops[3], ty)?,
            }
        }
        "shfl" => {
            if !m.take("sync") {
                return unsupported("shfl without .sync");
            }
            let mode = match m.take_any(&["up", "down", "bfly", "idx"]) {
                Some("up") => ShflMode::Up,
                Some("down") => ShflMode::Down,
                Some("bfly") => ShflMode::Bfly,
                Some(_) => ShflMode::Idx,
                None => return malformed("shfl.sync needs a mode"),
            };
            let ty = m.one_type()?;
            m.finish()?;
            if ty != Ty::B(32) {
                return malformed("shfl.sync is .b32");
            }
            arity(ops, 5)?;
            let (d, p) = match &ops[0] {
                Operand::Pair(d, p) => (
                    ctx.dst(&Operand::Name(d.clone()))?,
                    Some(ctx.pred_reg(&Operand::Name(p.clone()))?),
                ),
                o => (ctx.dst(o)?, None),
            };
            let u32t = Ty::B(32);
            Op::Shfl {
                mode,
                d,
                p,
                a: ctx.src(&ops[1], u32t)?,
                b: ctx.src(&ops[2], u32t)?,
                c: ctx.src(&ops[3], u32t)?,
                mask: ctx.src(&ops[4], u32t)?,
            }
        }
        "bar" if m.list.first() == Some(&"warp") => {
            m.take("warp");
            if !m.take("sync") {
                return unsupported("bar.warp other than bar.warp.sync");
            }
            m.finish()?;
            arity(ops, 1)?;
            Op::WarpSync {
                mask: ctx.src(&ops[0], Ty::B(32))?,
            }
        }
        "mma" => {
            if !(m.take("sync") && m.take("aligned")) {
                return malformed("mma needs .sync.aligned");
            }
            if !(m.take("m16n8k16") && m.take("row") && m.take("col")) {
                return unsupported("mma shape or layout (only .m16n8k16.row.col is modelled)");
            }
            let types = m.types();
            m.finish()?;
            if types != [Ty::F32, Ty::Bf16, Ty::Bf16, Ty::F32] {
                return unsupported("mma types (only .f32.bf16.bf16.f32 is modelled)");
            }
            arity(ops, 4)?;
            let (w, f) = (Ty::B(32), Ty::F32);
            Op::MmaBf16 {
                d: ctx.dsts(&ops[0], 4)?,
                a: ctx.srcs(&ops[1], 4, w)?,
                b: ctx.srcs(&ops[2], 2, w)?,
                c: ctx.srcs(&ops[3], 4, f)?,
            }
        }
        "stmatrix" => {
            if !(m.take("sync") && m.take("aligned")) {
                return malformed("stmatrix needs .sync.aligned");
            }
            if !m.take("m8n8") {
                return unsupported("stmatrix shape (only .m8n8 is modelled)");
            }
            let n = match m.take_any(&["x1", "x2", "x4"]) {
                Some("x1") => 1,
                Some("x2") => 2,
                Some(_) => 4,
                None => return malformed("stmatrix needs .x1, .x2 or .x4"),
            };
            if m.take("trans") {
                return unsupported("stmatrix.trans");
            }
            if !(m.take("shared") || m.take("shared::cta")) {
                return unsupported("stmatrix outside the .shared space");
            }
            let ty = m.one_type()?;
            m.finish()?;
            if ty != Ty::B(16) {
                return malformed("stmatrix.m8n8 is .b16");
            }
            arity(ops, 2)?;
            Op::Stmatrix {
                addr: ctx.addr(&ops[0])?,
                src: ctx.srcs(&ops[1], n, Ty::B(32))?,
            }
        }
        "bar" | "barrier" => {
            m.take("cta");
            let kind = if m.take("sync") {
                BarKind::Sync
            } else if m.take("arrive") {
                BarKind::Arrive
            } else if name == "barrier" && m.list.is_empty() {
                BarKind::Sync
            } else {
                return unsupported("only bar.sync / bar.arrive are modelled");
            };
            m.take("aligned");
            m.finish()?;
            let u32t = Ty::U(32);
            let (id, count) = match ops {
                [a] => (ctx.src(a, u32t)?, None),
                [a, b] => (ctx.src(a, u32t)?, Some(ctx.src(b, u32t)?)),
                _ => return malformed("bar takes 1 or 2 operands"),
            };
            if kind == BarKind::Arrive && count.is_none() {
                return malformed("bar.arrive needs a thread count");
            }
            Op::Bar { kind, id, count }
        }
        "atom" | "red" => decode_atom(name == "atom", &mut m, ops, ctx)?,
        "mbarrier" => decode_mbarrier(&mut m, ops, ctx)?,
        "cp" if m.list.first() == Some(&"reduce") => decode_tma_reduce(&mut m, ops, ctx)?,
        "cp" if m
            .list
            .iter()
            .any(|x| *x == "commit_group" || *x == "wait_group") =>
        {
            if !(m.take("async") && m.take("bulk")) {
                return unsupported("only cp.async.bulk bulk groups are modelled");
            }
            if m.take("commit_group") {
                m.finish()?;
                arity(ops, 0)?;
                Op::BulkCommit
            } else {
                m.take("wait_group");
                // `.read` (the sources are read) is what the model tracks; without it the
                // writes are also done, which the model's immediate reduce already is.
                m.take("read");
                m.finish()?;
                arity(ops, 1)?;
                let Operand::Int(n @ 0..=63) = ops[0] else {
                    return malformed("cp.async.bulk.wait_group takes an immediate 0..63");
                };
                Op::BulkWait { n: n as u32 }
            }
        }
        "cp" => decode_tma(&mut m, ops, ctx)?,
        "wgmma" => decode_wgmma(&mut m, ops, ctx)?,
        "tcgen05" => Op::Tcgen05(Box::new(decode_tcgen05(&mut m, ops, ctx)?)),
        "setmaxnreg" => {
            let inc = match m.take_any(&["inc", "dec"]) {
                Some(d) => d == "inc",
                None => return malformed("setmaxnreg needs .inc or .dec"),
            };
            if !(m.take("sync") && m.take("aligned")) {
                return malformed("setmaxnreg is .sync.aligned");
            }
            if m.one_type()? != Ty::U(32) {
                return malformed("setmaxnreg is .u32");
            }
            m.finish()?;
            arity(ops, 1)?;
            let Operand::Int(n) = ops[0] else {
                return malformed("setmaxnreg takes an immediate register count");
            };
            let count = u32::try_from(n)
                .map_err(|_| DecodeError::Malformed(format!("register count {n} out of range")))?;
            Op::SetMaxNReg { inc, count }
        }
        "fence" => {
            let kind = if m.take("proxy") {
                if !m.take("async") {
                    return unsupported("only fence.proxy.async is modelled among proxy fences");
                }
                m.take_any(&["shared::cta", "shared", "global"]);
                FenceKind::ProxyAsync
            } else if m.take("mbarrier_init") {
                m.take("release");
                m.take("cluster");
                FenceKind::MbarrierInit
            } else if m.take_any(&["sc", "acq_rel"]).is_some() {
                m.take_any(&["cta", "gpu", "sys", "cluster"]);
                FenceKind::Memory
            } else {
                return unsupported("fence flavour");
            };
            m.finish()?;
            arity(ops, 0)?;
            Op::Fence(kind)
        }
        "createpolicy" => {
            if !m.take("fractional") {
                return unsupported("only createpolicy.fractional is modelled");
            }
            m.ignore(&[
                "L2::evict_last",
                "L2::evict_normal",
                "L2::evict_first",
                "L2::evict_unchanged",
            ]);
            let ty = m.one_type()?;
            m.finish()?;
            if ty != Ty::B(64) {
                return malformed("createpolicy is .b64");
            }
            if ops.is_empty() || ops.len() > 2 {
                return malformed("createpolicy takes 1 or 2 operands");
            }
            Op::CreatePolicy {
                d: ctx.reg(&ops[0])?,
            }
        }
        "bra" => {
            m.take("uni");
            m.finish()?;
            arity(ops, 1)?;
            let Operand::Name(l) = &ops[0] else {
                return malformed("bra needs a label");
            };
            match ctx.labels.get(l) {
                Some(&target) => Op::Bra { target },
                None => return malformed(format!("unknown label `{l}`")),
            }
        }
        "trap" => {
            m.finish()?;
            arity(ops, 0)?;
            Op::Trap
        }
        "elect" => {
            if !m.take("sync") {
                return malformed("elect is .sync");
            }
            m.finish()?;
            arity(ops, 2)?;
            let (d, p) = match &ops[0] {
                Operand::Pair(d, p) => (
                    ctx.dst(&Operand::Name(d.clone()))?,
                    Some(ctx.pred_reg(&Operand::Name(p.clone()))?),
                ),
                o => (ctx.dst(o)?, None),
            };
            Op::Elect {
                d,
                p,
                mask: ctx.src(&ops[1], Ty::B(32))?,
            }
        }
        "vote" => {
            if !(m.take("sync") && m.take("ballot")) {
                return unsupported("vote other than vote.sync.ballot");
            }
            let ty = m.one_type()?;
            m.finish()?;
            if ty != Ty::B(32) {
                return malformed("vote.sync.ballot is .b32");
            }
            arity(ops, 3)?;
            Op::Ballot {
                d: ctx.dst(&ops[0])?,
                a: ctx.pred_src(&ops[1])?,
                mask: ctx.src(&ops[2], Ty::B(32))?,
            }
        }
        "redux" => {
            if !(m.take("sync") && m.take("min")) {
                return unsupported("redux other than redux.sync.min.u32");
            }
            let ty = m.one_type()?;
            m.finish()?;
            if ty != Ty::U(32) {
                return unsupported("redux.sync.min other than .u32");
            }
            arity(ops, 3)?;
            Op::ReduxMin {
                d: ctx.dst(&ops[0])?,
                a: ctx.src(&ops[1], Ty::U(32))?,
                mask: ctx.src(&ops[2], Ty::B(32))?,
            }
        }
        "ret" | "exit" => {
            m.take("uni");
            m.finish()?;
            arity(ops, 0)?;
            Op::Exit
        }
        _ => return unsupported(format!("opcode `{name}` is not modelled")),
    };
    Ok(op)
}

fn decode_cvt(m: &mut Mods<'_>, ops: &[Operand], ctx: &Ctx<'_>) -> Result<Op> {
    let round = m.take_any(&["rn", "rz", "rm", "rp", "rni", "rzi", "rmi", "rpi"]);
    let types = m.types();
    let [dt, at] = types[..] else {
        return malformed("cvt needs two types");
    };
    let m = Mods {
        list: std::mem::take(&mut m.list),
    };
    m.finish()?;
    if matches!(dt, Ty::Bf16x2 | Ty::F16x2) && at == Ty::F32 {
        if round != Some("rn") {
            return unsupported("cvt.bf16x2.f32 / cvt.f16x2.f32 without .rn");
        }
        arity(ops, 3)?;
        return Ok(Op::CvtBf16x2 {
            d: ctx.reg(&ops[0])?,
            f16: dt == Ty::F16x2,
            hi: ctx.src(&ops[1], Ty::F32)?,
            lo: ctx.src(&ops[2], Ty::F32)?,
        });
    }
    arity(ops, 2)?;
    let round_int = |r: Option<&str>| match r {
        Some("rni") => Ok(RoundInt::Nearest),
        Some("rzi") => Ok(RoundInt::Zero),
        Some("rmi") => Ok(RoundInt::Down),
        Some("rpi") => Ok(RoundInt::Up),
        other => unsupported(format!("rounding {other:?} for a float-to-integer cvt")),
    };
    let is_int = |t: Ty| matches!(t, Ty::U(_) | Ty::S(_) | Ty::B(_));
    let ity = |t: Ty| match t {
        Ty::S(n) => IntTy {
            bits: n,
            signed: true,
        },
        Ty::U(n) | Ty::B(n) => IntTy {
            bits: n,
            signed: false,
        },
        _ => IntTy {
            bits: 32,
            signed: false,
        },
    };
    let conv = match (dt, at) {
        (d, a) if is_int(d) && is_int(a) => {
            if round.is_some() {
                return unsupported("rounding on an integer-to-integer cvt");
            }
            Conversion::Int {
                from: ity(a),
                to: ity(d),
            }
        }
        (Ty::F32, a) if is_int(a) => {
            if round != Some("rn") {
                return unsupported(format!("rounding {round:?} for an integer-to-f32 cvt"));
            }
            Conversion::IntToF32 { from: ity(a) }
        }
        (d, Ty::F32) if is_int(d) => Conversion::F32ToInt {
            to: ity(d),
            round: round_int(round)?,
        },
        (Ty::F32, Ty::F32) => Conversion::F32Round(round_int(round)?),
        (Ty::F32, Ty::Bf16) if round.is_none() => Conversion::Bf16ToF32,
        (Ty::F32, Ty::F16) if round.is_none() => Conversion::F16ToF32,
        (Ty::Bf16, Ty::F32) if round == Some("rn") => Conversion::F32ToBf16,
        (Ty::F16, Ty::F32) if round == Some("rn") => Conversion::F32ToF16,
        _ => return unsupported(format!("cvt from {at:?} to {dt:?} with {round:?}")),
    };
    Ok(Op::Cvt {
        conv,
        d: ctx.reg(&ops[0])?,
        a: ctx.src(&ops[1], at)?,
    })
}

fn decode_atom(atom: bool, m: &mut Mods<'_>, ops: &[Operand], ctx: &Ctx<'_>) -> Result<Op> {
    let space = take_space(m)?;
    if space == Space::Param {
        return malformed("atomics on .param");
    }
    m.ignore(&[
        "relaxed", "acquire", "release", "acq_rel", "cta", "gpu", "sys",
    ]);
    let op = match m.take_any(&[
        "add", "min", "max", "and", "or", "xor", "exch", "cas", "inc", "dec",
    ]) {
        Some("add") => AtomOp::Add,
        Some("min") => AtomOp::Min,
        Some("max") => AtomOp::Max,
        Some("and") => AtomOp::And,
        Some("or") => AtomOp::Or,
        Some("xor") => AtomOp::Xor,
        Some("exch") => AtomOp::Exch,
        Some("cas") => AtomOp::Cas,
        Some("inc") => AtomOp::Inc,
        Some("dec") => AtomOp::Dec,
        _ => return malformed("atom/red needs an operation"),
    };
    let noftz = m.take("noftz");
    let hint = m.take("L2::cache_hint");
    let n = m.vector();
    let ty = m.one_type()?;
    let m = Mods {
        list: std::mem::take(&mut m.list),
    };
    m.finish()?;
    let float_ok = match ty {
        Ty::F32 => op == AtomOp::Add && !noftz,
        Ty::Bf16 | Ty::F16 => op == AtomOp::Add && noftz && n == 1,
        // `.v2`/`.v4` of packed pairs: sm_90's vector reductions.
        Ty::Bf16x2 | Ty::F16x2 => op == AtomOp::Add && noftz && matches!(n, 1 | 2 | 4),
        Ty::F64 => false,
        _ => true,
    };
    if !float_ok {
        return unsupported(format!("atomic {op:?} on {ty:?}"));
    }
    if n > 1 && !matches!(ty, Ty::F32 | Ty::Bf16x2 | Ty::F16x2) {
        return unsupported("vector atomics other than .f32, .f16x2 and .bf16x2");
    }
    if n > 1 && space != Space::Global {
        return malformed("vector atomics need .global");
    }
    if !ty.is_float()
        && !matches!(
            ty,
            Ty::B(32) | Ty::B(64) | Ty::U(32) | Ty::U(64) | Ty::S(32) | Ty::S(64)
        )
    {
        return unsupported(format!("atomic {op:?} on {ty:?}"));
    }
    let cas = op == AtomOp::Cas;
    let base = atom as usize + 2 + cas as usize;
    arity(ops, base + hint as usize)?;
    let mut i = 0;
    let d = if atom {
        i += 1;
        Some(ctx.dsts(&ops[0], n)?)
    } else {
        None
    };
    let addr = ctx.addr(&ops[i])?;
    let b = ctx.srcs(&ops[i + 1], n, ty)?;
    let c = if cas {
        Some(ctx.src(&ops[i + 2], ty)?)
    } else {
        None
    };
    Ok(Op::Atom {
        space,
        op,
        ty,
        d,
        addr,
        b,
        c,
        noftz,
    })
}

/// `.shared`, `.shared::cta` or no space (generic) for the mbarrier operand.
fn mbarrier_space(m: &mut Mods<'_>) -> Result<Space> {
    if m.take("shared") || m.take("shared::cta") {
        Ok(Space::Shared)
    } else if let Some(s) = m.take_any(&["shared::cluster", "global", "local", "const", "param"]) {
        unsupported(format!("mbarrier in state space `.{s}`"))
    } else {
        Ok(Space::Generic)
    }
}

fn decode_mbarrier(m: &mut Mods<'_>, ops: &[Operand], ctx: &Ctx<'_>) -> Result<Op> {
    let Some(kind) = m.take_any(&[
        "init",
        "arrive",
        "expect_tx",
        "complete_tx",
        "try_wait",
        "test_wait",
    ]) else {
        return unsupported(format!(
            "mbarrier operation `.{}`",
            m.list.first().copied().unwrap_or_default()
        ));
    };
    let expect = kind == "arrive" && m.take("expect_tx");
    if matches!(kind, "try_wait" | "test_wait") && !m.take("parity") {
        return unsupported(format!(
            "mbarrier.{kind} with a state token (only .parity is modelled)"
        ));
    }
    // Memory-order and scope qualifiers: the simulator is sequentially consistent and runs
    // one CTA at a time.
    m.ignore(&["release", "acquire", "relaxed", "cta", "cluster"]);
    let space = mbarrier_space(m)?;
    let ty = m.one_type()?;
    let m = Mods {
        list: std::mem::take(&mut m.list),
    };
    m.finish()?;
    if ty != Ty::B(64) {
        return malformed("mbarrier operations are .b64");
    }
    let u32t = Ty::U(32);
    Ok(match kind {
        "init" => {
            arity(ops, 2)?;
            Op::MbarrierInit {
                space,
                addr: ctx.addr(&ops[0])?,
                count: ctx.src(&ops[1], u32t)?,
            }
        }
        "arrive" => {
            if !(2..=3).contains(&ops.len()) || (expect && ops.len() != 3) {
                return malformed("mbarrier.arrive takes state, [addr] and an optional count");
            }
            let extra = ops.get(2).map(|o| ctx.src(o, u32t)).transpose()?;
            Op::MbarrierArrive {
                space,
                state: ctx.dst(&ops[0])?,
                addr: ctx.addr(&ops[1])?,
                count: if expect { None } else { extra },
                tx: if expect { extra } else { None },
            }
        }
        "expect_tx" | "complete_tx" => {
            arity(ops, 2)?;
            Op::MbarrierExpectTx {
                space,
                addr: ctx.addr(&ops[0])?,
                tx: ctx.src(&ops[1], u32t)?,
                complete: kind == "complete_tx",
            }
        }
        _ => {
            let test = kind == "test_wait";
            if !(3..=3 + !test as usize).contains(&ops.len()) {
                return malformed(
                    "mbarrier wait takes p, [addr], parity (and a hint for try_wait)",
                );
            }
            Op::MbarrierTryWait {
                test,
                space,
                p: ctx.pred_reg(&ops[0])?,
                addr: ctx.addr(&ops[1])?,
                parity: ctx.src(&ops[2], u32t)?,
            }
        }
    })
}

fn decode_tma(m: &mut Mods<'_>, ops: &[Operand], ctx: &Ctx<'_>) -> Result<Op> {
    if !(m.take("async") && m.take("bulk")) {
        return unsupported("only cp.async.bulk{.tensor} is modelled among cp instructions");
    }
    if !m.take("tensor") {
        return decode_bulk_load(m, ops, ctx);
    }
    let rank = take_rank(m, "cp.async.bulk.tensor")?;
    if m.take_any(&["shared::cluster", "shared::cta"]).is_none() || !m.take("global") {
        return unsupported("only global-to-shared tensor copies are modelled");
    }
    m.take("tile");
    if !m.take("mbarrier::complete_tx::bytes") {
        return unsupported("only mbarrier::complete_tx::bytes completion is modelled");
    }
    let hint = m.take("L2::cache_hint");
    let m = Mods {
        list: std::mem::take(&mut m.list),
    };
    m.finish()?;
    arity(ops, 3 + hint as usize)?;
    Ok(Op::CpAsyncBulkTensor(Box::new(TmaLoad {
        dst: ctx.addr(&ops[0])?,
        tensor: tensor_ref(&ops[1], rank, "copy", ctx)?,
        mbar: ctx.addr(&ops[2])?,
    })))
}

fn decode_tma_reduce(m: &mut Mods<'_>, ops: &[Operand], ctx: &Ctx<'_>) -> Result<Op> {
    if !(m.take("reduce") && m.take("async") && m.take("bulk")) {
        return unsupported("only cp.reduce.async.bulk{.tensor} is modelled among reductions");
    }
    if !m.take("tensor") {
        return decode_bulk_reduce(m, ops, ctx);
    }
    let rank = take_rank(m, "cp.reduce.async.bulk.tensor")?;
    if !m.take("global") || !m.take("shared::cta") {
        return unsupported("only shared-to-global tensor reductions are modelled");
    }
    if !m.take("add") {
        return unsupported("only the .add tensor reduction is modelled");
    }
    m.take("tile");
    if !m.take("bulk_group") {
        return unsupported("only .bulk_group completion is modelled for tensor reductions");
    }
    let hint = m.take("L2::cache_hint");
    let m = Mods {
        list: std::mem::take(&mut m.list),
    };
    m.finish()?;
    arity(ops, 2 + hint as usize)?;
    Ok(Op::TmaReduceAdd(Box::new(TmaReduce {
        src: ctx.addr(&ops[1])?,
        tensor: tensor_ref(&ops[0], rank, "reduction", ctx)?,
    })))
}

/// `cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes{.L2::cache_hint}`.
fn decode_bulk_load(m: &mut Mods<'_>, ops: &[Operand], ctx: &Ctx<'_>) -> Result<Op> {
    if m.take_any(&["shared::cluster", "shared::cta"]).is_none() || !m.take("global") {
        return unsupported("only global-to-shared bulk copies are modelled");
    }
    if !m.take("mbarrier::complete_tx::bytes") {
        return unsupported("only mbarrier::complete_tx::bytes completion is modelled");
    }
    let bytes = bulk_size(m, ops, 4, "bulk copy")?;
    Ok(Op::CpAsyncBulk(Box::new(BulkLoad {
        dst: ctx.addr(&ops[0])?,
        src: ctx.addr(&ops[1])?,
        bytes,
        mbar: ctx.addr(&ops[3])?,
    })))
}

/// `cp.reduce.async.bulk.global.shared::cta.bulk_group{.L2::cache_hint}.add.noftz.f16`.
fn decode_bulk_reduce(m: &mut Mods<'_>, ops: &[Operand], ctx: &Ctx<'_>) -> Result<Op> {
    if !(m.take("global") && m.take("shared::cta") && m.take("bulk_group")) {
        return unsupported("only shared-to-global .bulk_group bulk reductions are modelled");
    }
    if !(m.take("add") && m.take("noftz") && m.take("f16")) {
        return unsupported("only the .add.noftz.f16 bulk reduction is modelled");
    }
    let bytes = bulk_size(m, ops, 3, "bulk reduction")?;
    Ok(Op::BulkReduceAdd(Box::new(BulkReduce {
        dst: ctx.addr(&ops[0])?,
        src: ctx.addr(&ops[1])?,
        bytes,
    })))
}

/// The rest of a bulk (non-tensor) instruction (`what`) after its named modifiers: an
/// optional `.L2::cache_hint` (one more operand than `operands`, the policy) and nothing
/// else; returns its size operand (the third), a positive multiple of 16.
fn bulk_size(m: &mut Mods<'_>, ops: &[Operand], operands: usize, what: &str) -> Result<u32> {
    let hint = m.take("L2::cache_hint");
    let m = Mods {
        list: std::mem::take(&mut m.list),
    };
    m.finish()?;
    arity(ops, operands + hint as usize)?;
    match &ops[2] {
        Operand::Int(v) if *v > 0 && v % 16 == 0 && *v <= i128::from(u32::MAX) => Ok(*v as u32),
        _ => malformed(format!("a {what}'s size must be a positive multiple of 16")),
    }
}

/// The `.Nd` of a bulk tensor instruction (`what`).
fn take_rank(m: &mut Mods<'_>, what: &str) -> Result<u8> {
    match m.take_any(&["1d", "2d", "3d", "4d", "5d"]) {
        Some(d) => Ok(d.as_bytes()[0] - b'0'),
        None => malformed(format!("{what} needs a dimension")),
    }
}

/// A tensor operand `[map, {c0, ...}]` of a `rank`-dimensional `op` ("copy", "reduction").
fn tensor_ref(o: &Operand, rank: u8, op: &str, ctx: &Ctx<'_>) -> Result<TensorRef> {
    let Operand::Tensor(map, coords) = o else {
        return malformed("expected a tensor operand [map, {c0, ...}]");
    };
    if coords.len() != rank as usize {
        return malformed(format!("a {rank}d {op} with {} coordinates", coords.len()));
    }
    Ok(TensorRef {
        map: ctx.addr_of(map)?,
        coords: coords
            .iter()
            .map(|c| ctx.src(c, Ty::S(32)))
            .collect::<Result<_>>()?,
    })
}

fn imm_of(op: &Operand, allowed: &[i128], what: &str) -> Result<i128> {
    match op {
        Operand::Int(v) if allowed.contains(v) => Ok(*v),
        _ => malformed(format!("{what} must be one of {allowed:?}, found {op:?}")),
    }
}

fn decode_wgmma(m: &mut Mods<'_>, ops: &[Operand], ctx: &Ctx<'_>) -> Result<Op> {
    let kind = m.take_any(&["fence", "commit_group", "wait_group", "mma_async"]);
    if !(m.take("sync") && m.take("aligned")) {
        return malformed("wgmma instructions are .sync.aligned");
    }
    let sync = match kind {
        Some("fence") => Some(WgmmaSync::Fence),
        Some("commit_group") => Some(WgmmaSync::Commit),
        Some("wait_group") => {
            arity(ops, 1)?;
            let Operand::Int(n) = ops[0] else {
                return malformed("wgmma.wait_group takes an immediate");
            };
            Some(WgmmaSync::Wait(u32::try_from(n).map_err(|_| {
                DecodeError::Malformed(format!("wait_group {n} out of range"))
            })?))
        }
        Some(_) => None,
        None => return unsupported("wgmma variant"),
    };
    if let Some(s) = sync {
        let m = Mods {
            list: std::mem::take(&mut m.list),
        };
        m.finish()?;
        if !matches!(s, WgmmaSync::Wait(_)) {
            arity(ops, 0)?;
        }
        return Ok(Op::WgmmaSync(s));
    }
    let shape = m
        .list
        .iter()
        .position(|x| x.starts_with('m') && x.contains('n') && x.contains('k'));
    let Some(i) = shape else {
        return malformed("wgmma.mma_async needs a shape");
    };
    let shape = m.list.remove(i);
    let n = shape
        .strip_prefix("m64n")
        .and_then(|r| r.strip_suffix("k16"))
        .and_then(|n| n.parse::<u32>().ok())
        .filter(|n| n % 8 == 0 && (8..=256).contains(n));
    let Some(n) = n else {
        return unsupported(format!(
            "wgmma shape `.{shape}` (only m64nNk16 is modelled)"
        ));
    };
    let input = match m.types().as_slice() {
        [Ty::F32, Ty::Bf16, Ty::Bf16] => WgmmaInput::Bf16,
        [Ty::F32, Ty::F16, Ty::F16] => WgmmaInput::F16,
        t => {
            return unsupported(format!(
                "wgmma types {t:?} (only .f32.bf16.bf16 and .f32.f16.f16)"
            ))
        }
    };
    let m = Mods {
        list: std::mem::take(&mut m.list),
    };
    m.finish()?;
    let d = match &ops.first() {
        Some(Operand::Vector(items)) => items
            .iter()
            .map(|x| ctx.reg(x))
            .collect::<Result<Vec<_>>>()?,
        _ => return malformed("wgmma.mma_async needs a vector accumulator"),
    };
    if d.len() != n as usize / 2 {
        return malformed(format!(
            "m64n{n}k16 needs {} accumulator registers, found {}",
            n / 2,
            d.len()
        ));
    }
    let b64 = Ty::B(64);
    let rs = matches!(ops.get(1), Some(Operand::Vector(_)));
    arity(ops, if rs { 7 } else { 8 })?;
    let a = if let Operand::Vector(items) = &ops[1] {
        if items.len() != 4 {
            return malformed("the A fragment of m64nNk16 is four .b32 registers");
        }
        let r = items
            .iter()
            .map(|x| ctx.src(x, Ty::B(32)))
            .collect::<Result<Vec<_>>>()?;
        WgmmaA::Regs([r[0], r[1], r[2], r[3]])
    } else {
        WgmmaA::Desc(ctx.src(&ops[1], b64)?)
    };
    let scale_a = imm_of(&ops[4], &[1, -1], "imm-scale-a")?;
    let scale_b = imm_of(&ops[5], &[1, -1], "imm-scale-b")?;
    let (trans_a, trans_b) = if rs {
        (false, imm_of(&ops[6], &[0, 1], "imm-trans-b")? == 1)
    } else {
        (
            imm_of(&ops[6], &[0, 1], "imm-trans-a")? == 1,
            imm_of(&ops[7], &[0, 1], "imm-trans-b")? == 1,
        )
    };
    Ok(Op::Wgmma(Box::new(Wgmma {
        n,
        input,
        d,
        a,
        b: ctx.src(&ops[2], b64)?,
        scale_d: ctx.pred_src(&ops[3])?,
        negate_a: scale_a == -1,
        negate_b: scale_b == -1,
        trans_a,
        trans_b,
    })))
}

/// `finish` on the modifiers left in `m`.
fn finish_rest(m: &mut Mods<'_>) -> Result<()> {
    Mods {
        list: std::mem::take(&mut m.list),
    }
    .finish()
}

fn decode_tcgen05(m: &mut Mods<'_>, ops: &[Operand], ctx: &Ctx<'_>) -> Result<Tcgen05> {
    let Some(kind) = m.take_any(&[
        "alloc",
        "dealloc",
        "relinquish_alloc_permit",
        "mma",
        "commit",
        "ld",
        "st",
        "wait::ld",
        "wait::st",
        "fence::before_thread_sync",
        "fence::after_thread_sync",
    ]) else {
        return unsupported("tcgen05 variant");
    };
    let sync_aligned = |m: &mut Mods<'_>, what: &str| -> Result<()> {
        if m.take("sync") && m.take("aligned") {
            Ok(())
        } else {
            malformed(format!("tcgen05.{what} is .sync.aligned"))
        }
    };
    let cta_group = |m: &mut Mods<'_>| -> Result<()> {
        if m.take("cta_group::1") {
            Ok(())
        } else {
            unsupported("tcgen05 without .cta_group::1 (only one-CTA groups are modelled)")
        }
    };
    let u32t = Ty::U(32);
    let op = match kind {
        "alloc" => {
            cta_group(m)?;
            sync_aligned(m, "alloc")?;
            if !m.take("shared::cta") {
                return unsupported("tcgen05.alloc destination other than .shared::cta");
            }
            if m.one_type()? != Ty::B(32) {
                return malformed("tcgen05.alloc is .b32");
            }
            finish_rest(m)?;
            arity(ops, 2)?;
            Tcgen05::Alloc {
                dst: ctx.addr(&ops[0])?,
                ncols: ctx.src(&ops[1], u32t)?,
            }
        }
        "dealloc" => {
            cta_group(m)?;
            sync_aligned(m, "dealloc")?;
            if m.one_type()? != Ty::B(32) {
                return malformed("tcgen05.dealloc is .b32");
            }
            finish_rest(m)?;
            arity(ops, 2)?;
            Tcgen05::Dealloc {
                taddr: ctx.src(&ops[0], u32t)?,
                ncols: ctx.src(&ops[1], u32t)?,
            }
        }
        "relinquish_alloc_permit" => {
            cta_group(m)?;
            sync_aligned(m, "relinquish_alloc_permit")?;
            finish_rest(m)?;
            arity(ops, 0)?;
            Tcgen05::Relinquish
        }
        "mma" => {
            cta_group(m)?;
            if !m.take("kind::f16") {
                return unsupported("tcgen05.mma kind other than .kind::f16");
            }
            finish_rest(m)?;
            if ops.len() != 5 {
                return unsupported(
                    "tcgen05.mma operand list (only [d], a, bdesc, idesc, enable_input_d)",
                );
            }
            let b64 = Ty::B(64);
            let a = match &ops[1] {
                Operand::Address(x) => Tc05A::Tmem(ctx.addr_of(x)?),
                o => Tc05A::Desc(ctx.src(o, b64)?),
            };
            Tcgen05::Mma {
                d: ctx.addr(&ops[0])?,
                a,
                b: ctx.src(&ops[2], b64)?,
                idesc: ctx.src(&ops[3], Ty::B(32))?,
                enable_d: ctx.pred_src(&ops[4])?,
            }
        }
        "commit" => {
            cta_group(m)?;
            if !m.take("mbarrier::arrive::one") {
                return unsupported("tcgen05.commit without .mbarrier::arrive::one");
            }
            m.take_any(&["shared::cluster", "shared::cta"]);
            if m.one_type()? != Ty::B(64) {
                return malformed("tcgen05.commit is .b64");
            }
            finish_rest(m)?;
            arity(ops, 1)?;
            Tcgen05::Commit {
                mbar: ctx.addr(&ops[0])?,
            }
        }
        "ld" | "st" => {
            sync_aligned(m, kind)?;
            if !m.take("32x32b") {
                return unsupported(format!("tcgen05.{kind} shape (only .32x32b is modelled)"));
            }
            let Some(i) = m.list.iter().position(|x| {
                x.strip_prefix('x')
                    .and_then(|n| n.parse::<u32>().ok())
                    .is_some()
            }) else {
                return malformed(format!("tcgen05.{kind} needs .xN"));
            };
            let n: usize = m.list.remove(i)[1..].parse().expect("checked");
            if !n.is_power_of_two() || n > 128 {
                return malformed(format!(
                    "tcgen05.{kind}.x{n}: N must be a power of two <= 128"
                ));
            }
            if m.one_type()? != Ty::B(32) {
                return malformed(format!("tcgen05.{kind} is .b32"));
            }
            finish_rest(m)?;
            arity(ops, 2)?;
            if kind == "ld" {
                Tcgen05::Ld {
                    dst: ctx.dsts(&ops[0], n)?,
                    taddr: ctx.addr(&ops[1])?,
                }
            } else {
                Tcgen05::St {
                    taddr: ctx.addr(&ops[0])?,
                    src: ctx.srcs(&ops[1], n, Ty::B(32))?,
                }
            }
        }
        "wait::ld" | "wait::st" => {
            sync_aligned(m, kind)?;
            finish_rest(m)?;
            arity(ops, 0)?;
            if kind == "wait::ld" {
                Tcgen05::WaitLd
            } else {
                Tcgen05::WaitSt
            }
        }
        _ => {
            finish_rest(m)?;
            arity(ops, 0)?;
            Tcgen05::Fence {
                before: kind == "fence::before_thread_sync",
            }
        }
    };
    Ok(op)
}
