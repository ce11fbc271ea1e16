//! Topology constants and the CTA-walk rule (seed-design §1.1, §2.4).

/// Keys per document-local block, and the alignment unit of the workspace.
pub const BLOCK_SIZE: usize = 128;
