#!/usr/bin/env python3
"""Lists the file-to-file import edges of a Rust crate and reports import circles.

Usage: scripts/import-cycles.py CRATE_SRC_DIR [SUBDIR ...]

Edges come from `use` statements (braces expanded), inline `crate::`/`super::`/`self::`
paths, inline paths through a declared child module, and `mod` declarations (parent to
child). Names re-exported by `lib.rs` are followed to the module that defines them.
A child's import of its own ancestor (its parent, or the crate root) is listed but not
counted: a submodule that extends its parent's `impl` (Rust's usual split of one type over
several files) has to see it. Such upward imports are printed so they can be judged.
With SUBDIR, only edges between files under those folders are printed and checked.
Exits 1 when a circle is found.
"""

import re
import sys
from pathlib import Path


def module_of(src: Path, f: Path) -> tuple:
    parts = list(f.relative_to(src).with_suffix("").parts)
    if parts in (["lib"], ["main"]):
        return ()
    if parts[-1] == "mod":
        parts = parts[:-1]
    return tuple(parts)


def strip(text: str) -> str:
    """Drops comments and string/char literals, keeping line structure."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'r#*"(?:.|\n)*?"#*', '""', text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    text = re.sub(r"'(?:\\.|[^'\\])'", "' '", text)
    return re.sub(r"//[^\n]*", "", text)


def expand(tree: str) -> list:
    """Expands `a::{b, c::{d, e}}` into [[a,b],[a,c,d],[a,c,e]]."""
    tree = re.sub(r"\s+as\s+\w+", "", tree)
    tree = re.sub(r"\s+", "", tree)
    out = []

    def go(prefix, s):
        depth, start, items = 0, 0, []
        for i, ch in enumerate(s):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                items.append(s[start:i])
                start = i + 1
        items.append(s[start:])
        for item in filter(None, items):
            if "{" in item:
                head, rest = item.split("{", 1)
                segs = [p for p in head.split("::") if p]
                go(prefix + segs, rest[: rest.rfind("}")])
            else:
                out.append(prefix + [p for p in item.split("::") if p])

    go([], tree)
    return out


def main() -> int:
    src = Path(sys.argv[1])
    scope = [Path(s) for s in sys.argv[2:]]
    files = sorted(src.rglob("*.rs"))
    if (src / "lib.rs").exists():
        # A binary beside the library is another crate with its own root.
        files = [f for f in files if f != src / "main.rs"]
    mods = {module_of(src, f): f for f in files}
    root = src / "lib.rs"
    reexport = {}
    if root.exists():
        for m in re.finditer(r"pub\s+use\s+([^;]+);", strip(root.read_text())):
            for p in expand(m.group(1)):
                if p and p[0] not in ("crate", "super", "self", "std"):
                    reexport[p[-1]] = tuple(p[:-1])

    def file_for(path):
        path = tuple(path)
        for n in range(len(path), -1, -1):
            if path[:n] in mods:
                if n == 0 and len(path) >= 1 and path[0] in reexport:
                    return file_for(reexport[path[0]])
                return mods[path[:n]]
        return None

    edges, parent_edges = set(), set()
    for f in files:
        base = module_of(src, f)
        text = strip(f.read_text())
        # Inline `mod name { ... }` blocks change what `super::` means inside them.
        ctx, stack, depth, line_ctx = [base], [], 0, []
        for tok in re.finditer(r"\bmod\s+(\w+)\s*\{|[{}]|\n", text):
            s = tok.group(0)
            if s.startswith("mod"):
                depth += 1
                stack.append(depth)
                ctx.append(ctx[-1] + (tok.group(1),))
            elif s == "{":
                depth += 1
            elif s == "}":
                if stack and stack[-1] == depth:
                    stack.pop()
                    ctx.pop()
                depth -= 1
            else:
                line_ctx.append(ctx[-1])
        line_ctx.append(ctx[-1])
        children = set(re.findall(r"(?m)^\s*(?:pub(?:\([\w:]+\))?\s+)?mod\s+(\w+)\s*;", text))
        for c in children:
            if base + (c,) in mods:
                edges.add((f, mods[base + (c,)]))

        def resolve(cur, segs):
            if not segs:
                return None
            if segs[0] == "crate":
                return file_for(segs[1:])
            if segs[0] in ("super", "self"):
                p = list(cur)
                while segs and segs[0] in ("super", "self"):
                    if segs[0] == "super":
                        p = p[:-1]
                    segs = segs[1:]
                return file_for(p + list(segs))
            if segs[0] in children:
                return file_for(list(cur) + list(segs))
            return None

        refs = []
        for m in re.finditer(r"\buse\s+([^;]+);", text):
            cur = line_ctx[text.count("\n", 0, m.start())]
            refs += [(cur, p) for p in expand(m.group(1))]
        rest = re.sub(r"\buse\s+[^;]+;", "", text)
        names = "|".join(["crate", "super", "self"] + sorted(children))
        for m in re.finditer(r"\b(?:%s)(?:::\w+)+" % names, rest):
            cur = line_ctx[min(rest.count("\n", 0, m.start()), len(line_ctx) - 1)]
            refs.append((cur, m.group(0).split("::")))
        for cur, p in refs:
            t = resolve(cur, p)
            if t is None or t == f:
                continue
            tm = module_of(src, t)
            if base[: len(tm)] == tm:
                parent_edges.add((f, t))
            else:
                edges.add((f, t))

    def inside(f):
        return not scope or any(Path(f).is_relative_to(s) for s in scope)

    edges = {(a, b) for a, b in edges if inside(a) and inside(b)}
    parent_edges = {(a, b) for a, b in parent_edges if inside(a) and inside(b)}
    rel = lambda f: str(f.relative_to(src))
    for a, b in sorted(edges):
        print(f"{rel(a)} -> {rel(b)}")
    for a, b in sorted(parent_edges):
        print(f"{rel(a)} -> {rel(b)}  (child sees its ancestor; not counted)")

    # Tarjan's strongly connected components.
    graph = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index, low, on, st, sccs, n = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        st.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = st.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(rel(c) for c in comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    for c in sccs:
        print(f"CIRCLE of {len(c)}: {', '.join(c)}")
    print(f"{len(edges)} edges, {len(sccs)} circles")
    return 1 if sccs else 0


if __name__ == "__main__":
    sys.exit(main())
