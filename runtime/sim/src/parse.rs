//! PTX text to a syntax tree: tokens, module header, entries, declarations and statements.
//!
//! This layer knows PTX *syntax* only; [`crate::decode`] gives instructions their meaning.

use crate::error::ParseError;

/// A token kind.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum TokKind {
    /// Identifiers, opcodes (`ld.global.v4.b32`, `shared::cta`), registers (`%r1`, `%tid.x`),
    /// directives (`.reg`) and labels (`$L_0_x`).
    Ident(String),
    /// An integer literal (its magnitude; a leading `-` is a separate token).
    Int(u64),
    /// `0fXXXXXXXX`
    F32(u32),
    /// `0dXXXXXXXXXXXXXXXX` or a decimal floating literal.
    F64(u64),
    /// A string literal (only in `.pragma`, `.file`).
    Str,
    /// Punctuation.
    Punct(char),
}

#[derive(Debug, Clone)]
pub(crate) struct Tok {
    pub kind: TokKind,
    pub line: usize,
    pub start: usize,
    pub end: usize,
}

fn syntax(line: usize, message: impl Into<String>) -> ParseError {
    ParseError::Syntax {
        line,
        message: message.into(),
    }
}

fn is_ident_start(c: u8) -> bool {
    c.is_ascii_alphabetic() || matches!(c, b'_' | b'$' | b'%' | b'.')
}

fn is_ident_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, b'_' | b'$' | b'.')
}

pub(crate) fn lex(src: &str) -> Result<Vec<Tok>, ParseError> {
    let b = src.as_bytes();
    let mut toks = Vec::new();
    let mut i = 0;
    let mut line = 1;
    while i < b.len() {
        let c = b[i];
        if c == b'\n' {
            line += 1;
            i += 1;
            continue;
        }
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                if b[i] == b'\n' {
                    line += 1;
                }
                i += 1;
            }
            if i >= b.len() {
                return Err(syntax(line, "unterminated block comment"));
            }
            i += 2;
            continue;
        }
        let start = i;
        let kind = if is_ident_start(c) {
            i += 1;
            while i < b.len() {
                if is_ident_char(b[i]) {
                    i += 1;
                } else if b[i] == b':' && b.get(i + 1) == Some(&b':') {
                    i += 2;
                } else {
                    break;
                }
            }
            TokKind::Ident(src[start..i].to_string())
        } else if c.is_ascii_digit() {
            lex_number(src, &mut i, line)?
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\n' {
                    return Err(syntax(line, "unterminated string"));
                }
                i += 1;
            }
            i += 1;
            TokKind::Str
        } else if b",;:{}[]()<>+-!@|=".contains(&c) {
            i += 1;
            TokKind::Punct(c as char)
        } else {
            return Err(syntax(
                line,
                format!("unexpected character `{}`", c as char),
            ));
        };
        toks.push(Tok {
            kind,
            line,
            start,
            end: i,
        });
    }
    Ok(toks)
}

fn lex_number(src: &str, i: &mut usize, line: usize) -> Result<TokKind, ParseError> {
    let b = src.as_bytes();
    let start = *i;
    let radix_digits = |i: &mut usize, radix: u32| {
        let s = *i;
        while *i < b.len() && (b[*i] as char).is_digit(radix) {
            *i += 1;
        }
        &src[s..*i]
    };
    let bad = |what: &str| {
        syntax(
            line,
            format!("malformed {what} literal `{}`", &src[start..]),
        )
    };
    let kind = if b[*i] == b'0' && matches!(b.get(*i + 1), Some(b'f' | b'F')) {
        *i += 2;
        let digits = radix_digits(i, 16);
        if digits.len() != 8 {
            return Err(bad("f32"));
        }
        TokKind::F32(u32::from_str_radix(digits, 16).map_err(|_| bad("f32"))?)
    } else if b[*i] == b'0' && matches!(b.get(*i + 1), Some(b'd' | b'D')) {
        *i += 2;
        let digits = radix_digits(i, 16);
        if digits.len() != 16 {
            return Err(bad("f64"));
        }
        TokKind::F64(u64::from_str_radix(digits, 16).map_err(|_| bad("f64"))?)
    } else if b[*i] == b'0' && matches!(b.get(*i + 1), Some(b'x' | b'X')) {
        *i += 2;
        let digits = radix_digits(i, 16);
        TokKind::Int(u64::from_str_radix(digits, 16).map_err(|_| bad("hex"))?)
    } else if b[*i] == b'0' && matches!(b.get(*i + 1), Some(b'b' | b'B')) {
        *i += 2;
        let digits = radix_digits(i, 2);
        TokKind::Int(u64::from_str_radix(digits, 2).map_err(|_| bad("binary"))?)
    } else {
        let digits = radix_digits(i, 10);
        let is_float = *i < b.len()
            && (b[*i] == b'.' && b.get(*i + 1).is_some_and(|c| c.is_ascii_digit())
                || matches!(b[*i], b'e' | b'E'));
        if is_float {
            if b[*i] == b'.' {
                *i += 1;
                radix_digits(i, 10);
            }
            if *i < b.len() && matches!(b[*i], b'e' | b'E') {
                *i += 1;
                if *i < b.len() && matches!(b[*i], b'+' | b'-') {
                    *i += 1;
                }
                radix_digits(i, 10);
            }
            let v: f64 = src[start..*i].parse().map_err(|_| bad("floating"))?;
            TokKind::F64(v.to_bits())
        } else if digits.len() > 1 && digits.starts_with('0') {
            TokKind::Int(u64::from_str_radix(&digits[1..], 8).map_err(|_| bad("octal"))?)
        } else {
            TokKind::Int(digits.parse().map_err(|_| bad("decimal"))?)
        }
    };
    if *i < b.len() && b[*i] == b'U' {
        *i += 1;
    }
    if *i < b.len() && is_ident_char(b[*i]) {
        return Err(bad("numeric"));
    }
    Ok(kind)
}

/// An operand as written.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Operand {
    /// A register, special register, symbol, label or `_`.
    Name(String),
    /// `!%p`
    Not(String),
    /// `%r|%p`
    Pair(String, String),
    /// An integer literal (with its sign).
    Int(i128),
    /// `0fXXXXXXXX`
    F32(u32),
    /// `0d...` or decimal floating.
    F64(u64),
    /// `{a, b, ...}`
    Vector(Vec<Operand>),
    /// `[base+offset]`
    Address(AddrAst),
    /// `[map, {c0, c1, ...}]`
    Tensor(AddrAst, Vec<Operand>),
}

/// The base of an address as written.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum AddrBaseAst {
    Name(String),
    Abs(u64),
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AddrAst {
    pub base: AddrBaseAst,
    pub offset: i64,
}

/// One instruction statement.
#[derive(Debug, Clone)]
pub(crate) struct InstAst {
    pub line: usize,
    pub text: String,
    pub guard: Option<(String, bool)>,
    pub opcode: String,
    pub operands: Vec<Operand>,
}

#[derive(Debug, Clone)]
pub(crate) enum Stmt {
    Label(String, usize),
    Inst(InstAst),
}

/// `.param` declaration.
#[derive(Debug, Clone)]
pub(crate) struct ParamAst {
    pub name: String,
    pub ty: String,
    pub align: Option<u32>,
    pub ptr: bool,
    pub array: Option<u32>,
}

/// `.shared` declaration.
#[derive(Debug, Clone)]
pub(crate) struct SharedAst {
    pub name: String,
    pub align: u32,
    pub elem_bytes: u32,
    /// `None` for `name[]` (extern).
    pub count: Option<u32>,
    pub line: usize,
}

/// `.reg .type %name<N>` or `.reg .type %a, %b`.
#[derive(Debug, Clone)]
pub(crate) struct RegAst {
    pub ty: String,
    pub names: Vec<String>,
}

#[derive(Debug, Clone)]
pub(crate) struct EntryAst {
    pub name: String,
    pub line: usize,
    pub params: Vec<ParamAst>,
    pub maxntid: Option<[u32; 3]>,
    pub reqntid: Option<[u32; 3]>,
    pub minnctapersm: Option<u32>,
    pub maxnreg: Option<u32>,
    pub regs: Vec<RegAst>,
    pub shared: Vec<SharedAst>,
    pub body: Vec<Stmt>,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct ModuleAst {
    pub version: String,
    pub target: String,
    pub address_size: u32,
    pub shared: Vec<SharedAst>,
    pub extern_shared: Vec<SharedAst>,
    pub entries: Vec<EntryAst>,
}

struct Parser<'a> {
    src: &'a str,
    toks: Vec<Tok>,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<&TokKind> {
        self.toks.get(self.pos).map(|t| &t.kind)
    }

    fn peek_at(&self, k: usize) -> Option<&TokKind> {
        self.toks.get(self.pos + k).map(|t| &t.kind)
    }

    fn line(&self) -> usize {
        self.toks
            .get(self.pos)
            .or(self.toks.last())
            .map_or(1, |t| t.line)
    }

    fn next(&mut self) -> Result<Tok, ParseError> {
        let t = self
            .toks
            .get(self.pos)
            .cloned()
            .ok_or_else(|| syntax(self.line(), "unexpected end of input"))?;
        self.pos += 1;
        Ok(t)
    }

    fn text_of(&self, t: &Tok) -> &'a str {
        &self.src[t.start..t.end]
    }

    fn is_punct(&self, c: char) -> bool {
        self.peek() == Some(&TokKind::Punct(c))
    }

    fn eat_punct(&mut self, c: char) -> bool {
        if self.is_punct(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect_punct(&mut self, c: char) -> Result<(), ParseError> {
        let line = self.line();
        let t = self.next()?;
        if t.kind == TokKind::Punct(c) {
            Ok(())
        } else {
            Err(syntax(
                line,
                format!("expected `{c}`, found `{}`", self.text_of(&t)),
            ))
        }
    }

    fn ident(&mut self) -> Result<String, ParseError> {
        let line = self.line();
        let t = self.next()?;
        match t.kind {
            TokKind::Ident(s) => Ok(s),
            _ => Err(syntax(
                line,
                format!("expected a name, found `{}`", self.text_of(&t)),
            )),
        }
    }

    fn peek_ident(&self) -> Option<&str> {
        match self.peek() {
            Some(TokKind::Ident(s)) => Some(s),
            _ => None,
        }
    }

    fn uint(&mut self) -> Result<u64, ParseError> {
        let line = self.line();
        let t = self.next()?;
        match t.kind {
            TokKind::Int(v) => Ok(v),
            _ => Err(syntax(
                line,
                format!("expected an integer, found `{}`", self.text_of(&t)),
            )),
        }
    }

    fn u32(&mut self) -> Result<u32, ParseError> {
        let line = self.line();
        let v = self.uint()?;
        u32::try_from(v).map_err(|_| syntax(line, format!("{v} does not fit in 32 bits")))
    }

    /// Skips to the end of the current statement (`;`), inclusive.
    fn skip_statement(&mut self) -> Result<(), ParseError> {
        loop {
            let t = self.next()?;
            if t.kind == TokKind::Punct(';') {
                return Ok(());
            }
        }
    }

    fn module(&mut self) -> Result<ModuleAst, ParseError> {
        let mut m = ModuleAst::default();
        while self.pos < self.toks.len() {
            let line = self.line();
            let d = self.ident()?;
            match d.as_str() {
                ".version" => {
                    let t = self.next()?;
                    m.version = self.text_of(&t).to_string();
                }
                ".target" => {
                    let mut targets = vec![self.ident()?];
                    while self.eat_punct(',') {
                        targets.push(self.ident()?);
                    }
                    m.target = targets.join(", ");
                }
                ".address_size" => {
                    m.address_size = self.u32()?;
                    if m.address_size != 64 {
                        return Err(syntax(line, "only `.address_size 64` is supported"));
                    }
                }
                ".extern" => {
                    let space = self.ident()?;
                    if space != ".shared" {
                        return Err(ParseError::UnsupportedDirective {
                            line,
                            directive: format!(".extern {space}"),
                        });
                    }
                    let decl = self.shared_decl(line)?;
                    m.extern_shared.push(decl);
                }
                ".shared" => {
                    let decl = self.shared_decl(line)?;
                    if decl.count.is_none() {
                        return Err(syntax(line, "unsized `.shared` array without `.extern`"));
                    }
                    m.shared.push(decl);
                }
                ".visible" | ".weak" => {
                    let kind = self.ident()?;
                    self.entry_or_func(&kind, line, &mut m)?;
                }
                ".entry" | ".func" => self.entry_or_func(&d, line, &mut m)?,
                ".file" | ".section" | ".loc" => {
                    return Err(ParseError::UnsupportedDirective { line, directive: d })
                }
                _ => return Err(ParseError::UnsupportedDirective { line, directive: d }),
            }
        }
        Ok(m)
    }

    fn entry_or_func(
        &mut self,
        kind: &str,
        line: usize,
        m: &mut ModuleAst,
    ) -> Result<(), ParseError> {
        if kind != ".entry" {
            return Err(ParseError::UnsupportedDirective {
                line,
                directive: kind.to_string(),
            });
        }
        let entry = self.entry(line)?;
        m.entries.push(entry);
        Ok(())
    }

    /// After `.shared` (or `.extern .shared`): `[.align A] .type name[N];`
    fn shared_decl(&mut self, line: usize) -> Result<SharedAst, ParseError> {
        let mut align = None;
        let mut elem_bytes = None;
        while let Some(q) = self.peek_ident().map(str::to_string) {
            if !q.starts_with('.') {
                break;
            }
            self.pos += 1;
            if q == ".align" {
                align = Some(self.u32()?);
            } else if let Some(ty) = crate::ir::Ty::from_suffix(&q[1..]) {
                elem_bytes = Some(ty.bytes());
            } else {
                return Err(syntax(line, format!("unexpected `{q}` in `.shared`")));
            }
        }
        let name = self.ident()?;
        let elem_bytes = elem_bytes.ok_or_else(|| syntax(line, "`.shared` without a type"))?;
        let count = if self.eat_punct('[') {
            if self.eat_punct(']') {
                None
            } else {
                let n = self.u32()?;
                self.expect_punct(']')?;
                Some(n)
            }
        } else {
            Some(1)
        };
        self.expect_punct(';')?;
        Ok(SharedAst {
            name,
            align: align.unwrap_or(elem_bytes),
            elem_bytes,
            count,
            line,
        })
    }

    fn dims(&mut self) -> Result<[u32; 3], ParseError> {
        let mut d = [1u32; 3];
        d[0] = self.u32()?;
        for slot in d.iter_mut().skip(1) {
            if !self.eat_punct(',') {
                break;
            }
            *slot = self.u32()?;
        }
        Ok(d)
    }

    fn entry(&mut self, line: usize) -> Result<EntryAst, ParseError> {
        let name = self.ident()?;
        let mut e = EntryAst {
            name,
            line,
            params: Vec::new(),
            maxntid: None,
            reqntid: None,
            minnctapersm: None,
            maxnreg: None,
            regs: Vec::new(),
            shared: Vec::new(),
            body: Vec::new(),
        };
        if self.eat_punct('(') && !self.eat_punct(')') {
            loop {
                e.params.push(self.param()?);
                if self.eat_punct(')') {
                    break;
                }
                self.expect_punct(',')?;
            }
        }
        // Performance directives.
        while !self.is_punct('{') {
            let line = self.line();
            let d = self.ident()?;
            match d.as_str() {
                ".maxntid" => e.maxntid = Some(self.dims()?),
                ".reqntid" => e.reqntid = Some(self.dims()?),
                ".minnctapersm" => e.minnctapersm = Some(self.u32()?),
                ".maxnreg" => e.maxnreg = Some(self.u32()?),
                ".maxnctapersm" => {
                    self.u32()?;
                }
                ".noreturn" => {}
                _ => return Err(ParseError::UnsupportedDirective { line, directive: d }),
            }
        }
        self.expect_punct('{')?;
        self.body(&mut e)?;
        Ok(e)
    }

    fn param(&mut self) -> Result<ParamAst, ParseError> {
        let line = self.line();
        let p = self.ident()?;
        if p != ".param" {
            return Err(syntax(line, format!("expected `.param`, found `{p}`")));
        }
        let mut ty = None;
        let mut align = None;
        let mut ptr = false;
        while let Some(q) = self.peek_ident().map(str::to_string) {
            if !q.starts_with('.') {
                break;
            }
            self.pos += 1;
            match q.as_str() {
                ".align" => align = Some(self.u32()?),
                ".ptr" => ptr = true,
                ".global" | ".shared" | ".const" | ".local" => {}
                _ if crate::ir::Ty::from_suffix(&q[1..]).is_some() => ty = Some(q[1..].to_string()),
                _ => return Err(syntax(line, format!("unexpected `{q}` in `.param`"))),
            }
        }
        let name = self.ident()?;
        let array = if self.eat_punct('[') {
            let n = self.u32()?;
            self.expect_punct(']')?;
            Some(n)
        } else {
            None
        };
        Ok(ParamAst {
            name,
            ty: ty.ok_or_else(|| syntax(line, "`.param` without a type"))?,
            align,
            ptr,
            array,
        })
    }

    fn body(&mut self, e: &mut EntryAst) -> Result<(), ParseError> {
        loop {
            let line = self.line();
            if self.eat_punct('}') {
                return Ok(());
            }
            if self.is_punct('{') {
                return Err(ParseError::UnsupportedDirective {
                    line,
                    directive: "nested `{ }` scope".to_string(),
                });
            }
            if self.is_punct('@') {
                let inst = self.instruction()?;
                e.body.push(Stmt::Inst(inst));
                continue;
            }
            let name = self
                .peek_ident()
                .ok_or_else(|| syntax(line, "expected a statement"))?
                .to_string();
            if self.peek_at(1) == Some(&TokKind::Punct(':')) {
                self.pos += 2;
                e.body.push(Stmt::Label(name, line));
                continue;
            }
            match name.as_str() {
                ".reg" => {
                    self.pos += 1;
                    e.regs.push(self.reg_decl()?);
                }
                ".shared" => {
                    self.pos += 1;
                    let decl = self.shared_decl(line)?;
                    if decl.count.is_none() {
                        return Err(syntax(line, "unsized `.shared` array inside an entry"));
                    }
                    e.shared.push(decl);
                }
                ".pragma" => {
                    self.pos += 1;
                    self.skip_statement()?;
                }
                _ if name.starts_with('.') => {
                    return Err(ParseError::UnsupportedDirective {
                        line,
                        directive: name,
                    })
                }
                _ => {
                    let inst = self.instruction()?;
                    e.body.push(Stmt::Inst(inst));
                }
            }
        }
    }

    fn reg_decl(&mut self) -> Result<RegAst, ParseError> {
        let line = self.line();
        let ty = self.ident()?;
        if !ty.starts_with('.') || crate::ir::Ty::from_suffix(&ty[1..]).is_none() {
            return Err(syntax(line, format!("bad register type `{ty}`")));
        }
        let mut names = Vec::new();
        loop {
            let base = self.ident()?;
            if self.eat_punct('<') {
                let n = self.u32()?;
                self.expect_punct('>')?;
                names.extend((0..n).map(|i| format!("{base}{i}")));
            } else {
                names.push(base);
            }
            if self.eat_punct(';') {
                break;
            }
            self.expect_punct(',')?;
        }
        Ok(RegAst {
            ty: ty[1..].to_string(),
            names,
        })
    }

    fn instruction(&mut self) -> Result<InstAst, ParseError> {
        let first = self.pos;
        let line = self.line();
        let guard = if self.eat_punct('@') {
            let neg = self.eat_punct('!');
            Some((self.ident()?, neg))
        } else {
            None
        };
        let opcode = self.ident()?;
        let mut operands = Vec::new();
        if !self.eat_punct(';') {
            loop {
                operands.push(self.operand()?);
                if self.eat_punct(';') {
                    break;
                }
                self.expect_punct(',')?;
            }
        }
        let start = self.toks[first].start;
        let end = self.toks[self.pos - 1].end;
        let text = self.src[start..end]
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        Ok(InstAst {
            line,
            text,
            guard,
            opcode,
            operands,
        })
    }

    fn signed_int(&mut self) -> Result<i128, ParseError> {
        let neg = self.eat_punct('-');
        let v = self.uint()? as i128;
        Ok(if neg { -v } else { v })
    }

    fn address(&mut self) -> Result<Operand, ParseError> {
        let line = self.line();
        let base = match self.peek() {
            Some(TokKind::Ident(_)) => AddrBaseAst::Name(self.ident()?),
            Some(TokKind::Int(_)) => AddrBaseAst::Abs(self.uint()?),
            _ => return Err(syntax(line, "expected an address")),
        };
        if self.eat_punct(',') {
            self.expect_punct('{')?;
            let mut coords = Vec::new();
            loop {
                coords.push(self.operand()?);
                if self.eat_punct('}') {
                    break;
                }
                self.expect_punct(',')?;
            }
            self.expect_punct(']')?;
            return Ok(Operand::Tensor(AddrAst { base, offset: 0 }, coords));
        }
        let mut offset: i128 = 0;
        // `[a+4]`, `[a+-4]` and `[a-4]`.
        if self.eat_punct('+') || self.is_punct('-') {
            offset = self.signed_int()?;
        }
        self.expect_punct(']')?;
        let offset = i64::try_from(offset)
            .map_err(|_| syntax(line, format!("address offset {offset} out of range")))?;
        Ok(Operand::Address(AddrAst { base, offset }))
    }

    fn operand(&mut self) -> Result<Operand, ParseError> {
        let line = self.line();
        if self.eat_punct('[') {
            return self.address();
        }
        if self.eat_punct('{') {
            let mut items = Vec::new();
            loop {
                items.push(self.operand()?);
                if self.eat_punct('}') {
                    break;
                }
                self.expect_punct(',')?;
            }
            return Ok(Operand::Vector(items));
        }
        if self.eat_punct('!') {
            return Ok(Operand::Not(self.ident()?));
        }
        let neg = self.eat_punct('-');
        let t = self.next()?;
        let op = match t.kind {
            TokKind::Int(v) => Operand::Int(if neg { -(v as i128) } else { v as i128 }),
            TokKind::F32(bits) => Operand::F32(if neg { bits ^ 0x8000_0000 } else { bits }),
            TokKind::F64(bits) => Operand::F64(if neg { bits ^ (1 << 63) } else { bits }),
            TokKind::Ident(name) if !neg => {
                if self.eat_punct('|') {
                    Operand::Pair(name, self.ident()?)
                } else {
                    Operand::Name(name)
                }
            }
            _ => {
                return Err(syntax(
                    line,
                    format!("unexpected `{}` in an operand", self.text_of(&t)),
                ))
            }
        };
        Ok(op)
    }
}

/// Parses a whole module's syntax.
pub(crate) fn parse_module(src: &str) -> Result<ModuleAst, ParseError> {
    let toks = lex(src)?;
    let mut p = Parser { src, toks, pos: 0 };
    p.module()
}
