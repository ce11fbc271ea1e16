//! Edits of a kernel's PTX text for the planted-bug tests: an `mbarrier.try_wait` loop or one
//! instruction taken out. The edits match instruction forms and comments, not register names,
//! so they survive a regeneration of the kernel.

#![allow(dead_code)]

/// `ptx` without the last `mbarrier.try_wait` loop (the wait and its branch back) before the
/// first line containing `marker`.
pub fn without_wait_before(ptx: &str, marker: &str) -> String {
    without_wait_before_line(ptx, |l| l.contains(marker), marker)
}

/// `ptx` without the last `mbarrier.try_wait` loop before the first line `is_target` accepts
/// (`what` names it if there is none).
pub fn without_wait_before_line(ptx: &str, is_target: impl Fn(&str) -> bool, what: &str) -> String {
    let lines: Vec<&str> = ptx.lines().collect();
    let to = lines
        .iter()
        .position(|l| is_target(l))
        .unwrap_or_else(|| panic!("`{what}` is in the kernel"));
    let at = (0..to)
        .rev()
        .find(|&i| lines[i].contains("mbarrier.try_wait"))
        .expect("a wait before it");
    without_wait_at(&lines, at)
}

/// The kernel's `lines` without the `mbarrier.try_wait` at line `at` and the retry branch
/// after it, joined again.
pub fn without_wait_at(lines: &[&str], at: usize) -> String {
    assert!(lines[at].contains("mbarrier.try_wait"), "{}", lines[at]);
    assert!(lines[at + 1].contains("bra"), "{}", lines[at + 1]);
    let kept: Vec<&str> = lines[..at]
        .iter()
        .chain(&lines[at + 2..])
        .copied()
        .collect();
    kept.join("\n") + "\n"
}

/// `ptx` without the first line containing `needle` after the first occurrence of `after`
/// (`""`: from the start).
pub fn without_first_after(ptx: &str, after: &str, needle: &str) -> String {
    let from = ptx.find(after).expect("the marker exists");
    let at = from + ptx[from..].find(needle).expect("the instruction exists");
    let start = ptx[..at].rfind('\n').map_or(0, |i| i + 1);
    let end = at + ptx[at..].find('\n').expect("a line end");
    format!("{}{}", &ptx[..start], &ptx[end + 1..])
}
