//! Every opcode + modifier combination in every file of `generated/`, and which of them the
//! simulator does not model: none may be left, the Hopper main kernel's asynchronous
//! machinery and the Blackwell kernel's tcgen05 family included.

use std::path::PathBuf;

use msa_sim::coverage;
use msa_sim::{Module, ParseError};

/// The Hopper main kernel, whose asynchronous machinery (mbarrier, TMA, wgmma, setmaxnreg,
/// proxy fences) stage 2 models.
const SM90_KERNEL: &str = "msa_backward_sm90";

/// The Blackwell main kernel (tcgen05, TMEM), modelled since stage 3.
const SM100_KERNEL: &str = "msa_backward_sm100";

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
fn every_generated_opcode_is_supported() {
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
        for (op, s) in &gaps {
            failures.push(format!(
                "{file}: `{op}` unsupported (line {}: {})",
                s.first_line,
                s.unsupported.as_deref().unwrap_or("")
            ));
        }
        let m = if gaps.is_empty() {
            Module::parse(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
        } else {
            Module::parse_lenient(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
        };
        assert!(m.kernel(&kernel).is_some(), "{file} defines `{kernel}`");
        if kernel == SM90_KERNEL || kernel == SM100_KERNEL {
            assert!(gaps.is_empty(), "{file}: {gaps:?}");
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn the_sm90_kernel_uses_the_async_machinery_and_parses() {
    let (_, text) = generated()
        .into_iter()
        .find(|(f, _)| f.starts_with(SM90_KERNEL))
        .expect("the sm90 kernel is generated");
    let all = coverage::summary(&text).expect("parses");
    for family in [
        "mbarrier.init",
        "mbarrier.arrive.expect_tx",
        "mbarrier.try_wait.parity",
        "cp.async.bulk.tensor.3d",
        "wgmma.mma_async",
        "wgmma.fence",
        "wgmma.commit_group",
        "wgmma.wait_group",
        "setmaxnreg.inc",
        "setmaxnreg.dec",
        "fence.proxy.async",
        "stmatrix.sync.aligned.m8n8.x4",
        "bar.warp.sync",
        "cp.reduce.async.bulk.tensor.3d",
        "cp.async.bulk.commit_group",
        "cp.async.bulk.wait_group.read",
    ] {
        assert!(
            all.keys().any(|op| op.starts_with(family)),
            "`{family}` no longer used: {:?}",
            all.keys().collect::<Vec<_>>()
        );
    }
    let m = Module::parse(&text).expect("every instruction is modelled");
    let k = m.kernel(SM90_KERNEL).expect("entry");
    // 13 shared with the deterministic kernel, then the dQ pool's tensor map.
    assert_eq!(k.params().len(), 14);
    assert_eq!(k.params()[0].size, 128);
    assert_eq!(k.params()[0].align, 64);
    assert_eq!(k.dynamic_shared_base(), Some(0));
    assert_eq!(k.maxntid(), Some([384, 1, 1]));
    assert_eq!(k.minnctapersm(), Some(1));
}

#[test]
fn the_sm100_kernel_uses_tcgen05_and_parses() {
    let (_, text) = generated()
        .into_iter()
        .find(|(f, _)| f.starts_with(SM100_KERNEL))
        .expect("the sm100 kernel is generated");
    let all = coverage::summary(&text).expect("parses");
    for family in [
        "tcgen05.alloc",
        "tcgen05.relinquish_alloc_permit",
        "tcgen05.dealloc",
        "tcgen05.mma.cta_group::1.kind::f16",
        "tcgen05.commit",
        "tcgen05.ld.sync.aligned.32x32b",
        "tcgen05.st.sync.aligned.32x32b",
        "tcgen05.wait::ld",
        "tcgen05.wait::st",
        "tcgen05.fence::before_thread_sync",
        "tcgen05.fence::after_thread_sync",
        "elect.sync",
    ] {
        assert!(
            all.keys().any(|op| op.starts_with(family)),
            "`{family}` no longer used: {:?}",
            all.keys().collect::<Vec<_>>()
        );
    }
    let m = Module::parse(&text).expect("every instruction is modelled");
    assert!(m.kernel(SM100_KERNEL).is_some());
}

#[test]
fn unmodelled_instructions_are_still_rejected_with_their_line() {
    let text = ".version 8.0\n.target sm_90a\n.address_size 64\n\
        .visible .entry k()\n{\n\t.reg .b64 %rd<2>;\n\
        \ttcgen05.shift.cta_group::1.down [%rd0];\n\tret;\n}\n";
    match Module::parse(text) {
        Err(ParseError::Unsupported { opcode, line, .. }) => {
            assert_eq!(opcode, "tcgen05.shift.cta_group::1.down");
            assert_eq!(line, 7);
        }
        other => panic!("expected an unsupported-instruction error, got {other:?}"),
    }
}
