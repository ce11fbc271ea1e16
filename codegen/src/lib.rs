//! Code generator for the MSA backward kernels.
//!
//! Kernels are described in Rust ([`kernels`]) against a typed PTX builder ([`ptx`]); the
//! descriptions are printed as PTX text for each [`Target`], together with Rust launch
//! bindings ([`bindings`]), a resource manifest and a review summary ([`summary`]).
//! `cargo run -p codegen` writes everything under `generated/`.

pub mod bindings;
pub mod error;
pub mod kernels;
pub mod plan;
pub mod ptx;
pub mod summary;
pub mod target;

pub use error::CodegenError;
pub use target::{ptx_file_name, PtxVersion, Target};

use std::path::Path;

/// One generated file: its path relative to `generated/` and its contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GeneratedFile {
    /// Path relative to `generated/`.
    pub path: String,
    /// Contents.
    pub contents: String,
}

/// Builds every kernel for every target it is meant for.
pub fn build_all() -> Result<Vec<ptx::Kernel>, CodegenError> {
    let mut out = Vec::new();
    for desc in kernels::all() {
        for &target in desc.targets {
            out.push(desc.build(target)?);
        }
    }
    Ok(out)
}

/// Everything under `generated/`, in a stable order.
pub fn generate() -> Result<Vec<GeneratedFile>, CodegenError> {
    let kernels = build_all()?;
    let mut files = Vec::new();
    for k in &kernels {
        files.push(GeneratedFile {
            path: ptx_file_name(&k.name, k.target),
            contents: ptx::print::module(k)?,
        });
    }
    for desc in kernels::all() {
        let variants: Vec<&ptx::Kernel> = kernels.iter().filter(|k| k.name == desc.name).collect();
        files.push(GeneratedFile {
            path: format!("{}.manifest.txt", desc.name),
            contents: summary::manifest(desc, &variants),
        });
    }
    files.push(GeneratedFile {
        path: "bindings.rs".into(),
        contents: bindings::generate(&kernels)?,
    });
    files.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(files)
}

/// Writes `files` into `dir`, removing stale generated files that are no longer produced.
pub fn write_all(dir: &Path, files: &[GeneratedFile]) -> Result<(), CodegenError> {
    let io = |path: &Path, source| CodegenError::Io {
        path: path.display().to_string(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let keep: std::collections::BTreeSet<&str> = files.iter().map(|f| f.path.as_str()).collect();
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let path = entry.map_err(|e| io(dir, e))?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !keep.contains(name) && path.is_file() {
            std::fs::remove_file(&path).map_err(|e| io(&path, e))?;
        }
    }
    for f in files {
        let path = dir.join(&f.path);
        std::fs::write(&path, &f.contents).map_err(|e| io(&path, e))?;
    }
    Ok(())
}

/// The `generated/` directory of this workspace.
pub fn generated_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../generated")
}
