//! The error code generation reports.

use crate::target::Target;

/// Why code generation failed.
#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// A kernel description broke a rule the builder checks.
    #[error("kernel `{kernel}` ({target}): {}", errors.join("; "))]
    Kernel {
        /// Kernel name.
        kernel: String,
        /// Target being built.
        target: Target,
        /// Every violation found.
        errors: Vec<String>,
    },
    /// The module template failed to render.
    #[error("template: {0}")]
    Template(String),
    /// The generated Rust bindings did not parse.
    #[error("generated bindings do not parse: {0}")]
    Bindings(String),
    /// Writing the output failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
}
