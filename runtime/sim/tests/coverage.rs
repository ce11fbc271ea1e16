//! Every opcode + modifier combination in every file of `generated/`, and which of them the
//! simulator does not model. Stage 1 models everything except the Hopper main kernel's
//! asynchronous machinery.

use std::path::PathBuf;

use msa_sim::coverage;
use msa_sim::{Module, ParseError};

/// The kernel allowed to have gaps in stage 1, and the instruction families its gaps may
/// belong to (stage 2).
const STAGE2_KERNEL: &str = "msa_backward_sm90";
const STAGE2_FAMILIES: &[&str] = &[
    "mbarrier.",
    "cp.async.bulk.",
    "wgmma.",
    "setmaxnreg.",
    "fence.",
];

fn generated() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../generated");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "ptx"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&p).expect("readable PTX");
            (name, text)
        })
        .collect();
    files.sort();
    assert!(
        files.len() >= 11,
        "expected the generated PTX files in {}",
        dir.display()
    );
    files
}

#[test]
fn every_generated_opcode_is_supported_except_the_stage2_machinery() {
    let mut failures = Vec::new();
    for (file, text) in generated() {
        let kernel = file.split('.').next().unwrap_or_default().to_string();
        let all = coverage::summary(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        let gaps = coverage::unsupported(&text).expect("parses");
        println!(
            "{file}: {} distinct opcodes, {} instructions, {} unsupported",
            all.len(),
            all.values().map(|s| s.count).sum::<usize>(),
            gaps.len()
        );
        if kernel == STAGE2_KERNEL {
            for (op, s) in &gaps {
                println!(
                    "  gap: {op} (x{}, first at line {}: {})",
                    s.count,
                    s.first_line,
                    s.unsupported.as_deref().unwrap_or("")
                );
                if !STAGE2_FAMILIES.iter().any(|f| op.starts_with(f)) {
                    failures.push(format!("{file}: `{op}` is not a stage-2 instruction"));
                }
            }
            assert!(!gaps.is_empty(), "{file}: stage 2 landed? update this test");
            // Parsing the whole module must reject it with a clear message naming the line.
            match Module::parse(&text) {
                Err(ParseError::Unsupported { opcode, line, .. }) => {
                    assert!(gaps.contains_key(&opcode), "{opcode}");
                    assert_eq!(line, gaps.values().map(|s| s.first_line).min().unwrap());
                }
                other => panic!("{file}: expected an unsupported-instruction error, got {other:?}"),
            }
        } else {
            for (op, s) in &gaps {
                failures.push(format!(
                    "{file}: `{op}` unsupported (line {}: {})",
                    s.first_line,
                    s.unsupported.as_deref().unwrap_or("")
                ));
            }
            let m = Module::parse(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
            assert!(m.kernel(&kernel).is_some(), "{file} defines `{kernel}`");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_sm90_kernel_parses_leniently_and_refuses_to_launch() {
    let (_, text) = generated()
        .into_iter()
        .find(|(f, _)| f.starts_with(STAGE2_KERNEL))
        .expect("the sm90 kernel is generated");
    let m = Module::parse_lenient(&text).expect("syntax is fine");
    let k = m.kernel(STAGE2_KERNEL).expect("entry");
    assert_eq!(k.params().len(), 13);
    assert_eq!(k.params()[0].size, 128);
    assert_eq!(k.params()[0].align, 64);
    assert_eq!(k.dynamic_shared_base(), Some(0));
    assert_eq!(k.maxntid(), Some([384, 1, 1]));
    assert_eq!(k.minnctapersm(), Some(1));
    let mut gpu = msa_sim::Gpu::new();
    let cfg = msa_sim::LaunchConfig::new((1, 1, 1), (384, 1, 1));
    let err = gpu.launch(k, &cfg, &[]).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with("unsupported instruction `mbarrier.init"),
        "{msg}"
    );
    assert!(msg.contains(" at line "), "{msg}");
}
