//! Structural checks of `msa_backward_sm100`, read back from its PTX text.
//!
//! There is no Blackwell GPU to run the kernel on, so these tests check the synchronisation
//! skeleton on the printed PTX (the file under `generated/` and a fresh build):
//!
//! - every mbarrier wait has arrivals from the other side of its pipeline, and each side is
//!   exactly the roles the plan names (producer on `full`, consumers on `empty`);
//! - every `tcgen05.mma` and `tcgen05.commit` is guarded by the one `elect.sync` predicate of
//!   the MMA warp, which nothing else writes;
//! - the compute warps' generic `st.shared` of dS is followed by `fence.proxy.async` before
//!   each chunk publication, and the MMA that reads sPdS waits for every chunk stage first;
//! - TMEM is allocated once (followed by relinquish) and freed once, after the dealloc
//!   barrier that every role with `tcgen05.ld`/`st` reaches after its last access, while the
//!   MMA warp's last MMA is tracked by a commit the reduce warps wait for before it;
//! - every `tcgen05.ld`/`st` stays inside the plan's TMEM regions of its role.
//!
//! Each check is a function of the PTX text; the `mutated_*` tests show each can fail.

use codegen::kernels::backward_sm100::{self, MmaOrder};
use codegen::plan::roles::Role;
use codegen::plan::KernelPlan;
use codegen::Target;
use std::collections::{BTreeMap, BTreeSet};

const KERNEL: &str = "msa_backward_sm100";

fn built() -> String {
    let desc = codegen::kernels::all()
        .iter()
        .find(|s| s.name == KERNEL)
        .expect("the SM100 kernel is registered");
    let k = desc.build(Target::Sm100a).expect("the SM100 kernel builds");
    codegen::ptx::print::module(&k).expect("prints")
}

fn generated() -> String {
    let path = codegen::generated_dir().join(codegen::ptx_file_name(KERNEL, Target::Sm100a));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; run `cargo run -p codegen`", path.display()))
}

// ---- parsing -----------------------------------------------------------------------------

/// One instruction line.
#[derive(Debug, Clone)]
struct Inst {
    /// Line index in the text.
    line: usize,
    /// `(predicate, negated)`.
    guard: Option<(String, bool)>,
    opcode: String,
    operands: Vec<String>,
}

/// Splits operands at top-level commas (not inside `{}` or `[]`).
fn split_operands(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut cur = String::new();
    for ch in s.chars() {
        match ch {
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(cur.trim().to_string());
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(ch);
    }
    if !cur.trim().is_empty() {
        out.push(cur.trim().to_string());
    }
    out
}

fn parse(ptx: &str) -> Vec<Inst> {
    let mut out = Vec::new();
    for (line, raw) in ptx.lines().enumerate() {
        let t = raw.trim();
        if t.is_empty() || t.starts_with("//") || t.ends_with(':') || !t.ends_with(';') {
            continue;
        }
        if t.starts_with('.') || t.starts_with('{') || t.starts_with('}') {
            continue;
        }
        let t = t.trim_end_matches(';');
        let (guard, rest) = match t.strip_prefix('@') {
            Some(g) => {
                let (p, rest) = g.split_once(' ').unwrap_or((g, ""));
                let (neg, p) = match p.strip_prefix('!') {
                    Some(p) => (true, p),
                    None => (false, p),
                };
                (Some((p.to_string(), neg)), rest.trim())
            }
            None => (None, t),
        };
        let (opcode, ops) = rest.split_once(' ').unwrap_or((rest, ""));
        out.push(Inst {
            line,
            guard,
            opcode: opcode.to_string(),
            operands: split_operands(ops),
        });
    }
    out
}

/// The line ranges between `// role <name>: begin` and `// role <name>: end`.
fn role_regions(ptx: &str) -> Result<BTreeMap<String, (usize, usize)>, String> {
    let mut open: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for (i, l) in ptx.lines().enumerate() {
        let t = l.trim();
        if let Some(rest) = t.strip_prefix("// role ") {
            if let Some(name) = rest.strip_suffix(": begin") {
                open.insert(name.to_string(), i);
            } else if let Some(name) = rest.strip_suffix(": end") {
                let start = open
                    .remove(name)
                    .ok_or(format!("role {name} ends without a begin"))?;
                out.insert(name.to_string(), (start, i));
            }
        }
    }
    if !open.is_empty() {
        return Err(format!("roles without an end: {:?}", open.keys()));
    }
    Ok(out)
}

fn role_of(regions: &BTreeMap<String, (usize, usize)>, line: usize) -> Option<&str> {
    regions
        .iter()
        .find(|(_, &(a, b))| a < line && line < b)
        .map(|(n, _)| n.as_str())
}

/// The immediate offset of a `[%reg+off]` / `[%reg]` operand.
fn offset(op: &str) -> Option<i64> {
    let inner = op.strip_prefix('[')?.strip_suffix(']')?;
    match inner.split_once('+') {
        Some((_, off)) => off.parse().ok(),
        None => Some(0),
    }
}

/// The barrier operand of an mbarrier wait/arrive or a commit.
fn barrier_operand(i: &Inst) -> Option<i64> {
    let o = &i.operands;
    if i.opcode.starts_with("mbarrier.try_wait") || i.opcode.starts_with("mbarrier.arrive") {
        offset(o.get(1)?)
    } else if i.opcode.starts_with("tcgen05.commit") {
        offset(o.first()?)
    } else {
        None
    }
}

fn is_tmem_access(i: &Inst) -> bool {
    ["tcgen05.ld", "tcgen05.st", "tcgen05.mma"]
        .iter()
        .any(|p| i.opcode.starts_with(p))
}

// ---- the checks --------------------------------------------------------------------------

/// Barrier offsets (relative to the barrier array) of each pipeline's full and empty
/// barriers, with the roles that must wait and arrive on each.
struct BarrierRoles {
    name: String,
    waiters: BTreeSet<String>,
    arrivers: BTreeSet<String>,
}

fn plan_barriers(plan: &KernelPlan) -> BTreeMap<i64, BarrierRoles> {
    let mut out = BTreeMap::new();
    for p in plan.pipelines().pipes() {
        let pl = p.pipeline;
        let producer: BTreeSet<String> = [pl.producer.to_string()].into();
        let consumers: BTreeSet<String> = pl.consumers.iter().map(Role::to_string).collect();
        for s in 0..pl.stages {
            let full = 8 * (p.slot + s) as i64;
            let empty = 8 * (p.slot + pl.stages + s) as i64;
            out.insert(
                full,
                BarrierRoles {
                    name: format!("{}.full[{s}]", pl.name),
                    waiters: consumers.clone(),
                    arrivers: producer.clone(),
                },
            );
            let mut empty_waiters = producer.clone();
            if pl.name == "q_do" && backward_sm100::MMA_ORDER == MmaOrder::Explicit {
                // The MMA warp waits for its own Q/dO release before G5 (`MmaOrder`).
                empty_waiters.insert(Role::Mma.to_string());
            }
            out.insert(
                empty,
                BarrierRoles {
                    name: format!("{}.empty[{s}]", pl.name),
                    waiters: empty_waiters,
                    arrivers: consumers.clone(),
                },
            );
        }
    }
    out
}

/// Every mbarrier wait has an arrival (`mbarrier.arrive[.expect_tx]` or `tcgen05.commit`) on
/// the same barrier from another role; per barrier, the waiting and arriving roles are
/// exactly the plan's (consumers wait on `full`, the producer arrives; the reverse on
/// `empty`); every pipeline is used on both barriers.
fn check_barrier_matching(ptx: &str, plan: &KernelPlan) -> Result<(), String> {
    let regions = role_regions(ptx)?;
    let expected = plan_barriers(plan);
    let mut waits: BTreeMap<i64, BTreeSet<String>> = BTreeMap::new();
    let mut arrives: BTreeMap<i64, BTreeSet<String>> = BTreeMap::new();
    let mut commits: BTreeMap<i64, BTreeSet<String>> = BTreeMap::new();
    for i in parse(ptx) {
        let Some(off) = barrier_operand(&i) else {
            continue;
        };
        let role = role_of(&regions, i.line)
            .ok_or(format!(
                "line {}: `{}` outside every role",
                i.line + 1,
                i.opcode
            ))?
            .to_string();
        if i.opcode.starts_with("mbarrier.try_wait") {
            waits.entry(off).or_default().insert(role);
        } else {
            if i.opcode.starts_with("tcgen05.commit") {
                // The tensor core arrives, not the issuing thread: a role may wait for its
                // own MMAs (the MMA warp does before G5, see `MmaOrder`).
                commits.entry(off).or_default().insert(role.clone());
            }
            arrives.entry(off).or_default().insert(role);
        }
    }
    if waits.is_empty() {
        return Err("no mbarrier waits found".into());
    }
    for (off, roles) in &waits {
        let arr = arrives.get(off).cloned().unwrap_or_default();
        let own_commit = commits.get(off).cloned().unwrap_or_default();
        for r in roles {
            if !arr.iter().any(|a| a != r) && !own_commit.contains(r) {
                return Err(format!(
                    "the wait on barrier +{off} in role {r} has no arrival from another role \
                     (arrivals from {arr:?})"
                ));
            }
        }
    }
    for (off, want) in &expected {
        let got_w = waits.get(off).cloned().unwrap_or_default();
        let got_a = arrives.get(off).cloned().unwrap_or_default();
        // Stages of an iteration-indexed ring share the stage-0 offset in the text.
        if got_w.is_empty() && got_a.is_empty() {
            continue;
        }
        if got_w != want.waiters || got_a != want.arrivers {
            return Err(format!(
                "barrier {} (+{off}): waiters {got_w:?} arrivers {got_a:?}, the plan says \
                 waiters {:?} arrivers {:?}",
                want.name, want.waiters, want.arrivers
            ));
        }
    }
    for off in waits.keys().chain(arrives.keys()) {
        if !expected.contains_key(off) {
            return Err(format!(
                "barrier +{off} is not a pipeline barrier of the plan"
            ));
        }
    }
    for p in plan.pipelines().pipes() {
        let full = 8 * p.slot as i64;
        let empty = 8 * (p.slot + p.pipeline.stages) as i64;
        for (what, off) in [("full", full), ("empty", empty)] {
            if !waits.contains_key(&off) || !arrives.contains_key(&off) {
                return Err(format!(
                    "pipeline `{}`: its {what} barrier (+{off}) is not both waited and arrived",
                    p.pipeline.name
                ));
            }
        }
    }
    Ok(())
}

/// Every `tcgen05.mma` and `tcgen05.commit` sits in the MMA role, after its single
/// `elect.sync`, guarded by that predicate (not negated), which no other instruction writes.
fn check_elected_commits(ptx: &str) -> Result<(), String> {
    let regions = role_regions(ptx)?;
    let insts = parse(ptx);
    let elects: Vec<&Inst> = insts
        .iter()
        .filter(|i| i.opcode.starts_with("elect.sync"))
        .collect();
    let [elect] = elects.as_slice() else {
        return Err(format!(
            "{} elect.sync instructions; expected 1",
            elects.len()
        ));
    };
    if role_of(&regions, elect.line) != Some("mma") {
        return Err("elect.sync is not in the MMA role".into());
    }
    let pred = elect
        .operands
        .first()
        .and_then(|o| o.split_once('|'))
        .map(|(_, p)| p.to_string())
        .ok_or("elect.sync has no predicate destination")?;
    let (mut mmas, mut commits) = (0, 0);
    for i in &insts {
        let is_mma = i.opcode.starts_with("tcgen05.mma");
        let is_commit = i.opcode.starts_with("tcgen05.commit");
        if is_mma || is_commit {
            if role_of(&regions, i.line) != Some("mma") || i.line < elect.line {
                return Err(format!(
                    "line {}: `{}` outside the elected region",
                    i.line + 1,
                    i.opcode
                ));
            }
            if i.guard != Some((pred.clone(), false)) {
                return Err(format!(
                    "line {}: `{}` is guarded by {:?}, not the elected @{pred}",
                    i.line + 1,
                    i.opcode,
                    i.guard
                ));
            }
            mmas += is_mma as u32;
            commits += is_commit as u32;
        } else if i.line != elect.line && i.operands.first() == Some(&pred) {
            return Err(format!(
                "line {}: `{}` overwrites the elected predicate {pred}",
                i.line + 1,
                i.opcode
            ));
        }
    }
    if mmas == 0 || commits == 0 {
        return Err(format!("{mmas} MMAs and {commits} commits"));
    }
    Ok(())
}

/// In the compute role, no chunk publication (`mbarrier.arrive` on a chunk `full` barrier)
/// follows a `st.shared` without a `fence.proxy.async.shared::cta` in between; and in the MMA
/// role, the first MMA with the dQ^T descriptor (which reads sPdS) follows waits on every
/// chunk `full` barrier.
fn check_ds_fence(ptx: &str, plan: &KernelPlan) -> Result<(), String> {
    let regions = role_regions(ptx)?;
    let chunk = plan.pipelines().get("chunk").map_err(|e| e.to_string())?;
    let fulls: BTreeSet<i64> = (0..chunk.pipeline.stages)
        .map(|s| 8 * (chunk.slot + s) as i64)
        .collect();
    let insts = parse(ptx);
    let in_role = |i: &Inst, r: &str| role_of(&regions, i.line) == Some(r);
    let (mut dirty, mut stores, mut publishes) = (None, 0, 0);
    for i in insts.iter().filter(|i| in_role(i, "compute")) {
        if i.opcode.starts_with("st.shared") {
            dirty = Some(i.line);
            stores += 1;
        } else if i.opcode == "fence.proxy.async.shared::cta" {
            dirty = None;
        } else if i.opcode.starts_with("mbarrier.arrive")
            && barrier_operand(i).is_some_and(|o| fulls.contains(&o))
        {
            publishes += 1;
            if let Some(line) = dirty {
                return Err(format!(
                    "line {}: chunk publication after the st.shared of line {} without \
                     fence.proxy.async",
                    i.line + 1,
                    line + 1
                ));
            }
        }
    }
    if let Some(line) = dirty {
        return Err(format!("line {}: st.shared never fenced", line + 1));
    }
    if stores == 0 || publishes != fulls.len() {
        return Err(format!(
            "{stores} dS stores and {publishes} chunk publications in the compute role"
        ));
    }
    let idesc = plan
        .gemm("dq_t")
        .and_then(|g| g.instr_desc().ok())
        .ok_or("no dq_t GEMM")?
        .bits();
    let idesc = format!("{idesc:#x}");
    let mma: Vec<&Inst> = insts.iter().filter(|i| in_role(i, "mma")).collect();
    let first_dq = mma
        .iter()
        .position(|i| i.opcode.starts_with("tcgen05.mma") && i.operands.get(3) == Some(&idesc))
        .ok_or(format!("no MMA with the dQ^T descriptor {idesc}"))?;
    let waited: BTreeSet<i64> = mma[..first_dq]
        .iter()
        .filter(|i| i.opcode.starts_with("mbarrier.try_wait"))
        .filter_map(|i| barrier_operand(i))
        .collect();
    if !fulls.is_subset(&waited) {
        return Err(format!(
            "the MMA reading sPdS does not follow waits on every chunk stage {fulls:?} \
             (waited {waited:?})"
        ));
    }
    Ok(())
}

/// One `tcgen05.alloc` (immediately followed by `relinquish_alloc_permit`) and one
/// `tcgen05.dealloc`, both in the compute role. Every role of the dealloc barrier reaches
/// `bar.sync <id>, <threads>` (after `tcgen05.fence::before_thread_sync`) textually after
/// its last TMEM access, and the dealloc follows the compute role's barrier. The only other
/// role touching TMEM, the MMA warp, follows its last MMA with a commit to a `full` barrier
/// (which a consumer waits for in the same iteration) that a dealloc-barrier role waits for
/// before that barrier.
fn check_dealloc_order(ptx: &str, plan: &KernelPlan) -> Result<(), String> {
    let regions = role_regions(ptx)?;
    let insts = parse(ptx);
    let nb = plan
        .barrier("tmem_dealloc")
        .ok_or("no tmem_dealloc barrier")?;
    let nb_roles: BTreeSet<String> = nb.roles.iter().map(Role::to_string).collect();
    let sync_ops = vec![nb.id.to_string(), nb.threads.to_string()];
    let find = |p: &str| -> Vec<usize> {
        insts
            .iter()
            .enumerate()
            .filter(|(_, i)| i.opcode.starts_with(p))
            .map(|(k, _)| k)
            .collect()
    };
    let (allocs, deallocs) = (find("tcgen05.alloc"), find("tcgen05.dealloc"));
    let ([alloc], [dealloc]) = (allocs.as_slice(), deallocs.as_slice()) else {
        return Err(format!(
            "{} allocs and {} deallocs",
            allocs.len(),
            deallocs.len()
        ));
    };
    if !insts
        .get(alloc + 1)
        .is_some_and(|i| i.opcode.starts_with("tcgen05.relinquish_alloc_permit"))
    {
        return Err("tcgen05.alloc is not followed by relinquish_alloc_permit".into());
    }
    for k in [*alloc, *dealloc] {
        if role_of(&regions, insts[k].line) != Some("compute") {
            return Err(format!(
                "line {}: TMEM (de)allocation outside compute",
                insts[k].line + 1
            ));
        }
    }
    let mut barrier_at: BTreeMap<String, usize> = BTreeMap::new();
    for role in &nb_roles {
        let &(start, end) = regions.get(role).ok_or(format!("no {role} role"))?;
        let inside = |i: &&Inst| start < i.line && i.line < end;
        let bars: Vec<usize> = insts
            .iter()
            .enumerate()
            .filter(|(_, i)| inside(i) && i.opcode == "bar.sync" && i.operands == sync_ops)
            .map(|(k, _)| k)
            .collect();
        let [bar] = bars.as_slice() else {
            return Err(format!(
                "role {role} reaches the dealloc barrier {} times",
                bars.len()
            ));
        };
        if insts[bar - 1].opcode != "tcgen05.fence::before_thread_sync" {
            return Err(format!(
                "role {role}: no tcgen05.fence::before_thread_sync before the dealloc barrier"
            ));
        }
        if let Some(last) = insts.iter().rfind(|i| inside(i) && is_tmem_access(i)) {
            if last.line > insts[*bar].line {
                return Err(format!(
                    "role {role}: TMEM access at line {} after the dealloc barrier",
                    last.line + 1
                ));
            }
        }
        barrier_at.insert(role.clone(), *bar);
    }
    let compute_bar = barrier_at
        .get("compute")
        .ok_or("compute is not in the dealloc barrier")?;
    if dealloc < compute_bar {
        return Err("tcgen05.dealloc precedes the dealloc barrier".into());
    }
    // Roles outside the barrier that touch TMEM: only MMA, through commits someone waits on.
    for i in insts.iter().filter(|i| is_tmem_access(i)) {
        let role = role_of(&regions, i.line).ok_or(format!(
            "line {}: TMEM access outside every role",
            i.line + 1
        ))?;
        if !nb_roles.contains(role) && role != "mma" {
            return Err(format!(
                "role {role} accesses TMEM but is not ordered before the dealloc"
            ));
        }
    }
    let mma: Vec<&Inst> = insts
        .iter()
        .filter(|i| role_of(&regions, i.line) == Some("mma"))
        .collect();
    let last_mma = mma
        .iter()
        .rposition(|i| i.opcode.starts_with("tcgen05.mma"))
        .ok_or("no MMA")?;
    // Only a `full` barrier's wait observes the commit of the same iteration (an `empty`
    // wait observes the previous one), so only those count.
    let fulls: BTreeSet<i64> = plan
        .pipelines()
        .pipes()
        .flat_map(|p| (0..p.pipeline.stages).map(move |s| 8 * (p.slot + s) as i64))
        .collect();
    let tracked: BTreeSet<i64> = mma[last_mma..]
        .iter()
        .filter(|i| i.opcode.starts_with("tcgen05.commit"))
        .filter_map(|i| barrier_operand(i))
        .filter(|o| fulls.contains(o))
        .collect();
    let waited_before_dealloc = barrier_at.iter().any(|(role, &bar)| {
        let (start, _) = regions[role];
        insts.iter().any(|i| {
            start < i.line
                && i.line < insts[bar].line
                && i.opcode.starts_with("mbarrier.try_wait")
                && barrier_operand(i).is_some_and(|o| tracked.contains(&o))
        })
    });
    if !waited_before_dealloc {
        return Err(format!(
            "no dealloc-barrier role waits for the commits after the last MMA ({tracked:?})"
        ));
    }
    Ok(())
}

/// The columns a `tcgen05.ld`/`st` touches: `[offset, offset + N)` of its `[%b+offset]`
/// operand (the lane-quadrant part of the base register is not in the offset).
fn tmem_columns(i: &Inst) -> Option<(u32, u32)> {
    let n: u32 = i
        .opcode
        .split(".x")
        .nth(1)?
        .split('.')
        .next()?
        .parse()
        .ok()?;
    let addr = if i.opcode.starts_with("tcgen05.ld") {
        i.operands.get(1)?
    } else {
        i.operands.first()?
    };
    let off = offset(addr)? as u32;
    Some((off, off + n))
}

/// Compute reads only S and dP and writes only P (over S) and dS (over dP); reduce reads
/// only dQ, dV and dK; each access inside its region of the TMEM plan.
fn check_tmem_regions(ptx: &str, plan: &KernelPlan) -> Result<(), String> {
    use codegen::plan::tmem::TmemRegion::*;
    let regions = role_regions(ptx)?;
    let cols = |r| {
        plan.tmem()
            .region(r)
            .map(|x| (x.col, x.col + x.cols))
            .map_err(|e| e.to_string())
    };
    let allowed = [
        ("compute", "tcgen05.ld", vec![cols(S)?, cols(DP)?]),
        ("compute", "tcgen05.st", vec![cols(P)?, cols(DS)?]),
        (
            "reduce",
            "tcgen05.ld",
            vec![cols(DQ)?, cols(DV)?, cols(DK)?],
        ),
        ("reduce", "tcgen05.st", vec![]),
    ];
    let mut seen = 0;
    for i in parse(ptx) {
        let is_ld = i.opcode.starts_with("tcgen05.ld");
        if !is_ld && !i.opcode.starts_with("tcgen05.st") {
            continue;
        }
        let role = role_of(&regions, i.line).unwrap_or("none");
        let (a, b) = tmem_columns(&i).ok_or(format!("line {}: unparsed", i.line + 1))?;
        let ok = allowed.iter().any(|(r, op, ranges)| {
            *r == role
                && i.opcode.starts_with(op)
                && ranges.iter().any(|&(lo, hi)| lo <= a && b <= hi)
        });
        if !ok {
            return Err(format!(
                "line {}: {} of columns {a}..{b} in role {role} is outside its TMEM regions",
                i.line + 1,
                i.opcode
            ));
        }
        seen += 1;
    }
    if seen == 0 {
        return Err("no tcgen05.ld/st found".into());
    }
    Ok(())
}

fn all_checks(ptx: &str) -> Result<(), String> {
    let plan = KernelPlan::design().map_err(|e| e.to_string())?;
    check_barrier_matching(ptx, &plan)?;
    check_elected_commits(ptx)?;
    check_ds_fence(ptx, &plan)?;
    check_dealloc_order(ptx, &plan)?;
    check_tmem_regions(ptx, &plan)
}

// ---- tests -------------------------------------------------------------------------------

#[test]
fn generated_ptx_passes_every_structure_check() {
    let text = generated();
    assert_eq!(
        text,
        built(),
        "generated/ is stale: run `cargo run -p codegen`"
    );
    all_checks(&text).unwrap();
}

#[test]
fn kernel_shape_and_directives() {
    let text = built();
    for want in [
        ".version 8.6\n",
        ".target sm_100a\n",
        ".maxntid 512, 1, 1\n",
        ".minnctapersm 1\n",
        "tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32",
        "tcgen05.mma.cta_group::1.kind::f16",
        "0x8200490",
        "0x8210490",
        "0x8218490",
        "red.global.add.noftz.L2::cache_hint.bf16x2",
        "red.global.add.v4.f32",
        "createpolicy.fractional.L2::evict_last",
    ] {
        assert!(text.contains(want), "missing {want:?}");
    }
    // One setmaxnreg per warpgroup: idle 48, compute 184 (reduce keeps 128), warpgroup 3 48.
    let regs: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("setmaxnreg"))
        .map(str::trim)
        .collect();
    assert_eq!(
        regs,
        [
            "setmaxnreg.dec.sync.aligned.u32 48;",
            "setmaxnreg.inc.sync.aligned.u32 184;",
            "setmaxnreg.dec.sync.aligned.u32 48;"
        ]
    );
    // The same parameters, in the same order, as the Hopper kernel.
    let sm90 = codegen::kernels::all()
        .iter()
        .find(|s| s.name == "msa_backward_sm90")
        .unwrap()
        .build(Target::Sm90a)
        .unwrap();
    let sm100 = codegen::kernels::all()
        .iter()
        .find(|s| s.name == KERNEL)
        .unwrap()
        .build(Target::Sm100a)
        .unwrap();
    assert_eq!(sm90.params, sm100.params);
}

/// `$PTXAS`, or the project-local install; `None` skips.
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
    let dir = std::env::temp_dir().join(format!("sm100-structure-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("k.ptx");
    std::fs::write(&file, built()).unwrap();
    let out = std::process::Command::new(ptxas)
        .args(["-arch=sm_100a", "-v", "-o", "/dev/null"])
        .arg(&file)
        .output()
        .unwrap();
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

// ---- each check can fail ------------------------------------------------------------------

/// `text` with the first line for which `pick` holds replaced by `with(line)`.
fn mutate(text: &str, pick: impl Fn(&str) -> bool, with: impl Fn(&str) -> String) -> String {
    let mut done = false;
    let out: Vec<String> = text
        .lines()
        .map(|l| {
            if !done && pick(l) {
                done = true;
                with(l)
            } else {
                l.to_string()
            }
        })
        .collect();
    assert!(done, "no line to mutate");
    out.join("\n") + "\n"
}

fn plan() -> KernelPlan {
    KernelPlan::design().unwrap()
}

/// The byte offset of a pipeline barrier in the barrier array (stage 0).
fn bar_off(pipe: &str, empty: bool, stage: u32) -> i64 {
    let plan = plan();
    let p = plan.pipelines().get(pipe).unwrap();
    let slot = p.slot + if empty { p.pipeline.stages } else { 0 } + stage;
    8 * slot as i64
}

/// Whether `l` is an instruction `op...` on barrier offset `off`.
fn on_barrier(l: &str, op: &str, off: i64) -> bool {
    l.contains(op) && l.contains(&format!("+{off}]"))
}

#[test]
fn mutated_barriers_fail_the_matching_check() {
    let text = built();
    check_barrier_matching(&text, &plan()).unwrap();
    // Compute never releases S: the MMA warp's wait on s.empty has no arrival.
    let s_empty = bar_off("s", true, 0);
    let no_release = mutate(
        &text,
        |l| on_barrier(l, "mbarrier.arrive", s_empty),
        |_| String::new(),
    );
    let e = check_barrier_matching(&no_release, &plan()).unwrap_err();
    assert!(e.contains(&format!("+{s_empty} ")), "{e}");
    // The MMA warp commits dQ to the dP barrier: dq.full loses its producer.
    let (dq_full, dp_full) = (bar_off("dq", false, 0), bar_off("dp", false, 0));
    let wrong = mutate(
        &text,
        |l| on_barrier(l, "tcgen05.commit", dq_full),
        |l| l.replace(&format!("+{dq_full}]"), &format!("+{dp_full}]")),
    );
    let e = check_barrier_matching(&wrong, &plan()).unwrap_err();
    assert!(e.contains(&format!("+{dq_full} ")), "{e}");
}

#[test]
fn mutated_commit_guards_fail_the_election_check() {
    let text = built();
    check_elected_commits(&text).unwrap();
    let commit = |l: &str| l.contains("tcgen05.commit");
    let unguarded = mutate(&text, commit, |l| {
        let (_, rest) = l.trim().split_once(' ').unwrap();
        format!("\t{rest}")
    });
    let e = check_elected_commits(&unguarded).unwrap_err();
    assert!(e.contains("guarded by None"), "{e}");
    let negated = mutate(&text, commit, |l| l.replacen('@', "@!", 1));
    assert!(check_elected_commits(&negated).is_err());
    // A second definition of the elected predicate.
    let elect_line = text.lines().find(|l| l.contains("elect.sync")).unwrap();
    let pred = elect_line
        .split('|')
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap();
    let clobbered = mutate(
        &text,
        |l| l.contains("G2: dP^T"),
        |l| format!("{l}\n\tsetp.ne.u32 {pred}, %r0, 0;"),
    );
    let e = check_elected_commits(&clobbered).unwrap_err();
    assert!(e.contains("overwrites"), "{e}");
}

#[test]
fn a_missing_proxy_fence_fails_the_ds_check() {
    let text = built();
    check_ds_fence(&text, &plan()).unwrap();
    let unfenced: String = text
        .lines()
        .filter(|l| !l.contains("fence.proxy.async.shared::cta"))
        .map(|l| format!("{l}\n"))
        .collect();
    let e = check_ds_fence(&unfenced, &plan()).unwrap_err();
    assert!(e.contains("without fence.proxy.async"), "{e}");
    // G5 issued without waiting for the last chunk stage.
    let chunk = plan().pipelines().get("chunk").unwrap().pipeline.stages;
    let last = bar_off("chunk", false, chunk - 1);
    let early = mutate(
        &text,
        |l| on_barrier(l, "mbarrier.try_wait", last),
        |l| l.replace(&format!("+{last}]"), "+0]"),
    );
    let e = check_ds_fence(&early, &plan()).unwrap_err();
    assert!(e.contains("does not follow waits"), "{e}");
}

#[test]
fn dealloc_before_the_barrier_or_late_tmem_reads_fail_the_dealloc_check() {
    let text = built();
    let plan = plan();
    check_dealloc_order(&text, &plan).unwrap();
    let dealloc = text
        .lines()
        .find(|l| l.contains("tcgen05.dealloc"))
        .unwrap()
        .to_string();
    // Move the dealloc in front of the compute warps' dealloc barrier.
    let moved: String = text
        .lines()
        .filter(|l| *l != dealloc)
        .map(|l| format!("{l}\n"))
        .collect();
    let moved = mutate(
        &moved,
        |l| l.contains("every TMEM access of compute and reduce is done"),
        |l| format!("{l}\n{dealloc}"),
    );
    let e = check_dealloc_order(&moved, &plan).unwrap_err();
    assert!(e.contains("precedes"), "{e}");
    // A reduce-warp TMEM read after its dealloc barrier.
    let late = mutate(
        &text,
        |l| l.contains("// role reduce: end"),
        |l| format!("\ttcgen05.ld.sync.aligned.32x32b.x1.b32 {{%f0}}, [%b2];\n{l}"),
    );
    let e = check_dealloc_order(&late, &plan).unwrap_err();
    assert!(e.contains("after the dealloc barrier"), "{e}");
    // Alloc without relinquish.
    let kept = mutate(
        &text,
        |l| l.contains("relinquish_alloc_permit"),
        |_| String::new(),
    );
    let e = check_dealloc_order(&kept, &plan).unwrap_err();
    assert!(e.contains("relinquish"), "{e}");
    // Reduce no longer waits for dQ or dK/dV, the commits that follow the last MMA.
    let mut unwaited = text.clone();
    for off in [bar_off("dq", false, 0), bar_off("dkv", false, 0)] {
        unwaited = mutate(
            &unwaited,
            |l| on_barrier(l, "mbarrier.try_wait", off),
            |l| l.replace(&format!("+{off}]"), "+0]"),
        );
    }
    let e = check_dealloc_order(&unwaited, &plan).unwrap_err();
    assert!(e.contains("commits after the last MMA"), "{e}");
}

#[test]
fn a_store_outside_p_or_ds_fails_the_region_check() {
    let text = built();
    check_tmem_regions(&text, &plan()).unwrap();
    // P^T written one chunk too far: columns 64..80 lie in S but outside P.
    let p_last = mutate(
        &text,
        |l| l.contains("tcgen05.st") && l.contains("+48]"),
        |l| l.replace("+48]", "+64]"),
    );
    let e = check_tmem_regions(&p_last, &plan()).unwrap_err();
    assert!(e.contains("outside its TMEM regions"), "{e}");
}
