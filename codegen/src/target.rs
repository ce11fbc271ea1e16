//! Targets and the PTX ISA version policy.

use std::fmt;

/// A PTX ISA version `major.minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PtxVersion(pub u8, pub u8);

impl PtxVersion {
    /// The larger of two versions.
    pub fn max(self, other: Self) -> Self {
        std::cmp::max(self, other)
    }
}

impl fmt::Display for PtxVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.0, self.1)
    }
}

/// The newest PTX ISA the H200's driver (r580, CUDA 13.0) accepts; output never exceeds it.
pub const MAX_DRIVER_VERSION: PtxVersion = PtxVersion(9, 0);

/// A GPU architecture we emit PTX for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// Hopper (H100/H200) with the architecture-specific features (wgmma, setmaxnreg).
    Sm90a,
    /// Blackwell B200 with tcgen05/TMEM.
    Sm100a,
}

impl Target {
    /// Every target, in output order.
    pub const ALL: [Target; 2] = [Target::Sm90a, Target::Sm100a];

    /// The `.target` name, also used in file names.
    pub fn name(self) -> &'static str {
        match self {
            Target::Sm90a => "sm_90a",
            Target::Sm100a => "sm_100a",
        }
    }

    /// The lowest PTX ISA that knows the target: 8.0 introduced sm_90a, 8.6 sm_100a.
    pub fn min_version(self) -> PtxVersion {
        match self {
            Target::Sm90a => PtxVersion(8, 0),
            Target::Sm100a => PtxVersion(8, 6),
        }
    }

    /// The compute capability `(major, minor)` the target runs on.
    pub fn compute_capability(self) -> (u32, u32) {
        match self {
            Target::Sm90a => (9, 0),
            Target::Sm100a => (10, 0),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// File name of a kernel's PTX for a target.
pub fn ptx_file_name(kernel: &str, target: Target) -> String {
    format!("{kernel}.{}.ptx", target.name())
}
