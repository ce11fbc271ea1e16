//! A parsed and decoded PTX module: its kernels, their parameters, shared memory and code.

use std::collections::HashMap;

use crate::decode::{decode, Ctx, DecodeError, Symbol};
use crate::error::ParseError;
use crate::ir::{Guard, Inst, Op, Reg, SourceLoc, Ty, PARAM_WINDOW};
use crate::parse::{parse_module, EntryAst, ModuleAst, SharedAst, Stmt};

/// A kernel parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    /// Its name.
    pub name: String,
    /// Element type (`.u64`, `.u32`, `.b8` ...).
    pub ty: Ty,
    /// `.ptr` (a pointer; `.align` then describes the pointee).
    pub ptr: bool,
    /// `name[N]`: an array of `N` elements (e.g. a 128-byte tensor map).
    pub array: Option<u32>,
    /// Byte offset in the parameter buffer.
    pub offset: u32,
    /// Size in bytes.
    pub size: u32,
    /// Alignment in the parameter buffer.
    pub align: u32,
}

/// One `.entry` of a module, decoded and ready to launch.
#[derive(Debug, Clone)]
pub struct Kernel {
    pub(crate) name: String,
    pub(crate) params: Vec<Param>,
    pub(crate) param_bytes: u32,
    pub(crate) maxntid: Option<[u32; 3]>,
    pub(crate) reqntid: Option<[u32; 3]>,
    pub(crate) minnctapersm: Option<u32>,
    pub(crate) maxnreg: Option<u32>,
    pub(crate) static_shared: u32,
    pub(crate) dynamic_base: Option<u32>,
    pub(crate) code: Vec<Inst>,
    pub(crate) source: Vec<SourceLoc>,
    pub(crate) reg_names: Vec<String>,
    pub(crate) unsupported: Option<ParseError>,
    /// Per instruction: the registers it touches (for the wgmma register hazards).
    pub(crate) inst_regs: Vec<Box<[Reg]>>,
    /// Whether any instruction is a `wgmma` (turns on register-hazard tracking).
    pub(crate) uses_wgmma: bool,
    /// Whether any instruction is a `tcgen05` one.
    pub(crate) uses_tcgen05: bool,
    /// Whether any instruction reads shared memory through the async proxy (turns on the
    /// tracking of generic shared stores not yet ordered by `fence.proxy.async`).
    pub(crate) uses_async_proxy: bool,
}

impl Kernel {
    /// The entry name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Parameters in declaration order.
    pub fn params(&self) -> &[Param] {
        &self.params
    }

    /// `.maxntid`, if declared.
    pub fn maxntid(&self) -> Option<[u32; 3]> {
        self.maxntid
    }

    /// `.reqntid`, if declared.
    pub fn reqntid(&self) -> Option<[u32; 3]> {
        self.reqntid
    }

    /// `.minnctapersm`, if declared.
    pub fn minnctapersm(&self) -> Option<u32> {
        self.minnctapersm
    }

    /// `.maxnreg`, if declared.
    pub fn maxnreg(&self) -> Option<u32> {
        self.maxnreg
    }

    /// Bytes of static `.shared` memory.
    pub fn static_shared_bytes(&self) -> u32 {
        self.static_shared
    }

    /// Shared-space offset where dynamic shared memory (`.extern .shared`) starts, if the
    /// kernel declares any.
    pub fn dynamic_shared_base(&self) -> Option<u32> {
        self.dynamic_base
    }

    /// Number of decoded instructions.
    pub fn instruction_count(&self) -> usize {
        self.code.len()
    }

    /// Registers per thread (all types, predicates included).
    pub fn register_count(&self) -> usize {
        self.reg_names.len()
    }

    /// The decoded instructions (index = the simulator's PC).
    pub fn instructions(&self) -> &[Inst] {
        &self.code
    }

    /// Source line and text of instruction `pc`.
    pub fn source(&self, pc: usize) -> Option<&SourceLoc> {
        self.source.get(pc)
    }
}

/// A parsed PTX module.
#[derive(Debug, Clone)]
pub struct Module {
    version: String,
    target: String,
    kernels: Vec<Kernel>,
}

/// One instruction's opcode and whether the simulator models it (see [`crate::coverage`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpcodeUse {
    /// Kernel name.
    pub kernel: String,
    /// The opcode with all modifiers, as written.
    pub opcode: String,
    /// 1-based line.
    pub line: usize,
    /// `None` when supported, else why not.
    pub unsupported: Option<String>,
}

impl Module {
    /// Parses and decodes PTX text. Fails on the first malformed or unsupported statement
    /// (e.g. ``unsupported instruction `wgmma...` at line N``).
    pub fn parse(text: &str) -> Result<Module, ParseError> {
        let (module, _) = compile(text)?;
        for k in &module.kernels {
            if let Some(e) = &k.unsupported {
                return Err(e.clone());
            }
        }
        Ok(module)
    }

    /// Parses and decodes PTX text, keeping kernels that use unsupported instructions: they
    /// are listed by [`Module::kernels`] but refuse to launch with the first such instruction.
    pub fn parse_lenient(text: &str) -> Result<Module, ParseError> {
        Ok(compile(text)?.0)
    }

    /// `.version`
    pub fn version(&self) -> &str {
        &self.version
    }

    /// `.target`
    pub fn target(&self) -> &str {
        &self.target
    }

    /// Every entry, in file order.
    pub fn kernels(&self) -> &[Kernel] {
        &self.kernels
    }

    /// The entry called `name`.
    pub fn kernel(&self, name: &str) -> Option<&Kernel> {
        self.kernels.iter().find(|k| k.name == name)
    }
}

/// Parses and decodes leniently, also returning every instruction's opcode use.
pub(crate) fn compile(text: &str) -> Result<(Module, Vec<OpcodeUse>), ParseError> {
    let ast = parse_module(text)?;
    let mut uses = Vec::new();
    let mut kernels = Vec::new();
    for e in &ast.entries {
        kernels.push(build_kernel(&ast, e, &mut uses)?);
    }
    Ok((
        Module {
            version: ast.version.clone(),
            target: ast.target.clone(),
            kernels,
        },
        uses,
    ))
}

fn align_up(v: u32, a: u32) -> u32 {
    v.div_ceil(a.max(1)) * a.max(1)
}

fn layout_shared(
    decls: &[&SharedAst],
    at: &mut u32,
    symbols: &mut HashMap<String, Symbol>,
) -> Result<(), ParseError> {
    for d in decls {
        *at = align_up(*at, d.align);
        let size = d.elem_bytes as u64 * d.count.unwrap_or(0) as u64;
        symbols.insert(d.name.clone(), Symbol::Shared(*at));
        *at = u32::try_from(*at as u64 + size).map_err(|_| ParseError::Syntax {
            line: d.line,
            message: "shared memory past 4 GiB".to_string(),
        })?;
    }
    Ok(())
}

fn build_kernel(
    m: &ModuleAst,
    e: &EntryAst,
    uses: &mut Vec<OpcodeUse>,
) -> Result<Kernel, ParseError> {
    // Registers.
    let mut regs: HashMap<String, (Reg, Ty)> = HashMap::new();
    let mut reg_names = Vec::new();
    for decl in &e.regs {
        let ty = Ty::from_suffix(&decl.ty).unwrap_or(Ty::B(32));
        for n in &decl.names {
            let slot = reg_names.len() as Reg;
            if regs.insert(n.clone(), (slot, ty)).is_some() {
                return Err(ParseError::Syntax {
                    line: e.line,
                    message: format!("register `{n}` declared twice in `{}`", e.name),
                });
            }
            reg_names.push(n.clone());
        }
    }

    // Parameters.
    let mut symbols: HashMap<String, Symbol> = HashMap::new();
    let mut params = Vec::new();
    let mut at = 0u32;
    for p in &e.params {
        let ty = Ty::from_suffix(&p.ty).unwrap_or(Ty::B(8));
        let elem = ty.bytes();
        let size = elem * p.array.unwrap_or(1);
        // `.ptr .align N` is the pointee's alignment; the parameter itself is naturally aligned.
        let align = if p.ptr { elem } else { p.align.unwrap_or(elem) };
        at = align_up(at, align);
        symbols.insert(p.name.clone(), Symbol::Param(PARAM_WINDOW + at as u64));
        params.push(Param {
            name: p.name.clone(),
            ty,
            ptr: p.ptr,
            array: p.array,
            offset: at,
            size,
            align,
        });
        at += size;
    }
    let param_bytes = at;

    // Shared memory: module statics, entry statics, then the dynamic window.
    let mut shared_at = 0u32;
    let statics: Vec<&SharedAst> = m.shared.iter().chain(e.shared.iter()).collect();
    layout_shared(&statics, &mut shared_at, &mut symbols)?;
    let static_shared = shared_at;
    let dynamic_base = if m.extern_shared.is_empty() {
        None
    } else {
        let align = m.extern_shared.iter().map(|d| d.align).max().unwrap_or(16);
        let base = align_up(static_shared, align);
        for d in &m.extern_shared {
            symbols.insert(d.name.clone(), Symbol::Shared(base));
        }
        Some(base)
    };

    // Labels.
    let mut labels: HashMap<String, u32> = HashMap::new();
    let mut n = 0u32;
    for s in &e.body {
        match s {
            Stmt::Label(l, line) => {
                if labels.insert(l.clone(), n).is_some() {
                    return Err(ParseError::Syntax {
                        line: *line,
                        message: format!("label `{l}` defined twice"),
                    });
                }
            }
            Stmt::Inst(_) => n += 1,
        }
    }

    let ctx = Ctx {
        regs: &regs,
        symbols: &symbols,
        labels: &labels,
    };
    let mut code = Vec::new();
    let mut source = Vec::new();
    let mut unsupported = None;
    for s in &e.body {
        let Stmt::Inst(inst) = s else { continue };
        let guard = match &inst.guard {
            None => None,
            Some((g, negate)) => match regs.get(g) {
                Some(&(reg, Ty::Pred)) => Some(Guard {
                    reg,
                    negate: *negate,
                }),
                _ => {
                    return Err(ParseError::Syntax {
                        line: inst.line,
                        message: format!("guard `{g}` is not a predicate register"),
                    })
                }
            },
        };
        let op = match decode(inst, &ctx) {
            Ok(op) => {
                uses.push(OpcodeUse {
                    kernel: e.name.clone(),
                    opcode: inst.opcode.clone(),
                    line: inst.line,
                    unsupported: None,
                });
                op
            }
            Err(DecodeError::Unsupported(reason)) => {
                uses.push(OpcodeUse {
                    kernel: e.name.clone(),
                    opcode: inst.opcode.clone(),
                    line: inst.line,
                    unsupported: Some(reason.clone()),
                });
                unsupported.get_or_insert(ParseError::Unsupported {
                    opcode: inst.opcode.clone(),
                    line: inst.line,
                    text: inst.text.clone(),
                    reason,
                });
                // Never executed: the kernel refuses to launch.
                Op::Exit
            }
            Err(DecodeError::Malformed(message)) => {
                return Err(ParseError::Syntax {
                    line: inst.line,
                    message: format!("`{}`: {message}", inst.text),
                })
            }
        };
        code.push(Inst { guard, op });
        source.push(SourceLoc {
            line: inst.line,
            text: inst.text.clone(),
        });
    }
    // Falling off the end of the body exits.
    code.push(Inst {
        guard: None,
        op: Op::Exit,
    });
    source.push(SourceLoc {
        line: e
            .body
            .iter()
            .rev()
            .map(|s| match s {
                Stmt::Inst(i) => i.line,
                Stmt::Label(_, l) => *l,
            })
            .next()
            .unwrap_or(e.line),
        text: "(end of kernel body)".to_string(),
    });

    let inst_regs = code
        .iter()
        .map(|i| {
            let mut v = Vec::new();
            if let Some(g) = i.guard {
                v.push(g.reg);
            }
            i.op.registers(&mut v);
            v.sort_unstable();
            v.dedup();
            v.into_boxed_slice()
        })
        .collect();
    let uses_wgmma = code
        .iter()
        .any(|i| matches!(i.op, Op::Wgmma(_) | Op::WgmmaSync(_)));
    let uses_tcgen05 = code.iter().any(|i| matches!(i.op, Op::Tcgen05(_)));
    let uses_async_proxy = uses_wgmma || uses_tcgen05;

    Ok(Kernel {
        inst_regs,
        uses_wgmma,
        uses_tcgen05,
        uses_async_proxy,
        name: e.name.clone(),
        params,
        param_bytes,
        maxntid: e.maxntid,
        reqntid: e.reqntid,
        minnctapersm: e.minnctapersm,
        maxnreg: e.maxnreg,
        static_shared,
        dynamic_base,
        code,
        source,
        reg_names,
        unsupported,
    })
}
