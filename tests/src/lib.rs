//! Shared helpers of the cross-crate tests: locating ptxas, parsing its report, and opening a
//! GPU (or skipping cleanly without one).

pub mod cases;
pub mod streams;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits inside the workspace")
        .to_path_buf()
}

fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !matches!(v.as_str(), "" | "0" | "false"))
}

/// The ptxas binary: `$PTXAS`, else the project-local install the test command makes, else
/// `ptxas` on the PATH. `None` means skip, except under `CI=true`, where a missing ptxas fails.
pub fn ptxas() -> Option<PathBuf> {
    tool("PTXAS", ".tools/nvcc", "ptxas")
}

/// The nvdisasm binary: `$NVDISASM`, else the project-local install the test command makes,
/// else `nvdisasm` on the PATH. `None` means skip, except under `CI=true`.
pub fn nvdisasm() -> Option<PathBuf> {
    tool("NVDISASM", ".tools/nvdisasm", "nvdisasm")
}

/// A CUDA tool the test command installs: the first of `$var`,
/// `dir/nvidia/cu13/bin/name` under the workspace and `name` on the PATH that answers
/// `--version`. `None` means skip, except under `CI=true`, where a missing tool fails.
fn tool(var: &str, dir: &str, name: &str) -> Option<PathBuf> {
    let candidates = std::env::var_os(var)
        .map(PathBuf::from)
        .into_iter()
        .chain([workspace_root()
            .join(dir)
            .join("nvidia/cu13/bin")
            .join(name)])
        .chain([PathBuf::from(name)]);
    for c in candidates {
        if Command::new(&c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return Some(c);
        }
    }
    assert!(
        !ci(),
        "{name} not found under CI=true: run the README's test command, which installs it"
    );
    eprintln!("SKIP: {name} not found (run the README's test command, which installs it)");
    None
}

/// `ptx` written to `<temp>/msa-ptxas-<pid>/<name>.<arch>.ptx`, for ptxas to read.
fn ptx_file(ptx: &str, arch: &str, name: &str) -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join(format!("msa-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let file = dir.join(format!("{name}.{arch}.ptx"));
    std::fs::write(&file, ptx).map_err(|e| e.to_string())?;
    Ok(file)
}

/// The SASS ptxas makes of `ptx` for `arch`, as nvdisasm prints it; `Err` carries the
/// failing tool's output.
pub fn sass(
    ptxas: &Path,
    nvdisasm: &Path,
    ptx: &str,
    arch: &str,
    name: &str,
) -> Result<String, String> {
    let file = ptx_file(ptx, arch, name)?;
    let cubin = file.with_extension("cubin");
    let run = |cmd: &mut Command| -> Result<String, String> {
        let out = cmd.output().map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Ok(text)
        } else {
            Err(format!("{text}{}", String::from_utf8_lossy(&out.stderr)))
        }
    };
    run(Command::new(ptxas)
        .arg(format!("-arch={arch}"))
        .arg("-o")
        .arg(&cubin)
        .arg(&file))?;
    run(Command::new(nvdisasm).arg("-c").arg(&cubin))
}

/// Checks nvdisasm's SASS of a kernel that times returning atomics with `%clock` (see
/// `codegen::kernels::l2_sides::latency`) and returns how many it times. Hopper issues a
/// warp's instructions in order, so a clock read measures an atomic's round trip only when an
/// instruction that waits for the atomic's register (any later mention of it: a read, or a
/// write after its write) comes before the read. The check, in address order (no branch in a
/// timed section): every returning `ATOMG` is followed by such an instruction before the next
/// clock read, and the kernel reads the clock exactly twice per returning `ATOMG` (an atomic
/// whose value ptxas found unused becomes a `REDG`, and its clock reads time nothing).
pub fn check_clock_order(sass: &str) -> Result<usize, String> {
    let insts: Vec<&str> = sass
        .lines()
        .filter_map(|l| {
            l.split_once("*/")
                .map(|(_, i)| i.trim().trim_end_matches(';').trim())
        })
        .filter(|i| !i.is_empty())
        .collect();
    let is_clock = |i: &str| i.contains("SR_CLOCKLO") || i.contains("SR_CLOCKHI");
    let mentions = |i: &str, reg: &str| {
        i.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .any(|w| w == reg)
    };
    let clocks = insts.iter().filter(|i| is_clock(i)).count();
    let mut atoms = 0;
    for (n, inst) in insts.iter().enumerate() {
        // Past a guard such as `@!P3`.
        let body = match inst.strip_prefix('@') {
            Some(rest) => rest.split_once(' ').map_or("", |(_, b)| b.trim_start()),
            None => inst,
        };
        if !body.starts_with("ATOMG") {
            continue;
        }
        // `ATOMG.E.ADD.STRONG.GPU PT, R3, desc[UR14][R2.64], RZ`: the first register operand
        // after the predicate is the value's.
        let Some(reg) = body.split_once(' ').map(|(_, ops)| ops).and_then(|ops| {
            ops.split(", ")
                .find(|o| o.starts_with('R') && o[1..].chars().all(|c| c.is_ascii_digit()))
        }) else {
            return Err(format!("no value register in `{inst}`"));
        };
        atoms += 1;
        for later in &insts[n + 1..] {
            if is_clock(later) {
                return Err(format!(
                    "`{later}` reads the clock before any instruction waits for `{inst}`'s {reg}"
                ));
            }
            if mentions(later, reg) {
                break;
            }
        }
    }
    if clocks != 2 * atoms {
        return Err(format!(
            "{clocks} clock reads for {atoms} returning atomics; expected two per atomic"
        ));
    }
    Ok(atoms)
}

/// The labels [`msa_runtime::forward_kv::label_pair_homes`] gives a paired pool of `pairs`
/// pairs (anchors included) in fresh memory of `backend`, twice: phase 1 on `grids[i]` CTAs,
/// each time into its own label array.
pub fn homes_twice<B: msa_runtime::Backend>(
    backend: &mut B,
    pairs: usize,
    grids: [u32; 2],
) -> Result<[Vec<u32>; 2], msa_runtime::RuntimeError> {
    use msa_runtime::forward_kv::{label_pair_homes, PAIR_CHUNK_BYTES};
    let chunks = pairs * 2 * PAIR_CHUNK_BYTES;
    let buf = backend.alloc(
        "pairs and two labellings",
        chunks + PAIR_CHUNK_BYTES + 8 * pairs,
    )?;
    let raw = backend.address(&buf);
    let base = raw.div_ceil(PAIR_CHUNK_BYTES as u64) * PAIR_CHUNK_BYTES as u64;
    backend.zero("pairs", base, chunks)?;
    let mut out = [Vec::new(), Vec::new()];
    for (i, grid) in grids.into_iter().enumerate() {
        let at = base + (chunks + 4 * i * pairs) as u64;
        // SAFETY: `base` (4 KiB aligned) spans `pairs` pairs of 4 KiB chunks and `at`
        // `pairs` words, all inside `buf`.
        unsafe { label_pair_homes(backend, base, at, pairs, Some(grid)) }?;
        let bytes = backend.download("labels", at, 4 * pairs)?;
        out[i] = bytes
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")))
            .collect();
        assert!(out[i].iter().all(|&w| w <= 1), "labels are 0 or 1");
    }
    Ok(out)
}

/// The fraction of pairs two labellings agree on, and the first's fraction labelled 0.
pub fn label_agreement(a: &[u32], b: &[u32]) -> (f64, f64) {
    let n = a.len() as f64;
    let agree = a.iter().zip(b).filter(|(x, y)| x == y).count() as f64 / n;
    let zeros = a.iter().filter(|&&w| w == 0).count() as f64 / n;
    (agree, zeros)
}

/// What `ptxas -v` reports for one kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtxasReport {
    /// Registers per thread.
    pub registers: u32,
    /// Stack frame bytes.
    pub stack_bytes: u32,
    /// Spill store bytes.
    pub spill_stores: u32,
    /// Spill load bytes.
    pub spill_loads: u32,
    /// Static shared memory bytes.
    pub smem_bytes: u32,
    /// Lines ptxas printed that are not the usual info lines (warnings, C7508, ...).
    pub unusual: Vec<String>,
}

fn number_before(line: &str, unit: &str) -> Option<u32> {
    let end = line.find(unit)?;
    line[..end].split_whitespace().last()?.parse().ok()
}

/// Assembles `ptx` for `arch` with `ptxas -v`; `Err` carries ptxas's output on failure.
pub fn assemble(ptxas: &Path, ptx: &str, arch: &str, name: &str) -> Result<PtxasReport, String> {
    let file = ptx_file(ptx, arch, name)?;
    let out = Command::new(ptxas)
        .args([&format!("-arch={arch}"), "-v", "-o", "/dev/null"])
        .arg(&file)
        .output()
        .map_err(|e| e.to_string())?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(text);
    }
    let mut r = PtxasReport {
        registers: 0,
        stack_bytes: 0,
        spill_stores: 0,
        spill_loads: 0,
        smem_bytes: 0,
        unusual: vec![],
    };
    for line in text.lines() {
        if line.contains("Used") && line.contains("registers") {
            r.registers = number_before(line, "registers").unwrap_or(0);
            r.smem_bytes = number_before(line, "bytes smem").unwrap_or(0);
        } else if line.contains("stack frame") {
            r.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
            r.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
            r.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
        } else if !line.trim().is_empty()
            && (!line.starts_with("ptxas info") || line.contains("Potential Performance Loss"))
        {
            // Warnings, C7508 (setmaxnreg ignored) and anything else out of the ordinary.
            r.unusual.push(line.trim().to_string());
        }
    }
    Ok(r)
}

fn require_gpu() -> bool {
    std::env::var("REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// A stream on GPU 0, or `None` (skip) when there is no usable GPU. With `REQUIRE_GPU=1` a
/// missing GPU fails the test instead.
pub fn gpu_stream() -> Option<Arc<cudarc::driver::CudaStream>> {
    let why = match msa_runtime::Device::open(0) {
        Ok(dev) => return Some(dev.context().default_stream()),
        Err(e) => e.to_string(),
    };
    assert!(!require_gpu(), "REQUIRE_GPU=1 but no GPU: {why}");
    eprintln!("SKIP: no GPU ({why})");
    None
}

/// A small deterministic PRNG (splitmix64) for test data.
pub struct Rng(u64);

impl Rng {
    /// Seeds the generator.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}
