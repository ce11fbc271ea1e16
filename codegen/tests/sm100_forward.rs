//! Structural checks of `msa_forward_sm100`, read back from its PTX text (there is no Blackwell
//! GPU; `runtime/sim/tests/forward.rs` runs it on the simulator):
//!
//! - ptxas assembles it for sm_100a with no spills, no warning and no ignored `setmaxnreg`;
//! - the CTA shape and register budgets are the plan's, TMEM is allocated once with the plan's
//!   columns and freed once;
//! - every `tcgen05.mma` and `tcgen05.commit` is guarded by the MMA warp's one `elect.sync`
//!   predicate, and lies inside the MMA role;
//! - every `tcgen05.ld`/`st` stays inside the TMEM regions its role may touch (compute: S, P
//!   and O; the epilogue reads O only).
//!
//! The `mutated_*` tests show each check can fail.

use codegen::kernels::forward_sm100;
use codegen::plan::roles::Role;
use codegen::plan::tmem::TmemRegion;
use codegen::Target;
use std::ops::Range;

const KERNEL: &str = "msa_forward_sm100";

fn built() -> String {
    let desc = codegen::kernels::all()
        .iter()
        .find(|s| s.name == KERNEL)
        .expect("the SM100 forward is registered");
    let k = desc.build(Target::Sm100a).expect("it builds");
    codegen::ptx::print::module(&k).expect("prints")
}

/// The line range of role `name` (between its begin and end markers).
fn role_lines(ptx: &str, name: &str) -> Range<usize> {
    let lines: Vec<&str> = ptx.lines().collect();
    let find = |m: String| {
        lines
            .iter()
            .position(|l| l.trim() == m)
            .unwrap_or_else(|| panic!("marker `{m}` missing"))
    };
    find(format!("// role {name}: begin"))..find(format!("// role {name}: end"))
}

/// The column offset of a TMEM operand `[%bN]` / `[%bN+off]` (the first `[` of the line).
fn tmem_col(line: &str) -> u32 {
    let at = line.find("[%b").expect("a TMEM operand");
    let rest = &line[at + 1..];
    let end = rest.find(']').expect("closed");
    match rest[..end].split_once('+') {
        Some((_, off)) => off.parse().expect("a column offset"),
        None => 0,
    }
}

fn region(id: TmemRegion) -> Range<u32> {
    let r = forward_sm100::tmem_plan().unwrap().region(id).unwrap();
    r.col..r.col + r.cols
}

/// Every `tcgen05.ld`/`st` of the compute and epilogue roles inside the regions the role may
/// touch (a 32-column load or 16-column packed store starting at its operand's column). S and
/// P are addressed from their stage's base (stage 1 is stage 0 shifted by the plan's stride,
/// which the kernel's plan check enforces), so their offsets are checked against stage 0.
fn check_tmem_regions(ptx: &str) -> Result<(), String> {
    let lines: Vec<&str> = ptx.lines().collect();
    let (s, p, o) = (
        region(TmemRegion::S),
        region(TmemRegion::P),
        region(TmemRegion::O),
    );
    let inside = |c: Range<u32>, r: &Range<u32>| c.start >= r.start && c.end <= r.end;
    for (role, loads, stores) in [
        (
            "compute",
            vec![s.clone(), o.clone()],
            vec![p.clone(), o.clone()],
        ),
        ("epilogue", vec![o.clone()], vec![]),
    ] {
        for i in role_lines(ptx, role) {
            let l = lines[i].trim();
            let (allowed, width) = if l.starts_with("tcgen05.ld") {
                (&loads, 32)
            } else if l.starts_with("tcgen05.st") {
                // Packed bf16 into P is 16 columns; fp32 into O is 32.
                let c = tmem_col(l);
                (&stores, if inside(c..c + 1, &p) { 16 } else { 32 })
            } else {
                continue;
            };
            let c = tmem_col(l);
            if !allowed.iter().any(|r| inside(c..c + width, r)) {
                return Err(format!(
                    "{role} line {i}: columns {c}..{} outside {allowed:?}: {l}",
                    c + width
                ));
            }
        }
    }
    Ok(())
}

/// Every `tcgen05.mma`/`commit` inside the MMA role and guarded by its one `elect.sync`
/// predicate, which nothing else in the kernel writes.
fn check_elected(ptx: &str) -> Result<(), String> {
    let lines: Vec<&str> = ptx.lines().collect();
    let mma = role_lines(ptx, "mma");
    let elect: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].contains("elect.sync"))
        .collect();
    if elect.len() != 1 {
        return Err(format!("{} elect.sync, want 1", elect.len()));
    }
    // `elect.sync %r|%p, 0xffffffff;`
    let e = lines[elect[0]];
    let pred = e
        .split('|')
        .nth(1)
        .and_then(|x| x.split(',').next())
        .ok_or(format!("unparsed: {e}"))?
        .trim()
        .to_string();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim();
        if t.contains("tcgen05.mma") || t.contains("tcgen05.commit") {
            if !mma.contains(&i) {
                return Err(format!("line {i} outside the MMA role: {t}"));
            }
            if !t.starts_with(&format!("@{pred} ")) {
                return Err(format!("line {i} not guarded by {pred}: {t}"));
            }
        } else if i != elect[0] && t.contains(&format!("{pred},")) && t.starts_with("setp") {
            return Err(format!("line {i} rewrites {pred}: {t}"));
        }
    }
    Ok(())
}

#[test]
fn shipped_and_built_text_pass_the_structure_checks() {
    let path = codegen::generated_dir().join(codegen::ptx_file_name(KERNEL, Target::Sm100a));
    let shipped = std::fs::read_to_string(&path).expect("generated/ holds the kernel");
    for ptx in [shipped, built()] {
        check_tmem_regions(&ptx).unwrap();
        check_elected(&ptx).unwrap();
    }
}

#[test]
fn kernel_shape_registers_and_tmem_allocation() {
    let ptx = built();
    assert!(ptx.contains(".maxntid 512, 1, 1"), "512 threads");
    assert!(ptx.contains(".minnctapersm 1"));
    let plan = forward_sm100::plan().unwrap();
    let warps = plan.warps();
    // Each warpgroup's count: raised, lowered, or (the epilogue's 128) the launch count kept.
    let launch = codegen::plan::roles::LAUNCH_REGS;
    for role in [Role::Idle, Role::Compute, Role::Reduce, Role::Mma] {
        let n = warps.regs(role);
        let dir = match n.cmp(&launch) {
            std::cmp::Ordering::Greater => "inc",
            std::cmp::Ordering::Less => "dec",
            std::cmp::Ordering::Equal => continue,
        };
        let inst = format!("setmaxnreg.{dir}.sync.aligned.u32 {n};");
        assert!(ptx.contains(&inst), "{inst} ({role})");
    }
    let cols = plan.tmem().alloc_cols();
    assert_eq!(cols, 512);
    let count = |needle: &str| ptx.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(count("tcgen05.alloc."), 1);
    assert_eq!(count("tcgen05.relinquish_alloc_permit"), 1);
    assert_eq!(count("tcgen05.dealloc."), 1);
    assert!(ptx
        .lines()
        .any(|l| l.contains("tcgen05.alloc.") && l.trim_end().ends_with(&format!(", {cols};"))));
}

fn ptxas() -> Option<std::path::PathBuf> {
    let local = codegen::generated_dir().join("../.tools/nvcc/nvidia/cu13/bin/ptxas");
    std::env::var_os("PTXAS")
        .map(Into::into)
        .into_iter()
        .chain([local])
        .find(|p: &std::path::PathBuf| {
            std::process::Command::new(p)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

#[test]
fn ptxas_accepts_without_spills_or_ignored_setmaxnreg() {
    let Some(ptxas) = ptxas() else {
        eprintln!("SKIP: ptxas not found");
        return;
    };
    let dir = std::env::temp_dir().join(format!("sm100-forward-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("k.ptx");
    std::fs::write(&file, built()).unwrap();
    let out = std::process::Command::new(ptxas)
        .args(["-arch=sm_100a", "-v", "-o", "/dev/null"])
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{log}");
    assert!(
        log.contains("0 bytes spill stores, 0 bytes spill loads"),
        "{log}"
    );
    assert!(
        !log.contains("C7508") && !log.contains("setmaxnreg"),
        "{log}"
    );
    assert!(!log.contains("warning"), "{log}");
}

// ---- each check can fail --------------------------------------------------------------------

/// `text` with the first line for which `pick` holds replaced by `with(line)`.
fn mutate(text: &str, pick: impl Fn(&str) -> bool, with: impl Fn(&str) -> String) -> String {
    let mut done = false;
    let mut out = String::new();
    for l in text.lines() {
        if !done && pick(l) {
            done = true;
            out.push_str(&with(l));
        } else {
            out.push_str(l);
        }
        out.push('\n');
    }
    assert!(done, "nothing to mutate");
    out
}

#[test]
fn mutated_tmem_accesses_fail_the_region_check() {
    let ptx = built();
    // The first packed P store (16 columns) moved past P's 64 columns.
    let bad = mutate(
        &ptx,
        |l| l.trim().starts_with("tcgen05.st.sync.aligned.32x32b.x16"),
        |l| match l.find("]") {
            Some(end) if tmem_col(l) == 0 => format!("{}+64{}", &l[..end], &l[end..]),
            _ => l.replacen(&format!("+{}]", tmem_col(l)), "+64]", 1),
        },
    );
    assert_ne!(bad, ptx);
    assert!(check_tmem_regions(&bad).is_err());
    // An epilogue load of S: its first O load moved to column 0.
    let first = role_lines(&ptx, "epilogue")
        .find(|&i| ptx.lines().nth(i).unwrap().trim().starts_with("tcgen05.ld"))
        .expect("an epilogue load");
    let bad: String = ptx
        .lines()
        .enumerate()
        .map(|(i, l)| {
            let l = if i == first {
                l.replace(&format!("+{}]", tmem_col(l)), "]")
            } else {
                l.to_string()
            };
            l + "\n"
        })
        .collect();
    assert_ne!(bad, ptx);
    assert!(check_tmem_regions(&bad).is_err());
}

#[test]
fn mutated_commit_guards_fail_the_election_check() {
    let ptx = built();
    let unguarded = mutate(
        &ptx,
        |l| l.contains("tcgen05.commit"),
        |l| {
            let t = l.trim();
            let rest = t.split_once(' ').map(|x| x.1).unwrap_or(t);
            format!("\t{rest}")
        },
    );
    assert!(check_elected(&unguarded).is_err());
}
