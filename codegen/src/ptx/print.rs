//! Printing a [`Kernel`] as PTX text.
//!
//! The fixed boilerplate (header, entry signature, parameter list, register and shared
//! declarations) comes from the Tera template `templates/module.ptx.tera`; the instruction
//! stream is printed here, one statement per line. The body is handed to the template as a
//! value, so PTX's `{%r1, %r2}` vector operands never meet Tera's `{%` block syntax.

use super::ir::{Kernel, Stmt};
use crate::error::CodegenError;
use std::fmt::Write;

const MODULE_TEMPLATE: &str = include_str!("../../../templates/module.ptx.tera");

/// Prints the instruction stream.
pub fn body(kernel: &Kernel) -> String {
    let mut out = String::new();
    for s in &kernel.body {
        // Writing to a String cannot fail.
        let _ = match s {
            Stmt::Inst(i) => writeln!(out, "\t{i}"),
            Stmt::Label(l) => writeln!(out, "{l}:"),
            Stmt::Comment(c) => writeln!(out, "\t// {c}"),
        };
    }
    out
}

/// Prints the whole module.
pub fn module(kernel: &Kernel) -> Result<String, CodegenError> {
    let mut tera = tera::Tera::default();
    tera.add_raw_template("module.ptx", MODULE_TEMPLATE)
        .map_err(|e| CodegenError::Template(format!("{e:?}")))?;
    let mut ctx = tera::Context::new();
    ctx.insert("name", &kernel.name);
    ctx.insert("target", kernel.target.name());
    ctx.insert("version", &kernel.version().to_string());
    let params: Vec<String> = kernel.params.iter().map(|p| p.decl()).collect();
    ctx.insert("params", &params);
    let (x, y, z) = kernel.threads;
    let mut directives = vec![format!(".maxntid {x}, {y}, {z}")];
    directives.extend(kernel.min_ctas_per_sm.map(|n| format!(".minnctapersm {n}")));
    directives.extend(kernel.max_regs.map(|n| format!(".maxnreg {n}")));
    ctx.insert("directives", &directives);
    let regs: Vec<std::collections::BTreeMap<&str, String>> = kernel
        .regs
        .iter()
        .map(|(decl, prefix, count)| {
            [
                ("decl", decl.to_string()),
                ("prefix", prefix.to_string()),
                ("count", count.to_string()),
            ]
            .into_iter()
            .collect()
        })
        .collect();
    ctx.insert("regs", &regs);
    // The dynamic (`.extern`) array must live at module scope; sized arrays stay in the entry.
    let (dynamic, sized): (Vec<_>, Vec<_>) = kernel.shared.iter().partition(|s| s.dynamic);
    let decls = |v: Vec<&super::ir::SharedDecl>| v.iter().map(|s| s.decl()).collect::<Vec<_>>();
    ctx.insert("module_shared", &decls(dynamic));
    ctx.insert("entry_shared", &decls(sized));
    ctx.insert("body", &body(kernel));
    tera.render("module.ptx", &ctx)
        .map_err(|e| CodegenError::Template(format!("{e:?}")))
}
